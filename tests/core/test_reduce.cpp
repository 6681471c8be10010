// Reductions: sum, mean, var (correction 0 and 1), max over all axes, one axis, negative axes,
// keepdim, contiguous and non-contiguous axis sets. Values against a plain-loop reference in
// float32 and float64, float64 gradchecks, max's tie rule, and the errors.
#include <algorithm>
#include <limits>
#include <sstream>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {

// Reductions accumulate in double: hold float32 results to 1e-6.
void check_close_tight(const Tensor& y, const std::vector<double>& e, double rtol32 = 1e-6, double atol32 = 1e-6) {
  check_close(y, e, rtol32, atol32);
}

// Pseudo-random values on a 1/64 grid (exact in float32), all distinct enough for max.
std::vector<double> grid_values(std::int64_t n, std::uint64_t seed) {
  Generator g(seed);
  Tensor r = randn({n}, float64, &g);
  std::vector<double> v = r.to_vector<double>();
  for (double& x : v) x = std::round(x * 64) / 64;
  return v;
}

std::vector<bool> reduced_dims(int nd, const std::vector<int>& axes) {
  std::vector<bool> red(static_cast<std::size_t>(nd), axes.empty());
  for (int a : axes) red[static_cast<std::size_t>(a < 0 ? a + nd : a)] = true;
  return red;
}

