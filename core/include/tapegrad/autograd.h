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
#include <algorithm>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

namespace detail {
// The tape's bump allocator: a node's small arrays and its backward closure are carved out of
// blocks by moving a pointer, and all given back at once when the tape is emptied (the blocks are
// kept for the next step). A training step records a few hundred nodes; with the general-purpose
// heap each would cost five or six malloc/free pairs, more than the op itself at small sizes.
class Arena {
 public:
  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  // bytes at the given alignment (a power of two), valid until reset().
  void* allocate(std::size_t bytes, std::size_t align) {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr_);
    const std::uintptr_t a = (p + align - 1) & ~(static_cast<std::uintptr_t>(align) - 1);
    if (ptr_ && a + bytes <= reinterpret_cast<std::uintptr_t>(end_)) {
      ptr_ = reinterpret_cast<char*>(a + bytes);
      return reinterpret_cast<void*>(a);
    }
    return allocate_slow(bytes, align);
  }
  void reset();  // forgets every allocation, keeps the blocks

 private:
  void* allocate_slow(std::size_t bytes, std::size_t align);  // moves to the next block
  std::vector<std::pair<char*, std::size_t>> blocks_;
  std::size_t block_ = 0;  // index of the block being carved
  char* ptr_ = nullptr;
  char* end_ = nullptr;
};
}  // namespace detail

struct Node;

// A node's backward closure, type-erased without std::function's heap allocation: the closure
// object lives in the tape's arena; the node calls and destroys it through one static table per
// closure type (two words per node, not three).
struct BackwardOps {
  void (*call)(void*, Node&);
  void (*destroy)(void*);  // null for a trivially destructible closure
};
struct BackwardFn {
  void* obj = nullptr;
  const BackwardOps* ops = nullptr;
  explicit operator bool() const { return ops != nullptr; }
};

// Where a backward kernel writes input i's gradient. The first gradient to reach a tensor in a
// backward pass is written straight into a fresh, uninitialised buffer (acc = false: the kernel
// assigns every element), later ones add into it (acc = true). This spares a zero fill and a read
// of zeros per gradient; a kernel that cannot write every element uses Node::grad_in instead.
// buf points at the input's gradient in its autograd slot, which the node keeps alive while its
// backward runs (a pointer, not a Tensor: no reference count or shape copied per gradient).
struct GradDest {
  Tensor* buf = nullptr;  // null when the input needs no gradient
  bool acc = false;       // add into buf (true) or overwrite it (false)
  bool defined() const { return buf != nullptr; }
  template <class T> T* ptr() { return buf ? buf->data<T>() : nullptr; }
};

