// Activation checkpointing (tapegrad/checkpoint.h): a segment recorded as one node that saves its
// input alone and recomputes the rest in the backward. The results and every gradient are the
// same bits as without it, also with dropout (the same masks), autocast, BatchNorm (running
// statistics updated once), gradient hooks (fired once, with the final gradient) and nesting; a
// segment that reads a tensor requiring grad from outside x and params is refused by name. And
// the allocator's counters (memory_allocated, max_memory_allocated) that show what it saves.
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "helpers.h"
#include "tapegrad/memory.h"

using namespace tg;
using namespace tgtest;

namespace {

// Same dtype, shape and bytes (float bits, NaN payloads included).
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// CHECKs that a and b hold the same bits; on failure prints how far apart they are.
void check_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  INFO(what << ": a " << (a.defined() ? a.shape().str() : "undefined") << ", b "
            << (b.defined() ? b.shape().str() : "undefined"));
  if (a.defined() && b.defined() && a.shape() == b.shape() && a.dtype() == b.dtype()) {
    INFO("max |a - b| = " << max_abs_diff(a, b));
    CHECK(same_bits(a, b));
  } else {
    CHECK(a.defined() == b.defined());
    CHECK((!a.defined() || same_bits(a, b)));
  }
}

// Copies of the tensors' gradients (undefined where there is none).
std::vector<Tensor> grads_of(const std::vector<Tensor>& ts) {
  std::vector<Tensor> g;
  for (const Tensor& t : ts) g.push_back(t.grad().defined() ? t.grad().detach().clone() : Tensor());
  return g;
}

void check_same_grads(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) check_same_bits(a[i], b[i], "gradient " + std::to_string(i));
}

// A leaf of N(0, scale^2) entries from its own seed.
Tensor leaf(const Shape& shape, DType dtype, std::uint64_t seed, double scale = 1.0, bool grad = true) {
  Generator g(seed);
  Tensor t = mul(randn(shape, dtype, &g), scale);
  if (grad) t.requires_grad_();
  return t;
}

// Two layers with a norm between: x (rows, C) -> linear -> gelu -> layer_norm -> [dropout] ->
// tanh -> linear -> (rows, C). Every op has a backward with saved activations.
struct Net {
  Tensor w1, b1, g, beta, w2, b2;
  double p = 0;  // dropout after the norm (train mode), 0: none
  Net(DType dt, std::int64_t C, std::int64_t H, std::uint64_t seed)
      : w1(leaf({H, C}, dt, seed, 0.5)), b1(leaf({H}, dt, seed + 1, 0.1)), g(leaf({H}, dt, seed + 2, 0.2)),
        beta(leaf({H}, dt, seed + 3, 0.1)), w2(leaf({C, H}, dt, seed + 4, 0.3)), b2(leaf({C}, dt, seed + 5, 0.1)) {}
  explicit Net(const std::vector<Tensor>& p) : w1(p[0]), b1(p[1]), g(p[2]), beta(p[3]), w2(p[4]), b2(p[5]) {}
  std::vector<Tensor> params() const { return {w1, b1, g, beta, w2, b2}; }
  Tensor operator()(const Tensor& x) const {
    Tensor h = layer_norm(gelu(linear(x, w1, b1)), add(g, 1.0), beta);  // a gain near 1
    if (p > 0) h = dropout(h, p, true);
    return linear(tanh(h), w2, b2);
  }
  void zero_grad() {
    for (Tensor t : params()) t.zero_grad();
  }
};

}  // namespace

