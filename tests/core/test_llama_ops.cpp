// The LLaMA ops, silu, swiglu, rope and rope_tables: values against their formulas (the far tails
// of SiLU included), float64 gradients against finite differences, the fused ops against their
// composite twins in float32 and float64, RoPE's defining properties (a rotation, relative
// positions), the serial and parallel kernels bit for bit, and the error messages. PyTorch's own
// values are compared in tests/nn/test_torch_parity.cpp.
#include <cmath>
#include <limits>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {

// Finite differences in float64 at a tolerance that a wrong derivative term cannot pass.
GradcheckOptions tight() {
  GradcheckOptions o;
  o.atol = 1e-7;
  o.rtol = 1e-6;
  return o;
}

// A float64 (scale) or float32 leaf of N(0, scale^2) values.
Tensor leaf(const Shape& shape, std::uint64_t seed, DType dtype, double scale = 1.0) {
  Tensor t = param64(shape, seed, scale).detach();
  return to(t, dtype).requires_grad_();
}

// max |a - b| / (1 + max |b|): a difference relative to the size of the values.
double rel_diff(const Tensor& a, const Tensor& b) {
  return max_abs_diff(a, b) / (1.0 + max(abs(b.detach())).item());
}

// fused(x) and composite(x) from the same leaf, with the same upstream gradient: the largest
// relative differences of the outputs and of x's gradients.
struct TwinDiff {
  double value, grad;
};
TwinDiff twin_diff(const std::function<Tensor(const Tensor&)>& fused, const std::function<Tensor(const Tensor&)>& comp,
                   const Tensor& x0, std::uint64_t seed) {
  Tensor x1 = x0.detach().clone().requires_grad_(), x2 = x0.detach().clone().requires_grad_();
  Tensor y1 = fused(x1), y2 = comp(x2);
  REQUIRE(y1.shape() == y2.shape());
  Generator g(seed);
  Tensor dy = to(randn(y1.shape(), float64, &g), x0.dtype());
  y1.backward(dy);
  y2.backward(dy);
  return {rel_diff(y1, y2), rel_diff(x1.grad(), x2.grad())};
}

// Tolerances of the twins: float32 a few ulps of the values' size, float64 near-exact.
double twin_tol(DType d) { return d == float32 ? 2e-6 : 1e-14; }

double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }
double silu_grad_ref(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s * (1.0 + x * (1.0 - s));
}

}  // namespace

// ---- silu ----

TEST_CASE("silu: values against x / (1 + e^-x) in float32 and float64, far tails included") {
  const std::vector<double> xs = {-3e38, -1e30, -1000, -100, -88, -30, -5, -1, -1e-30, 0, 1e-30, 1, 5, 30, 88, 100, 1e30, 3e38};
  for (DType d : kFloatTypes) {
    INFO(d);
    Tensor y = silu(tensor(xs, {static_cast<std::int64_t>(xs.size())}, d));
    std::vector<double> want;
    for (double x : xs) want.push_back(silu_ref(x));
    // float32: fast_exp's 2 ulp, and 0 for e^-88 (below float's smallest normal); float64: 1e-12
    check_close(y, want, 3e-7, 1e-30);
    for (double v : y.to_vector<double>()) CHECK(std::isfinite(v));
  }
  // The two ends exactly: the identity on the right, zero on the left.
  CHECK(silu(tensor({1e30}, {1}, float32)).item() == 1e30f);
  CHECK(silu(tensor({-1e30}, {1}, float64)).item() == 0.0);
}

