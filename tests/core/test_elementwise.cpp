// Elementwise ops: add/sub/mul/div with NumPy broadcasting, their scalar forms and operators, and
// the unary ops. Forward values against std:: math in float32 and float64, float64 gradchecks
// (broadcasting cases included), and the errors.
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <sstream>
#include <string>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {

// Deterministic test values, all exactly representable in float32.
std::vector<double> ramp(std::int64_t n, double start, double step) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = start + step * static_cast<double>(i);
  return v;
}

// Reference NumPy broadcasting written as plain index arithmetic (independent of the library's
// stride plan): out[idx] = f(a[idx restricted to a], b[idx restricted to b]).
std::vector<double> ref_broadcast(const Shape& sa, const std::vector<double>& a, const Shape& sb,
                                  const std::vector<double>& b, const Shape& out,
                                  const std::function<double(double, double)>& f) {
  auto flat_in = [&](const Shape& s, const std::vector<std::int64_t>& idx) {
    const int off = out.ndim() - s.ndim();
    std::int64_t flat = 0;
    for (int k = 0; k < s.ndim(); ++k) flat = flat * s[k] + (s[k] == 1 ? 0 : idx[static_cast<std::size_t>(k + off)]);
    return static_cast<std::size_t>(flat);
  };
  std::vector<double> y;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(out.ndim()), 0);
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    std::int64_t rem = i;
    for (int d = out.ndim() - 1; d >= 0; --d) {
      idx[static_cast<std::size_t>(d)] = rem % out[d];
      rem /= out[d];
    }
    y.push_back(f(a[flat_in(sa, idx)], b[flat_in(sb, idx)]));
  }
  return y;
}

struct BinaryOp {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  double (*ref)(double, double);
};
const BinaryOp kBinaryOps[] = {
    {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }, [](double a, double b) { return a + b; }},
    {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }, [](double a, double b) { return a - b; }},
    {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, [](double a, double b) { return a * b; }},
    {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }, [](double a, double b) { return a / b; }},
};

struct BroadcastCase {
  const char* what;
  Shape a, b, out;
};
const BroadcastCase kBroadcastCases[] = {
    {"same shape", {2, 3}, {2, 3}, {2, 3}},
    {"(1,) operand", {2, 3}, {1}, {2, 3}},
    {"0-d operand", {2, 3}, {}, {2, 3}},
    {"(B,T,C) + (C,)", {2, 3, 4}, {4}, {2, 3, 4}},
    {"(B,T,C) + (T,C)", {2, 3, 4}, {3, 4}, {2, 3, 4}},
    {"(3,1) + (1,4): both sides broadcast", {3, 1}, {1, 4}, {3, 4}},
    {"(2,1,4) + (3,1): both sides, different ranks", {2, 1, 4}, {3, 1}, {2, 3, 4}},
    {"left operand broadcast: (C,) + (B,T,C)", {4}, {2, 3, 4}, {2, 3, 4}},
    {"left operand broadcast: (T,1) + (B,T,C)", {3, 1}, {2, 3, 4}, {2, 3, 4}},
    {"left operand 0-d", {}, {2, 3}, {2, 3}},
    {"left operand (1,)", {1}, {3, 2}, {3, 2}},
    {"0-d and (1,)", {}, {1}, {1}},
    {"0-d and 0-d", {}, {}, {}},
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Binary tensor-tensor ops
// ---------------------------------------------------------------------------------------------

TEST_CASE("add, sub, mul, div: same-shape values by hand in float32 and float64") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor a = tensor({1, -2, 3.5, 0.25, 8, -6}, {2, 3}, dt);
    Tensor b = tensor({2, 4, -0.5, 0.5, -4, 3}, {2, 3}, dt);
    Tensor y = add(a, b);
    CHECK(y.shape() == Shape{2, 3});
    CHECK(y.dtype() == dt);
    check_close(y, {3, 2, 3, 0.75, 4, -3});
    check_close(sub(a, b), {-1, -6, 4, -0.25, 12, -9});
    check_close(mul(a, b), {2, -8, -1.75, 0.125, -32, -18});
    check_close(div(a, b), {0.5, -0.5, -7, 0.5, -2, -2});
    // The operators are the same functions.
    check_close(a + b, {3, 2, 3, 0.75, 4, -3});
    check_close(a - b, {-1, -6, 4, -0.25, 12, -9});
    check_close(a * b, {2, -8, -1.75, 0.125, -32, -18});
    check_close(a / b, {0.5, -0.5, -7, 0.5, -2, -2});
    // Division by zero follows IEEE (as PyTorch): +-inf and NaN, no error.
    Tensor z = tensor({1, -1, 0}, {3}, dt);
    check_close(div(z, zeros({3}, dt)), {std::numeric_limits<double>::infinity(),
                                          -std::numeric_limits<double>::infinity(),
                                          std::numeric_limits<double>::quiet_NaN()});
  }
}