TEST_CASE("checkpoint gives the same output and gradients, bit for bit, as the function itself") {
  tape().clear();  // what other tests left on this thread's tape
  // Layouts: x used by the checkpoint alone (its gradient written), and x also used before and
  // after it (the checkpoint's dx added to the others'). Two backwards without zeroing: the
  // parameters' gradients accumulate as they do without the checkpoint.
  for (DType dt : kFloatTypes)
    for (bool x_grad : {true, false})
      for (bool shared : {false, true}) {
        INFO(dt << (x_grad ? ", x requires grad" : ", x constant") << (shared ? ", x shared" : ", x alone"));
        Net net(dt, 6, 10, 100);
        const Tensor dy = leaf({7, 6}, dt, 7, 1.0, false);
        auto run = [&](bool ck) {
          Tensor x0 = leaf({7, 6}, dt, 5, 1.0, x_grad);
          net.zero_grad();
          std::vector<Tensor> y_seen, after_first;
          for (int pass = 0; pass < 2; ++pass) {
            const Tensor x = mul(x0, 1.5);
            const Tensor a = shared ? mul(x, 3.0) : Tensor();
            Tensor y = ck ? checkpoint([&](const Tensor& in) { return net(in); }, x, net.params()) : net(x);
            y_seen.push_back(y.detach().clone());
            if (shared) y = add(add(a, y), x);
            sum(mul(tanh(y), dy)).backward();
            if (pass == 0) after_first = grads_of(net.params());
          }
          std::vector<Tensor> all = {x0};
          for (const Tensor& p : net.params()) all.push_back(p);
          return std::tuple{y_seen, after_first, grads_of(all)};
        };
        const auto [y_plain, first_plain, plain] = run(false);
        const auto [y_ck, first_ck, ck] = run(true);
        check_same_bits(y_ck[0], y_plain[0], "output");
        check_same_grads(first_ck, first_plain);
        check_same_grads(ck, plain);
        CHECK(plain[0].defined() == x_grad);
        for (std::size_t i = 1; i < plain.size(); ++i) CHECK(plain[i].defined());
        CHECK(tape().live() == 0);
      }
}

TEST_CASE("checkpoint passes a float64 gradcheck, with x as an input and as a constant") {
  Net net(float64, 3, 4, 200);
  const Tensor x = leaf({2, 3}, float64, 9);
  std::vector<Tensor> inputs = {x};
  for (const Tensor& p : net.params()) inputs.push_back(p);
  auto through_checkpoint = [](const std::vector<Tensor>& in) {
    const Net of_inputs(std::vector<Tensor>(in.begin() + 1, in.end()));
    // of_inputs by value: fn runs again in the backward, after this function has returned
    return checkpoint([of_inputs](const Tensor& v) { return of_inputs(v); }, in[0], of_inputs.params());
  };
  require_gradcheck(through_checkpoint, inputs);
  inputs[0] = x.detach();  // a constant input: the parameters' gradients alone
  require_gradcheck(through_checkpoint, inputs);
}

TEST_CASE("a kept tape differentiates through a checkpoint twice, recomputing each time") {
  tape().clear();  // what other tests left on this thread's tape
  Net net(float64, 5, 8, 250);
  const Tensor dy = leaf({4, 5}, float64, 6, 1.0, false);
  int calls = 0;
  auto run = [&](bool ck) {
    net.zero_grad();
    Tensor x0 = leaf({4, 5}, float64, 3);
    auto fn = [&](const Tensor& in) {
      ++calls;
      return net(in);
    };
    Tensor loss = sum(mul(ck ? checkpoint(fn, x0, net.params()) : fn(x0), dy));
    loss.backward(Tensor(), /*keep_tape=*/true);
    loss.backward();  // the gradients add up: twice the first
    std::vector<Tensor> all = {x0};
    for (const Tensor& p : net.params()) all.push_back(p);
    return grads_of(all);
  };
  const std::vector<Tensor> plain = run(false);
  CHECK(calls == 1);
  calls = 0;
  check_same_grads(run(true), plain);
  CHECK(calls == 3);  // the forward, and a recomputation per backward
  CHECK(tape().live() == 0);
}