TEST_CASE("silu: the gradient is finite and right far in both tails") {
  const std::vector<double> xs = {-3e38, -1e30, -1000, -100, -30, -5, 0, 5, 17, 30, 100, 1e30, 3e38};
  for (DType d : kFloatTypes) {
    INFO(d);
    Tensor x = tensor(xs, {static_cast<std::int64_t>(xs.size())}, d).requires_grad_();
    silu(x).backward(ones(x.shape(), d));
    std::vector<double> want;
    for (double v : xs) want.push_back(std::fabs(v) > 700 ? (v > 0 ? 1.0 : 0.0) : silu_grad_ref(v));
    check_close(x.grad(), want, 3e-6, 1e-30);
    for (double v : x.grad().to_vector<double>()) CHECK(std::isfinite(v));
  }
}

TEST_CASE("silu: float64 gradcheck, with one and with two consumers of x") {
  Tensor x = param64({4, 7}, 1, 4.0);
  require_gradcheck([](const std::vector<Tensor>& in) { return silu(in[0]); }, {x}, tight());
  // x reaches two silu nodes: the first writes its gradient, the second adds.
  require_gradcheck([](const std::vector<Tensor>& in) { return silu(in[0]) + silu(in[0]) * 2.0; }, {x}, tight());
  // silu of an intermediate: the gradient may take the upstream gradient's buffer.
  require_gradcheck([](const std::vector<Tensor>& in) { return silu(silu(in[0] * 1.5)); }, {x}, tight());
}

TEST_CASE("silu: fused equals the composite twin x * sigmoid(x)") {
  for (DType d : kFloatTypes) {
    INFO(d);
    const TwinDiff t = twin_diff([](const Tensor& x) { return silu(x); },
                                 [](const Tensor& x) { return composite::silu(x); }, leaf({8, 33}, 2, d, 5.0), 3);
    CHECK(t.value <= twin_tol(d));
    CHECK(t.grad <= twin_tol(d));
  }
}

TEST_CASE("silu: refuses what is not a float tensor, naming the op") {
  REQUIRE_THROWS_WITH(silu(tensor({1, 2}, {2}, int32)), Catch::Contains("silu") && Catch::Contains("int32 (2,)"));
  REQUIRE_THROWS_WITH(silu(Tensor()), Catch::Contains("silu") && Catch::Contains("undefined"));
}

// ---- swiglu ----

TEST_CASE("swiglu: silu(gate) * up over the packed last axis") {
  for (DType d : kFloatTypes) {
    INFO(d);
    // rows of 2F = 6: gate = the first 3 columns, up = the last 3
    const std::vector<double> xs = {-2, 0, 3, 1, -1, 0.5, 40, -40, 1, 2, 3, 4};
    Tensor y = swiglu(tensor(xs, {2, 6}, d));
    REQUIRE(y.shape() == Shape{2, 3});
    std::vector<double> want;
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < 3; ++j) want.push_back(silu_ref(xs[r * 6 + j]) * xs[r * 6 + 3 + j]);
    check_close(y, want, 3e-7, 1e-30);
  }
  CHECK(swiglu(zeros({3, 0})).shape() == Shape{3, 0});
  CHECK(swiglu(zeros({2, 5, 8})).shape() == Shape{2, 5, 4});
}

TEST_CASE("swiglu: float64 gradcheck in 1, 2 and 3 dims, and with x used twice") {
  require_gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, {param64({10}, 4, 3.0)}, tight());
  require_gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, {param64({5, 8}, 5, 3.0)}, tight());
  require_gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, {param64({2, 3, 12}, 6, 3.0)}, tight());
  require_gradcheck([](const std::vector<Tensor>& in) { return swiglu(in[0]) * swiglu(in[0] * -1.0); },
                    {param64({3, 6}, 7, 2.0)}, tight());
}

TEST_CASE("swiglu: fused equals the composite twin silu(gate) * up") {
  for (DType d : kFloatTypes) {
    INFO(d);
    const TwinDiff t = twin_diff([](const Tensor& x) { return swiglu(x); },
                                 [](const Tensor& x) { return composite::swiglu(x); }, leaf({4, 7, 34}, 8, d, 4.0), 9);
    CHECK(t.value <= twin_tol(d));
    CHECK(t.grad <= twin_tol(d));
  }
}