Shape expected_shape(const Shape& s, const std::vector<int>& axes, bool keepdim) {
  const std::vector<bool> red = reduced_dims(s.ndim(), axes);
  Shape out;
  for (int d = 0; d < s.ndim(); ++d) {
    if (!red[static_cast<std::size_t>(d)]) out.push_back(s[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

enum class Red { Sum, Mean, Var0, Var1, Max };
const char* red_name(Red r) {
  switch (r) {
    case Red::Sum: return "sum";
    case Red::Mean: return "mean";
    case Red::Var0: return "var(correction=0)";
    case Red::Var1: return "var(correction=1)";
    default: return "max";
  }
}
Tensor apply(Red r, const Tensor& x, const std::vector<int>& axes, bool keepdim) {
  switch (r) {
    case Red::Sum: return sum(x, axes, keepdim);
    case Red::Mean: return mean(x, axes, keepdim);
    case Red::Var0: return var(x, axes, keepdim, 0);
    case Red::Var1: return var(x, axes, keepdim, 1);
    default: return max(x, axes, keepdim);
  }
}

// Reference: group the elements by their index over the kept dims, in plain loops, then reduce
// each group in the textbook way.
std::vector<double> ref_reduce(const Shape& s, const std::vector<double>& x, const std::vector<int>& axes, Red r) {
  const std::vector<bool> red = reduced_dims(s.ndim(), axes);
  std::int64_t groups = 1;
  for (int d = 0; d < s.ndim(); ++d)
    if (!red[static_cast<std::size_t>(d)]) groups *= s[d];
  std::vector<std::vector<double>> members(static_cast<std::size_t>(groups));
  for (std::int64_t i = 0; i < s.numel(); ++i) {
    std::int64_t rem = i, g = 0, gstride = 1;
    for (int d = s.ndim() - 1; d >= 0; --d) {
      const std::int64_t id = rem % s[d];
      rem /= s[d];
      if (!red[static_cast<std::size_t>(d)]) {
        g += id * gstride;
        gstride *= s[d];
      }
    }
    members[static_cast<std::size_t>(g)].push_back(x[static_cast<std::size_t>(i)]);
  }
  std::vector<double> out;
  for (const auto& m : members) {
    double total = 0;
    for (double v : m) total += v;
    const double n = static_cast<double>(m.size()), mu = total / n;
    double ss = 0;
    for (double v : m) ss += (v - mu) * (v - mu);
    switch (r) {
      case Red::Sum: out.push_back(total); break;
      case Red::Mean: out.push_back(mu); break;
      case Red::Var0: out.push_back(ss / n); break;
      case Red::Var1: out.push_back(ss / (n - 1)); break;
      case Red::Max: out.push_back(*std::max_element(m.begin(), m.end())); break;
    }
  }
  return out;
}

struct AxesCase {
  const char* what;
  Shape shape;
  std::vector<int> axes;
};
const AxesCase kAxesCases[] = {
    {"all axes (empty list)", {2, 3, 4}, {}},
    {"all axes listed", {2, 3, 4}, {0, 1, 2}},
    {"first axis", {2, 3, 4}, {0}},
    {"middle axis", {2, 3, 4}, {1}},
    {"last axis", {2, 3, 4}, {2}},
    {"negative axis -1", {2, 3, 4}, {-1}},
    {"negative axis -3", {2, 3, 4}, {-3}},
    {"contiguous {1, 2} of a 4-d tensor", {2, 3, 4, 5}, {1, 2}},
    {"contiguous {2, 3} of a 4-d tensor", {2, 3, 4, 5}, {2, 3}},
    {"contiguous, given out of order and negative {-2, 1}", {2, 3, 4, 5}, {-2, 1}},
    {"non-contiguous {0, 2}", {2, 3, 4}, {0, 2}},
    {"non-contiguous {0, 2} of a 4-d tensor", {2, 3, 4, 5}, {0, 2}},
    {"non-contiguous {1, 3} of a 4-d tensor", {2, 3, 4, 5}, {1, 3}},
    {"non-contiguous {3, 0}, reversed", {2, 3, 4, 5}, {3, 0}},
    {"non-contiguous {0, 1, 3}", {2, 3, 4, 5}, {0, 1, 3}},
    {"1-d", {7}, {0}},
    {"size-1 dims, non-contiguous {0, 2}", {2, 1, 3, 1}, {0, 2}},
};
constexpr Red kReds[] = {Red::Sum, Red::Mean, Red::Var0, Red::Var1, Red::Max};

}  // namespace

TEST_CASE("reductions by hand on a 2x3 matrix in float32 and float64") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1, 2, 3, 4, 5, 9}, {2, 3}, dt);
    check_close_tight(sum(x), {24});
    CHECK(sum(x).dim() == 0);
    check_close_tight(sum(x, {0}), {5, 7, 12});
    check_close_tight(sum(x, {1}), {6, 18});
    check_close_tight(sum(x, {-1}), {6, 18});
    check_close_tight(mean(x), {4});
    check_close_tight(mean(x, {0}), {2.5, 3.5, 6});
    check_close_tight(mean(x, {1}), {2, 6});
    check_close_tight(var(x, {1}), {1, 7});                              // correction 1: ss / 2
    check_close_tight(var(x, {1}, false, 0), {2.0 / 3, 14.0 / 3});       // correction 0: ss / 3
    check_close_tight(var(x, {0}), {4.5, 4.5, 18});
    check_close_tight(var(x), {(9 + 4 + 1 + 0 + 1 + 25) / 5.0});
    check_close_tight(var(x, {}, false, 0), {40.0 / 6});
    check_close_tight(max(x), {9});
    check_close_tight(max(x, {0}), {4, 5, 9});
    check_close_tight(max(x, {1}), {3, 9});
    check_close_tight(max(x, {-2}, true), {4, 5, 9});
    CHECK(max(x, {-2}, true).shape() == Shape{1, 3});
    // Tensor methods
    check_close_tight(x.sum({1}), {6, 18});
    check_close_tight(x.mean(), {4});
    CHECK(x.sum({0}, true).shape() == Shape{1, 3});
    // dtype is preserved
    CHECK(sum(x).dtype() == dt);
    CHECK(max(x, {1}).dtype() == dt);
    CHECK(var(x, {1}).dtype() == dt);
  }
}

TEST_CASE("reductions match a plain-loop reference: every axis set, keepdim, both dtypes") {
  std::uint64_t seed = 1;
  for (const AxesCase& c : kAxesCases) {
    const std::vector<double> xv = grid_values(c.shape.numel(), seed++);
    for (Red r : kReds) {
      const std::vector<double> want = ref_reduce(c.shape, xv, c.axes, r);
      for (bool keepdim : {false, true}) {
        for (DType dt : kFloatTypes) {
          INFO(c.what << ": " << red_name(r) << " of " << c.shape << (keepdim ? " keepdim" : "") << " in " << dt);
          Tensor x = tensor(xv, c.shape, dt);
          Tensor y = apply(r, x, c.axes, keepdim);
          CHECK(y.shape() == expected_shape(c.shape, c.axes, keepdim));
          CHECK(y.dtype() == dt);
          check_close_tight(y, want, 1e-5);
        }
      }
    }
  }
}