TEST_CASE("dropout inside a checkpoint draws the same masks in the recomputation, also as a generator shard") {
  // Between the forward and the backward the default generator moves on (another dropout): the
  // recomputation must draw from where the forward drew, and leave the generator where it was.
  Net net(float32, 8, 12, 300);
  net.p = 0.4;
  const Tensor dy = leaf({6, 8}, float32, 8, 1.0, false);
  for (bool sharded : {false, true}) {
    INFO((sharded ? "forward as shard 1 of 2" : "whole batch"));
    auto run = [&](bool ck, std::uint64_t seed) {
      manual_seed(seed);
      net.zero_grad();
      Tensor x0 = leaf({6, 8}, float32, 4);
      if (sharded) default_generator().set_shard(1, 2);
      Tensor y = ck ? checkpoint([&](const Tensor& in) { return dropout(net(in), 0.25, true); }, x0, net.params())
                    : dropout(net(x0), 0.25, true);
      default_generator().set_shard(0, 1);
      (void)dropout(ones({5, 7}), 0.5, true);
      const std::uint64_t before_backward = default_generator().offset();
      sum(mul(y, dy)).backward();
      CHECK(default_generator().offset() == before_backward);
      CHECK(default_generator().shard() == 0);
      CHECK(default_generator().shards() == 1);
      std::vector<Tensor> all = {x0};
      for (const Tensor& p : net.params()) all.push_back(p);
      return std::tuple{y.detach(), grads_of(all), default_generator().offset()};
    };
    const auto [y_plain, plain, end_plain] = run(false, 21);
    const auto [y_ck, ck, end_ck] = run(true, 21);
    check_same_bits(y_ck, y_plain, "output");
    check_same_grads(ck, plain);
    CHECK(end_ck == end_plain);
    // The masks matter: another seed gives other gradients.
    const auto [y_other, other, end_other] = run(true, 22);
    CHECK_FALSE(same_bits(other[1], plain[1]));
    CHECK(end_other == end_plain);
  }
}

TEST_CASE("checkpoint under autocast: the bf16 products' bits") {
  Net net(float32, 24, 40, 400);
  const Tensor dy = leaf({10, 24}, float32, 10, 1.0, false);
  // cast_forward / cast_backward: an AutocastGuard around the forward / the backward.
  auto run = [&](bool ck, bool cast_forward, bool cast_backward) {
    net.zero_grad();
    Tensor x0 = leaf({10, 24}, float32, 11);
    Tensor y;
    {
      AutocastGuard cast(cast_forward);
      y = ck ? checkpoint([&](const Tensor& in) { return net(in); }, x0, net.params()) : net(x0);
    }
    {
      AutocastGuard cast(cast_backward);
      sum(mul(y, dy)).backward();
    }
    std::vector<Tensor> all = {x0};
    for (const Tensor& p : net.params()) all.push_back(p);
    return std::pair{y.detach(), grads_of(all)};
  };
  const auto [y32, g32] = run(false, false, false);
  SECTION("forward under autocast, backward outside") {
    const auto [y_plain, plain] = run(false, true, false);
    const auto [y_ck, ck] = run(true, true, false);
    check_same_bits(y_ck, y_plain, "output");
    check_same_grads(ck, plain);
    CHECK(max_abs_diff(y_plain, y32) > 1e-4);  // the products are bf16 ones
    CHECK(max_abs_diff(plain[1], g32[1]) > 1e-4);
  }
  SECTION("forward outside autocast, backward inside: the recomputation is float32, as the forward") {
    const auto [y_ck, ck] = run(true, false, true);
    check_same_bits(y_ck, y32, "output");
    check_same_grads(ck, g32);
  }
}