TEST_CASE("swiglu: refuses an odd last dim, a 0-d tensor and int32, naming the op and the shape") {
  REQUIRE_THROWS_WITH(swiglu(zeros({4, 7})), Catch::Contains("swiglu") && Catch::Contains("(4, 7)") &&
                                                 Catch::Contains("must be even"));
  REQUIRE_THROWS_WITH(swiglu(zeros({})), Catch::Contains("swiglu") && Catch::Contains("0-d"));
  REQUIRE_THROWS_WITH(swiglu(tensor({1, 2}, {2}, int32)), Catch::Contains("swiglu") && Catch::Contains("int32"));
  REQUIRE_THROWS_AS(swiglu(zeros({3})), Error);
}

// ---- rope_tables ----

TEST_CASE("rope_tables: shapes, position 0, equal halves, and the angles p theta^(-2j/hs)") {
  for (DType d : kFloatTypes) {
    INFO(d);
    const std::int64_t P = 300, hs = 16;
    const double theta = 10000.0;
    auto [cos, sin] = rope_tables(P, hs, theta, d);
    REQUIRE(cos.shape() == Shape{P, hs});
    REQUIRE(sin.shape() == Shape{P, hs});
    REQUIRE(cos.dtype() == d);
    const std::vector<double> c = cos.to_vector<double>(), s = sin.to_vector<double>();
    double worst = 0;
    for (std::int64_t p = 0; p < P; ++p)
      for (std::int64_t j = 0; j < hs / 2; ++j) {
        const std::size_t at = static_cast<std::size_t>(p * hs + j), mirror = at + hs / 2;
        REQUIRE(c[at] == c[mirror]);
        REQUIRE(s[at] == s[mirror]);
        const double angle = static_cast<double>(p) * std::pow(theta, -2.0 * static_cast<double>(j) / hs);
        // float32 rounds the angle to float32 first: an error of up to p * 2^-24 relative, times its size
        const double tol = d == float64 ? 1e-13 : 1e-7 + angle * 1.2e-7;
        worst = std::max({worst, std::fabs(c[at] - std::cos(angle)) / tol, std::fabs(s[at] - std::sin(angle)) / tol});
      }
    CHECK(worst <= 1.0);
    for (std::int64_t j = 0; j < hs; ++j) {  // position 0: no turn at all
      CHECK(c[static_cast<std::size_t>(j)] == 1.0);
      CHECK(s[static_cast<std::size_t>(j)] == 0.0);
    }
  }
  CHECK(rope_tables(0, 4).first.shape() == Shape{0, 4});
  CHECK(rope_tables(3, 4).first.dtype() == float32);
}

