// The fused norms (core/ops/norms.cpp) against their composite twins (forward and every gradient,
// 1e-12 in float64), against finite differences, and in float32 on badly centred data.
// The kernels against their reference loops: test_norm_kernels.cpp.
#include <cmath>

#include "helpers.h"  // tests/helpers.h: param64(shape, seed, scale, shift) = a float64 leaf, scale * N(0,1) + shift

using namespace tg;
using namespace tgtest;

namespace {

using NormFn = std::function<Tensor(const Tensor& x, const Tensor& w, const Tensor& b)>;

// |a - b| <= 1e-12, relative to the size of the values when they exceed 1 (pRMSNorm with k = 1
// divides by |a_0|, which random data sometimes makes small, and its gradients large).
bool close12(const Tensor& a, const Tensor& b) {
  const double scale = std::max(1.0, max(abs(b.detach())).item());
  return max_abs_diff(a, b) <= 1e-12 * scale;
}

// Runs fused and composite on the same inputs with the same upstream gradient and compares the
// outputs and the gradients of x, w and b.
void require_twins(const NormFn& fused, const NormFn& comp, const Shape& xs, std::int64_t C, bool use_w, bool use_b,
                   std::uint64_t seed) {
  INFO("x " << xs << " C=" << C << " weight=" << use_w << " bias=" << use_b);
  Tensor x1 = param64(xs, seed, 2.0, 0.5), x2 = x1.detach().clone().requires_grad_();
  Tensor w1 = use_w ? param64({C}, seed + 1, 0.5, 1.0) : Tensor();
  Tensor b1 = use_b ? param64({C}, seed + 2) : Tensor();
  Tensor w2 = use_w ? w1.detach().clone().requires_grad_() : Tensor();
  Tensor b2 = use_b ? b1.detach().clone().requires_grad_() : Tensor();
  Tensor y1 = fused(x1, w1, b1), y2 = comp(x2, w2, b2);
  CHECK(close12(y1, y2));
  Generator g(seed + 3);
  Tensor dy = randn(y1.shape(), float64, &g);
  y1.backward(dy);
  y2.backward(dy);
  CHECK(close12(x1.grad(), x2.grad()));
  if (use_w) CHECK(close12(w1.grad(), w2.grad()));
  if (use_b) CHECK(close12(b1.grad(), b2.grad()));
}

const std::vector<std::pair<Shape, std::int64_t>> kRowShapes = {
    {{4, 6}, 6}, {{2, 3, 5}, 5}, {{3, 1}, 1}, {{1, 7}, 7}, {{1, 1, 9}, 9}, {{5, 16}, 16}};

}  // namespace

TEST_CASE("fused LayerNorm equals its composite twin, forward and backward") {
  std::uint64_t seed = 10;
  for (auto& [xs, C] : kRowShapes)
    for (bool w : {true, false})
      for (bool b : {true, false})
        require_twins([](auto& x, auto& w, auto& b) { return layer_norm(x, w, b, 1e-5); },
                      [](auto& x, auto& w, auto& b) { return composite::layer_norm(x, w, b, 1e-5); }, xs, C, w, b, seed++);
}

TEST_CASE("fused RMSNorm and pRMSNorm equal their composite twin") {
  std::uint64_t seed = 100;
  for (double p : {1.0, 0.5, 0.25, 0.0625, 0.3})
    for (auto& [xs, C] : kRowShapes)
      for (bool b : {false, true})
        require_twins([p](auto& x, auto& w, auto& bb) { return rms_norm(x, w, bb, 1e-5, p); },
                      [p](auto& x, auto& w, auto& bb) { return composite::rms_norm(x, w, bb, 1e-5, p); }, xs, C, true, b,
                      seed++);
  // no gain at all
  require_twins([](auto& x, auto&, auto&) { return rms_norm(x, Tensor(), Tensor(), 1e-5, 0.5); },
                [](auto& x, auto&, auto&) { return composite::rms_norm(x, Tensor(), Tensor(), 1e-5, 0.5); }, {3, 8}, 8,
                false, false, 7);
}

TEST_CASE("RMSNorm's parameter sums over many rows: blocks of 16 rows, split across threads") {
  // Unlike norms.h's loops (all in double), norms_fast.h sums dg and db over blocks of 16 rows in T,
  // then the blocks into per-thread double partials: row counts with a partial last block, below and
  // above the size at which the rows are split across threads (32768 elements), at 1, 2, 3 threads.
  const int before = get_num_threads();
  std::uint64_t seed = 500;
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    INFO("threads " << threads);
    for (auto [rows, C] : std::vector<std::pair<std::int64_t, std::int64_t>>{{16, 8}, {37, 24}, {300, 128}, {517, 70}})
      for (double p : {1.0, 0.25})
        require_twins([p](auto& x, auto& w, auto& b) { return rms_norm(x, w, b, 1e-5, p); },
                      [p](auto& x, auto& w, auto& b) { return composite::rms_norm(x, w, b, 1e-5, p); }, {rows, C}, C,
                      true, true, seed++);
  }
  // float32: the gain's gradient over 4096 rows stays within float32 accuracy of the float64 one.
  set_num_threads(2);
  Tensor x64 = param64({4096, 48}, 9, 1.0, 0.0), g64 = param64({48}, 10, 0.5, 1.0);
  Generator gen(11);
  Tensor dy64 = randn({4096, 48}, float64, &gen);
  rms_norm(x64, g64, Tensor(), 1e-5, 1.0).backward(dy64);
  Tensor x32 = x64.detach().to(float32).requires_grad_(), g32 = g64.detach().to(float32).requires_grad_();
  rms_norm(x32, g32, Tensor(), 1e-5, 1.0).backward(dy64.to(float32));
  const double scale = max(abs(g64.grad())).item();
  CHECK(max_abs_diff(g32.grad().to(float64), g64.grad()) <= 2e-6 * scale);
  CHECK(max_abs_diff(x32.grad().to(float64), x64.grad()) <= 1e-5 * max(abs(x64.grad())).item());
  set_num_threads(before);
}