TEST_CASE("binary ops broadcast like NumPy (values against a reference loop)") {
  for (const BroadcastCase& c : kBroadcastCases) {
    for (const BinaryOp& op : kBinaryOps) {
      for (DType dt : kFloatTypes) {
        INFO(c.what << ": " << op.name << " " << c.a << " with " << c.b << " in " << dt);
        // Values avoid 0 in the divisor; quarter steps are exact in float32.
        const std::vector<double> va = ramp(c.a.numel(), -1.25, 0.5);
        const std::vector<double> vb = ramp(c.b.numel(), 0.75, 0.25);
        Tensor a = tensor(va, c.a, dt), b = tensor(vb, c.b, dt);
        Tensor y = op.op(a, b);
        CHECK(y.shape() == c.out);
        CHECK(y.dtype() == dt);
        check_close(y, ref_broadcast(c.a, va, c.b, vb, c.out, op.ref));
      }
    }
  }
}

TEST_CASE("broadcast (3,1) + (1,4) and (2,3) * (3,) by hand") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor col = tensor({0, 10, 20}, {3, 1}, dt);
    Tensor row = tensor({1, 2, 3, 4}, {1, 4}, dt);
    Tensor y = add(col, row);
    REQUIRE(y.shape() == Shape{3, 4});
    check_close(y, {1, 2, 3, 4, 11, 12, 13, 14, 21, 22, 23, 24});
    Tensor y2 = sub(row, col);  // broadcasting on the left operand as well
    REQUIRE(y2.shape() == Shape{3, 4});
    check_close(y2, {1, 2, 3, 4, -9, -8, -7, -6, -19, -18, -17, -16});

    Tensor m = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, dt);
    Tensor v = tensor({10, 100, 1000}, {3}, dt);
    check_close(mul(m, v), {10, 200, 3000, 40, 500, 6000});
    check_close(div(v, m), {10, 50, 1000.0 / 3, 2.5, 20, 1000.0 / 6});
    Tensor s = tensor({2}, Shape{}, dt);  // 0-d
    check_close(mul(s, m), {2, 4, 6, 8, 10, 12});
    Tensor s1 = tensor({2}, Shape{1}, dt);  // (1,)
    check_close(sub(m, s1), {-1, 0, 1, 2, 3, 4});
  }
}

TEST_CASE("binary ops gradcheck: same shape and every broadcasting case, both operands") {
  std::uint64_t seed = 100;
  for (const BroadcastCase& c : kBroadcastCases) {
    for (const BinaryOp& op : kBinaryOps) {
      INFO(c.what << ": " << op.name << " " << c.a << " with " << c.b);
      Tensor a = param64(c.a, seed++);
      // The divisor stays well away from 0: N(0,1) * 0.3 + 2.
      Tensor b = param64(c.b, seed++, 0.3, 2.0);
      auto f = op.op;
      require_gradcheck([f](const std::vector<Tensor>& in) { return f(in[0], in[1]); }, {a, b});
    }
  }
}

