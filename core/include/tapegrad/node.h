#pragma once
// A Node is one recorded op: what its backward needs, and where its gradients go. Every
// differentiable op has the same shape (core/ops/*.cpp, docs/tutorial.md):
//
//   Tensor my_op(const Tensor& x, const Tensor& w) {
//     ...argument checks, naming the op and the shapes...
//     Tensor y = Tensor::empty(shape, x.dtype());
//     kernels::my_op_forward(x.data<float>(), w.data<float>(), y.data<float>(), N);
//     if (should_record({&x, &w})) {
//       struct Saved { Tensor x, w; };                   // what backward reads, by name
//       record("my_op", {&x, &w}, {&y}, Saved{x.detach(), w.detach()},
//              [N](Node& n, const Saved& s) {              // scalars are captured by value
//                Tensor dx = n.new_grad(0), dw = n.new_grad(1);  // undefined if not needed
//                kernels::my_op_backward(s.x.data<float>(), s.w.data<float>(), n.grad_out().data<float>(),
//                                        detail::grad_ptr<float>(dx), detail::grad_ptr<float>(dw), N);
//                n.pass_grad(0, std::move(dx));            // the tape adds them up
//                n.pass_grad(1, std::move(dw));
//              });
//     }
//     return y;
//   }
//
// The one rule for gradients: a backward kernel writes a fresh gradient (dx = ...; grad_ptr gives
// null for an input that needs none, and the kernel skips it), and the tape alone combines the
// parts that reach one tensor, in pass_grad. One exception saves a buffer: an elementwise op that
// declares may_reuse_grad_out() may get dy's own buffer from new_grad and write dx over it.
// Saved holds only Tensor fields (detached: a saved tensor keeps its data, not its history); the
// node keeps them until its backward has run. The closure captures scalars, never a Tensor: a
// tensor it needs goes in Saved, where the tape sees it (and the sweep can free it). An op that
// saves nothing passes the closure alone: record(op, inputs, outputs, [](Node& n) { ... }).
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tapegrad/tensor.h"
#include "tapegrad/detail/node_parts.h"

namespace tg {

class Node {
 public:
  // ---- what a backward closure uses ----
  // dL/d(output j): the gradient that flowed into output j. A node runs only when one of its
  // outputs has one; an op with several outputs checks the others with defined().
  const Tensor& grad_out(std::size_t j = 0) const { return outputs()[j]->grad.get(); }
  // Whether input i needs a gradient at all (new_grad returns an undefined tensor when not).
  bool needs_grad(std::size_t i) const { return i < n_in_ && slots()[i] != nullptr; }
  // A fresh, uninitialised buffer for input i's gradient (input i's shape and dtype), or an
  // undefined tensor when input i needs none. For a node recorded with may_reuse_grad_out(),
  // the first call may instead return output 0's gradient itself, viewed in input i's shape, when
  // nothing else holds it: the kernel then writes dx over dy, reading dy[k] before writing dx[k]
  // (or, for a residual added to the output, passes dy on unwritten: linear, mlp).
  Tensor new_grad(std::size_t i) const;
  // Hands g, input i's gradient (or this node's part of it), to the tape: an input with no
  // gradient yet takes the buffer itself; otherwise the tape adds g to the gradient already there
  // (micrograd's +=, ggml's add_or_set). An undefined g, or an input that needs no gradient, is
  // ignored. g has input i's dtype and number of elements.
  void pass_grad(std::size_t i, Tensor&& g) const;
  // Declared when an op records: the first gradient its backward asks for may be output 0's
  // own buffer (see new_grad). Returns *this.
  Node& may_reuse_grad_out() {
    overwrite_ok_ = true;
    return *this;
  }

  // A tensor this node saved, for the backward to write its own results over, when nothing can read
  // it afterwards: the walk frees the node once this backward returns (backward() without
  // keep_tape, not in anomaly mode) and no other tensor shares its memory. Otherwise an undefined
  // tensor. As new_grad's reuse of dy, it spends memory the step has already paid for (mlp's
  // backward writes h over the saved x w1^T + b1 it was made from). The tensor's version is bumped
  // as it is handed out: should the backward throw before the node is freed, a later walk through
  // the node is refused (a saved tensor modified in place) instead of reading what was written.
  Tensor reusable_saved(const Tensor& saved) const;

  // ---- what printing and tools read ----
  const char* name() const { return op_; }  // the op's name, a static string
  bool freed() const { return freed_; }     // its backward has run, or it was swept
  const Shape& input_shape(std::size_t i) const;  // as recorded
  std::size_t bytes_saved() const;
  using Slot = detail::Ref<AutogradMeta>;
  // One autograd slot per input (null where it needs no gradient), and the outputs' slots.
  detail::Span<const Slot> inputs() const { return {slots(), n_in_}; }
  detail::Span<const Slot> outputs() const { return {slots() + n_in_, n_out_}; }

 private:
  // The tape's bookkeeping (core/autograd.cpp, core/tape_internal.h): the saved tensors, then the
  // slots and the shapes of the inputs without a slot, in one block of the tape's arena.
  friend struct detail::TapeAccess;
  friend struct detail::NodeAccess;
  Slot* slots() const { return reinterpret_cast<Slot*>(reinterpret_cast<char*>(saved_) + n_saved_ * sizeof(Tensor)); }
  const char* op_ = "";
  std::uint32_t n_in_ = 0, n_other_ = 0, n_out_ = 0, n_saved_ = 0;
  bool freed_ = false;
  bool overwrite_ok_ = false;            // may_reuse_grad_out()
  mutable bool grad_out_given_ = false;  // new_grad handed output 0's gradient out
  bool freed_after_run_ = false;         // the walk frees the node after this backward (reusable_saved)
  std::uint64_t undefined_inputs_ = 0;   // bit i: input i was an undefined (optional) tensor
  Tensor* saved_ = nullptr;
  void* closure_ = nullptr;
  const detail::ClosureOps* ops_ = nullptr;
};

// True when recording is on (no NoGradGuard) and any input requires a gradient.
inline bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!detail::t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->requires_grad()) return true;
  return false;
}

// Records op on this thread's tape (call only when should_record() said yes). `saved` is a struct
// of Tensor fields that the closure receives by name: backward(Node&, const Saved&).
template <class Saved, class F>
Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             const Saved& saved, F&& backward) {
  return detail::record_saved<Saved>(op, {inputs.begin(), inputs.size()}, outputs, saved, std::forward<F>(backward));
}
// The same for an op that saves nothing: backward(Node&).
template <class F>
Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             F&& backward) {
  return detail::record_plain(op, {inputs.begin(), inputs.size()}, outputs, std::forward<F>(backward));
}
// Any number of inputs (cat): the same two forms over a vector.
template <class Saved, class F>
Node& record(const char* op, const std::vector<const Tensor*>& inputs, std::initializer_list<Tensor*> outputs,
             const Saved& saved, F&& backward) {
  return detail::record_saved<Saved>(op, {inputs.data(), inputs.size()}, outputs, saved, std::forward<F>(backward));
}
template <class F>
Node& record(const char* op, const std::vector<const Tensor*>& inputs, std::initializer_list<Tensor*> outputs,
             F&& backward) {
  return detail::record_plain(op, {inputs.data(), inputs.size()}, outputs, std::forward<F>(backward));
}

}  // namespace tg

#include "tapegrad/detail/record.h"