TEST_CASE("a tensor used twice gets the sum of both paths' gradients: y = rms_norm(x, g) + x") {
  // rms_norm's node and add's node each pass a gradient for x; the tape adds them (pass_grad).
  Tensor x1 = param64({3, 5}, 30, 2.0, 0.5), g1 = param64({5}, 31, 0.5, 1.0), dy = param64({3, 5}, 32).detach();
  Tensor x2 = x1.detach().clone().requires_grad_(), g2 = g1.detach().clone().requires_grad_();
  (rms_norm(x1, g1, Tensor(), 1e-5) + x1).backward(dy);
  (composite::rms_norm(x2, g2, Tensor(), 1e-5) + x2).backward(dy);
  CHECK(close12(x1.grad(), x2.grad()));
  CHECK(close12(g1.grad(), g2.grad()));
  Tensor x3 = x1.detach().clone().requires_grad_();  // the norm's path alone: x's gradient lacks dy
  rms_norm(x3, g1.detach(), Tensor(), 1e-5).backward(dy);
  CHECK(close12(x1.grad(), x3.grad() + dy));
  require_gradcheck([](auto& in) { return rms_norm(in[0], in[1], Tensor(), 1e-5) + in[0]; },
                    {param64({3, 5}, 33), param64({5}, 34)});
}

TEST_CASE("fused BatchNorm equals its composite twin in training and eval") {
  std::uint64_t seed = 200;
  for (bool training : {true, false})
    for (auto [xs, C, cl] : {std::tuple<Shape, std::int64_t, bool>{{6, 4}, 4, false},
                             {{3, 4, 5}, 4, false},
                             {{2, 5, 3}, 3, true},
                             {{2, 1}, 1, false},
                             {{2, 3, 7}, 7, true}}) {
      Generator g(seed);
      Tensor rm = randn({C}, float64, &g), rv = add(rand({C}, float64, &g), 0.5);
      Tensor rm2 = rm.clone(), rv2 = rv.clone();
      require_twins(
          [=](auto& x, auto& w, auto& b) { return batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5, cl); },
          [=](auto& x, auto& w, auto& b) { return composite::batch_norm(x, rm2, rv2, w, b, training, 1e-5, cl); }, xs, C,
          true, true, seed++);
    }
}

TEST_CASE("fused WeightNorm equals its composite twin") {
  Tensor v1 = param64({5, 3}, 1), g1 = param64({5}, 2, 0.5, 1.0);
  Tensor v2 = v1.detach().clone().requires_grad_(), g2 = g1.detach().clone().requires_grad_();
  Tensor w1 = weight_norm(v1, g1), w2 = composite::weight_norm(v2, g2);
  CHECK(max_abs_diff(w1, w2) < 1e-12);
  Tensor dy = param64({5, 3}, 3).detach();
  w1.backward(dy);
  w2.backward(dy);
  CHECK(max_abs_diff(v1.grad(), v2.grad()) < 1e-12);
  CHECK(max_abs_diff(g1.grad(), g2.grad()) < 1e-12);
}

