#include "tape_internal.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <limits>
#include <mutex>
#include <ostream>
#include <sstream>
#include <unordered_map>

#include "dispatch.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "pool.h"
#include "tapegrad/ops.h"

namespace tg {

namespace detail {
thread_local constinit bool t_grad_enabled = true;
thread_local constinit bool t_anomaly = false;
thread_local constinit bool t_record_hook = false;  // t_anomaly or op timing
thread_local constinit Tape* t_tape = nullptr;
thread_local constinit bool t_hooks_off = false;
}  // namespace detail
using detail::t_anomaly;
using detail::t_grad_enabled;

namespace {

std::string human_bytes(std::size_t b) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  if (b >= (1u << 20)) s << static_cast<double>(b) / (1 << 20) << " MiB";
  else if (b >= (1u << 10)) s << static_cast<double>(b) / (1 << 10) << " KiB";
  else s << b << " B";
  return s.str();
}
}  // namespace

// ---- arena ----

namespace detail {

Arena::~Arena() {
  for (auto& [p, n] : blocks_) ::operator delete(p, n, std::align_val_t(64));
}

void Arena::reset() {
  block_ = 0;
  ptr_ = blocks_.empty() ? nullptr : blocks_[0].first;
  end_ = blocks_.empty() ? nullptr : blocks_[0].first + blocks_[0].second;
}

void* Arena::allocate_slow(std::size_t bytes, std::size_t align) {
  for (;;) {
    // The next kept block, or a new one (64 KiB, doubling, at least big enough for this request).
    const std::size_t next = ptr_ ? block_ + 1 : 0;
    if (next >= blocks_.size()) {
      const std::size_t want = std::max<std::size_t>(bytes + align, blocks_.empty() ? (64u << 10) : 2 * blocks_.back().second);
      blocks_.emplace_back(static_cast<char*>(::operator new(want, std::align_val_t(64))), want);
    } else if (blocks_[next].second < bytes + align) {
      // A kept block too small for this request: put a big enough one in its place.
      ::operator delete(blocks_[next].first, blocks_[next].second, std::align_val_t(64));
      const std::size_t want = std::max(bytes + align, 2 * blocks_[next].second);
      blocks_[next] = {static_cast<char*>(::operator new(want, std::align_val_t(64))), want};
    }
    block_ = next;
    ptr_ = blocks_[next].first;
    end_ = ptr_ + blocks_[next].second;
    const auto p = reinterpret_cast<std::uintptr_t>(ptr_);
    const std::uintptr_t a = (p + align - 1) & ~(static_cast<std::uintptr_t>(align) - 1);
    if (a + bytes <= reinterpret_cast<std::uintptr_t>(end_)) {
      ptr_ = reinterpret_cast<char*>(a + bytes);
      return reinterpret_cast<void*>(a);
    }
  }
}

}  // namespace detail

// ---- autograd slots: made by record_node (through ensure_meta), dropped by Node::release ----

AutogradMeta* AutogradMeta::make(const Shape& s, DType d) { return detail::pool_new<AutogradMeta>(s, d); }
void AutogradMeta::destroy(AutogradMeta* m) noexcept { detail::pool_delete(m); }

// ---- Node ----

static_assert(std::is_trivially_copyable_v<Node> && std::is_trivially_destructible_v<Node>,
              "the tape moves and forgets nodes without running code per node");

void Node::release() {
  static_assert(std::is_trivially_destructible_v<Shape>, "other_shapes are not destroyed one by one");
  Slot* slot = slots();
  for (std::uint32_t i = 0; i < n_in + n_out; ++i) slot[i].~Slot();
  for (std::uint32_t i = 0; i < n_saved; ++i) saved_[i].~Tensor();
  if (ops_ && ops_->destroy) ops_->destroy(closure_);
  ops_ = nullptr;  // the closure's memory belongs to the arena
  n_in = n_out = n_other = n_saved = 0;  // a freed node's arrays read as empty
}

const Shape& Node::input_shape(std::size_t i) const {
  if (slots()[i]) return slots()[i]->shape;
  std::size_t k = 0;  // the number of inputs before i that have no autograd slot
  for (std::size_t j = 0; j < i; ++j) k += slots()[j] ? 0 : 1;
  return other_shapes()[k];
}

bool Node::input_repeated_slow(std::size_t i) const {
  for (std::size_t j = 0; j < n_in; ++j)
    if (j != i && slots()[j] == slots()[i]) return true;
  return false;
}

GradDest Node::add_grad(std::size_t i) const {
  if (!needs_grad(i)) return GradDest{};
  return GradDest{&slots()[i]->grad_accumulator(), true};
}