TEST_CASE("a segment reading a tensor that requires grad from outside x and params is refused in the backward") {
  Net net(float32, 5, 7, 500);
  const Tensor dy = leaf({4, 5}, float32, 13, 1.0, false);
  auto plain_grads = [&] {
    net.zero_grad();
    Tensor x0 = leaf({4, 5}, float32, 14);
    sum(mul(net(mul(x0, 2.0)), dy)).backward();
    return grads_of(net.params());
  };
  const std::vector<Tensor> plain = plain_grads();
  Tensor x0 = leaf({4, 5}, float32, 14);
  const Tensor outside = tanh(x0);  // an activation of the outer graph
  // fn reads w2 (left out of params) / fn reads an activation of the outer graph
  const std::vector<Tensor> without_w2 = {net.w1, net.b1, net.g, net.beta, net.b2};
  struct Case {
    const char* what;
    std::function<Tensor(const Tensor&)> fn;
    std::vector<Tensor> params;
    const char* op;
  };
  // fn draws dropout masks and runs under autocast: the recomputation restores the forward's
  // generator state and turns autocast on, and must put both back when it throws.
  for (const Case& c : {Case{"a parameter left out", [&](const Tensor& in) { return dropout(net(in), 0.3, true); },
                             without_w2, "'linear'"},
                        Case{"a captured activation", [&](const Tensor& in) { return add(net(in), outside); },
                             net.params(), "'add'"}}) {
    INFO(c.what);
    net.zero_grad();
    Tape* const outer = &tape();
    Tensor y;
    {
      AutocastGuard cast;
      y = checkpoint(c.fn, mul(x0, 2.0), c.params);  // the forward records no op of fn: no check yet
    }
    (void)dropout(ones({3}), 0.5, true);  // the generator moves on between the forward and the backward
    const std::uint64_t offset = default_generator().offset();
    Tensor loss = sum(mul(y, dy));
    REQUIRE_TG_ERROR(loss.backward(), "checkpoint", c.op, "requires grad", "params");
    // Nothing of the segment was written, and the thread's state is back as it was.
    for (const Tensor& p : net.params()) CHECK_FALSE(p.grad().defined());
    CHECK_FALSE(x0.grad().defined());
    CHECK(&tape() == outer);
    CHECK(grad_enabled());
    CHECK_FALSE(in_checkpoint_recompute());
    CHECK_FALSE(is_autocast_enabled());
    CHECK(default_generator().offset() == offset);
    // A correct segment on a fresh graph then differentiates as usual (the failed graph's nodes
    // are still on the tape, unwalked).
    net.zero_grad();
    Tensor x1 = leaf({4, 5}, float32, 14);
    Tensor fresh = checkpoint([&](const Tensor& in) { return net(in); }, mul(x1, 2.0), net.params());
    sum(mul(fresh, dy)).backward();
    check_same_grads(grads_of(net.params()), plain);
  }
  // A captured constant (no gradient) is fine.
  const Tensor constant = outside.detach();
  net.zero_grad();
  Tensor y = checkpoint([&](const Tensor& in) { return add(net(in), constant); }, x0, net.params());
  sum(mul(y, dy)).backward();
  for (const Tensor& p : net.params()) CHECK(p.grad().defined());
  tape().clear();
}

TEST_CASE("gradient hooks on a segment's parameters fire once per backward, with the final gradient") {
  // s is used before the segment (x = x0 * s) and inside it: its gradient is final only after the
  // earlier node; the others' right after the checkpoint's node. x0's hook fires too.
  Net net(float32, 6, 9, 600);
  Tensor s = leaf({6}, float32, 15);
  Tensor x0 = leaf({5, 6}, float32, 16);
  const Tensor dy = leaf({5, 6}, float32, 17, 1.0, false);
  std::vector<Tensor> watched = net.params();
  watched.push_back(s);
  watched.push_back(x0);
  std::vector<int> fired(watched.size(), 0);
  std::vector<Tensor> seen(watched.size());
  std::vector<GradHookHandle> hooks;
  for (std::size_t i = 0; i < watched.size(); ++i)
    hooks.push_back(register_post_accumulate_grad_hook(watched[i], [&, i](const Tensor& g) {
      ++fired[i];
      seen[i] = g.detach().clone();
    }));
  std::vector<Tensor> segment_params = net.params();
  segment_params.push_back(s);
  auto step = [&](bool ck) {
    for (Tensor t : watched) t.zero_grad();
    const Tensor x = mul(x0, s);
    auto fn = [&](const Tensor& in) { return mul(net(in), s); };
    Tensor y = ck ? checkpoint(fn, x, segment_params) : fn(x);
    sum(mul(y, dy)).backward();
    return grads_of(watched);
  };
  const std::vector<Tensor> plain = step(false);
  for (std::size_t i = 0; i < watched.size(); ++i) {
    INFO("tensor " << i);
    CHECK(fired[i] == 1);
    check_same_bits(seen[i], plain[i], "hook's gradient");
  }
  std::fill(fired.begin(), fired.end(), 0);
  const std::vector<Tensor> ck = step(true);
  check_same_grads(ck, plain);
  for (std::size_t i = 0; i < watched.size(); ++i) {
    INFO("tensor " << i);
    CHECK(fired[i] == 1);
    check_same_bits(seen[i], ck[i], "hook's gradient");
  }
  // A backward after that fires them again, once (the inner backward's switch is off again).
  std::fill(fired.begin(), fired.end(), 0);
  (void)step(false);
  for (int f : fired) CHECK(f == 1);
}

