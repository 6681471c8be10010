#pragma once
// The tape: reverse-mode automatic differentiation by recording.
//
// Every op whose inputs need a gradient appends one Node to a thread-local Tape, in execution
// order. backward(loss) seeds d loss / d loss = 1 and walks the tape in reverse: the order of
// execution is already a topological order, so no sort is needed. Each node reads the gradients of
// its outputs and accumulates (+=) into the gradients of its inputs. Afterwards the nodes that led
// to the loss are freed (their saved activations released), unless the caller keeps them for a
// second backward; other graphs recorded on the same tape stay usable. When no live node is left
// the tape is emptied. Nodes that nothing can reach any more (every output tensor dropped, e.g. a
// forward pass made for evaluation without a NoGradGuard) are freed by a sweep as the tape grows.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

struct Node {
  const char* op = "";                                  // static string naming the op
  std::vector<std::shared_ptr<AutogradMeta>> inputs;    // null where an input needs no gradient
  std::vector<std::shared_ptr<AutogradMeta>> outputs;
  std::vector<Shape> input_shapes;                       // for printing
  std::uint64_t undefined_inputs = 0;                    // bit i: input i was an undefined tensor (optional)
  std::vector<Tensor> saved;                             // what backward reads (activations)
  std::function<void(Node&)> backward;
  bool freed = false;                                    // consumed by a backward, or unreachable

  // The gradient flowing into output i (undefined if nothing downstream reached it).
  const Tensor& grad_out(std::size_t i = 0) const;
  // Input i's gradient buffer to accumulate into, or an undefined tensor when i needs no gradient.
  Tensor grad_in(std::size_t i) const;
  bool needs_grad(std::size_t i) const { return i < inputs.size() && inputs[i] != nullptr; }
  std::size_t bytes_saved() const;
};

class Tape {
 public:
  std::size_t size() const { return nodes_.size(); }   // nodes recorded since the tape was last emptied
  std::size_t live() const { return live_; }           // of those, not yet freed
  const Node& operator[](std::size_t i) const { return nodes_[i]; }
  std::uint64_t generation() const { return generation_; }
  std::size_t bytes_saved() const;
  // One line per live node: index, op, input shapes -> output shapes, bytes saved for backward.
  void print(std::ostream& os) const;
  // The recorded graph in Graphviz DOT: tensors as ellipses, ops as boxes.
  std::string to_dot() const;
  // Drops every node (and the activations they saved); tensors recorded so far can no longer
  // be differentiated through.
  void clear();

  Node& push(Node&& n);
  Node& node(std::size_t i) { return nodes_[i]; }
  // Releases node i's saved tensors, closure and input references.
  void free_node(std::size_t i);
  // Frees every live node whose outputs no tensor and no later node refers to; empties the tape
  // when nothing is left. Runs automatically as the tape grows.
  void sweep();

 private:
  std::vector<Node> nodes_;
  std::uint64_t generation_ = 1;
  std::size_t live_ = 0;
  std::size_t next_sweep_ = kFirstSweep;
  static constexpr std::size_t kFirstSweep = 1 << 14;
};

// This thread's tape.
Tape& tape();

// Recording is on unless a NoGradGuard is alive on this thread (PyTorch's torch.no_grad()).
bool grad_enabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Same as root.backward(grad, keep_tape).
void backward(const Tensor& root, const Tensor& grad = Tensor(), bool keep_tape = false);

// ---- for op implementers ----
// True when recording is on and any of the inputs requires a gradient.
bool should_record(std::initializer_list<const Tensor*> inputs);
// Appends a node for `op` with the given inputs and outputs; marks outputs as requiring grad.
// Call only when should_record() said yes.
Node& record(const char* op, std::initializer_list<const Tensor*> inputs,
             std::initializer_list<Tensor*> outputs, std::function<void(Node&)> backward,
             std::vector<Tensor> saved = {});
Node& record(const char* op, const std::vector<const Tensor*>& inputs,
             const std::vector<Tensor*>& outputs, std::function<void(Node&)> backward,
             std::vector<Tensor> saved = {});

}  // namespace tg