GradDest Node::write_grad(std::size_t i) const {
  if (!needs_grad(i)) return GradDest{};
  AutogradMeta& m = *slots()[i];
  // The same tensor passed as two inputs (x * x): both writes add into one zero-filled buffer, so
  // the kernel's order of writing them does not matter.
  if (m.grad.defined() || input_repeated(i)) return GradDest{&m.grad_accumulator(), true};
  return GradDest{&m.grad.set(Tensor::empty(m.shape, m.dtype)), false};
}

bool Node::take_grad(std::size_t i, Tensor& g) const {
  if (!needs_grad(i)) return false;
  AutogradMeta& m = *slots()[i];
  if (m.grad.defined() || input_repeated(i) || !g.sole_owner() || g.dtype() != m.dtype || !(g.shape() == m.shape))
    return false;
  m.grad.set(g);  // a copy first: should set() throw, g is still the caller's
  g = Tensor();
  return true;
}

GradDest Node::write_grad_over_output(std::size_t i, std::size_t j) const {
  if (needs_grad(i)) {
    AutogradMeta& m = *slots()[i];
    AutogradMeta& o = *outputs()[j];
    const Tensor& og = o.grad.get();
    if (!m.grad.defined() && !o.retains_grad && og.sole_owner() && og.dtype() == m.dtype && !input_repeated(i)) {
      const bool same_shape = og.shape() == m.shape;
      if (same_shape || og.numel() == m.shape.numel()) {
        m.grad = std::move(o.grad);  // moves the slot's pointer: leaves o.grad undefined
        Tensor& g = *m.grad.ptr();
        if (!same_shape) g = g.alias(m.shape);
        return GradDest{&g, false};
      }
    }
  }
  return write_grad(i);
}

// ---- the tape combines: new_grad and pass_grad ----

namespace {

// Whether nothing but g itself and this node's outputs' gradient slots (which the walk empties as
// soon as the node has run, unless the user retains them) holds g's memory: then the tape may keep
// g as an input's gradient and add into it later.
bool held_only_here(const Node& n, const Tensor& g) {
  std::size_t transient = 0;
  for (const auto& o : n.outputs())
    if (!o->retains_grad && o->grad.get().shares_storage(g)) ++transient;
  return g.storage_refs() <= 1 + transient;
}

// dst += src, elementwise over the same number of elements; float32, float64 or bfloat16 (through
// float32, rounded back).
void add_into(Tensor& dst, const Tensor& src) {
  const std::int64_t count = dst.numel();
  if (dst.dtype() == DType::bf16) {
    kernels::bf16* d = dst.data<kernels::bf16>();
    const kernels::bf16* g = src.data<kernels::bf16>();
    for (std::int64_t i = 0; i < count; ++i) d[i] = kernels::to_bf16(kernels::to_float(d[i]) + kernels::to_float(g[i]));
    return;
  }
  detail::dispatch_float("backward", dst.dtype(), [&](auto z) {
    using T = decltype(z);
    T* d = dst.data<T>();
    const T* g = src.data<T>();
    kernels::parallel_for(count, count, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) d[i] += g[i];
    });
  });
}

}  // namespace

Tensor Node::new_grad(std::size_t i) const {
  if (!needs_grad(i)) return Tensor();
  const AutogradMeta& m = *slots()[i];
  if (overwrite_ok_ && !grad_out_given_ && n_out > 0) {
    const AutogradMeta& o = *outputs()[0];
    const Tensor& dy = o.grad.get();
    if (!o.retains_grad && dy.defined() && dy.sole_owner() && dy.dtype() == m.dtype && dy.numel() == m.shape.numel()) {
      grad_out_given_ = true;
      return dy.alias(m.shape);
    }
  }
  return Tensor::empty(m.shape, m.dtype);
}

void Node::pass_grad(std::size_t i, Tensor&& g) const {
  if (!needs_grad(i) || !g.defined()) return;
  AutogradMeta& m = *slots()[i];
  if (g.dtype() != m.dtype || g.numel() != m.shape.numel())
    fail(op, "backward passed a ", g.dtype(), " gradient of shape ", g.shape(), " for input ", i, ", a ", m.dtype,
         " tensor of shape ", m.shape);
  if (m.grad.defined()) {  // another consumer ran first, or a leaf kept its gradient: add
    add_into(*m.grad.ptr(), g);
    return;
  }
  // An empty slot takes the buffer; memory shared with anything that outlives this node (a
  // retained gradient, the caller's seed, a saved tensor) is copied first, so that a later add
  // into the slot writes nothing but the gradient.
  Tensor keep = held_only_here(*this, g) ? std::move(g) : g.clone_data();
  m.grad.set(keep.shape() == m.shape ? std::move(keep) : keep.alias(m.shape));
}