TEST_CASE("keepdim keeps size-1 dims in place") {
  Tensor x = zeros({2, 3, 4, 5});
  CHECK(sum(x, {1, 2}, true).shape() == Shape{2, 1, 1, 5});
  CHECK(sum(x, {1, 2}, false).shape() == Shape{2, 5});
  CHECK(mean(x, {0, 2}, true).shape() == Shape{1, 3, 1, 5});
  CHECK(mean(x, {0, 2}).shape() == Shape{3, 5});
  CHECK(var(x, {-1}, true).shape() == Shape{2, 3, 4, 1});
  CHECK(max(x, {}, true).shape() == Shape{1, 1, 1, 1});
  CHECK(max(x, {}).shape() == Shape{});
  // A keepdim result broadcasts back against the input.
  Tensor v = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, float64);
  Tensor centred = sub(v, mean(v, {1}, true));
  check_close_tight(centred, {-1, 0, 1, -1, 0, 1});
}

TEST_CASE("reductions gradcheck: every axis set, keepdim true and false") {
  std::uint64_t seed = 500;
  for (const AxesCase& c : kAxesCases) {
    for (Red r : kReds) {
      for (bool keepdim : {false, true}) {
        INFO(c.what << ": " << red_name(r) << " of " << c.shape << (keepdim ? " keepdim" : ""));
        Tensor x = param64(c.shape, seed++);  // continuous values: no ties for max
        const std::vector<int> axes = c.axes;
        require_gradcheck([r, axes, keepdim](const std::vector<Tensor>& in) { return apply(r, in[0], axes, keepdim); }, {x});
      }
    }
  }
}

TEST_CASE("reduction gradients by hand") {
  Tensor x = leaf64({1, 2, 3, 4, 5, 9}, {2, 3});
  sum(x, {0}).backward(tensor({1, 10, 100}, {3}, float64));
  check_close_tight(x.grad(), {1, 10, 100, 1, 10, 100});
  x.zero_grad();
  mean(x, {1}).backward(tensor({3, 6}, {2}, float64));
  check_close_tight(x.grad(), {1, 1, 1, 2, 2, 2});
  x.zero_grad();
  mean(x).backward();
  check_close_tight(x.grad(), std::vector<double>(6, 1.0 / 6));
  x.zero_grad();
  // d var / d x_r = 2 (x_r - mean) / (R - correction); row means 2 and 6
  sum(var(x, {1})).backward();
  check_close_tight(x.grad(), {-1, 0, 1, -2, -1, 3});
  x.zero_grad();
  sum(var(x, {1}, false, 0)).backward();
  check_close_tight(x.grad(), {-2.0 / 3, 0, 2.0 / 3, -4.0 / 3, -2.0 / 3, 2});
  x.zero_grad();
  sum(max(x, {0})).backward();
  check_close_tight(x.grad(), {0, 0, 0, 1, 1, 1});
}

TEST_CASE("max: the gradient is shared evenly between tied maxima") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1, 3, 3, 2, 2, 2, 5, 0, 4}, {3, 3}, dt);
    x.requires_grad_();
    Tensor y = max(x, {1});
    check_close_tight(y, {3, 2, 5});
    sum(y).backward();
    check_close_tight(x.grad(), {0, 0.5, 0.5, 1.0 / 3, 1.0 / 3, 1.0 / 3, 1, 0, 0});
    x.zero_grad();
    // over all axes: one maximum
    max(x).backward();
    check_close_tight(x.grad(), {0, 0, 0, 0, 0, 0, 1, 0, 0});
    x.zero_grad();
    // along axis 0: columns (1,2,5), (3,2,0), (3,2,4) have single maxima at rows 2, 0, 2
    max(x, {0}).backward(tensor({6, 6, 6}, {3}, dt));
    check_close_tight(x.grad(), {0, 6, 0, 0, 0, 0, 6, 0, 6});
    x.zero_grad();
    // through another op: a three-way tie in the row (2,2,2) of a slice
    Tensor m = slice(x, 0, 1, 3);  // rows (2,2,2), (5,0,4)
    max(m, {1}).backward(tensor({1, 1}, {2}, dt));
    check_close_tight(x.grad(), {0, 0, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3, 1, 0, 0});
  }
  // all-equal input over all axes: each element gets 1/n
  Tensor c = leaf64({7, 7, 7, 7}, {2, 2});
  max(c).backward();
  check_close_tight(c.grad(), {0.25, 0.25, 0.25, 0.25});
  // ties across a non-contiguous axis set {0, 2}
  Tensor t = leaf64({1, 4, 2, 0, 4, 3, 2, 1}, {2, 2, 2});  // groups: j=0 -> {1,4,4,3}, j=1 -> {2,0,2,1}
  sum(max(t, {0, 2})).backward();
  check_close_tight(t.grad(), {0, 0.5, 0.5, 0, 0.5, 0, 0.5, 0});
}

