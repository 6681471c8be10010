// The tape's bookkeeping: the arena that holds nodes' arrays and closures, recording a node,
// freeing nodes, the sweep of unreachable ones, and printing (docs/tape.md, "Making it safe").
#include "tape_internal.h"

#include <algorithm>
#include <atomic>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <unordered_map>

#include "pool.h"
#include "tapegrad/ops.h"

namespace tg {

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

namespace detail {
void TapeAccess::release(Node& n) {
  static_assert(std::is_trivially_destructible_v<Shape>, "the other inputs' shapes are not destroyed one by one");
  Node::Slot* slot = n.slots();
  for (std::uint32_t i = 0; i < n.n_in_ + n.n_out_; ++i) slot[i].~Ref();
  for (std::uint32_t i = 0; i < n.n_saved_; ++i) n.saved_[i].~Tensor();
  if (n.ops_ && n.ops_->destroy) n.ops_->destroy(n.closure_);
  n.ops_ = nullptr;  // the closure's memory belongs to the arena
  n.n_in_ = n.n_out_ = n.n_other_ = n.n_saved_ = 0;  // a freed node's arrays read as empty
  n.freed_ = true;
}

void TapeAccess::fill(Node& n, const char* op, Tensor* saved, std::size_t n_saved, std::size_t n_in,
                      std::size_t n_out, std::size_t n_other, std::uint64_t undefined, void* closure) {
  n.op_ = op;
  n.saved_ = saved;  // the slots follow: Node::slots() finds them from here
  n.n_saved_ = static_cast<std::uint32_t>(n_saved);
  n.n_in_ = static_cast<std::uint32_t>(n_in);
  n.n_out_ = static_cast<std::uint32_t>(n_out);
  n.n_other_ = static_cast<std::uint32_t>(n_other);
  n.undefined_inputs_ = undefined;
  n.closure_ = closure;  // raw memory until record_with constructs the closure
}
}  // namespace detail

const Shape& Node::input_shape(std::size_t i) const {
  if (slots()[i]) return slots()[i]->shape;
  std::size_t k = 0;  // the number of inputs before i that have no autograd slot
  for (std::size_t j = 0; j < i; ++j) k += slots()[j] ? 0 : 1;
  return reinterpret_cast<const Shape*>(slots() + n_in_ + n_out_)[k];
}

std::size_t Node::bytes_saved() const {
  std::size_t b = 0;
  for (std::uint32_t i = 0; i < n_saved_; ++i) b += saved_[i].defined() ? saved_[i].nbytes() : 0;
  return b;
}

// ---- recording ----

namespace detail {

namespace {
// Where a node's arrays sit in its arena block: the saved tensors first (the strictest alignment),
// then the input and output slots, the shapes of the inputs without a slot, the saved tensors'
// versions (see check_saved_versions), and the closure last.
struct Layout {
  std::size_t slots_at, shapes_at, versions_at, closure_at, bytes;
  Layout(std::size_t n_saved, std::size_t n_slots, std::size_t n_other, std::size_t closure_bytes, std::size_t align) {
    slots_at = n_saved * sizeof(Tensor);
    shapes_at = slots_at + n_slots * sizeof(Node::Slot);
    versions_at = shapes_at + n_other * sizeof(Shape);
    closure_at = (versions_at + n_saved * sizeof(std::uint32_t) + align - 1) & ~(align - 1);  // a power of two
    bytes = closure_at + closure_bytes;
  }
};

// Copies the inputs' slots (or, for an input that needs no gradient, its shape) into the block;
// returns the bits of the undefined (optional) inputs. Notes on the tape an input whose graph is
// gone (recorded under an older generation: see TapeAccess::note_stale_input).
std::uint64_t place_inputs(Tape& tp, const Tensor* const* inputs, std::size_t n_in, Node::Slot* in, Shape* shapes) {
  std::uint64_t undefined = 0;
  for (std::size_t i = 0, k = 0; i < n_in; ++i) {
    const Tensor* t = inputs[i];
    if (t->requires_grad()) {
      const auto& m = t->meta();
      if (m->node >= 0 && m->generation != TapeAccess::generation(tp)) TapeAccess::note_stale_input(tp);
      ::new (in + i) Node::Slot(m);
    } else {
      ::new (in + i) Node::Slot();
      ::new (shapes + k++) Shape(t->shape());
      if (!t->defined() && i < 64) undefined |= std::uint64_t(1) << i;  // (an undefined tensor needs no grad)
    }
  }
  return undefined;
}
}  // namespace

// Appends the node. What can throw comes before anything is recorded: the outputs' slots, then the
// node (push may sweep, and a sweep that empties the tape resets the arena: so before the arena
// allocation), then the arena block, whose failure takes the still empty node back off the tape.
// The rest only copies handles and cannot throw.
Node& record_node(const char* op, const Tensor* const* inputs, std::size_t n_in, Tensor* const* outputs,
                  std::size_t n_out, const Tensor* saved, std::size_t n_saved, std::size_t closure_bytes,
                  std::size_t closure_align) {
  static_assert(alignof(Node::Slot) <= alignof(Tensor) && alignof(Shape) <= alignof(Tensor));
  Tape& tp = tape();
  if (n_in > UINT32_MAX || n_out > UINT32_MAX) fail(op, "too many inputs or outputs to record (", n_in, ", ", n_out, ")");
  for (std::size_t i = 0; i < n_out; ++i) outputs[i]->ensure_meta();
  Node& n = TapeAccess::push(tp);
  std::size_t n_other = 0;
  for (std::size_t i = 0; i < n_in; ++i) n_other += inputs[i]->requires_grad() ? 0 : 1;
  const Layout at(n_saved, n_in + n_out, n_other, closure_bytes, closure_align);
  char* mem = nullptr;
  try {
    mem = static_cast<char*>(TapeAccess::arena(tp).allocate(at.bytes, std::max(alignof(Tensor), closure_align)));
  } catch (...) {
    TapeAccess::discard_last(tp);
    throw;
  }
  auto* in = reinterpret_cast<Node::Slot*>(mem + at.slots_at);
  const std::uint64_t undefined = place_inputs(tp, inputs, n_in, in, reinterpret_cast<Shape*>(mem + at.shapes_at));
  auto* sv = reinterpret_cast<Tensor*>(mem);
  auto* versions = reinterpret_cast<std::uint32_t*>(mem + at.versions_at);
  for (std::size_t i = 0; i < n_saved; ++i) {
    ::new (sv + i) Tensor(saved[i]);
    versions[i] = saved[i].version();
  }
  const auto index = static_cast<std::int64_t>(tp.size()) - 1;
  for (std::size_t i = 0; i < n_out; ++i) {
    const auto& m = outputs[i]->meta();
    m->requires_grad = true;
    m->node = index;
    m->generation = TapeAccess::generation(tp);
    ::new (in + n_in + i) Node::Slot(m);
  }
  TapeAccess::fill(n, op, sv, n_saved, n_in, n_out, n_other, undefined, mem + at.closure_at);
  TapeAccess::note_saved(tp, n.bytes_saved());  // free_node takes the same count back
  return n;
}

// A saved tensor written in place after the forward (Tensor::set, copy_, an optimizer's step)
// would give a wrong gradient: refuse, as PyTorch's version counter does.
void TapeAccess::check_saved_versions(const Node& n, std::size_t index) {
  const auto* versions = reinterpret_cast<const std::uint32_t*>(
      reinterpret_cast<const char*>(n.slots() + n.n_in_ + n.n_out_) + n.n_other_ * sizeof(Shape));
  for (std::uint32_t i = 0; i < n.n_saved_; ++i) {
    const Tensor& t = n.saved_[i];
    if (t.defined() && t.version() != versions[i])
      fail("backward", "saved tensor ", i, " of op '", n.op_, "' (tape node ", index, ", ", t.dtype(), " ", t.shape(),
           ") was modified in place after the forward (version ", versions[i], ", now ", t.version(),
           "); its gradient would be wrong. Write to a clone(), or make the change before the forward");
  }
}

void drop_last_node_and_rethrow() {
  Tape& tp = tape();
  TapeAccess::free_node(tp, tp.size() - 1);
  throw;
}

void check_anomaly_outputs(const char* op, std::size_t index, const Node& node, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in);
}  // namespace detail

// ---- Tape ----

namespace detail {
Tape& tape_slow() {
  thread_local Tape t;  // a guarded thread_local: its destructor runs when the thread ends
  t_tape = &t;
  return t;
}
}  // namespace detail

namespace {
std::atomic<std::uint64_t> g_tapes{0};
}  // namespace

// A generation names one tape (its high bits: each thread's tape is another) and one stretch of it
// between two clears (its low bits), so a slot tells which tape and which stretch recorded it.
Tape::Tape() : arena_(std::make_unique<detail::Arena>()) {
  generation_ = ((g_tapes.fetch_add(1, std::memory_order_relaxed) + 1) << kGenerationBits) | 1;
}

Tape::~Tape() {
  detail::TapeAccess::empty(*this);
  if (detail::t_tape == this) detail::t_tape = nullptr;
}

void Tape::clear() {
  cleared_by_user_.push_back(generation_);
  if (cleared_by_user_.size() > 64) cleared_by_user_.erase(cleared_by_user_.begin());
  detail::TapeAccess::empty(*this);
}

bool detail::TapeAccess::cleared_by_user(const Tape& t, std::uint64_t g) {
  return std::find(t.cleared_by_user_.begin(), t.cleared_by_user_.end(), g) != t.cleared_by_user_.end();
}

void detail::TapeAccess::empty(Tape& t) {
  t.stale_input_ = false;
  if (t.live_ > 0)
    for (Node& n : t.nodes_)
      if (!n.freed()) release(n);
  t.nodes_.clear();  // O(1): nodes are trivially destructible
  t.arena_->reset();
  t.live_ = 0;
  t.next_sweep_ = Tape::kFirstSweep;
  t.saved_live_ = 0;
  t.next_sweep_bytes_ = Tape::kSweepBytes;
  ++t.generation_;
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
  if (n.freed()) return;
  t.saved_live_ -= std::min(t.saved_live_, n.bytes_saved());
  // The outputs' slots go too, while the walk has them in cache (not in a later pass of clear()).
  // A freed node is found from its outputs' side instead: their slots keep the node's index.
  release(n);
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
    if (n.freed()) continue;
    bool unreachable = true;
    for (const auto& o : n.outputs()) unreachable = unreachable && o.use_count() == 1;
    if (unreachable) free_node(t, i);
  }
  // The next sweep when the tape has doubled, or quadrupled if this one freed under a quarter of
  // the nodes (a long graph that is still in use: sweeping it again soon would find nothing).
  // Either way the sweeps cost O(1) per recorded node, amortised. The byte trigger waits until
  // what is saved has doubled since this sweep: geometric too.
  if (t.live_ == 0) empty(t);
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
    if (n.freed()) continue;
    std::ostringstream line;
    line << std::setw(4) << i << "  " << std::left << std::setw(22) << n.name() << std::right;
    bool first = true;
    const auto ins = n.inputs();
    for (std::size_t k = 0; k < ins.size(); ++k) {
      if (k < 64 && (detail::TapeAccess::undefined_inputs(n) >> k & 1)) continue;  // an absent optional input (e.g. no bias)
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
    if (n.freed()) continue;
    s << "  op" << i << " [shape=box, style=filled, fillcolor=\"#f6e7c1\", label=\"#" << i << ' ' << n.name()
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

}  // namespace tg