TEST_CASE("float64 gradcheck of every fused norm for input and parameters") {
  require_gradcheck([](auto& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
                    {param64({3, 5}, 1), param64({5}, 2), param64({5}, 3)});
  for (double p : {1.0, 0.4, 0.1})
    require_gradcheck([p](auto& in) { return rms_norm(in[0], in[1], in[2], 1e-5, p); },
                      {param64({3, 6}, 4), param64({6}, 5), param64({6}, 6)});
  for (bool training : {true, false}) {
    Tensor rm = zeros({4}, float64), rv = ones({4}, float64);
    // momentum 0 keeps the running stats fixed across gradcheck's many forward passes
    require_gradcheck([=](auto& in) { return batch_norm(in[0], rm, rv, in[1], in[2], training, 0.0, 1e-5); },
                      {param64({5, 4}, 7), param64({4}, 8), param64({4}, 9)});
    require_gradcheck([=](auto& in) { return batch_norm(in[0], rm, rv, in[1], in[2], training, 0.0, 1e-5, true); },
                      {param64({2, 3, 4}, 10), param64({4}, 11), param64({4}, 12)});
  }
  require_gradcheck([](auto& in) { return weight_norm(in[0], in[1]); }, {param64({4, 3}, 13), param64({4}, 14)});
}

TEST_CASE("float32 LayerNorm and BatchNorm stay accurate on data with mean 1e4 and std 1") {
  // A one-pass E[x^2] - E[x]^2 variance would lose every significant digit here (1e8 - 1e8).
  Tensor x64 = param64({64, 32}, 42, 1.0, 1e4).detach();
  Tensor x32 = x64.to(float32);
  Tensor ln64 = layer_norm(x64, Tensor(), Tensor(), 1e-5), ln32 = layer_norm(x32, Tensor(), Tensor(), 1e-5);
  CHECK(max_abs_diff(ln32.to(float64), ln64) < 1e-2);
  Tensor bn64 = batch_norm(x64, Tensor(), Tensor(), Tensor(), Tensor(), true);
  Tensor bn32 = batch_norm(x32, Tensor(), Tensor(), Tensor(), Tensor(), true);
  CHECK(max_abs_diff(bn32.to(float64), bn64) < 1e-2);
  // A row of subnormals with eps = 0: 1/std (2e40) is beyond float32, the normalised row is not.
  Tensor sub = zeros({1, 2}, float32);
  sub.set({0, 0}, -1e-40);
  Tensor lsub = layer_norm(sub, Tensor(), Tensor(), 0.0);
  CHECK(std::fabs(lsub.at({0, 0}) + 1.0) < 1e-3);
  CHECK(std::fabs(lsub.at({0, 1}) - 1.0) < 1e-3);
  // and the gradients
  Tensor a = x32.clone().requires_grad_(), b = x64.clone().requires_grad_();
  Tensor dy = param64({64, 32}, 43).detach();
  layer_norm(a, Tensor(), Tensor(), 1e-5).backward(dy.to(float32));
  layer_norm(b, Tensor(), Tensor(), 1e-5).backward(dy);
  CHECK(max_abs_diff(a.grad().to(float64), b.grad()) < 1e-2);
  // On the very same (float32-representable) input, the float32 gradient matches float64 to float32
  // rounding: the saved mean is kept in double (rounded to float32 it would cost ~5e-4 here).
  Tensor c = x32.to(float64).requires_grad_();
  layer_norm(c, Tensor(), Tensor(), 1e-5).backward(dy);
  CHECK(max_abs_diff(a.grad().to(float64), c.grad()) < 2e-5);
}

TEST_CASE("RMSNorm output has L2 norm sqrt(n) and is invariant to re-scaling the input") {
  Tensor x = param64({4, 10}, 3).detach();
  Tensor y = rms_norm(x, Tensor(), Tensor(), 0.0);
  Tensor norms = sqrt(sum(y * y, {-1}));
  for (int r = 0; r < 4; ++r) CHECK(norms.at({r}) == Approx(std::sqrt(10.0)).epsilon(1e-12));
  CHECK(max_abs_diff(rms_norm(x * 7.5, Tensor(), Tensor(), 0.0), y) < 1e-12);
  // and is not invariant to re-centering (LayerNorm is)
  CHECK(max_abs_diff(rms_norm(x + 3.0, Tensor(), Tensor(), 0.0), y) > 1e-2);
  Tensor l = layer_norm(x, Tensor(), Tensor(), 0.0);
  CHECK(max_abs_diff(layer_norm(x + 3.0, Tensor(), Tensor(), 0.0), l) < 1e-12);
}

TEST_CASE("norm argument errors name the op and the shapes") {
  Tensor x = zeros({2, 4});
  REQUIRE_TG_ERROR(layer_norm(x, zeros({3}), Tensor()), "layer_norm", "weight", "(3,)", "(2, 4)");
  REQUIRE_TG_ERROR(layer_norm(x, zeros({4}, float64), Tensor()), "layer_norm", "float64");
  REQUIRE_TG_ERROR(layer_norm(x, Tensor(), Tensor(), -1.0), "layer_norm", "eps");
  REQUIRE_TG_ERROR(rms_norm(x, Tensor(), Tensor(), 1e-5, 0.0), "rms_norm", "p must be in (0, 1]");
  REQUIRE_TG_ERROR(rms_norm(x, Tensor(), Tensor(), 1e-5, 1.5), "rms_norm", "p must be in (0, 1]");
  REQUIRE_TG_ERROR(rms_norm(zeros({2, 4}, int32), Tensor(), Tensor()), "rms_norm", "int32");
  REQUIRE_TG_ERROR(batch_norm(zeros({1, 4}), Tensor(), Tensor(), Tensor(), Tensor(), true), "batch_norm", "more than 1 value");
  REQUIRE_TG_ERROR(batch_norm(zeros({2, 3, 4, 5}), Tensor(), Tensor(), Tensor(), Tensor(), true), "batch_norm", "(2, 3, 4, 5)");
  REQUIRE_TG_ERROR(batch_norm(x, zeros({4}), Tensor(), Tensor(), Tensor(), true), "batch_norm", "together");
  REQUIRE_TG_ERROR(weight_norm(zeros({3, 2}), zeros({2})), "weight_norm", "(3,)");
}