TEST_CASE("max handles -inf and propagates NaN") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    check_close_tight(max(tensor({-inf, -inf, -5}, {3}, dt)), {-5});
    check_close_tight(max(tensor({-inf, -inf}, {2}, dt)), {-inf});
    check_close_tight(max(tensor({1, nan, 3, 2, 0, 1}, {2, 3}, dt), {1}), {nan, 2});
    check_close_tight(max(tensor({nan, 1, 3}, {3}, dt)), {nan});
  }
}

TEST_CASE("reductions are accurate: double accumulation and two-pass variance") {
  // 10^6 copies of float(0.1): a float32 running sum would drift by ~1%; the kernel accumulates in double.
  Tensor x = full({1000000}, 0.1, float32);
  const double want = 1e6 * static_cast<double>(0.1f);
  CHECK(std::fabs(sum(x).item() - want) < 0.05);
  CHECK(std::fabs(mean(x).item() - static_cast<double>(0.1f)) < 1e-7);
  // A large offset: E[x^2] - E[x]^2 would lose every digit; the two-pass variance keeps them.
  Tensor off = tensor({1e9 + 1, 1e9 + 2, 1e9 + 3, 1e9 + 4}, {4}, float64);
  CHECK(var(off).item() == Approx(5.0 / 3).epsilon(1e-9));
  CHECK(var(off, {}, false, 0).item() == Approx(1.25).epsilon(1e-9));
  Tensor off32 = tensor({4096 + 0.5, 4096 + 1, 4096 + 1.5, 4096 + 2}, {4}, float32);
  CHECK(var(off32).item() == Approx(5.0 / 12).epsilon(1e-6));
  // constant rows have exactly zero variance
  CHECK(var(full({5}, 3.25, float64)).item() == 0.0);
}

TEST_CASE("reductions of 0-d and empty tensors") {
  Tensor s = tensor({2.5}, Shape{}, float64);
  CHECK(sum(s).item() == 2.5);
  CHECK(sum(s).dim() == 0);
  CHECK(max(s).item() == 2.5);
  CHECK(mean(s).item() == 2.5);
  // a sum over zero elements is 0 (as PyTorch)
  Tensor e = zeros({0, 3}, float64);
  CHECK(sum(e).item() == 0.0);
  Tensor se = sum(e, {0});
  REQUIRE(se.shape() == Shape{3});
  check_close_tight(se, {0, 0, 0});
  CHECK(sum(e, {1}).shape() == Shape{0});
  CHECK(max(e, {1}).shape() == Shape{0});  // nothing to reduce into: no error
}