TEST_CASE("binary ops gradcheck with one constant operand") {
  Tensor a = param64({2, 3, 4}, 1, 0.3, 2.0);  // away from 0: it is also used as the divisor
  Tensor b = tensor({0.5, -1.5, 2, 3}, {4}, float64);  // constant, broadcast
  for (const BinaryOp& op : kBinaryOps) {
    INFO(op.name);
    auto f = op.op;
    tg::GradcheckReport r = gradcheck([f](const std::vector<Tensor>& in) { return f(in[0], in[1]); }, {a, b});
    INFO(r.str());
    CHECK(r.ok);
    CHECK(r.inputs.size() == 1);  // only the input that requires grad is checked
    require_gradcheck([f](const std::vector<Tensor>& in) { return f(in[1], in[0]); }, {a, b});
  }
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("broadcast backward sums the gradient over the broadcast dims (by hand)") {
  Tensor a = leaf64({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = leaf64({10, 20, 30}, {3});
  Tensor c = leaf64({7}, Shape{});
  sum(mul(add(a, b), c)).backward();
  // d/da = c everywhere; d/db_j = sum_i c = 2c; d/dc = sum(a + b).
  check_close(a.grad(), {7, 7, 7, 7, 7, 7});
  check_close(b.grad(), {14, 14, 14});
  REQUIRE(c.grad().shape() == Shape{});
  check_close(c.grad(), {21 + 2 * 60});

  Tensor col = leaf64({1, 2, 3}, {3, 1});
  Tensor row = leaf64({1, 10, 100, 1000}, {1, 4});
  sum(mul(col, row)).backward();
  REQUIRE(col.grad().shape() == Shape{3, 1});
  REQUIRE(row.grad().shape() == Shape{1, 4});
  check_close(col.grad(), {1111, 1111, 1111});  // sum of row
  check_close(row.grad(), {6, 6, 6, 6});        // sum of col
}

TEST_CASE("an operand used twice accumulates both gradients") {
  Tensor x = leaf64({-1.5, 0.5, 2}, {3});
  sum(mul(x, x)).backward();
  check_close(x.grad(), {-3, 1, 4});  // d(x^2)/dx = 2x
  x.zero_grad();
  sum(div(x, x)).backward();  // x / x = 1: gradient 1/x - x/x^2 = 0
  check_close(x.grad(), {0, 0, 0});
  x.zero_grad();
  sum(sub(x, x)).backward();
  check_close(x.grad(), {0, 0, 0});
}

TEST_CASE("binary op errors name the op and the shapes or dtypes") {
  Tensor a = zeros({2, 3}), b = zeros({4}), c = zeros({3, 2});
  Tensor a64 = zeros({2, 3}, float64);
  Tensor ai = zeros({2, 3}, int32);
  REQUIRE_TG_ERROR(add(a, b), "add:", "(2, 3)", "(4,)", "cannot be broadcast");
  REQUIRE_TG_ERROR(sub(a, c), "sub:", "(2, 3)", "(3, 2)");
  REQUIRE_TG_ERROR(mul(b, a), "mul:", "(4,)", "(2, 3)");
  REQUIRE_TG_ERROR(div(zeros({2, 3, 4}), zeros({2, 4})), "div:", "(2, 3, 4)", "(2, 4)");
  REQUIRE_TG_ERROR(a + b, "add:", "(2, 3)", "(4,)");
  // int32 operands
  REQUIRE_TG_ERROR(add(ai, a), "add:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(sub(a, ai), "sub:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(mul(ai, ai), "mul:", "int32");
  REQUIRE_TG_ERROR(div(ai, a), "div:", "int32");
  // float32 with float64: no implicit promotion
  REQUIRE_TG_ERROR(add(a, a64), "add:", "dtypes differ", "float32", "float64", "(2, 3)");
  REQUIRE_TG_ERROR(sub(a64, a), "sub:", "float64", "float32");
  REQUIRE_TG_ERROR(mul(a, a64), "mul:", "float32", "float64");
  REQUIRE_TG_ERROR(div(a64, a), "div:", "float64", "float32");
  // undefined operand
  REQUIRE_TG_ERROR(add(Tensor(), a), "add:", "undefined");
}

// ---------------------------------------------------------------------------------------------
// Scalar forms
// ---------------------------------------------------------------------------------------------

TEST_CASE("scalar forms and operators: values by hand in float32 and float64") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor a = tensor({-2, 0.5, 1, 4}, {2, 2}, dt);
    check_close(add(a, 1.5), {-0.5, 2, 2.5, 5.5});
    check_close(sub(a, 1.5), {-3.5, -1, -0.5, 2.5});
    check_close(mul(a, -2.0), {4, -1, -2, -8});
    check_close(div(a, 4.0), {-0.5, 0.125, 0.25, 1});
    check_close(rsub(1.0, a), {3, 0.5, 0, -3});
    check_close(rdiv(2.0, a), {-1, 4, 2, 0.5});
    // operators with the scalar on either side
    check_close(a + 1.5, {-0.5, 2, 2.5, 5.5});
    check_close(1.5 + a, {-0.5, 2, 2.5, 5.5});
    check_close(a - 1.5, {-3.5, -1, -0.5, 2.5});
    check_close(1.0 - a, {3, 0.5, 0, -3});
    check_close(a * 3.0, {-6, 1.5, 3, 12});
    check_close(3.0 * a, {-6, 1.5, 3, 12});
    check_close(a / 4.0, {-0.5, 0.125, 0.25, 1});
    check_close(2.0 / a, {-1, 4, 2, 0.5});
    check_close(-a, {2, -0.5, -1, -4});
    Tensor y = a * 2.0;
    CHECK(y.shape() == Shape{2, 2});
    CHECK(y.dtype() == dt);
    // div by a scalar that is not a power of two
    check_close(div(a, 3.0), {-2.0 / 3, 0.5 / 3, 1.0 / 3, 4.0 / 3});
  }
}

TEST_CASE("scalar forms gradcheck") {
  Tensor x = param64({2, 3}, 7, 0.4, 1.5);  // positive, for rdiv
  using F = std::function<Tensor(const std::vector<Tensor>&)>;
  const std::vector<std::pair<const char*, F>> cases = {
      {"add", [](const std::vector<Tensor>& in) { return add(in[0], 2.5); }},
      {"sub", [](const std::vector<Tensor>& in) { return sub(in[0], -0.75); }},
      {"mul", [](const std::vector<Tensor>& in) { return mul(in[0], -3.0); }},
      {"div", [](const std::vector<Tensor>& in) { return div(in[0], 0.3); }},
      {"rsub", [](const std::vector<Tensor>& in) { return rsub(4.0, in[0]); }},
      {"rdiv", [](const std::vector<Tensor>& in) { return rdiv(-1.5, in[0]); }},
      {"operators", [](const std::vector<Tensor>& in) { return (2.0 - in[0]) * 3.0 / (1.0 + in[0]) + 2.0 / in[0] - 0.5; }},
      {"neg", [](const std::vector<Tensor>& in) { return -in[0]; }},
  };
  for (const auto& [name, f] : cases) {
    INFO(name);
    require_gradcheck(f, {x});
  }
}

TEST_CASE("scalar form gradients by hand") {
  Tensor x = leaf64({0.5, 2, -4}, {3});
  sum(rdiv(2.0, x)).backward();  // d(2/x)/dx = -2/x^2
  check_close(x.grad(), {-8, -0.5, -0.125});
  x.zero_grad();
  sum(mul(x, -3.0)).backward();
  check_close(x.grad(), {-3, -3, -3});
  x.zero_grad();
  sum(rsub(5.0, x)).backward();
  check_close(x.grad(), {-1, -1, -1});
  x.zero_grad();
  sum(div(x, 4.0)).backward();
  check_close(x.grad(), {0.25, 0.25, 0.25});
}

TEST_CASE("scalar form errors") {
  Tensor a = ones({2, 3});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_TG_ERROR(div(a, 0.0), "div:", "scalar 0", "(2, 3)");
  REQUIRE_TG_ERROR(a / 0.0, "div:", "(2, 3)");
  REQUIRE_TG_ERROR(add(a, nan), "add:", "NaN");
  REQUIRE_TG_ERROR(sub(a, nan), "sub:", "NaN");
  REQUIRE_TG_ERROR(mul(a, nan), "mul:", "NaN");
  REQUIRE_TG_ERROR(div(a, nan), "div:", "NaN");
  REQUIRE_TG_ERROR(rsub(nan, a), "rsub:", "NaN");
  REQUIRE_TG_ERROR(rdiv(nan, a), "rdiv:", "NaN");
  Tensor ai = zeros({2, 3}, int32);
  REQUIRE_TG_ERROR(add(ai, 1.0), "add:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(mul(ai, 2.0), "mul:", "int32");
  REQUIRE_TG_ERROR(rsub(1.0, ai), "rsub:", "int32");
  REQUIRE_TG_ERROR(rdiv(1.0, ai), "rdiv:", "int32");
}

// ---------------------------------------------------------------------------------------------
// Unary ops
// ---------------------------------------------------------------------------------------------

namespace {

double gelu_erf_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::numbers::sqrt2)); }
double gelu_tanh_ref(double x) {
  const double u = std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1 + std::tanh(u));
}

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<double(double)> ref;
  bool positive_only;  // domain: x > 0
};