TEST_CASE("rope_tables: refuses an odd or non-positive head size, negative positions, a bad theta or dtype") {
  REQUIRE_THROWS_WITH(rope_tables(8, 5), Catch::Contains("rope_tables") && Catch::Contains("head_size must be even and positive, got 5"));
  REQUIRE_THROWS_WITH(rope_tables(8, 0), Catch::Contains("rope_tables") && Catch::Contains("got 0"));
  REQUIRE_THROWS_WITH(rope_tables(8, -4), Catch::Contains("rope_tables") && Catch::Contains("got -4"));
  REQUIRE_THROWS_WITH(rope_tables(-1, 4), Catch::Contains("rope_tables") && Catch::Contains("max_pos must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(rope_tables(8, 4, 0.0), Catch::Contains("rope_tables") && Catch::Contains("theta"));
  REQUIRE_THROWS_WITH(rope_tables(8, 4, std::numeric_limits<double>::infinity()), Catch::Contains("rope_tables"));
  REQUIRE_THROWS_WITH(rope_tables(8, 4, 1e4, int32),
                      Catch::Contains("rope_tables") && Catch::Contains("dtype must be float32 or float64, got int32"));
}

// ---- rope ----

TEST_CASE("rope: a hand-worked example, hs = 4 at positions 0 and 1") {
  // hs = 4: the pairs (x0, x2) and (x1, x3) turn by p w_0 and p w_1, w_0 = 1, w_1 = 10000^(-1/2) = 0.01.
  const std::vector<double> xs = {1, 2, 3, 4, 1, 2, 3, 4};
  auto [cos, sin] = rope_tables(2, 4, 10000.0, float64);
  Tensor y = rope(tensor(xs, {2, 4}, float64), cos, sin, 4);
  const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.01), s1 = std::sin(0.01);
  check_close(y, {1, 2, 3, 4, 1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1});
  // The same rows as positions 5 and 6 of a longer table: pos0 shifts the table, not the rows.
  auto [cos8, sin8] = rope_tables(8, 4, 10000.0, float64);
  Tensor y56 = rope(tensor(xs, {2, 4}, float64), cos8, sin8, 4, -1, 5);
  const double c5 = std::cos(5.0), s5 = std::sin(5.0);
  CHECK(y56.at({0, 0}) == Approx(1 * c5 - 3 * s5).epsilon(1e-14));
  CHECK(y56.at({0, 2}) == Approx(3 * c5 + 1 * s5).epsilon(1e-14));
}

TEST_CASE("rope: a rotation, and q . k depends on the positions through p - p' alone") {
  const std::int64_t hs = 8;
  auto [cos, sin] = rope_tables(20, hs, 10000.0, float64);
  Tensor q = param64({1, hs}, 20).detach(), k = param64({1, hs}, 21).detach();
  auto at = [&](const Tensor& v, std::int64_t p) { return rope(v, cos, sin, hs, -1, p); };
  auto dot = [](const Tensor& a, const Tensor& b) { return sum(a * b).item(); };
  const double d3 = dot(at(q, 5), at(k, 2));
  CHECK(dot(at(q, 3), at(k, 0)) == Approx(d3).epsilon(1e-13));
  CHECK(dot(at(q, 17), at(k, 14)) == Approx(d3).epsilon(1e-13));
  CHECK(std::fabs(dot(at(q, 5), at(k, 1)) - d3) > 1e-3);  // another distance, another product
  // Each pair keeps its length: (x_j, x_{j + hs/2}) turns about the origin.
  Tensor y = at(q, 11);
  for (std::int64_t j = 0; j < hs / 2; ++j) {
    const double before = std::hypot(q.at({0, j}), q.at({0, j + hs / 2}));
    CHECK(std::hypot(y.at({0, j}), y.at({0, j + hs / 2})) == Approx(before).epsilon(1e-14));
  }
}

TEST_CASE("rope: columns past `rotated` are copied, and their gradient is dy") {
  // A packed qkv (B, T, 3C), C = 2 heads of 4: q and k turn, v passes through.
  const std::int64_t B = 2, T = 3, C = 8, hs = 4;
  auto [cos, sin] = rope_tables(10, hs, 10000.0, float64);
  Tensor x = param64({B, T, 3 * C}, 30);
  Tensor y = rope(x, cos, sin, hs, 2 * C, 4);
  CHECK(max_abs_diff(slice(y.detach(), 2, 2 * C, 3 * C), slice(x.detach(), 2, 2 * C, 3 * C)) == 0.0);
  CHECK(max_abs_diff(slice(y.detach(), 2, 0, 2 * C), slice(x.detach(), 2, 0, 2 * C)) > 0.1);
  Tensor dy = param64({B, T, 3 * C}, 31).detach();
  y.backward(dy);
  CHECK(max_abs_diff(slice(x.grad(), 2, 2 * C, 3 * C), slice(dy, 2, 2 * C, 3 * C)) == 0.0);
  // rotated = 0 turns nothing: y is x and dx is dy.
  Tensor x0 = param64({T, C}, 32);
  Tensor y0 = rope(x0, cos, sin, hs, 0, 2);
  CHECK(max_abs_diff(y0, x0.detach()) == 0.0);
}

TEST_CASE("rope: float64 gradcheck, all columns, packed qkv with pos0 > 0, (T, D), an odd half, x used twice") {
  auto [c8, s8] = rope_tables(12, 8, 10000.0, float64);
  require_gradcheck([&](const std::vector<Tensor>& in) { return rope(in[0], c8, s8, 8); }, {param64({2, 5, 16}, 40)},
                    tight());
  auto [c4, s4] = rope_tables(10, 4, 10000.0, float64);
  // qkv (2, 4, 3C), C = 8: q and k (16 columns) turn at positions 3..6, v passes through
  require_gradcheck([&](const std::vector<Tensor>& in) { return rope(in[0], c4, s4, 4, 16, 3); },
                    {param64({2, 4, 24}, 41)}, tight());
  auto [c6, s6] = rope_tables(9, 6, 500000.0, float64);
  require_gradcheck([&](const std::vector<Tensor>& in) { return rope(in[0], c6, s6, 6, -1, 2); },
                    {param64({6, 12}, 42)}, tight());
  require_gradcheck([&](const std::vector<Tensor>& in) { return rope(in[0], c4, s4, 4, 8, 1) * rope(in[0], c4, s4, 4, -1, 5); },
                    {param64({1, 3, 12}, 43)}, tight());
}

TEST_CASE("rope: tables that require grad are constants: x's gradient is the same, and none reaches them") {
  auto [cos, sin] = rope_tables(6, 4, 10000.0, float64);
  Tensor cg = cos.clone().requires_grad_(), sg = sin.clone().requires_grad_();
  Tensor x1 = param64({2, 3, 8}, 50), x2 = x1.detach().clone().requires_grad_();
  Tensor dy = param64({2, 3, 8}, 51).detach();
  rope(x1, cos, sin, 4, -1, 2).backward(dy);
  rope(x2, cg, sg, 4, -1, 2).backward(dy);
  CHECK(max_abs_diff(x1.grad(), x2.grad()) == 0.0);
  CHECK_FALSE(cg.grad().defined());
  CHECK_FALSE(sg.grad().defined());
}

TEST_CASE("rope: fused equals the composite twin q * cos + rotate_half(q) * sin") {
  struct Config {
    Shape shape;
    std::int64_t hs, rotated, pos0;
  };
  const Config configs[] = {{{2, 5, 16}, 8, -1, 0}, {{2, 4, 24}, 4, 16, 3}, {{7, 12}, 6, 6, 2},
                            {{1, 3, 32}, 16, 32, 9}, {{3, 2, 8}, 4, 0, 1}};
  std::uint64_t seed = 60;
  for (DType d : kFloatTypes)
    for (const Config& c : configs) {
      INFO(d << " x " << c.shape << " hs " << c.hs << " rotated " << c.rotated << " pos0 " << c.pos0);
      auto [cos, sin] = rope_tables(c.pos0 + c.shape[c.shape.ndim() - 2] + 2, c.hs, 10000.0, d);
      const TwinDiff t = twin_diff([&](const Tensor& x) { return rope(x, cos, sin, c.hs, c.rotated, c.pos0); },
                                   [&](const Tensor& x) { return composite::rope(x, cos, sin, c.hs, c.rotated, c.pos0); },
                                   leaf(c.shape, seed, d, 2.0), seed + 1);
      seed += 2;
      CHECK(t.value <= twin_tol(d));
      CHECK(t.grad <= twin_tol(d));
    }
}

// The message starts with "rope: " and contains both fragments. (A macro: a Catch matcher made of
// && holds its parts by reference, so it cannot be returned from a function.)
#define REQUIRE_ROPE_ERROR(expr, a, b) \
  REQUIRE_THROWS_WITH(expr, Catch::StartsWith("rope: ") && Catch::Contains(a) && Catch::Contains(b))

TEST_CASE("rope: refuses bad shapes, head sizes, rotated, pos0 and tables, naming the op and the shapes") {
  auto [cos, sin] = rope_tables(8, 4, 10000.0, float32);
  const Tensor x = zeros({2, 5, 12});
  REQUIRE_ROPE_ERROR(rope(zeros({12}), cos, sin, 4), "(B, T, D) or (T, D)", "(12,)");
  REQUIRE_ROPE_ERROR(rope(zeros({1, 2, 5, 12}), cos, sin, 4), "(B, T, D) or (T, D)", "(1, 2, 5, 12)");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 3), "head_size must be even and positive", "got 3");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 0), "head_size must be even and positive", "got 0");
  REQUIRE_ROPE_ERROR(rope(zeros({2, 5, 10}), cos, sin, 4), "(2, 5, 10)", "not a multiple of head_size 4");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, 6), "rotated must be", "got 6 for x (2, 5, 12)");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, 16), "rotated must be", "in [0, 12], got 16");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, -2), "rotated must be", "got -2");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, -1, -1), "pos0 must be >= 0", "got -1");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, -1, std::numeric_limits<std::int64_t>::max()), "hold 8 positions",
                     "from pos0 9223372036854775807");
  REQUIRE_ROPE_ERROR(rope(x, cos, sin, 4, -1, 4), "the tables (8, 4) hold 8 positions",
                     "but x (2, 5, 12) needs 5 positions from pos0 4");
  auto [c8, s8] = rope_tables(8, 8, 10000.0, float32);
  REQUIRE_ROPE_ERROR(rope(x, c8, s8, 4), "must both be (P, head_size 4)", "cos (8, 8)");
  REQUIRE_ROPE_ERROR(rope(x, cos, slice(sin, 0, 0, 6), 4), "must both be (P, head_size 4)", "sin (6, 4)");
  REQUIRE_ROPE_ERROR(rope(x, to(cos, float64), sin, 4), "x's dtype", "cos float64 (8, 4)");
  REQUIRE_ROPE_ERROR(rope(x, Tensor(), sin, 4), "cos", "undefined");
  REQUIRE_ROPE_ERROR(rope(zeros({2, 5, 12}, int32), cos, sin, 4), "float32 or float64", "int32 (2, 5, 12)");
  REQUIRE_THROWS_AS(rope(x, cos, sin, 4, 5), Error);
}