std::size_t Node::bytes_saved() const {
  std::size_t b = 0;
  for (std::uint32_t i = 0; i < n_saved; ++i) b += saved_[i].defined() ? saved_[i].nbytes() : 0;
  return b;
}

// ---- recording ----

namespace detail {

// Appends the node. What can throw comes before anything is recorded: the outputs' slots, then the
// node (push may sweep, and a sweep that empties the tape resets the arena: so before the arena
// allocation), then the arena block, whose failure takes the still empty node back off the tape.
// The rest only copies handles and cannot throw.
Node& record_node(const char* op, const Tensor* const* inputs, std::size_t n_in, Tensor* const* outputs,
                  std::size_t n_out, const Tensor* saved, std::size_t n_saved, std::size_t closure_bytes,
                  std::size_t closure_align) {
  using Slot = Node::Slot;
  static_assert(alignof(Slot) <= alignof(Tensor) && alignof(Shape) <= alignof(Tensor));
  Tape& tp = tape();
  if (n_in > UINT32_MAX || n_out > UINT32_MAX) fail(op, "too many inputs or outputs to record (", n_in, ", ", n_out, ")");
  for (std::size_t i = 0; i < n_out; ++i) outputs[i]->ensure_meta();
  Node& n = TapeAccess::push(tp);
  // One arena block: the saved tensors first (the strictest alignment), then the input and output
  // slots, the shapes of the inputs without a slot, and the closure last.
  std::size_t n_other = 0;
  for (std::size_t i = 0; i < n_in; ++i) n_other += inputs[i]->requires_grad() ? 0 : 1;
  const std::size_t arrays = n_saved * sizeof(Tensor) + (n_in + n_out) * sizeof(Slot) + n_other * sizeof(Shape);
  const std::size_t closure_at = (arrays + closure_align - 1) & ~(closure_align - 1);  // a power of two
  char* mem = nullptr;
  try {
    mem = static_cast<char*>(TapeAccess::arena(tp).allocate(closure_at + closure_bytes, std::max(alignof(Tensor), closure_align)));
  } catch (...) {
    TapeAccess::discard_last(tp);
    throw;
  }
  auto* sv = reinterpret_cast<Tensor*>(mem);
  auto* in = reinterpret_cast<Slot*>(mem + n_saved * sizeof(Tensor));
  auto* out = in + n_in;
  auto* shapes = reinterpret_cast<Shape*>(reinterpret_cast<char*>(out + n_out));
  std::uint64_t undefined = 0;
  for (std::size_t i = 0, k = 0; i < n_in; ++i) {
    const Tensor* t = inputs[i];
    if (t->requires_grad()) {
      ::new (in + i) Slot(t->meta());
    } else {
      ::new (in + i) Slot();
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
    m->generation = TapeAccess::generation(tp);
    ::new (out + i) Slot(m);
  }
  n.op = op;
  n.saved_ = sv;  // the slots follow: Node::slots() finds them from here
  n.n_saved = static_cast<std::uint32_t>(n_saved);
  n.n_in = static_cast<std::uint32_t>(n_in);
  n.n_out = static_cast<std::uint32_t>(n_out);
  n.n_other = static_cast<std::uint32_t>(n_other);
  n.undefined_inputs = undefined;
  n.closure_ = mem + closure_at;  // raw memory until record_with constructs the closure
  TapeAccess::note_saved(tp, n.bytes_saved());  // free_node takes the same count back
  return n;
}

void drop_last_node_and_rethrow() {
  Tape& tp = tape();
  TapeAccess::free_node(tp, tp.size() - 1);
  throw;
}

void check_anomaly_outputs(const char* op, std::size_t index, const Node& node, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in);

namespace {
// Op timing (set_op_timing): per op name (static strings, so the pointer is the key), this thread.
using Clock = std::chrono::steady_clock;
thread_local constinit bool t_timing = false;
thread_local Clock::time_point t_mark;
thread_local std::unordered_map<const char*, OpTime> t_times;

void time_forward(const char* op) {
  const auto now = Clock::now();
  OpTime& t = t_times[op];
  t.forward_s += std::chrono::duration<double>(now - t_mark).count();
  ++t.calls;
  t_mark = now;
}
}  // namespace

void after_record(Node& node, const Tensor* const* outputs, std::size_t n_out, const Tensor* const* inputs,
                  std::size_t n_in) {
  if (t_anomaly) check_anomaly_outputs(node.op, tape().size() - 1, node, outputs, n_out, inputs, n_in);
  if (t_timing) time_forward(node.op);
}

// Runs node's backward, timed when op timing is on.
void run_backward_timed(Node& n) {
  if (!t_timing) return n.run_backward();
  const auto t0 = Clock::now();
  n.run_backward();
  t_times[n.op].backward_s += std::chrono::duration<double>(Clock::now() - t0).count();
  t_mark = Clock::now();
}

}  // namespace detail

// ---- Tape ----

namespace detail {
Tape& tape_slow() {
  thread_local Tape t;  // a guarded thread_local: its destructor runs when the thread ends
  t_tape = &t;
  return t;
}
}  // namespace detail

Tape::Tape() : arena_(std::make_unique<detail::Arena>()) {}

Tape::~Tape() {
  clear();
  if (detail::t_tape == this) detail::t_tape = nullptr;
}

void Tape::clear() {
  if (live_ > 0)
    for (Node& n : nodes_)
      if (!n.freed) {
        n.release();
        n.freed = true;
      }
  nodes_.clear();  // O(1): nodes are trivially destructible
  arena_->reset();
  live_ = 0;
  next_sweep_ = kFirstSweep;
  saved_live_ = 0;
  next_sweep_bytes_ = kSweepBytes;
  ++generation_;
}

namespace detail {

Node& TapeAccess::push(Tape& t) {
  if (t.nodes_.size() >= t.next_sweep_ || t.saved_live_ >= t.next_sweep_bytes_) sweep(t);
  t.nodes_.emplace_back();
  ++t.live_;
  return t.nodes_.back();
}

void TapeAccess::free_node(Tape& t, std::size_t i) {
  Node& n = t.nodes_[i];
  if (n.freed) return;
  n.freed = true;
  t.saved_live_ -= std::min(t.saved_live_, n.bytes_saved());
  // The outputs' slots go too, while the walk has them in cache (not in a later pass of clear()).
  // A freed node is found from its outputs' side instead: their slots keep the node's index.
  n.release();
  --t.live_;
}

void TapeAccess::discard_last(Tape& t) {
  t.nodes_.pop_back();
  --t.live_;
}

void TapeAccess::sweep(Tape& t) {
  // A node is unreachable when the only owner of each of its outputs' autograd slots is the node.
  const std::size_t live_before = t.live_;
  for (std::size_t i = t.nodes_.size(); i-- > 0;) {
    Node& n = t.nodes_[i];
    if (n.freed) continue;
    bool unreachable = true;
    for (const auto& o : n.outputs()) unreachable = unreachable && o.use_count() == 1;
    if (unreachable) free_node(t, i);
  }
  // The next sweep when the tape has doubled, or quadrupled if this one freed under a quarter of
  // the nodes (a long graph that is still in use: sweeping it again soon would find nothing).
  // Either way the sweeps cost O(1) per recorded node, amortised. The byte trigger waits until
  // what is saved has doubled since this sweep: geometric too.
  if (t.live_ == 0) t.clear();
  else {
    t.next_sweep_ = std::max(Tape::kFirstSweep, (4 * (live_before - t.live_) < live_before ? 4 : 2) * t.nodes_.size());
    t.next_sweep_bytes_ = std::max(Tape::kSweepBytes, 2 * t.saved_live_);
  }
}

}  // namespace detail

std::size_t Tape::bytes_saved() const {
  std::size_t b = 0;
  for (const Node& n : nodes_) b += n.bytes_saved();
  return b;
}

void Tape::print(std::ostream& os) const {
  os << "tape: " << live_ << " nodes, " << human_bytes(bytes_saved()) << " saved for backward\n";
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.freed) continue;
    std::ostringstream line;
    line << std::setw(4) << i << "  " << std::left << std::setw(22) << n.op << std::right;
    bool first = true;
    const auto ins = n.inputs();
    for (std::size_t k = 0; k < ins.size(); ++k) {
      if (k < 64 && (n.undefined_inputs >> k & 1)) continue;  // an absent optional input (e.g. no bias)
      line << (first ? "" : ", ") << n.input_shape(k);
      first = false;
      if (ins[k] && ins[k]->name && !ins[k]->name->empty()) line << ' ' << *ins[k]->name;
    }
    line << " -> ";
    const auto outs = n.outputs();
    for (std::size_t k = 0; k < outs.size(); ++k) line << (k ? ", " : "") << outs[k]->shape;
    line << "   saved " << human_bytes(n.bytes_saved());
    os << line.str() << '\n';
  }
}

