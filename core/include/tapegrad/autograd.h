#pragma once
// The tape: reverse-mode automatic differentiation by recording (docs/tape.md).
//
// Every op whose inputs need a gradient appends one Node (tapegrad/node.h) to a thread-local
// Tape, in execution order. backward(loss) seeds d loss / d loss = 1 and walks the tape in
// reverse: the order of execution is already a topological order, so no sort is needed. Each node
// reads the gradients of its outputs and writes or adds the gradients of its inputs. The nodes
// that led to the loss are then freed (their saved activations released), unless the caller keeps
// them for a second backward; other graphs recorded on the same tape stay usable. Nodes that
// nothing can reach any more (every output dropped, e.g. a forward pass made for evaluation
// without a NoGradGuard) are freed by a sweep as the tape grows.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/node.h"
#include "tapegrad/tensor.h"

namespace tg {

namespace detail {
class Arena;        // core/tape_internal.h: the bump allocator for nodes' arrays and closures
struct TapeAccess;  // core/tape_internal.h: recording, the backward walk and the sweep
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
  std::uint64_t generation_ = 1;          // bumped by clear(): slots of older generations are stale
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

// ---- gradient hooks (PyTorch's Tensor.register_post_accumulate_grad_hook) ----
// hook(grad) runs during a backward() that reaches `leaf`, as soon as leaf's gradient is final for
// that backward: right after the last node of the walk that adds into it (the earliest-recorded of
// its consumers), before the walk goes on, with leaf.grad() as argument. It runs on the thread
// of the backward, with recording off; an exception from it stops the backward. A backward
// that does not reach the leaf does not call it. Data parallelism (tg::dist) starts reducing a
// bucket of gradients from here while the rest of the backward runs.
// The hook stays until its handle is destroyed or remove()d; register only on a leaf that
// requires grad (a parameter). A backward with no hook registered anywhere costs nothing extra.
class GradHookHandle {
 public:
  GradHookHandle() = default;
  ~GradHookHandle() { remove(); }
  GradHookHandle(GradHookHandle&& o) noexcept : id_(o.id_) { o.id_ = 0; }
  GradHookHandle& operator=(GradHookHandle&& o) noexcept;
  GradHookHandle(const GradHookHandle&) = delete;
  GradHookHandle& operator=(const GradHookHandle&) = delete;
  void remove();  // idempotent
  bool active() const { return id_ != 0; }

 private:
  friend GradHookHandle register_post_accumulate_grad_hook(const Tensor&, std::function<void(const Tensor&)>);
  explicit GradHookHandle(std::uint64_t id) : id_(id) {}
  std::uint64_t id_ = 0;
};
[[nodiscard]] GradHookHandle register_post_accumulate_grad_hook(const Tensor& leaf,
                                                                std::function<void(const Tensor& grad)> hook);

// ---- anomaly mode (PyTorch's torch.autograd.set_detect_anomaly) ----
// When on (for this thread), every recorded op checks its outputs and every backward step the
// gradients it wrote, and the first NaN or Inf throws tg::Error naming the op, its tape index and
// its input and output shapes, and whether its inputs were already non-finite. Costs a pass over
// every output and gradient: a debugging aid, off by default. Ops run under NoGradGuard are not
// recorded and so not checked. A backward stopped this way leaves the gradients part-accumulated.
void set_detect_anomaly(bool on);
bool is_anomaly_enabled();
class DetectAnomalyGuard {
 public:
  explicit DetectAnomalyGuard(bool on = true);
  ~DetectAnomalyGuard();
  DetectAnomalyGuard(const DetectAnomalyGuard&) = delete;
  DetectAnomalyGuard& operator=(const DetectAnomalyGuard&) = delete;

 private:
  bool prev_;
};

// ---- op timing, for benchmarks ----
// When on (for this thread), the tape times every recorded op: its forward as the time from the
// previous record (or from op_timing_mark()) to its own, which covers the op's checks, its output's
// allocation and its kernel; its backward as the time of its backward step. op_times() sums them
// by op name, largest total first. Costs a clock read per op; off by default.
struct OpTime {
  std::string op;
  double forward_s = 0, backward_s = 0;
  std::int64_t calls = 0;
};
void set_op_timing(bool on);
void op_timing_mark();  // the next op's forward starts now (call before a forward pass)
std::vector<OpTime> op_times();
void reset_op_times();

}  // namespace tg
