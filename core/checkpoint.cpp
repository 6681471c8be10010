// checkpoint: a segment recorded as one node that recomputes its inside during the backward
// (tapegrad/checkpoint.h). The forward runs it without recording; the backward runs it again on
// a tape of its own, checks what it read, and walks that tape back.
#include "tapegrad/checkpoint.h"

#include <unordered_set>

#include "dispatch.h"  // check_defined
#include "ops/internal.h"
#include "tape_internal.h"
#include "tapegrad/anomaly.h"
#include "tapegrad/autocast.h"
#include "tapegrad/random.h"

namespace tg {

namespace {

thread_local constinit bool t_recomputing = false;

// For its lifetime, this thread records on a tape of its own, with recording on; then the tape is
// emptied (freeing what the segment saved) and the thread's tape and grad mode come back.
class OwnTape {
 public:
  OwnTape() : prev_tape_(detail::t_tape), prev_grad_(detail::t_grad_enabled) {
    detail::t_tape = &tape_;
    detail::t_grad_enabled = true;
  }
  ~OwnTape() {
    tape_.clear();
    detail::t_tape = prev_tape_;
    detail::t_grad_enabled = prev_grad_;
  }
  OwnTape(const OwnTape&) = delete;
  OwnTape& operator=(const OwnTape&) = delete;
  Tape& get() { return tape_; }

 private:
  Tape tape_;
  Tape* prev_tape_;
  bool prev_grad_;
};

// The default generator's state and shard: what dropout's masks depend on.
struct RngState {
  std::uint64_t seed, offset, shard, shards;
  static RngState now() {
    const Generator& g = default_generator();
    return {g.seed(), g.offset(), g.shard(), g.shards()};
  }
  void restore() const {
    Generator& g = default_generator();
    g.set_state(seed, offset);
    g.set_shard(shard, shards);
  }
};

// The recomputation's conditions, as the forward had them, for its lifetime.
class AsInForward {
 public:
  explicit AsInForward(const RngState& forward) : after_(RngState::now()), prev_recomputing_(t_recomputing) {
    forward.restore();
    t_recomputing = true;
  }
  ~AsInForward() {
    after_.restore();
    t_recomputing = prev_recomputing_;
  }
  AsInForward(const AsInForward&) = delete;
  AsInForward& operator=(const AsInForward&) = delete;

 private:
  RngState after_;
  bool prev_recomputing_;
};

class HooksOff {
 public:
  HooksOff() : prev_(detail::t_hooks_off) { detail::t_hooks_off = true; }
  ~HooksOff() { detail::t_hooks_off = prev_; }
  HooksOff(const HooksOff&) = delete;
  HooksOff& operator=(const HooksOff&) = delete;

 private:
  bool prev_;
};

// x as the segment's own leaf: same data, no history, requiring grad when x's gradient is wanted.
Tensor segment_input(const Tensor& x, bool wants_grad) {
  Tensor xd = x.detach();
  if (wants_grad) xd.requires_grad_();
  return xd;
}

// Every tensor requiring grad that the segment's ops read must be the segment's input xd, one of
// params, or computed on the segment's tape: a tensor from outside it (a parameter left out of
// params, or an activation of the outer graph that fn captured) would receive its gradient on the
// inner tape, where nothing carries it on.
void check_reads(Tape& t, const Tensor& xd, const std::vector<Tensor>& params, const Tensor& out) {
  std::unordered_set<const AutogradMeta*> known;
  for (const Tensor& p : params) known.insert(p.meta().get());
  if (xd.meta()) known.insert(xd.meta().get());
  for (std::size_t i = 0; i < t.size(); ++i) {
    const Node& n = detail::TapeAccess::node(t, i);
    if (n.freed()) continue;  // swept: nothing reads its outputs
    for (const Node::Slot& s : n.inputs())
      if (s && !known.count(s.get()))
        fail("checkpoint", "fn's op '", n.name(), "' reads a tensor ", s->dtype, " ", s->shape,
             " that requires grad and is neither x, nor in params, nor computed by fn from them; pass a parameter "
             "in params (a module's parameters()) and an activation as x");
    for (const Node::Slot& o : n.outputs()) known.insert(o.get());
  }
  // The result itself: an outer tensor returned as it is would seed a walk of the wrong tape.
  if (out.requires_grad() && !known.count(out.meta().get()))
    fail("checkpoint", "fn's result ", out.dtype(), " ", out.shape(), " requires grad and is neither x, nor in params, "
         "nor computed by fn from them; pass an activation as x");
}

}  // namespace

bool in_checkpoint_recompute() { return t_recomputing; }

Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& x, const std::vector<Tensor>& params) {
  const char* op = "checkpoint";
  if (!fn) fail(op, "fn is empty");
  detail::check_defined(op, x, "x");
  std::vector<Tensor> leaves;  // the params that need a gradient
  for (const Tensor& p : params) {
    detail::check_defined(op, p, "a tensor in params");
    if (!p.requires_grad()) continue;
    if (!p.is_leaf()) fail(op, "params must be leaves (parameters); got a tensor ", p.shape(), " computed by an op");
    leaves.push_back(p);
  }
  if (!grad_enabled() || (!x.requires_grad() && leaves.empty())) return fn(x);
  // Anomaly mode records fn's ops as they are, so that a NaN is named by the op that made it.
  if (is_anomaly_enabled()) return fn(x);

  const bool autocast = is_autocast_enabled();
  const RngState rng = RngState::now();
  Tensor y;
  {
    NoGradGuard no_record;  // fn's activations are freed as it goes
    y = fn(x);
  }
  detail::check_defined(op, y, "fn's result");
  y = y.detach();  // fn may return x itself, whose history is not this node's

  std::vector<const Tensor*> inputs{&x};
  for (const Tensor& p : leaves) inputs.push_back(&p);
  struct Saved { Tensor x; };
  auto backward_fn = [fn = std::move(fn), leaves = std::move(leaves), autocast, rng](Node& n, const Saved& s) {
    const Tensor dy = n.grad_out();
    Tensor gx;
    {
      AsInForward conditions(rng);
      AutocastGuard cast(autocast);
      OwnTape inner;
      const Tensor xd = segment_input(s.x, n.needs_grad(0));
      const Tensor out = fn(xd);
      check_reads(inner.get(), xd, leaves, out);
      if (!out.defined() || !(out.shape() == dy.shape()) || out.dtype() != dy.dtype())
        fail("checkpoint", "the recomputation gave ", out.defined() ? out.shape().str() : "an undefined tensor",
             " where the forward gave ", dy.dtype(), " ", dy.shape(), ": fn must give the same result when run again");
      // A result that depends on nothing requiring grad (x does not, and fn ignores params): every
      // gradient through it is zero, and x's is written as zeros below.
      if (out.requires_grad()) {
        HooksOff hooks;  // the outer walk fires the parameters' hooks, after this node
        backward(out, dy);
        gx = xd.grad();
      }
    }  // the segment's tape is empty again
    if (!gx.defined()) return detail::pass_zeros(n, 0);  // fn's result does not depend on x
    n.pass_grad(0, std::move(gx));  // the inner walk's buffer, to be x's gradient
  };
  record(op, inputs, {&y}, Saved{x.detach()}, std::move(backward_fn));
  return y;
}

}  // namespace tg