TEST_CASE("a checkpointed forward keeps its input alone on the tape") {
  Net net(float32, 32, 128, 700);
  Tensor x0 = leaf({64, 32}, float32, 18);
  tape().clear();
  Tensor y = checkpoint([&](const Tensor& in) { return net(in); }, x0, net.params());
  CHECK(tape().live() == 1);
  CHECK(tape()[0].name() == std::string("checkpoint"));
  CHECK(tape().bytes_saved() == x0.nbytes());
  Tensor loss = sum(mul(y, 2.0));  // ops outside the segment: a scaling and a sum save nothing
  CHECK(tape().bytes_saved() == x0.nbytes());
  tape().clear();
  Tensor y_plain = net(x0);
  const std::size_t plain = tape().bytes_saved();
  INFO("without the checkpoint: " << plain << " bytes saved, x: " << x0.nbytes());
  CHECK(plain > 8 * x0.nbytes());  // the hidden activations are (64, 128): 4 x's width, several of them
  tape().clear();
}

TEST_CASE("BatchNorm inside a checkpoint updates its running statistics once per forward") {
  Net net(float32, 6, 10, 800);
  // The same BatchNorm twice: one used without checkpoint, one inside it.
  nn::BatchNorm1d bn_plain(10), bn_ck(10);
  const Tensor dy = leaf({8, 6}, float32, 19, 1.0, false);
  auto fn_with = [&net](nn::BatchNorm1d* bn) {
    return [&net, bn](const Tensor& in) {
      return linear(tanh(bn->forward(linear(in, net.w1, net.b1))), net.w2, net.b2);
    };
  };
  std::vector<Tensor> params = {net.w1, net.b1, net.w2, net.b2, bn_ck.weight, bn_ck.bias};
  for (int step = 1; step <= 2; ++step) {
    INFO("step " << step);
    Tensor x = leaf({8, 6}, float32, 20 + static_cast<std::uint64_t>(step), 1.0, true);
    net.zero_grad();
    bn_plain.zero_grad();
    Tensor y_plain = fn_with(&bn_plain)(add(x, 0.5));  // a mean away from 0, so the running mean moves
    sum(mul(y_plain, dy)).backward();
    const std::vector<Tensor> plain = grads_of({x, net.w1, net.b1, net.w2, bn_plain.weight, bn_plain.bias});
    net.zero_grad();
    bn_ck.zero_grad();
    x.zero_grad();
    Tensor y_ck = checkpoint(fn_with(&bn_ck), add(x, 0.5), params);
    CHECK(bn_ck.num_batches_tracked.data<std::int32_t>()[0] == step);  // the forward's update
    sum(mul(y_ck, dy)).backward();
    const std::vector<Tensor> ck = grads_of({x, net.w1, net.b1, net.w2, bn_ck.weight, bn_ck.bias});
    check_same_bits(y_ck, y_plain, "output");
    check_same_grads(ck, plain);
    CHECK(bn_ck.num_batches_tracked.data<std::int32_t>()[0] == step);  // and none by the recomputation
    CHECK(bn_plain.num_batches_tracked.data<std::int32_t>()[0] == step);
    check_same_bits(bn_ck.running_mean, bn_plain.running_mean, "running mean");
    check_same_bits(bn_ck.running_var, bn_plain.running_var, "running var");
  }
  CHECK(max_abs_diff(bn_ck.running_mean, zeros({10})) > 1e-3);  // the statistics did move
}