const std::vector<UnaryCase>& unary_cases() {
  static const std::vector<UnaryCase> cases = {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, false},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, false},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, true},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::fabs(x); }, false},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1 / (1 + std::exp(-x)); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0.0; }, false},
      {"gelu none", [](const Tensor& x) { return gelu(x, "none"); }, gelu_erf_ref, false},
      {"gelu default", [](const Tensor& x) { return gelu(x); }, gelu_erf_ref, false},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, gelu_tanh_ref, false},
      {"pow 3", [](const Tensor& x) { return pow(x, 3); }, [](double x) { return x * x * x; }, false},
  };
  return cases;
}

const std::vector<double> kMixedInputs = {-3, -1.5, -0.25, 0.5, 1.25, 2.75};
const std::vector<double> kPositiveInputs = {0.125, 0.5, 1, 2.25, 4, 9.5};

}  // namespace

TEST_CASE("unary ops: values against std:: math in float32 and float64") {
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : kFloatTypes) {
      INFO(c.name << " in " << dt);
      const std::vector<double>& xs = c.positive_only ? kPositiveInputs : kMixedInputs;
      Tensor x = tensor(xs, {2, 3}, dt);
      Tensor y = c.op(x);
      CHECK(y.shape() == Shape{2, 3});
      CHECK(y.dtype() == dt);
      std::vector<double> want;
      for (double v : xs) want.push_back(c.ref(v));
      check_close(y, want);
    }
  }
}