std::string Tape::to_dot() const {
  std::ostringstream s;
  s << "digraph tape {\n  rankdir=TB;\n  node [fontname=\"Helvetica\", fontsize=10];\n";
  std::unordered_map<std::uint32_t, bool> declared;
  auto tensor_node = [&](AutogradMeta& m, bool leaf) {
    if (declared[m.dot_id()]) return;
    declared[m.dot_id()] = true;
    s << "  t" << m.dot_id() << " [shape=ellipse, label=\"" << (m.label().empty() ? "" : m.label() + "\\n") << m.shape.str() << "\"";
    if (leaf) s << ", style=filled, fillcolor=\"#dbe9f6\"";
    s << "];\n";
  };
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.freed) continue;
    s << "  op" << i << " [shape=box, style=filled, fillcolor=\"#f6e7c1\", label=\"#" << i << ' ' << n.op
      << "\\nsaved " << human_bytes(n.bytes_saved()) << "\"];\n";
    for (const auto& in : n.inputs()) {
      if (!in) continue;
      tensor_node(*in, in->node < 0);
      s << "  t" << in->dot_id() << " -> op" << i << ";\n";
    }
    for (const auto& o : n.outputs()) {
      tensor_node(*o, false);
      s << "  op" << i << " -> t" << o->dot_id() << ";\n";
    }
  }
  s << "}\n";
  return s.str();
}

