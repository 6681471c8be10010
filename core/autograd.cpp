// Reverse-mode autodiff: the tape records (tapegrad/node.h's record()), and backward() walks it
// back (docs/tape.md). This file holds the walk and the one rule for gradients (new_grad,
// pass_grad); the tape's bookkeeping is in core/tape.cpp, hooks in core/hooks.cpp, anomaly mode
// and op timing in core/anomaly.cpp.
#include "tape_internal.h"

#include <string>

#include "dispatch.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "tapegrad/ops.h"

namespace tg {

namespace detail {
thread_local constinit bool t_grad_enabled = true;
thread_local constinit bool t_anomaly = false;
thread_local constinit bool t_record_hook = false;  // t_anomaly or op timing
thread_local constinit Tape* t_tape = nullptr;
thread_local constinit bool t_hooks_off = false;
}  // namespace detail
using detail::t_grad_enabled;

// ---- grad mode ----

NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }
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
  if (dst.dtype() == bfloat16) {
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

Tensor Node::reusable_saved(const Tensor& saved) const {
  if (!freed_after_run_ || !saved.defined() || !saved.sole_owner()) return Tensor();
  Tensor t = saved;
  t.bump_version();
  return t;
}

Tensor Node::new_grad(std::size_t i) const {
  if (!needs_grad(i)) return Tensor();
  const AutogradMeta& m = *slots()[i];
  // (Not in anomaly mode: its check after the node reads dy, to say whether the NaN came from upstream.)
  if (overwrite_ok_ && !grad_out_given_ && n_out_ > 0 && !detail::t_anomaly) {
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
    fail(op_, "backward passed a ", g.dtype(), " gradient of shape ", g.shape(), " for input ", i, ", a ", m.dtype,
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

// ---- backward ----
//
// backward(root) is four steps: check the root and make the seed; find what the root depends on
// (refusing, before any gradient is touched, a graph part of which was freed); seed the root's
// gradient; walk the tape back. The walk is the whole idea; the rest makes it safe to call twice.

namespace {

using detail::TapeAccess;
using MetaRef = detail::Ref<AutogradMeta>;

// Why the graph behind a tensor (its slot m) is gone, when it is: the node that made it was freed
// by a backward, the tape was emptied since (by a backward, or by Tape::clear()), or the tensor was
// recorded on another thread's tape. Empty when the graph is still there.
std::string why_gone(const Tape& tp, const AutogradMeta& m) {
  const char* const fix = "; detach() it to use it as a constant in a new graph, or pass keep_tape=true to the "
                          "backward that freed it to differentiate through it again";
  if (m.node < 0) return {};
  if (!TapeAccess::same_tape(tp, m.generation))
    return "this tensor was recorded on another thread's tape; backward() walks the calling thread's tape only, so "
           "call it on the thread that ran the forward";
  if (m.generation != TapeAccess::generation(tp)) {
    if (TapeAccess::cleared_by_user(tp, m.generation))
      return "the tape was cleared (Tape::clear()) after this tensor was recorded, which drops its graph; run its "
             "forward again, or detach() it to use it as a constant";
    return std::string("part of the graph of this tensor was freed by an earlier backward()") + fix;
  }
  if (m.node >= static_cast<std::int64_t>(tp.size())) return "the graph of this tensor is not on this tape";
  const Node& n = TapeAccess::node(tp, static_cast<std::size_t>(m.node));
  if (n.freed())
    return "part of the graph of this tensor was freed by an earlier backward() (op '" + std::string(n.name()) +
           "', tape node " + std::to_string(m.node) + ")" + fix;
  return {};
}

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

// A tensor whose graph is gone is refused: read as a constant, it would drop its path's gradient.
void refuse_if_freed(Tape& tp, const AutogradMeta& m) {
  if (const std::string why = why_gone(tp, m); !why.empty()) fail("backward", why);
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
    if (n.freed()) continue;
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

// For the time of a node's backward: whether the walk frees it after (Node::reusable_saved); reset
// however the backward ends.
struct FreedAfterRun {
  Node& n;
  FreedAfterRun(Node& node, bool freed) : n(node) { TapeAccess::set_freed_after_run(n, freed); }
  ~FreedAfterRun() { TapeAccess::set_freed_after_run(n, false); }
  FreedAfterRun(const FreedAfterRun&) = delete;
  FreedAfterRun& operator=(const FreedAfterRun&) = delete;
};

// A node runs when one of its outputs was reached and holds a gradient.
bool reached(const Node& n, std::uint64_t mark) {
  for (const auto& o : n.outputs())
    if (o->visit == mark && o->grad.defined()) return true;
  return false;
}

// The reverse walk: from the root's node back to the start of the tape, each node reached reads
// its outputs' gradients and passes its inputs' to the tape. An output's gradient is dead once its node has
// run (PyTorch keeps only leaves' and retained ones), and so is the node unless kept. A hooked
// leaf's hook fires as soon as the walk has passed the last node that adds into it.
void walk(Tape& tp, std::int64_t from, std::uint64_t mark, bool keep_tape, std::vector<detail::DueHook>& hooks) {
  NoGradGuard no_record;  // backward kernels must not append to the tape they walk
  const bool anomaly = detail::t_anomaly;
  auto next_hook = hooks.begin();
  for (std::int64_t i = from; i >= 0; --i) {
    detail::fire_hooks(next_hook, hooks.end(), i);  // without hooks: one comparison per node
    Node& n = TapeAccess::node(tp, static_cast<std::size_t>(i));
    if (n.freed() || !reached(n, mark)) continue;
    for (const auto& in : n.inputs())
      if (in) in->visit = mark;
    TapeAccess::check_saved_versions(n, static_cast<std::size_t>(i));
    {
      FreedAfterRun scope(n, !keep_tape && !anomaly);
      detail::run_backward_timed(n);
    }
    if (anomaly) detail::check_anomaly_backward(n, static_cast<std::size_t>(i));
    for (const auto& o : n.outputs())
      if (!o->retains_grad) o->grad.reset();
    if (!keep_tape) TapeAccess::free_node(tp, static_cast<std::size_t>(i));
  }
  detail::fire_hooks(next_hook, hooks.end(), -2);
}

}  // namespace

void backward(const Tensor& root, const Tensor& grad, bool keep_tape) {
  const Tensor seed = make_seed(root, grad);
  AutogradMeta& rm = *root.meta();
  Tape& tp = tape();
  refuse_if_freed(tp, rm);
  static thread_local std::uint64_t epoch = 0;
  const std::uint64_t mark = ++epoch;
  rm.visit = mark;
  const bool hooks_live = detail::hooks_registered() && !detail::t_hooks_off;
  Marked found;
  if (grad.defined() || tp.live() != tp.size() || TapeAccess::has_stale_input(tp) || detail::retain_grad_used() ||
      hooks_live)
    found = mark_graph(tp, root, seed, mark);
  std::vector<detail::DueHook> hooks;
  if (hooks_live) hooks = detail::due_hooks(tp, rm, mark);
  SetAside set_aside(found.retained);
  seed_root(rm, seed, found.seed_aliased);
  walk(tp, rm.node, mark, keep_tape, hooks);
  if (tp.live() == 0) TapeAccess::empty(tp);
}

}  // namespace tg
