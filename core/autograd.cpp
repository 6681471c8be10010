#include "tapegrad/autograd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <unordered_map>

#include "dispatch.h"
#include "kernels/parallel.h"
#include "pool.h"
#include "tapegrad/ops.h"

namespace tg {

namespace detail {
thread_local constinit bool t_grad_enabled = true;
thread_local constinit bool t_anomaly = false;
thread_local constinit Tape* t_tape = nullptr;
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

// ---- autograd slots: made by record_node (inline in each op's file, through ensure_meta) and
// dropped by Node::release (here, where destroy inlines) ----

AutogradMeta* AutogradMeta::make(const Shape& s, DType d) { return detail::pool_new<AutogradMeta>(s, d); }
void AutogradMeta::destroy(AutogradMeta* m) noexcept { detail::pool_delete(m); }

// ---- Node ----

static_assert(std::is_trivially_copyable_v<Node> && std::is_trivially_destructible_v<Node>,
              "the tape moves and forgets nodes without running code per node");

void Node::release() {
  static_assert(std::is_trivially_destructible_v<Shape>, "other_shapes are not destroyed one by one");
  Slot* slot = slots();  // before saved.destroy(), which forgets where the slots start
  for (std::uint32_t i = 0; i < n_in + n_out; ++i) slot[i].~Slot();
  saved.destroy();
  release_backward();
  n_in = n_out = n_other = 0;  // a freed node's arrays read as empty
}

const Shape& Node::input_shape(std::size_t i) const {
  if (slots()[i]) return slots()[i]->shape;
  std::size_t k = 0;  // the number of inputs before i that have no autograd slot
  for (std::size_t j = 0; j < i; ++j) k += slots()[j] ? 0 : 1;
  return other_shapes()[k];
}

Tensor Node::grad_in(std::size_t i) const {
  if (!needs_grad(i)) return Tensor();
  return slots()[i]->grad_accumulator();
}

bool Node::input_repeated_slow(std::size_t i) const {
  for (std::size_t j = 0; j < n_in; ++j)
    if (j != i && slots()[j] == slots()[i]) return true;
  return false;
}

GradDest Node::grad_add(std::size_t i) const {
  if (!needs_grad(i)) return GradDest{};
  return GradDest{&slots()[i]->grad_accumulator(), true};
}

GradDest Node::grad_dest(std::size_t i) const {
  GradDest d;
  if (!needs_grad(i)) return d;
  AutogradMeta& m = *slots()[i];
  // The same tensor passed as two inputs (x * x): both writes add into one zero-filled buffer, so
  // the kernel's order of writing them does not matter.
  if (m.grad.defined() || input_repeated(i)) {
    d.buf = &m.grad_accumulator();
    d.acc = true;
  } else {
    d.buf = &m.grad.set(Tensor::empty(m.shape, m.dtype));
    d.acc = false;
  }
  return d;
}

GradDest Node::grad_dest_over(std::size_t i, std::size_t j) const {
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
  return grad_dest(i);
}

std::size_t Node::bytes_saved_slow() const {
  std::size_t b = 0;
  for (const Tensor& t : saved) b += t.defined() ? t.nbytes() : 0;
  return b;
}

// ---- Tape ----

namespace detail {
Tape& tape_slow() {
  thread_local Tape t;  // a guarded thread_local: its destructor runs when the thread ends
  t_tape = &t;
  return t;
}
}  // namespace detail

Tape::~Tape() {
  clear();
  if (detail::t_tape == this) detail::t_tape = nullptr;
}

Node& Tape::push() {
  if (nodes_.size() >= next_sweep_ || saved_live_ >= next_sweep_bytes_) sweep();
  nodes_.emplace_back();
  ++live_;
  return nodes_.back();
}

void Tape::clear() {
  if (live_ > 0)
    for (Node& n : nodes_)
      if (!n.freed) {
        n.release();
        n.freed = true;
      }
  nodes_.clear();  // O(1): nodes are trivially destructible
  arena_.reset();
  live_ = 0;
  next_sweep_ = kFirstSweep;
  saved_live_ = 0;
  next_sweep_bytes_ = kSweepBytes;
  ++generation_;
}

void Tape::free_node(std::size_t i) {
  Node& n = nodes_[i];
  if (n.freed) return;
  n.freed = true;
  saved_live_ -= std::min(saved_live_, n.bytes_saved());
  // The outputs' slots go too, while the walk has them in cache (not in a later pass of clear()).
  // A freed node is found from its outputs' side instead: their slots keep the node's index.
  n.release();
  --live_;
}

void Tape::discard_last() {
  nodes_.pop_back();
  --live_;
}

void Tape::sweep() {
  // From the newest node back: a node is unreachable when the only owner of each of its outputs'
  // autograd slots is the node itself. Freeing it drops its references to its inputs, which may
  // make an earlier node unreachable in turn.
  const std::size_t live_before = live_;
  for (std::size_t i = nodes_.size(); i-- > 0;) {
    Node& n = nodes_[i];
    if (n.freed) continue;
    bool unreachable = true;
    for (const auto& o : n.outputs()) unreachable = unreachable && o.use_count() == 1;
    if (unreachable) free_node(i);
  }
  // The next sweep when the tape has doubled, or quadrupled if this one freed under a quarter of
  // the nodes (a long graph that is still in use: sweeping it again soon would find nothing).
  // Either way the sweeps cost O(1) per recorded node, amortised. The byte trigger waits until
  // what is saved has doubled since this sweep: geometric too.
  if (live_ == 0) clear();
  else {
    next_sweep_ = std::max(kFirstSweep, (4 * (live_before - live_) < live_before ? 4 : 2) * nodes_.size());
    next_sweep_bytes_ = std::max(kSweepBytes, 2 * saved_live_);
  }
}

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

void set_detect_anomaly(bool on) { t_anomaly = on; }
bool is_anomaly_enabled() { return t_anomaly; }
DetectAnomalyGuard::DetectAnomalyGuard(bool on) : prev_(t_anomaly) { t_anomaly = on; }
DetectAnomalyGuard::~DetectAnomalyGuard() { t_anomaly = prev_; }

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

// ---- backward ----

void backward(const Tensor& root, const Tensor& grad, bool keep_tape) {
  detail::check_defined("backward", root, "tensor");
  if (!root.requires_grad())
    fail("backward", "tensor of shape ", root.shape(), " does not require grad (no input of its graph did, or it was made under NoGradGuard)");
  Tensor seed;
  if (grad.defined()) {
    if (!(grad.shape() == root.shape()) || grad.dtype() != root.dtype())
      fail("backward", "gradient ", grad.dtype(), " ", grad.shape(), " does not match tensor ", root.dtype(), " ", root.shape());
    seed = grad;
  } else {
    if (root.numel() != 1)
      fail("backward", "implicit gradient needs a scalar, got shape ", root.shape(), "; pass an upstream gradient");
    seed = ones(root.shape(), root.dtype());
  }
  AutogradMeta& rm = *root.meta();
  Tape& tp = tape();
  const char* freed_msg = "part of the graph of this tensor was freed by an earlier backward(); "
                          "call backward(grad, /*keep_tape=*/true) to differentiate a graph twice";
  if (rm.node >= 0 && (rm.generation != tp.generation() || rm.node >= static_cast<std::int64_t>(tp.size())))
    fail("backward", freed_msg);

  // Pass 1, before any gradient is touched: mark what the root depends on, and refuse if any of it
  // was freed (so a failing call changes nothing).
  static thread_local std::uint64_t epoch = 0;
  const std::uint64_t mark = ++epoch;
  // A retained non-leaf gradient (retain_grad) is both what the user reads and the buffer its node
  // reads during the walk: what an earlier backward left in it must not flow again. Pass 1 notes
  // them; they are set aside once the pass has found nothing to refuse, and added back afterwards.
  // (Owning pointers: freeing the walked nodes may drop the last other owner of a slot.)
  std::vector<detail::Ref<AutogradMeta>> retained;
  // The caller's upstream gradient may be shared with the root (not copied) unless it is the
  // memory of a gradient this walk adds into (y.backward(x.grad()) with x in y's graph).
  bool seed_aliased = false;
  rm.visit = mark;
  // Pass 1 can find something only when the tape holds freed nodes, a retained gradient may exist,
  // or the caller passed a gradient. Otherwise (a training step) the marks are made during the
  // walk itself, which is equivalent because every consumer of a tensor runs before its producer,
  // and a pass over the whole tape is saved.
  if (grad.defined() || tp.live() != tp.size() || detail::retain_grad_used()) {
    auto note = [&](const detail::Ref<AutogradMeta>& m) {
      if (!m->grad.defined()) return;
      if (m->node >= 0 && m->retains_grad) retained.push_back(m);
      seed_aliased = seed_aliased || m->grad.get().shares_storage(seed);
    };
    // A freed node's outputs are gone; it is recognised through a tensor made by it.
    auto check_producer = [&](const AutogradMeta& m) {
      if (m.node >= 0 && m.generation == tp.generation() && tp.node(static_cast<std::size_t>(m.node)).freed)
        fail("backward", freed_msg, " (op '", tp.node(static_cast<std::size_t>(m.node)).op, "', node ", m.node, ")");
    };
    check_producer(rm);
    note(root.meta());
    for (std::int64_t i = rm.node; i >= 0; --i) {
      Node& n = tp.node(static_cast<std::size_t>(i));
      if (n.freed) continue;
      bool reached = false;
      for (const auto& o : n.outputs()) reached = reached || o->visit == mark;
      if (!reached) continue;
      for (const auto& in : n.inputs())
        if (in && in->visit != mark) {
          check_producer(*in);
          in->visit = mark;
          note(in);
        }
    }
  }
  // The retained gradients' slots are moved aside and moved back: nothing to allocate in the
  // destructor below (reserve first, so no emplace_back can throw after a slot has moved).
  std::vector<std::pair<detail::Ref<AutogradMeta>, detail::GradSlot>> kept;
  kept.reserve(retained.size());
  for (auto& m : retained) kept.emplace_back(m, std::move(m->grad));
  struct Restore {  // also when a backward kernel or anomaly mode throws
    std::vector<std::pair<detail::Ref<AutogradMeta>, detail::GradSlot>>& kept;
    ~Restore() {
      for (auto& [m, old] : kept) {
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
  } restore{kept};

  // Seed the root's gradient. An intermediate root whose gradient nobody keeps is only read by its
  // own node (backward kernels never write their upstream gradient), so it shares the caller's
  // tensor, as PyTorch's engine does, unless that memory is a gradient this walk writes (noted in
  // pass 1); a leaf's or a retained gradient accumulates (so backward on a leaf, or twice with
  // keep_tape, adds up) into a buffer of its own.
  if (!rm.grad.defined() && rm.node >= 0 && !rm.retains_grad && !seed_aliased) {
    rm.grad.set(seed.detach());
  } else {
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
  const bool anomaly = detail::anomaly_enabled();
  // Pass 2: the reverse walk over the marked nodes.
  NoGradGuard no_record;  // backward kernels must not append to the tape they walk
  for (std::int64_t i = rm.node; i >= 0; --i) {
    Node& n = tp.node(static_cast<std::size_t>(i));
    if (n.freed) continue;
    bool reached = false;
    for (const auto& o : n.outputs()) reached = reached || (o->visit == mark && o->grad.defined());
    if (!reached) continue;
    for (const auto& in : n.inputs())
      if (in) in->visit = mark;
    n.run_backward();
    if (anomaly) detail::check_anomaly_backward(n, static_cast<std::size_t>(i));
    // An intermediate gradient is dead once its node has run: free it (PyTorch keeps only leaves').
    for (const auto& o : n.outputs())
      if (!o->retains_grad && o->grad.defined()) o->grad.reset();  // (often already taken by grad_dest_over)
    if (!keep_tape) tp.free_node(static_cast<std::size_t>(i));
  }
  if (tp.live() == 0) tp.clear();
}

}  // namespace tg