// ---- grad mode ----

NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

// ---- anomaly mode ----

namespace {

// Index of the first NaN or Inf in t, or -1 (float tensors only; integers are always finite).
std::int64_t first_nonfinite(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return -1;
  return detail::dispatch_float("anomaly", t.dtype(), [&](auto z) -> std::int64_t {
    using T = decltype(z);
    const T* p = t.data<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return i;
    return -1;
  });
}

std::string describe(const Tensor& t, std::int64_t i) {
  std::ostringstream s;
  // Read directly: an op here would be recorded and checked in turn.
  const double v = detail::dispatch_float("anomaly", t.dtype(), [&](auto z) {
    using T = decltype(z);
    return static_cast<double>(t.data<T>()[i]);
  });
  s << (std::isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf") << " at flat index " << i << " of " << t.dtype() << ' '
    << t.shape();
  return s.str();
}

std::string shapes_of(const Node& n) {
  std::ostringstream s;
  s << '(';
  for (std::size_t k = 0; k < n.inputs().size(); ++k) s << (k ? ", " : "") << n.input_shape(k);
  s << ") -> (";
  for (std::size_t k = 0; k < n.outputs().size(); ++k) s << (k ? ", " : "") << n.outputs()[k]->shape;
  s << ')';
  return s.str();
}
}  // namespace

void set_detect_anomaly(bool on) {
  t_anomaly = on;
  detail::t_record_hook = t_anomaly || detail::t_timing;
}
bool is_anomaly_enabled() { return t_anomaly; }

void set_op_timing(bool on) {
  detail::t_timing = on;
  detail::t_record_hook = t_anomaly || detail::t_timing;
  detail::t_mark = detail::Clock::now();
}
void op_timing_mark() {
  if (detail::t_timing) detail::t_mark = detail::Clock::now();
}
void reset_op_times() { detail::t_times.clear(); }
std::vector<OpTime> op_times() {
  std::unordered_map<std::string, OpTime> by_name;  // one op name may sit at several addresses
  for (const auto& [op, t] : detail::t_times) {
    OpTime& m = by_name[op];
    m.op = op;
    m.forward_s += t.forward_s;
    m.backward_s += t.backward_s;
    m.calls += t.calls;
  }
  std::vector<OpTime> v;
  for (auto& [name, t] : by_name) v.push_back(t);
  std::sort(v.begin(), v.end(), [](const OpTime& a, const OpTime& b) {
    return a.forward_s + a.backward_s > b.forward_s + b.backward_s;
  });
  return v;
}
DetectAnomalyGuard::DetectAnomalyGuard(bool on) : prev_(t_anomaly) { set_detect_anomaly(on); }
DetectAnomalyGuard::~DetectAnomalyGuard() { set_detect_anomaly(prev_); }

namespace detail {

namespace {
std::atomic<bool> g_retain_grad_used{false};
}  // namespace
void note_retain_grad() { g_retain_grad_used.store(true, std::memory_order_relaxed); }
bool retain_grad_used() { return g_retain_grad_used.load(std::memory_order_relaxed); }

void check_anomaly_outputs(const char* op, std::size_t index, const Node& n, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in) {
  for (std::size_t k = 0; k < n_out; ++k) {
    const std::int64_t at = first_nonfinite(*outputs[k]);
    if (at < 0) continue;
    std::ostringstream why;
    bool input_bad = false;
    for (std::size_t j = 0; j < n_in; ++j) {
      const std::int64_t ja = first_nonfinite(*inputs[j]);
      if (ja >= 0) {
        why << "; input " << j << " already had " << describe(*inputs[j], ja);
        input_bad = true;
      }
    }
    fail("anomaly", "forward of op '", op, "' (tape node ", index, ", shapes ", shapes_of(n), ") produced ",
         describe(*outputs[k], at), " in output ", k, input_bad ? why.str() : std::string("; its inputs were all finite"));
  }
}

void check_anomaly_backward(const Node& n, std::size_t index) {
  const auto ins = n.inputs();
  const auto outs = n.outputs();
  for (std::size_t k = 0; k < ins.size(); ++k) {
    if (!ins[k]) continue;
    const Tensor& g = ins[k]->grad.get();
    const std::int64_t at = first_nonfinite(g);
    if (at < 0) continue;
    std::ostringstream up;
    bool up_bad = false;
    for (std::size_t j = 0; j < outs.size(); ++j) {
      const Tensor& dy = outs[j]->grad.get();
      const std::int64_t ja = first_nonfinite(dy);
      if (ja >= 0) {
        up << "; the upstream gradient of output " << j << " already had " << describe(dy, ja);
        up_bad = true;
      }
    }
    fail("anomaly", "backward of op '", n.op, "' (tape node ", index, ", shapes ", shapes_of(n), ") produced ",
         describe(g, at), " in the gradient of input ", k,
         up_bad ? up.str() : std::string("; the upstream gradient was finite"));
  }
}

}  // namespace detail

// ---- gradient hooks ----
//
// A registry of (id, leaf, hook), shared by every thread; backward() reads it only when it is not
// empty (g_hooks_live), so a program without hooks pays one relaxed atomic load per backward.

namespace {

struct HookEntry {
  std::uint64_t id;
  detail::Ref<AutogradMeta> leaf;  // owning: the slot cannot be reused by another tensor while hooked
  std::function<void(const Tensor&)> fn;
};
struct HookRegistry {
  std::mutex m;
  std::vector<HookEntry> entries;
  std::uint64_t next_id = 1;
};
// Never destroyed: a handle may be released during static destruction.
HookRegistry& hook_registry() {
  static HookRegistry* r = new HookRegistry;
  return *r;
}
std::atomic<std::size_t> g_hooks_live{0};

// A hook due during this walk: fire once every node with an index above `after` has run.
struct DueHook {
  std::int64_t after;  // the index of the last node that adds into the leaf (-1: the leaf is the root)
  detail::Ref<AutogradMeta> leaf;
  std::function<void(const Tensor&)> fn;
};

}  // namespace

GradHookHandle register_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(const Tensor&)> hook) {
  detail::check_defined("register_post_accumulate_grad_hook", leaf, "tensor");
  if (!leaf.requires_grad() || !leaf.is_leaf())
    fail("register_post_accumulate_grad_hook", "needs a leaf tensor that requires grad (a parameter), got a ",
         leaf.is_leaf() ? "leaf that does not require grad" : "tensor made by an op", " of shape ", leaf.shape());
  if (!hook) fail("register_post_accumulate_grad_hook", "the hook is empty");
  HookRegistry& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.m);
  const std::uint64_t id = r.next_id++;
  r.entries.push_back(HookEntry{id, leaf.meta(), std::move(hook)});
  g_hooks_live.fetch_add(1, std::memory_order_relaxed);
  return GradHookHandle(id);
}