TEST_CASE("unary ops: a few values known independently of any formula") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    check_close(exp(tensor({0, 1}, {2}, dt)), {1, std::numbers::e});
    check_close(log(tensor({1, std::numbers::e}, {2}, dt)), {0, 1});
    check_close(sqrt(tensor({0, 4, 6.25}, {3}, dt)), {0, 2, 2.5});
    check_close(rsqrt(tensor({4, 0.25}, {2}, dt)), {0.5, 2});
    check_close(abs(tensor({-2, 0, 3}, {3}, dt)), {2, 0, 3});
    check_close(relu(tensor({-2, 0, 3}, {3}, dt)), {0, 0, 3});
    check_close(sigmoid(tensor({0}, {1}, dt)), {0.5});
    check_close(tanh(tensor({0}, {1}, dt)), {0});
    // GELU(1) = Phi(1) = 0.841344746068543 (the normal CDF at 1); GELU(0) = 0.
    check_close(gelu(tensor({0, 1}, {2}, dt)), {0, 0.8413447460685429});
    check_close(gelu(tensor({0}, {1}, dt), "tanh"), {0});
    // log of 0 and of a negative, sqrt of a negative follow IEEE
    check_close(log(tensor({0, -1}, {2}, dt)), {-std::numeric_limits<double>::infinity(),
                                                 std::numeric_limits<double>::quiet_NaN()});
    check_close(sqrt(tensor({-1}, {1}, dt)), {std::numeric_limits<double>::quiet_NaN()});
  }
}

TEST_CASE("unary ops gradcheck on their domain") {
  std::uint64_t seed = 300;
  for (const UnaryCase& c : unary_cases()) {
    if (std::string(c.name) == "abs" || std::string(c.name) == "relu") continue;  // kinks at 0: below
    INFO(c.name);
    // log / sqrt / rsqrt on [~1, ~3]; the others on N(0, 1).
    Tensor x = c.positive_only ? param64({2, 3}, seed++, 0.3, 2.0) : param64({2, 3}, seed++);
    auto op = c.op;
    require_gradcheck([op](const std::vector<Tensor>& in) { return op(in[0]); }, {x});
  }
  // rsqrt and sqrt also close to 0 where the derivative is steep
  Tensor small = leaf64({0.05, 0.1, 0.3}, {3});
  require_gradcheck([](const std::vector<Tensor>& in) { return rsqrt(in[0]); }, {small});
  require_gradcheck([](const std::vector<Tensor>& in) { return sqrt(in[0]); }, {small});
  require_gradcheck([](const std::vector<Tensor>& in) { return log(in[0]); }, {small});
}