TEST_CASE("nested checkpoints give the same gradients, dropout masks and generator offset") {
  tape().clear();  // what other tests left on this thread's tape
  Net inner(float32, 6, 10, 900), outer(float32, 6, 10, 950);
  inner.p = 0.3;
  outer.p = 0.2;
  const Tensor dy = leaf({5, 6}, float32, 23, 1.0, false);
  std::vector<Tensor> all_params = inner.params();
  for (const Tensor& p : outer.params()) all_params.push_back(p);
  auto run = [&](bool ck) {
    manual_seed(31);
    inner.zero_grad();
    outer.zero_grad();
    Tensor x0 = leaf({5, 6}, float32, 24);
    auto segment = [&](const Tensor& in) {
      Tensor h = ck ? checkpoint([&](const Tensor& v) { return inner(v); }, in, inner.params()) : inner(in);
      return outer(dropout(h, 0.5, true));
    };
    Tensor y = ck ? checkpoint(segment, x0, all_params) : segment(x0);
    sum(mul(y, dy)).backward();
    std::vector<Tensor> all = {x0};
    for (const Tensor& p : all_params) all.push_back(p);
    return std::tuple{y.detach(), grads_of(all), default_generator().offset()};
  };
  const auto [y_plain, plain, end_plain] = run(false);
  const auto [y_ck, ck, end_ck] = run(true);
  check_same_bits(y_ck, y_plain, "output");
  check_same_grads(ck, plain);
  CHECK(end_ck == end_plain);
  CHECK(tape().live() == 0);
}

TEST_CASE("checkpoint is fn(x) under NoGradGuard or without anything to differentiate, and runs fn twice otherwise") {
  Net net(float32, 4, 6, 1000);
  const Tensor x = leaf({3, 4}, float32, 25, 1.0, false);
  int calls = 0;
  auto counted = [&](const Tensor& in) {
    ++calls;
    return net(in);
  };
  tape().clear();
  Tensor expected;
  {
    NoGradGuard ng;
    expected = net(x);
    Tensor y = checkpoint(counted, x, net.params());
    CHECK(calls == 1);
    CHECK(tape().size() == 0);
    CHECK_FALSE(y.requires_grad());
    check_same_bits(y, expected, "under NoGradGuard");
  }
  // Constants only: the parameters' detached copies and a constant x.
  std::vector<Tensor> constants;
  for (const Tensor& p : net.params()) constants.push_back(p.detach());
  const Net frozen(constants);
  calls = 0;
  Tensor y = checkpoint([&](const Tensor& in) { ++calls; return frozen(in); }, x, constants);
  CHECK(calls == 1);
  CHECK(tape().size() == 0);
  CHECK_FALSE(y.requires_grad());
  check_same_bits(y, expected, "constants");
  // Recorded: one node, fn once in the forward and once more in the backward.
  calls = 0;
  Tensor r = checkpoint(counted, x, net.params());
  CHECK(calls == 1);
  CHECK(tape().live() == 1);
  CHECK(r.requires_grad());
  check_same_bits(r, expected, "recorded");
  sum(r).backward();
  CHECK(calls == 2);
  CHECK(tape().live() == 0);
  // fn may return x itself: x's gradient is then the incoming one.
  Tensor x1 = leaf({3, 4}, float32, 26);
  const Tensor d = leaf({3, 4}, float32, 27, 1.0, false);
  checkpoint([](const Tensor& in) { return in; }, x1, {}).backward(d);
  check_same_bits(x1.grad(), d, "identity");
}

TEST_CASE("checkpoint's argument errors name it") {
  Net net(float32, 4, 6, 1100);
  const Tensor x = leaf({3, 4}, float32, 28);
  tape().clear();
  REQUIRE_TG_ERROR(checkpoint(nullptr, x, net.params()), "checkpoint", "fn is empty");
  REQUIRE_TG_ERROR(checkpoint([&](const Tensor& in) { return net(in); }, Tensor(), net.params()), "checkpoint", "x");
  REQUIRE_TG_ERROR(checkpoint([&](const Tensor& in) { return net(in); }, x, {net.w1, Tensor()}), "checkpoint",
                   "params");
  REQUIRE_TG_ERROR(checkpoint([](const Tensor&) { return Tensor(); }, x, net.params()), "checkpoint", "fn's result");
  CHECK(tape().size() == 0);  // nothing recorded by a refused call
  const Tensor computed = mul(net.w1, 2.0);  // requires grad, made by an op
  REQUIRE_TG_ERROR(checkpoint([&](const Tensor& in) { return linear(in, computed); }, x, {computed}), "checkpoint",
                   "params must be leaves", "(6, 4)");
  CHECK(tape().size() == 1);  // the mul alone
  tape().clear();
}