void GradHookHandle::remove() {
  if (id_ == 0) return;
  HookRegistry& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.m);
  auto it = std::find_if(r.entries.begin(), r.entries.end(), [&](const HookEntry& e) { return e.id == id_; });
  if (it != r.entries.end()) {
    r.entries.erase(it);
    g_hooks_live.fetch_sub(1, std::memory_order_relaxed);
  }
  id_ = 0;
}

GradHookHandle& GradHookHandle::operator=(GradHookHandle&& o) noexcept {
  if (this != &o) {
    remove();
    id_ = o.id_;
    o.id_ = 0;
  }
  return *this;
}

// ---- backward ----
//
// backward(root) is four steps: check the root and make the seed; find what the root depends on
// (refusing, before any gradient is touched, a graph part of which was freed); seed the root's
// gradient; walk the tape back. The walk is the whole idea; the rest makes it safe to call twice.

namespace {

using detail::TapeAccess;
using MetaRef = detail::Ref<AutogradMeta>;

const char* const kFreedMsg = "part of the graph of this tensor was freed by an earlier backward(); "
                              "call backward(grad, /*keep_tape=*/true) to differentiate a graph twice";

// d root / d root: the caller's gradient (checked against root), or 1 for a scalar root.
Tensor make_seed(const Tensor& root, const Tensor& grad) {
  detail::check_defined("backward", root, "tensor");
  if (!root.requires_grad())
    fail("backward", "tensor of shape ", root.shape(), " does not require grad (no input of its graph did, or it was made under NoGradGuard)");
  if (grad.defined()) {
    if (!(grad.shape() == root.shape()) || grad.dtype() != root.dtype())
      fail("backward", "gradient ", grad.dtype(), " ", grad.shape(), " does not match tensor ", root.dtype(), " ", root.shape());
    return grad;
  }
  if (root.numel() != 1)
    fail("backward", "implicit gradient needs a scalar, got shape ", root.shape(), "; pass an upstream gradient");
  return ones(root.shape(), root.dtype());
}

// What the first pass found: retained non-leaf gradients (retain_grad), and whether the caller's
// seed shares memory with a gradient this walk adds into (y.backward(x.grad()) with x in y's graph).
struct Marked {
  std::vector<MetaRef> retained;
  bool seed_aliased = false;
};

// A tensor made by a node that an earlier backward freed: refuse.
void refuse_if_freed(Tape& tp, const AutogradMeta& m) {
  if (m.node < 0 || m.generation != TapeAccess::generation(tp)) return;
  const Node& n = TapeAccess::node(tp, static_cast<std::size_t>(m.node));
  if (n.freed) fail("backward", kFreedMsg, " (op '", n.op, "', node ", m.node, ")");
}

// Marks every tensor the root depends on with `mark`, refusing freed parts. Needed only when the
// tape holds freed nodes, a retained gradient may exist, or the caller passed a gradient; otherwise
// (a training step) the walk marks as it goes, which is equivalent because every consumer of a
// tensor runs before its producer.
Marked mark_graph(Tape& tp, const Tensor& root, const Tensor& seed, std::uint64_t mark) {
  Marked found;
  auto note = [&](const MetaRef& m) {
    if (!m->grad.defined()) return;
    if (m->node >= 0 && m->retains_grad) found.retained.push_back(m);
    found.seed_aliased = found.seed_aliased || m->grad.get().shares_storage(seed);
  };
  const AutogradMeta& rm = *root.meta();
  refuse_if_freed(tp, rm);
  note(root.meta());
  for (std::int64_t i = rm.node; i >= 0; --i) {
    Node& n = TapeAccess::node(tp, static_cast<std::size_t>(i));
    if (n.freed) continue;
    bool reached = false;
    for (const auto& o : n.outputs()) reached = reached || o->visit == mark;
    if (!reached) continue;
    for (const auto& in : n.inputs())
      if (in && in->visit != mark) {
        refuse_if_freed(tp, *in);
        in->visit = mark;
        note(in);
      }
  }
  return found;
}

// A retained non-leaf gradient is both what the user reads and the buffer its node reads during
// the walk: what an earlier backward left in it must not flow again. Its slot is set aside for the
// walk and added back afterwards, also when a backward kernel or anomaly mode throws. (Owning
// references: freeing the walked nodes may drop the last other owner of a slot.)
class SetAside {
 public:
  explicit SetAside(const std::vector<MetaRef>& retained) {
    kept_.reserve(retained.size());  // no emplace_back can throw after a slot has moved
    for (const auto& m : retained) kept_.emplace_back(m, std::move(m->grad));
  }
  ~SetAside() {
    for (auto& [m, old] : kept_) {
      if (m->grad.defined()) {
        Tensor& o = *old.ptr();  // defined: only slots that held a gradient were set aside
        detail::dispatch_float("backward", o.dtype(), [&](auto z) {
          using T = decltype(z);
          T* op = o.data<T>();
          const T* g = m->grad.get().data<T>();
          for (std::int64_t i = 0; i < o.numel(); ++i) op[i] += g[i];
        });
      }
      m->grad = std::move(old);
    }
  }
  SetAside(const SetAside&) = delete;
  SetAside& operator=(const SetAside&) = delete;