TEST_CASE("abs and relu: gradcheck away from 0, subgradient 0 at 0") {
  // Away from the kink (|x| >= 0.2, far beyond the finite-difference step).
  Tensor x = leaf64({-2.1, -0.7, -0.2, 0.2, 0.9, 3.3}, {2, 3});
  require_gradcheck([](const std::vector<Tensor>& in) { return abs(in[0]); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return relu(in[0]); }, {x});

  Tensor z = leaf64({-1.5, 0, 2}, {3});
  sum(abs(z)).backward();
  check_close(z.grad(), {-1, 0, 1});  // sign(x), 0 at 0 (as PyTorch)
  z.zero_grad();
  sum(relu(z)).backward();
  check_close(z.grad(), {0, 0, 1});  // 0 at 0 (as PyTorch)
}

TEST_CASE("unary gradients by hand") {
  Tensor x = leaf64({0.5, 1, 2}, {3});
  sum(exp(x)).backward();
  check_close(x.grad(), {std::exp(0.5), std::exp(1.0), std::exp(2.0)});
  x.zero_grad();
  sum(log(x)).backward();
  check_close(x.grad(), {2, 1, 0.5});
  x.zero_grad();
  sum(sqrt(x)).backward();
  check_close(x.grad(), {0.5 / std::sqrt(0.5), 0.5, 0.5 / std::sqrt(2.0)});
  x.zero_grad();
  sum(rsqrt(x)).backward();  // -x^(-3/2) / 2
  check_close(x.grad(), {-0.5 * std::pow(0.5, -1.5), -0.5, -0.5 * std::pow(2.0, -1.5)});
  x.zero_grad();
  sum(tanh(x)).backward();
  check_close(x.grad(), {1 - std::pow(std::tanh(0.5), 2), 1 - std::pow(std::tanh(1.0), 2), 1 - std::pow(std::tanh(2.0), 2)});
  x.zero_grad();
  sum(gelu(x)).backward();  // Phi(x) + x phi(x)
  std::vector<double> want;
  for (double v : {0.5, 1.0, 2.0})
    want.push_back(0.5 * (1 + std::erf(v / std::numbers::sqrt2)) + v * std::exp(-v * v / 2) / std::sqrt(2 * std::numbers::pi));
  check_close(x.grad(), want);
}

TEST_CASE("pow: exponents 0, 1, 2, 0.5, -1.5, 3 (values and gradcheck)") {
  const double exps[] = {0, 1, 2, 0.5, -1.5, 3};
  for (double p : exps) {
    const bool needs_positive = p != std::floor(p);
    const std::vector<double>& xs = needs_positive ? kPositiveInputs : kMixedInputs;
    for (DType dt : kFloatTypes) {
      INFO("pow " << p << " in " << dt);
      Tensor y = pow(tensor(xs, {2, 3}, dt), p);
      std::vector<double> want;
      for (double v : xs) want.push_back(std::pow(v, p));
      check_close(y, want);
    }
    INFO("gradcheck pow " << p);
    Tensor x = needs_positive ? param64({2, 3}, 400 + static_cast<std::uint64_t>(p * 4 + 8), 0.3, 2.0)
                              : param64({2, 3}, 400 + static_cast<std::uint64_t>(p * 4 + 8));
    require_gradcheck([p](const std::vector<Tensor>& in) { return pow(in[0], p); }, {x});
  }
  // Gradients by hand: p = 0 gives 0 everywhere (also at 0), p = 1 gives 1, p = 2 gives 2x.
  Tensor x = leaf64({-2, 0, 3}, {3});
  sum(pow(x, 0)).backward();
  check_close(x.grad(), {0, 0, 0});
  x.zero_grad();
  sum(pow(x, 1)).backward();
  check_close(x.grad(), {1, 1, 1});
  x.zero_grad();
  sum(pow(x, 2)).backward();
  check_close(x.grad(), {-4, 0, 6});
  x.zero_grad();
  sum(pow(x, 3)).backward();
  check_close(x.grad(), {12, 0, 27});
  check_close(pow(tensor({0, 5}, {2}, float64), 0), {1, 1});  // 0^0 = 1 (as std::pow and PyTorch)
}