TEST_CASE("memory_allocated counts the tensors in use, max_memory_allocated the peak since a reset") {
  constexpr std::size_t MiB = std::size_t(1) << 20;
  const std::size_t before = memory_allocated();
  reset_peak_memory_stats();
  CHECK(max_memory_allocated() == before);
  {
    Tensor t = Tensor::empty({static_cast<std::int64_t>(MiB / 4)}, float32);
    CHECK(memory_allocated() >= before + MiB);
    CHECK(memory_allocated() < before + 2 * MiB);
    CHECK(max_memory_allocated() >= before + MiB);
  }
  CHECK(memory_allocated() == before);  // back, although the block may sit in the cache
  CHECK(max_memory_allocated() >= before + MiB);
  reset_peak_memory_stats();
  CHECK(max_memory_allocated() == before);
  {
    Tensor a = Tensor::empty({static_cast<std::int64_t>(MiB / 2)}, float32);  // 2 MiB
  }
  Tensor b = Tensor::empty({static_cast<std::int64_t>(MiB / 4)}, float32);  // 1 MiB, after a is gone
  CHECK(max_memory_allocated() >= before + 2 * MiB);
  CHECK(max_memory_allocated() < before + 3 * MiB);
  CHECK(memory_allocated() >= before + MiB);
  b = Tensor();
  CHECK(memory_allocated() == before);
}

TEST_CASE("checkpointed segments lower the peak of tensor memory of a forward and backward") {
  // Six segments of the two-layer net (hidden width 4 C, 256 rows: activations well above the
  // parameters' gradients): without checkpoints the backward starts with every segment's
  // activations alive; with them, with six segment inputs, and one segment's at a time after.
  std::vector<Net> nets;
  for (std::uint64_t i = 0; i < 6; ++i) nets.emplace_back(float32, 32, 128, 1200 + 10 * i);
  Tensor x0 = leaf({256, 32}, float32, 29);
  auto peak = [&](bool ck) {
    for (Net& n : nets) n.zero_grad();
    x0.zero_grad();
    const std::size_t base = memory_allocated();
    reset_peak_memory_stats();
    {
      Tensor h = x0;
      for (Net& n : nets) h = ck ? checkpoint([&](const Tensor& in) { return n(in); }, h, n.params()) : n(h);
      sum(h).backward();
    }
    for (Net& n : nets) n.zero_grad();  // the gradients, the same in both, are not the activations
    x0.zero_grad();
    CHECK(memory_allocated() == base);
    return max_memory_allocated() - base;
  };
  const std::size_t plain = peak(false), ck = peak(true);
  INFO("peak above the start: " << plain << " bytes without checkpoints, " << ck << " with");
  CHECK(ck * 2 < plain);
}