 private:
  std::vector<std::pair<MetaRef, detail::GradSlot>> kept_;
};

// The root's gradient. An intermediate root whose gradient nobody keeps is read only by its own
// node (backward kernels never write their upstream gradient), so it shares the caller's tensor,
// as PyTorch's engine does, unless that memory is a gradient this walk writes; a leaf's or a
// retained gradient accumulates into a buffer of its own (so backward twice adds up).
void seed_root(AutogradMeta& rm, const Tensor& seed, bool seed_aliased) {
  if (!rm.grad.defined() && rm.node >= 0 && !rm.retains_grad && !seed_aliased) {
    rm.grad.set(seed.detach());
    return;
  }
  Tensor g = rm.grad_accumulator();
  detail::dispatch_float("backward", g.dtype(), [&](auto z) {
    using T = decltype(z);
    T* gp = g.data<T>();
    const T* sp = seed.data<T>();
    kernels::parallel_for(g.numel(), g.numel(), [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) gp[i] += sp[i];
    });
  });
}

// A node runs when one of its outputs was reached and holds a gradient.
bool reached(const Node& n, std::uint64_t mark) {
  for (const auto& o : n.outputs())
    if (o->visit == mark && o->grad.defined()) return true;
  return false;
}

// The hooks this walk fires, in firing order. A hooked leaf's gradient is final once the walk has
// run the earliest-recorded reached node that has the leaf as an input (the walk goes down the
// tape, so that node adds into it last). Needs the reached nodes marked (mark_graph).
std::vector<DueHook> due_hooks(Tape& tp, AutogradMeta& rm, std::uint64_t mark) {
  constexpr std::int64_t kUnreached = std::numeric_limits<std::int64_t>::max();
  std::vector<HookEntry> hooked;
  {
    HookRegistry& r = hook_registry();
    std::lock_guard<std::mutex> lock(r.m);
    hooked = r.entries;
  }
  std::unordered_map<const AutogradMeta*, std::int64_t> last;  // hooked leaf -> its last adding node
  for (const auto& e : hooked) last.emplace(e.leaf.get(), kUnreached);
  if (auto it = last.find(&rm); it != last.end()) it->second = -1;  // a hooked leaf as the root itself
  for (std::int64_t i = rm.node; i >= 0; --i) {
    const Node& n = TapeAccess::node(tp, static_cast<std::size_t>(i));
    if (n.freed) continue;
    bool reached = false;
    for (const auto& o : n.outputs()) reached = reached || o->visit == mark;
    if (!reached) continue;
    for (const auto& in : n.inputs())
      if (in && in->node < 0)
        if (auto it = last.find(in.get()); it != last.end()) it->second = i;
  }
  std::vector<DueHook> due;
  for (auto& e : hooked)
    if (const std::int64_t at = last[e.leaf.get()]; at != kUnreached) due.push_back(DueHook{at, e.leaf, std::move(e.fn)});
  // Latest node first; stable, so the hooks of one leaf keep their registration order.
  std::stable_sort(due.begin(), due.end(), [](const DueHook& a, const DueHook& b) { return a.after > b.after; });
  return due;
}