TEST_CASE("sigmoid is stable for large |x|") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    const std::vector<double> xs = {-1000, -100, -30, 30, 100, 1000};
    Tensor y = sigmoid(tensor(xs, {6}, dt));
    std::vector<double> want;
    for (double v : xs) want.push_back(v >= 0 ? 1 / (1 + std::exp(-v)) : std::exp(v) / (1 + std::exp(v)));
    check_close(y, want);
    for (double v : y.to_vector<double>()) {
      CHECK(std::isfinite(v));
      CHECK(v >= 0);
      CHECK(v <= 1);
    }
    CHECK(y.at({0}) == 0.0);
    CHECK(y.at({5}) == 1.0);
    // tanh saturates the same way
    check_close(tanh(tensor({-1000, 1000}, {2}, dt)), {-1, 1});
  }
  // The gradient at large |x| is (close to) 0, never NaN.
  Tensor x = leaf64({-1000, -40, 40, 1000}, {4});
  sum(sigmoid(x)).backward();
  for (double g : x.grad().to_vector<double>()) {
    CHECK(std::isfinite(g));
    CHECK(g >= 0);
    CHECK(g < 1e-15);
  }
  // and a gradcheck at moderately large |x| on both sides
  Tensor m = leaf64({-12, -6, -2.5, 2.5, 6, 12}, {2, 3});
  require_gradcheck([](const std::vector<Tensor>& in) { return sigmoid(in[0]); }, {m});
}

TEST_CASE("gelu: none and tanh approximations agree to ~1e-3 and differ") {
  Tensor x = tensor(ramp(41, -5, 0.25), {41}, float64);
  const double d = max_abs_diff(gelu(x, "none"), gelu(x, "tanh"));
  CHECK(d < 1e-3);
  CHECK(d > 1e-6);  // they are different functions
  // GELU tends to x for large x and to 0 for very negative x
  Tensor big = tensor({-20, 20}, {2}, float64);
  check_close(gelu(big), {0, 20});
  check_close(gelu(big, "tanh"), {0, 20});
  Tensor t = param64({2, 3}, 17, 2.0);  // wider range than N(0, 1)
  require_gradcheck([](const std::vector<Tensor>& in) { return gelu(in[0], "tanh"); }, {t});
  require_gradcheck([](const std::vector<Tensor>& in) { return gelu(in[0], "none"); }, {t});
}

TEST_CASE("unary ops on 0-d and empty tensors") {
  Tensor s = tensor({2}, Shape{}, float64);
  Tensor y = exp(s);
  CHECK(y.dim() == 0);
  CHECK(y.item() == Approx(std::exp(2.0)).epsilon(1e-14));
  Tensor e = zeros({0, 3});
  CHECK(tanh(e).shape() == Shape{0, 3});
  CHECK(add(e, e).shape() == Shape{0, 3});
  CHECK(add(e, zeros({3})).shape() == Shape{0, 3});
}