// A node's saved tensors: their number is known when the node is recorded, so they are carved
// once from the tape's arena. A plain view (trivially copied and destroyed, like the Node that holds
// it, so forgetting a tape of freed nodes is O(1)): Node::release() runs the elements' destructors
// through destroy(), and the tape releases every live node before it forgets it.
template <class T>
class NodeArray {
 public:
  NodeArray() = default;
  NodeArray(T* p, std::size_t n) : p_(p), n_(n) {}
  T* begin() { return p_; }
  T* end() { return p_ + n_; }
  const T* begin() const { return p_; }
  const T* end() const { return p_ + n_; }
  std::size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T& operator[](std::size_t i) { return p_[i]; }
  const T& operator[](std::size_t i) const { return p_[i]; }
  void destroy() {
    for (std::size_t i = 0; i < n_; ++i) p_[i].~T();
    n_ = 0;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

// A view of one of a node's arrays.
template <class T>
struct NodeSpan {
  T* p;
  std::size_t n;
  T* begin() const { return p; }
  T* end() const { return p + n; }
  std::size_t size() const { return n; }
  bool empty() const { return n == 0; }
  T& operator[](std::size_t i) const { return p[i]; }
};

// A node owns what its arrays hold until release(); it is trivially copyable so that the tape's
// vector moves and forgets nodes without running code per node (Tape::clear releases the live
// ones first).
struct Node {
  Node() = default;
  Node(Node&&) = default;
  Node& operator=(Node&&) = delete;
  Node(const Node&) = delete;

  using Slot = detail::Ref<AutogradMeta>;
  const char* op = "";                                // static string naming the op
  NodeArray<Tensor> saved;                            // what backward reads (activations)
  // The node's other arrays follow the saved tensors in the same arena block (see record_node), so
  // three counts describe them and a node is 64 bytes, one cache line:
  //   inputs():  one autograd slot per input, null where an input needs no gradient
  //   outputs(): the outputs' slots
  //   other_shapes(): the shapes of the inputs that need no gradient, in input order (for printing
  //                   and error messages; the others' shapes are in their slots): see input_shape().
  std::uint32_t n_in = 0;
  std::uint32_t n_other = 0;
  std::uint32_t n_out = 0;
  bool freed = false;                                 // consumed by a backward, or unreachable
  std::uint64_t undefined_inputs = 0;                 // bit i: input i was an undefined tensor (optional)
  BackwardFn backward;

  NodeSpan<const Slot> inputs() const { return {slots(), n_in}; }
  NodeSpan<const Slot> outputs() const { return {slots() + n_in, n_out}; }
  NodeSpan<const Shape> other_shapes() const { return {reinterpret_cast<const Shape*>(slots() + n_in + n_out), n_other}; }

  // The gradient flowing into output i (undefined if nothing downstream reached it).
  const Tensor& grad_out(std::size_t i = 0) const { return outputs()[i]->grad.get(); }
  // Input i's gradient buffer to accumulate (+=) into, zero-filled when new; undefined when i needs
  // no gradient.
  Tensor grad_in(std::size_t i) const;
  // Input i's gradient for a kernel that writes every element (see GradDest).
  GradDest grad_dest(std::size_t i) const;
  // grad_in(i) as a GradDest that adds (acc = true): for a kernel that cannot write every element.
  GradDest grad_add(std::size_t i) const;
  // The same, for an elementwise kernel that reads dy[k] before it writes dx[k]: when input i has
  // no gradient yet and output j's incoming gradient is held by nothing else (not retained, not
  // shared with the caller), that buffer becomes input i's gradient and the kernel writes over it
  // in place, saving a buffer per op. A grad_out(j) reference taken before the call then names
  // input i's gradient (its shape too; read its data before writing dx); grad_out(j) called
  // afterwards is undefined.
  GradDest grad_dest_over(std::size_t i, std::size_t j = 0) const;
  bool needs_grad(std::size_t i) const { return i < n_in && slots()[i] != nullptr; }
  // Input i's autograd slot is also another input's (x * x).
  bool input_repeated(std::size_t i) const { return n_in > 1 && input_repeated_slow(i); }
  // Input i's shape as recorded (not available once the node is freed).
  const Shape& input_shape(std::size_t i) const;
  std::size_t bytes_saved() const { return saved.empty() ? 0 : bytes_saved_slow(); }
  void run_backward() { backward.ops->call(backward.obj, *this); }
  void release_backward() {
    if (backward.ops && backward.ops->destroy) backward.ops->destroy(backward.obj);
    backward = BackwardFn{};  // the closure's memory belongs to the arena
  }
  // Destroys the saved tensors, the closure and the slots (the memory goes back with the arena),
  // leaving the arrays empty; the caller marks the node freed.
  void release();

 private:
  bool input_repeated_slow(std::size_t i) const;
  std::size_t bytes_saved_slow() const;
  // The first slot: right after the saved tensors (valid while saved holds its recorded count).
  Slot* slots() const {
    return reinterpret_cast<Slot*>(reinterpret_cast<char*>(const_cast<Tensor*>(saved.begin())) + saved.size() * sizeof(Tensor));
  }
};

class Tape {
 public:
  Tape() = default;
  ~Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
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

  // A new node at the end of the tape, its arrays in the tape's arena.
  Node& push();
  // Counts bytes a new node saved for its backward (see kSweepBytes).
  void note_saved(std::size_t bytes) { saved_live_ += bytes; }
  Node& node(std::size_t i) { return nodes_[i]; }
  detail::Arena& arena() { return arena_; }
  // Releases node i's saved tensors, closure, input references and output slots.
  void free_node(std::size_t i);
  // Removes the last node, which holds nothing yet: a recording whose allocation failed.
  void discard_last();
  // Frees every live node whose outputs no tensor and no later node refers to; empties the tape
  // when nothing is left. Runs automatically as the tape grows: when its node count has doubled
  // (or quadrupled, see sweep()) since the last sweep, and when the bytes of the tensors saved by
  // live nodes (counted per node) reach kSweepBytes, or twice what the last sweep left if that was
  // more. The second trigger bounds what forward passes made for evaluation without a NoGradGuard
  // hold: the default GPT's forward saves 28 MB in 45 nodes, so a node count alone let 360 of them
  // pile up (10 GB) before the first sweep. A training loop frees its nodes in each backward and
  // never reaches it.
  void sweep();
  static constexpr std::size_t kSweepBytes = std::size_t(256) << 20;
  // The node count of the first sweep: about 30 MB of the tape's own records (a small op's node,
  // arena block and output slot take ~230 bytes). A sweep reads every live node's output slots,
  // which in a long graph are cache misses: a chain of 10^5 small ops spent 5% of its time in the
  // sweeps at 16384 and 65536 nodes, which found nothing to free.
  static constexpr std::size_t kFirstSweep = std::size_t(1) << 17;

 private:
  detail::Arena arena_;  // declared before nodes_: destroyed after them
  std::vector<Node> nodes_;
  std::uint64_t generation_ = 1;
  std::size_t live_ = 0;
  std::size_t next_sweep_ = kFirstSweep;
  std::size_t saved_live_ = 0;  // bytes of the tensors the live nodes saved (counted per node)
  std::size_t next_sweep_bytes_ = kSweepBytes;
};

namespace detail {
// This thread's switches and tape, read inline by every op (see grad_enabled, set_detect_anomaly
// and tape()). constinit: no dynamic initialisation, so an access is a plain thread-local load
// with no call to an initialisation wrapper.
extern thread_local constinit bool t_grad_enabled;
extern thread_local constinit bool t_anomaly;
extern thread_local constinit Tape* t_tape;  // null until tape_slow() has made this thread's tape
Tape& tape_slow();
}  // namespace detail

// This thread's tape.
inline Tape& tape() {
  Tape* t = detail::t_tape;
  return t ? *t : detail::tape_slow();
}
namespace detail {
inline std::size_t tape_size() { return tape().size(); }
inline bool anomaly_enabled() { return t_anomaly; }
}  // namespace detail

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

// Same as root.backward(grad, keep_tape).
void backward(const Tensor& root, const Tensor& grad = Tensor(), bool keep_tape = false);

// ---- for op implementers ----
// True when recording is on and any of the inputs requires a gradient.
inline bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!detail::t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->requires_grad()) return true;
  return false;
}