// Fires the due hooks whose leaves no node at or below index `below` adds into any more.
void fire_hooks(std::vector<DueHook>::iterator& next, std::vector<DueHook>::iterator end, std::int64_t below) {
  for (; next != end && next->after > below; ++next)
    if (next->leaf->grad.defined()) next->fn(next->leaf->grad.get());
}

// The reverse walk: from the root's node back to the start of the tape, each node reached reads
// its outputs' gradients and writes its inputs'. An output's gradient is dead once its node has
// run (PyTorch keeps only leaves' and retained ones), and so is the node unless kept. A hooked
// leaf's hook fires as soon as the walk has passed the last node that adds into it.
void walk(Tape& tp, std::int64_t from, std::uint64_t mark, bool keep_tape, std::vector<DueHook>& hooks) {
  NoGradGuard no_record;  // backward kernels must not append to the tape they walk
  const bool anomaly = detail::t_anomaly;
  auto next_hook = hooks.begin();
  for (std::int64_t i = from; i >= 0; --i) {
    fire_hooks(next_hook, hooks.end(), i);  // without hooks: one comparison per node
    Node& n = TapeAccess::node(tp, static_cast<std::size_t>(i));
    if (n.freed || !reached(n, mark)) continue;
    for (const auto& in : n.inputs())
      if (in) in->visit = mark;
    detail::run_backward_timed(n);
    if (anomaly) detail::check_anomaly_backward(n, static_cast<std::size_t>(i));
    for (const auto& o : n.outputs())
      if (!o->retains_grad) o->grad.reset();
    if (!keep_tape) TapeAccess::free_node(tp, static_cast<std::size_t>(i));
  }
  fire_hooks(next_hook, hooks.end(), -2);
}

}  // namespace

void backward(const Tensor& root, const Tensor& grad, bool keep_tape) {
  const Tensor seed = make_seed(root, grad);
  AutogradMeta& rm = *root.meta();
  Tape& tp = tape();
  if (rm.node >= 0 && (rm.generation != TapeAccess::generation(tp) || rm.node >= static_cast<std::int64_t>(tp.size())))
    fail("backward", kFreedMsg);
  static thread_local std::uint64_t epoch = 0;
  const std::uint64_t mark = ++epoch;
  rm.visit = mark;
  const bool hooks_live = g_hooks_live.load(std::memory_order_relaxed) != 0 && !detail::t_hooks_off;
  Marked found;
  if (grad.defined() || tp.live() != tp.size() || detail::retain_grad_used() || hooks_live)
    found = mark_graph(tp, root, seed, mark);
  std::vector<DueHook> hooks;
  if (hooks_live) hooks = due_hooks(tp, rm, mark);
  SetAside set_aside(found.retained);
  seed_root(rm, seed, found.seed_aliased);
  walk(tp, rm.node, mark, keep_tape, hooks);
  if (tp.live() == 0) tp.clear();
}

}  // namespace tg