TEST_CASE("reduction errors name the op, the axis and the shape") {
  Tensor x = zeros({2, 3, 4});
  REQUIRE_TG_ERROR(sum(x, {3}), "sum:", "axis 3", "(2, 3, 4)");
  REQUIRE_TG_ERROR(sum(x, {-4}), "sum:", "axis -4", "(2, 3, 4)");
  REQUIRE_TG_ERROR(mean(x, {5}), "mean:", "axis 5", "(2, 3, 4)");
  REQUIRE_TG_ERROR(var(x, {0, 3}), "var:", "axis 3", "(2, 3, 4)");
  REQUIRE_TG_ERROR(max(x, {-5}), "max:", "axis -5", "(2, 3, 4)");
  REQUIRE_TG_ERROR(x.sum({7}), "sum:", "axis 7");
  // the same axis twice, also through a negative alias
  REQUIRE_TG_ERROR(sum(x, {1, 1}), "sum:", "given twice", "(2, 3, 4)");
  REQUIRE_TG_ERROR(mean(x, {0, -3}), "mean:", "given twice", "(2, 3, 4)");
  REQUIRE_TG_ERROR(max(x, {2, -1}), "max:", "given twice");
  // an axis on a 0-d tensor
  REQUIRE_TG_ERROR(sum(tensor({1}, Shape{}), {0}), "sum:", "axis 0", "0-d");
  // int32 input
  Tensor xi = zeros({2, 3}, int32);
  REQUIRE_TG_ERROR(sum(xi), "sum:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(mean(xi), "mean:", "int32");
  REQUIRE_TG_ERROR(var(xi), "var:", "int32");
  REQUIRE_TG_ERROR(max(xi), "max:", "int32");
  // var needs more elements than the correction
  REQUIRE_TG_ERROR(var(zeros({1, 3}), {0}), "var:", "correction 1", "(1, 3)");
  REQUIRE_TG_ERROR(var(zeros({2, 3}), {0}, false, 2), "var:", "correction 2", "(2, 3)");
  REQUIRE_TG_ERROR(var(zeros({2, 3}), {0}, false, -1), "var:", "correction", "-1");
  // mean / max over zero elements are undefined
  REQUIRE_TG_ERROR(mean(zeros({0, 3}), {0}), "mean:", "zero elements", "(0, 3)");
  REQUIRE_TG_ERROR(max(zeros({0, 3}), {0}), "max:", "zero elements", "(0, 3)");
  REQUIRE_TG_ERROR(max(zeros({0})), "max:", "(0,)");
}

TEST_CASE("large reductions (parallel, several column blocks) match the reference") {
  // I > 256 exercises several column blocks per output row; > 32768 elements the OpenMP path.
  struct Big { Shape shape; std::vector<int> axes; };
  const Big cases[] = {
      {{3, 4, 300}, {1}},      // O = 3, R = 4, I = 300: two blocks of columns
      {{3, 4, 300}, {0, 2}},   // permuted
      {{70, 600}, {0}},        // 42000 elements, I = 600
      {{70, 600}, {1}},
      {{70, 600}, {}},
  };
  std::uint64_t seed = 700;
  for (const Big& c : cases) {
    const std::vector<double> xv = grid_values(c.shape.numel(), seed++);
    for (Red r : kReds) {
      for (DType dt : kFloatTypes) {
        INFO(red_name(r) << " of " << c.shape << " in " << dt);
        Tensor y = apply(r, tensor(xv, c.shape, dt), c.axes, false);
        CHECK(y.shape() == expected_shape(c.shape, c.axes, false));
        check_close_tight(y, ref_reduce(c.shape, xv, c.axes, r), 1e-5);
      }
    }
  }
  // gradients on a multi-block shape, by hand: sum -> 1, mean -> 1/R, max -> one-hot (no ties)
  Tensor x = param64({2, 3, 260}, 800);
  sum(x, {1}).backward(ones({2, 260}, float64));
  for (double g : x.grad().to_vector<double>()) CHECK(g == 1.0);
  x.zero_grad();
  max(x, {1}).backward(ones({2, 260}, float64));
  const std::vector<double> xv = x.to_vector<double>(), gv = x.grad().to_vector<double>();
  int mismatches = 0;
  for (std::size_t o = 0; o < 2; ++o)
    for (std::size_t i = 0; i < 260; ++i) {
      std::size_t best = 0;
      for (std::size_t r = 1; r < 3; ++r)
        if (xv[(o * 3 + r) * 260 + i] > xv[(o * 3 + best) * 260 + i]) best = r;
      for (std::size_t r = 0; r < 3; ++r) mismatches += gv[(o * 3 + r) * 260 + i] != (r == best ? 1.0 : 0.0);
    }
  CHECK(mismatches == 0);
  require_gradcheck([](const std::vector<Tensor>& in) { return var(in[0], {1}); }, {x});
}

TEST_CASE("sum and mean with fewer output blocks than threads split the reduced axis (2 and 3 threads)") {
  // Column sums of a tall matrix (a bias gradient) are one block of output: kernels::sum_forward
  // then gives each thread a share of the rows and adds the per-thread sums in thread order.
  const int before = get_num_threads();
  for (int threads : {2, 3}) {
    set_num_threads(threads);
    for (const AxesCase& c : {AxesCase{"first axis of a tall matrix", {3000, 20}, {0}},
                              AxesCase{"all axes of a long vector", {40000}, {}},
                              AxesCase{"middle axis, two outputs", {2, 2000, 24}, {1}}}) {
      const std::vector<double> xv = grid_values(c.shape.numel(), 77);
      for (Red r : {Red::Sum, Red::Mean})
        for (DType dt : kFloatTypes) {
          INFO(c.what << ": " << red_name(r) << " of " << c.shape << " in " << dt << ", " << threads << " threads");
          Tensor y = apply(r, tensor(xv, c.shape, dt), c.axes, false);
          check_close_tight(y, ref_reduce(c.shape, xv, c.axes, r), 1e-6);
          // the same bits on a second run
          CHECK(max_abs_diff(apply(r, tensor(xv, c.shape, dt), c.axes, false), y) == 0);
        }
    }
  }
  set_num_threads(before);
}