TEST_CASE("unary op errors name the op") {
  Tensor ai = zeros({2, 3}, int32);
  REQUIRE_TG_ERROR(neg(ai), "neg:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(-ai, "neg:", "int32");
  REQUIRE_TG_ERROR(exp(ai), "exp:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(log(ai), "log:", "int32");
  REQUIRE_TG_ERROR(sqrt(ai), "sqrt:", "int32");
  REQUIRE_TG_ERROR(rsqrt(ai), "rsqrt:", "int32");
  REQUIRE_TG_ERROR(pow(ai, 2), "pow:", "int32");
  REQUIRE_TG_ERROR(abs(ai), "abs:", "int32");
  REQUIRE_TG_ERROR(tanh(ai), "tanh:", "int32");
  REQUIRE_TG_ERROR(sigmoid(ai), "sigmoid:", "int32");
  REQUIRE_TG_ERROR(relu(ai), "relu:", "int32");
  REQUIRE_TG_ERROR(gelu(ai), "gelu", "int32");
  REQUIRE_TG_ERROR(gelu(ai, "tanh"), "gelu", "int32");
  Tensor x = ones({2});
  REQUIRE_TG_ERROR(gelu(x, "erf"), "gelu:", "approximate", "erf");
  REQUIRE_TG_ERROR(gelu(x, nullptr), "gelu:", "approximate");
  REQUIRE_TG_ERROR(pow(x, std::numeric_limits<double>::infinity()), "pow:", "exponent");
  REQUIRE_TG_ERROR(pow(x, std::numeric_limits<double>::quiet_NaN()), "pow:", "exponent");
  REQUIRE_TG_ERROR(exp(Tensor()), "exp:", "undefined");
}

TEST_CASE("large tensors (parallel kernels) give the same values and gradients") {
  // 40000 elements: above the OpenMP threshold, so the parallel loops run.
  const std::int64_t R = 200, C = 200;
  Tensor a = param64({R, C}, 901, 0.5, 0.0);
  Tensor b = param64({R, C}, 902, 0.5, 2.0);
  Tensor row = param64({C}, 903);
  Tensor y = add(mul(a, b), div(exp(a), b));
  Tensor z = mul(y, row);  // broadcast path
  sum(z).backward();
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>(), rv = row.to_vector<double>();
  const std::vector<double> yv = y.to_vector<double>(), ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
  std::vector<double> want_gr(static_cast<std::size_t>(C), 0.0);
  bool values_ok = true, grads_ok = true;
  for (std::int64_t i = 0; i < R * C; ++i) {
    const auto k = static_cast<std::size_t>(i), c = static_cast<std::size_t>(i % C);
    const double yi = av[k] * bv[k] + std::exp(av[k]) / bv[k];
    values_ok = values_ok && std::fabs(yv[k] - yi) <= 1e-12 * (1 + std::fabs(yi));
    const double dai = rv[c] * (bv[k] + std::exp(av[k]) / bv[k]);
    const double dbi = rv[c] * (av[k] - std::exp(av[k]) / (bv[k] * bv[k]));
    grads_ok = grads_ok && std::fabs(ga[k] - dai) <= 1e-12 * (1 + std::fabs(dai));
    grads_ok = grads_ok && std::fabs(gb[k] - dbi) <= 1e-12 * (1 + std::fabs(dbi));
    want_gr[c] += yi;
  }
  CHECK(values_ok);
  CHECK(grads_ok);
  check_close(row.grad(), want_gr);
}

TEST_CASE("a recorded GELU gives the same bits as an unrecorded one, and its saved derivative is the derivative") {
  // Recorded, the GELUs compute f and f' in one pass and save f' (unary_forward_deriv); the output
  // must not depend on whether the op is recorded, and the backward must be dy * f'(x).
  for (const char* approx : {"none", "tanh"}) {
    for (DType dt : {float32, float64}) {
      INFO(approx << " " << dt);
      Tensor x = (randn({257}, dt) * 3.0).detach();
      Tensor plain;
      {
        NoGradGuard no_grad;
        plain = gelu(x, approx);
      }
      Tensor xr = x.clone().requires_grad_();
      Tensor y = gelu(xr, approx);
      CHECK(y.to_vector<double>() == plain.to_vector<double>());
      Tensor dy = randn({257}, dt);
      y.backward(dy);
      const auto g = xr.grad().to_vector<double>(), xv = x.to_vector<double>(), dv = dy.to_vector<double>();
      const double tol = dt == float32 ? 2e-6 : 1e-12;  // fast_erf / fast_exp are float-accurate
      for (std::size_t i = 0; i < g.size(); ++i) {
        const double a = xv[i];
        double d;
        if (std::string(approx) == "none") {
          d = 0.5 * (1 + std::erf(a / std::numbers::sqrt2)) + a * std::exp(-0.5 * a * a) / std::sqrt(2 * std::numbers::pi);
        } else {
          const double c = std::sqrt(2 / std::numbers::pi), t = std::tanh(c * (a + 0.044715 * a * a * a));
          d = 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * 0.044715 * a * a);
        }
        CHECK(g[i] == Approx(dv[i] * d).margin(tol * (1 + std::abs(dv[i] * d))));
      }
    }
  }
}