TEST_CASE("checkpoint's edge cases: x among the params, token ids as x, no rows, fn ignoring x") {
  tape().clear();  // what other tests left on this thread's tape
  Net net(float32, 5, 8, 1300);
  SECTION("x is also a parameter: its two contributions add up as for w * w") {
    Tensor w = leaf({4, 5}, float32, 30);
    const Tensor dy = leaf({4, 5}, float32, 31, 1.0, false);
    sum(mul(mul(w, w), dy)).backward();
    const Tensor plain = w.grad().clone();
    w.zero_grad();
    sum(mul(checkpoint([&](const Tensor& v) { return mul(v, w); }, w, {w}), dy)).backward();
    check_same_bits(w.grad(), plain, "w");
  }
  SECTION("int32 ids as x: an embedding inside the segment") {
    Tensor table = leaf({10, 5}, float32, 32);
    const Tensor ids = from_vector<std::int32_t>({1, 2, 3, 9, 2}, {5});
    std::vector<Tensor> params = net.params();
    params.push_back(table);
    auto fn = [&](const Tensor& i) { return net(embedding(table, i)); };
    sum(fn(ids)).backward();
    const std::vector<Tensor> plain = grads_of(params);
    for (Tensor p : params) p.zero_grad();
    sum(checkpoint(fn, ids, params)).backward();
    check_same_grads(grads_of(params), plain);
  }
  SECTION("no rows: empty gradients for x, zero ones for the parameters") {
    Tensor x = leaf({0, 5}, float32, 33);
    sum(checkpoint([&](const Tensor& v) { return net(v); }, x, net.params())).backward();
    REQUIRE(x.grad().defined());
    CHECK(x.grad().shape() == Shape{0, 5});
    CHECK(sum(abs(net.w1.grad())).item() == 0);
  }
  SECTION("fn ignoring x: x's gradient is zero") {
    Tensor x = leaf({4, 5}, float32, 34);
    sum(checkpoint([&](const Tensor&) { return tanh(net.b2); }, x, net.params())).backward();
    REQUIRE(x.grad().defined());
    CHECK(max_abs_diff(x.grad(), zeros({4, 5})) == 0);
    CHECK(net.b2.grad().defined());
  }
  CHECK(tape().live() == 0);
}

TEST_CASE("checkpoint: a result that depends on nothing requiring grad has zero gradients, not an error") {
  // x needs no gradient and fn ignores its params: the forward cannot know that, so y requires
  // grad; the backward finds the recomputed result constant and writes nothing.
  tg::Tensor x = tg::randn({3});
  tg::Tensor w = tg::randn({3}).requires_grad_();
  tg::Tensor y = tg::checkpoint([](const tg::Tensor& v) { return v * 2.0; }, x, {w});
  REQUIRE(y.requires_grad());
  REQUIRE_NOTHROW(tg::sum(y).backward());
  CHECK_FALSE(w.grad().defined());
  // x requiring grad, fn ignoring it: x's gradient is zeros.
  tg::Tensor x2 = tg::randn({3}).requires_grad_();
  tg::Tensor z = tg::checkpoint([w](const tg::Tensor&) { return w.detach() * 3.0; }, x2, {w});
  REQUIRE_NOTHROW(tg::sum(z).backward());
  REQUIRE(x2.grad().defined());
  CHECK(x2.grad().to_vector<float>() == std::vector<float>{0.0f, 0.0f, 0.0f});
}

TEST_CASE("checkpoint refuses a result taken from outside the segment, and records op by op in anomaly mode") {
  // An outer activation returned as it is would seed a walk of the wrong tape.
  tg::Tensor a = tg::randn({4}).requires_grad_();
  tg::Tensor outside = a * 2.0;
  tg::Tensor x = tg::randn({4}).requires_grad_();
  tg::Tensor y = tg::checkpoint([outside](const tg::Tensor&) { return outside; }, x, {});
  REQUIRE_TG_ERROR(tg::sum(y).backward(), "checkpoint", "fn's result");
  tg::tape().clear();
  // In anomaly mode the segment's ops are recorded (so a NaN names its op), and the gradients
  // are still those of fn.
  tg::Tensor w = tg::randn({4}).requires_grad_();
  auto fn = [w](const tg::Tensor& v) { return tg::tanh(v * w); };
  tg::Tensor x1 = tg::randn({4}).requires_grad_();
  std::size_t nodes = 0;
  {
    tg::DetectAnomalyGuard anomaly;
    const std::size_t before = tg::tape().size();
    tg::Tensor z = tg::checkpoint(fn, x1, {w});
    nodes = tg::tape().size() - before;
    tg::sum(z).backward();
  }
  CHECK(nodes == 2);  // mul and tanh, no checkpoint node
  tg::Tensor gw = w.grad().clone(), gx = x1.grad().clone();
  w.zero_grad();
  x1.zero_grad();
  tg::sum(fn(x1)).backward();
  CHECK(gw.to_vector<float>() == w.grad().to_vector<float>());
  CHECK(gx.to_vector<float>() == x1.grad().to_vector<float>());
}
