#pragma once
// The tape: reverse-mode automatic differentiation by recording (docs/tape.md).
//
// Every op whose inputs need a gradient appends one Node (tapegrad/node.h) to a thread-local
// Tape, in execution order. backward(loss) seeds d loss / d loss = 1 and walks the tape in
// reverse: the order of execution is already a topological order, so no sort is needed. Each node
// reads the gradients of its outputs and hands its inputs' gradients to the tape, which adds up
// the parts that reach one tensor. The nodes that led to the loss are then freed (their saved
// activations released), unless the caller keeps them for a second backward; other graphs recorded on the same tape stay usable. Nodes that
// nothing can reach any more (every output dropped, e.g. a forward pass made for evaluation
// without a NoGradGuard) are freed by a sweep as the tape grows.
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/node.h"
#include "tapegrad/tensor.h"

namespace tg {

namespace detail {
class Arena;  // core/tape_internal.h: the bump allocator for nodes' arrays and closures
}  // namespace detail

class Tape {
 public:
  Tape();
  ~Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
  std::size_t size() const { return nodes_.size(); }  // nodes recorded since the tape was last emptied
  std::size_t live() const { return live_; }          // of those, not yet freed
  const Node& operator[](std::size_t i) const { return nodes_[i]; }
  std::size_t bytes_saved() const;                    // by the live nodes, for their backward
  // One line per live node: index, op, input shapes -> output shapes, bytes saved for backward.
  void print(std::ostream& os) const;
  // The recorded graph in Graphviz DOT: tensors as ellipses, ops as boxes.
  std::string to_dot() const;
  // Drops every node (and the activations they saved); tensors recorded so far can no longer be
  // differentiated through.
  void clear();

  // The sweep's triggers: a node count that doubles (the first at kFirstSweep), and kSweepBytes of
  // tensors saved by live nodes (a node count alone does not bound memory: one node can save
  // megabytes, as a forward pass made for evaluation without a NoGradGuard does).
  static constexpr std::size_t kFirstSweep = std::size_t(1) << 17;
  static constexpr std::size_t kSweepBytes = std::size_t(256) << 20;

 private:
  friend struct detail::TapeAccess;
  std::unique_ptr<detail::Arena> arena_;  // declared before nodes_: destroyed after them
  std::vector<Node> nodes_;
  static constexpr int kGenerationBits = 40;
  std::uint64_t generation_ = 1;          // this tape's id and a count of its clears (core/tape.cpp)
  std::vector<std::uint64_t> cleared_by_user_;  // the last generations that clear() ended
  bool stale_input_ = false;              // a node recorded an input whose graph is gone
  std::size_t live_ = 0;
  std::size_t next_sweep_ = kFirstSweep;
  std::size_t saved_live_ = 0;            // bytes of the tensors the live nodes saved
  std::size_t next_sweep_bytes_ = kSweepBytes;
};

// This thread's tape.
namespace detail {
extern thread_local constinit Tape* t_tape;  // null until tape_slow() makes this thread's tape
Tape& tape_slow();
}  // namespace detail
inline Tape& tape() {
  Tape* t = detail::t_tape;
  return t ? *t : detail::tape_slow();
}

// Recording is on unless a NoGradGuard is alive on this thread (PyTorch's torch.no_grad()).
inline bool grad_enabled() { return detail::t_grad_enabled; }
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Same as root.backward(grad, keep_tape): seeds root's gradient with grad (1 for a scalar when
// grad is undefined) and walks the tape back from root's node. keep_tape keeps the walked nodes
// for another backward (PyTorch's retain_graph).
void backward(const Tensor& root, const Tensor& grad = Tensor(), bool keep_tape = false);

}  // namespace tg