namespace detail {
// Appends the node (inputs, outputs, saved tensors) with closure_bytes of the tape's arena, at
// closure_align, for its backward closure in node.backward.obj; record_with() constructs it there.
// Inline, so that at each op's call site the counts and sizes are constants and its loops fold
// away (the chain of small ops: 924 -> 907 instructions per op, callgrind).
inline Node& record_node(const char* op, const Tensor* const* inputs, std::size_t n_in, Tensor* const* outputs,
                         std::size_t n_out, const Tensor* saved, std::size_t n_saved, std::size_t closure_bytes,
                         std::size_t closure_align) {
  using Meta = Ref<AutogradMeta>;
  static_assert(alignof(Meta) <= alignof(Tensor) && alignof(Shape) <= alignof(Tensor));
  Tape& tp = tape();
  // What can throw comes before anything is recorded: the outputs' slots, then the node (push may
  // sweep, and a sweep that empties the tape resets the arena: so before the arena allocation),
  // then the arena block, whose failure takes the still empty node back off the tape. The rest
  // only copies handles and cannot throw.
  if (n_in > UINT32_MAX || n_out > UINT32_MAX) fail(op, "too many inputs or outputs to record (", n_in, ", ", n_out, ")");
  for (std::size_t i = 0; i < n_out; ++i) outputs[i]->ensure_meta();
  Node& n = tp.push();
  // One arena allocation for the four arrays and the closure: saved tensors first (the strictest
  // alignment of the arrays), the closure last. Shapes are kept only for inputs without an
  // autograd slot (the slot has the shape of the others).
  std::size_t n_other = 0;
  for (std::size_t i = 0; i < n_in; ++i) n_other += inputs[i]->requires_grad() ? 0 : 1;
  const std::size_t arrays = n_saved * sizeof(Tensor) + (n_in + n_out) * sizeof(Meta) + n_other * sizeof(Shape);
  const std::size_t closure_at = (arrays + closure_align - 1) & ~(closure_align - 1);  // alignments are powers of two
  char* mem = nullptr;
  try {
    mem = static_cast<char*>(tp.arena().allocate(closure_at + closure_bytes, std::max(alignof(Tensor), closure_align)));
  } catch (...) {
    tp.discard_last();
    throw;
  }
  auto* sv = reinterpret_cast<Tensor*>(mem);
  auto* in = reinterpret_cast<Meta*>(mem + n_saved * sizeof(Tensor));
  auto* out = in + n_in;
  auto* shapes = reinterpret_cast<Shape*>(reinterpret_cast<char*>(out + n_out));
  std::uint64_t undefined = 0;
  for (std::size_t i = 0, k = 0; i < n_in; ++i) {
    const Tensor* t = inputs[i];
    if (t->requires_grad()) {
      ::new (in + i) Meta(t->meta());
    } else {
      ::new (in + i) Meta();
      ::new (shapes + k++) Shape(t->shape());
      if (!t->defined() && i < 64) undefined |= std::uint64_t(1) << i;  // (an undefined tensor needs no grad)
    }
  }
  for (std::size_t i = 0; i < n_saved; ++i) ::new (sv + i) Tensor(saved[i]);
  const auto index = static_cast<std::int64_t>(tp.size()) - 1;
  for (std::size_t i = 0; i < n_out; ++i) {
    const auto& m = outputs[i]->meta();
    m->requires_grad = true;
    m->node = index;
    m->generation = tp.generation();
    ::new (out + i) Meta(m);
  }
  n.op = op;
  n.saved = NodeArray<Tensor>(sv, n_saved);  // the slots follow: Node::slots() finds them from here
  tp.note_saved(n.bytes_saved());  // free_node takes the same count back
  n.n_in = static_cast<std::uint32_t>(n_in);
  n.n_out = static_cast<std::uint32_t>(n_out);
  n.n_other = static_cast<std::uint32_t>(n_other);
  n.undefined_inputs = undefined;
  n.backward.obj = mem + closure_at;  // raw memory until record_with constructs the closure
  return n;
}
// Anomaly mode's forward check of a freshly recorded node's outputs (see set_detect_anomaly).
void check_anomaly_outputs(const char* op, std::size_t index, const Node& node, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in);
// Whether retain_grad() was ever called (in any thread): backward then takes its careful first pass.
void note_retain_grad();
bool retain_grad_used();

template <class Fn>
inline constexpr BackwardOps kBackwardOps{
    [](void* p, Node& n) { (*static_cast<Fn*>(p))(n); },
    std::is_trivially_destructible_v<Fn> ? nullptr : +[](void* p) { static_cast<Fn*>(p)->~Fn(); }};

template <class F>
Node& record_with(const char* op, const Tensor* const* in, std::size_t n_in, Tensor* const* out, std::size_t n_out,
                  F&& backward, const Tensor* saved, std::size_t n_saved) {
  using Fn = std::decay_t<F>;
  Node& node = record_node(op, in, n_in, out, n_out, saved, n_saved, sizeof(Fn), alignof(Fn));
  try {
    node.backward.obj = ::new (node.backward.obj) Fn(std::forward<F>(backward));
  } catch (...) {  // the op throws and its outputs are never seen: leave no half-made node live
    tape().free_node(tape_size() - 1);
    throw;
  }
  node.backward.ops = &kBackwardOps<Fn>;
  if (anomaly_enabled()) check_anomaly_outputs(op, tape_size() - 1, node, out, n_out, in, n_in);
  return node;
}
}  // namespace detail

// Appends a node for `op` with the given inputs and outputs; marks outputs as requiring grad.
// `backward` is any callable void(Node&): it reads grad_out() and saved, and writes the inputs'
// gradients through grad_dest(i) / grad_in(i). Call only when should_record() said yes.
template <class F>
Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             F&& backward, std::initializer_list<Tensor> saved = {}) {
  return detail::record_with(op, inputs.begin(), inputs.size(), outputs.begin(), outputs.size(),
                             std::forward<F>(backward), saved.begin(), saved.size());
}
template <class F>
Node& record(const char* op, const std::vector<const Tensor*>& inputs, std::initializer_list<Tensor*> outputs,
             F&& backward, std::initializer_list<Tensor> saved = {}) {
  return detail::record_with(op, inputs.data(), inputs.size(), outputs.begin(), outputs.size(),
                             std::forward<F>(backward), saved.begin(), saved.size());
}

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

}  // namespace tg