// ---- threads ----

TEST_CASE("silu, swiglu and rope: one thread and the pool give the same bits, forward and backward") {
  // Large enough for the kernels' parallel loops (kernels/parallel.h): every row is computed the
  // same way on any thread, so the results are identical.
  const int threads = get_num_threads();
  auto [cos, sin] = rope_tables(80, 16, 10000.0, float32);
  const Tensor x = leaf({4, 64, 384}, 70, float32, 3.0), dy = leaf({4, 64, 384}, 71, float32);
  const std::function<Tensor(const Tensor&)> ops[] = {
      [](const Tensor& v) { return silu(v); }, [](const Tensor& v) { return swiglu(v); },
      [&](const Tensor& v) { return rope(v, cos, sin, 16, 256, 7); }};
  for (const auto& op : ops) {
    Tensor y[2], dx[2];
    for (int run = 0; run < 2; ++run) {
      set_num_threads(run == 0 ? 1 : std::max(threads, 2));
      Tensor xi = x.detach().clone().requires_grad_();
      y[run] = op(xi);
      y[run].backward(slice(dy.detach(), 2, 0, y[run].size(-1)).reshape(y[run].shape()));
      dx[run] = xi.grad();
    }
    set_num_threads(threads);
    CHECK(max_abs_diff(y[0], y[1]) == 0.0);
    CHECK(max_abs_diff(dx[0], dx[1]) == 0.0);
  }
}
