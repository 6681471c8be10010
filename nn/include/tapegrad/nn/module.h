#pragma once
// Module: a tree of named parameters, buffers and child modules, as torch.nn.Module.
//
// Parameters and buffers are tensor handles: a module keeps one in a member (for forward) and
// the same handle in its registry (for named_parameters, state_dict, optimizers). Loading a state
// dict copies values into the existing storage, so every handle stays valid.
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "tapegrad/io.h"
#include "tapegrad/tensor.h"

namespace tg::nn {

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // A leaf tensor that requires grad, owned by this module under `name`. Returns the handle.
  Tensor register_parameter(const std::string& name, Tensor t);
  // State that is saved and loaded but not trained (e.g. BatchNorm's running statistics).
  Tensor register_buffer(const std::string& name, Tensor t);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // Recursive, with dotted names ("blocks.0.attn.qkv.weight"), in registration order. A tensor
  // registered under two names (tied weights) is listed once, under its first name.
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const { return children_; }

  void train(bool on = true);  // this module and its children
  void eval() { train(false); }
  bool is_training() const { return training_; }
  void zero_grad();            // drops every parameter's gradient
  std::int64_t num_parameters() const;
  // Names every parameter and buffer tensor with its dotted path, so printed and drawn tapes show them.
  void name_tensors(const std::string& prefix = "");

  // Parameters and buffers by dotted name (PyTorch's state_dict), sharing storage with the module.
  StateDict state_dict() const;
  // Copies values in. Every problem is collected first and reported in one tg::Error (missing
  // keys, unexpected keys when strict, shape or dtype mismatches); on error nothing is changed.
  // Each copy is an in-place write (Tensor::copy_): a graph that saved a parameter before the
  // load refuses its backward.
  virtual void load_state_dict(const StateDict& sd, bool strict = true);

  // PyTorch-like printout: type, settings and children.
  virtual std::string type_name() const = 0;
  virtual std::string extra_repr() const { return ""; }
  void print(std::ostream& os, int indent = 0) const;

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  void collect(const std::string& prefix, bool params, std::vector<std::pair<std::string, Tensor>>& out) const;
  std::vector<std::pair<std::string, Tensor>> params_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

// A module with one tensor in and one out; callable.
class UnaryModule : public Module {
 public:
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }
};

// Children named "0", "1", ... (torch.nn.ModuleList).
template <class M>
class ModuleList : public Module {
 public:
  void push_back(std::shared_ptr<M> m) {
    register_module(std::to_string(items_.size()), m);
    items_.push_back(std::move(m));
  }
  std::size_t size() const { return items_.size(); }
  M& operator[](std::size_t i) { return *items_[i]; }
  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }
  std::string type_name() const override { return "ModuleList"; }

 private:
  std::vector<std::shared_ptr<M>> items_;
};

}  // namespace tg::nn
