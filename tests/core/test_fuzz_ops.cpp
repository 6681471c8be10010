// Randomized robustness test of every public op in tapegrad/ops.h.
//
// Thousands of calls with random shapes (0 to 4 dims, sizes 0 to 5, so zero-size tensors are
// common), dtypes (float32, float64, and int32 and bfloat16 that float ops must refuse), axes (negative,
// duplicated, out of range), scalars and values (normal numbers mixed with signed zeros, 1e30,
// subnormals, float32's largest value, NaN, +-inf), undefined tensors and deliberately
// mismatched shapes and dtypes. Every call must either return or throw tg::Error; any other
// exception fails the test, and the sanitizer build turns memory errors and undefined behaviour
// into failures. On top of that, an independent oracle in this file decides which calls are valid:
// a valid call that throws, or an invalid one that returns, fails. A successful call is checked
// against an expected shape and a naive float64 reference (NaN where NaN, infinities exactly,
// finite values within a tolerance scaled by the magnitude of the terms, skipped where float32
// would overflow an intermediate the float64 reference does not). When an input requires grad,
// backward runs with a random upstream gradient; each such input must receive a gradient of its
// own shape, with values checked against a reference for the elementwise ops, reductions, matmul,
// softmax, cross_entropy, the data-movement ops, swiglu and rope, and against the composite twin
// for the fused norms, attention, swiglu and rope. No op or backward may write into its inputs. A
// last family runs large inputs (above the parallel threshold) on one thread and on the pool: the
// results must agree.
//
// Deterministic: each call draws from its own std::mt19937_64 seed, printed on failure. Replay one
// call with TAPEGRAD_FUZZ_SEED=<seed> test_core "[fuzz]".
//
// Library bugs found by this test are listed in kKnownBugs below (all fixed): a flag set to true
// steers the fuzz around a bug while it is open, and the test case "[fuzz_regressions]" asserts
// the correct behaviour for each.
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.h"
#include "kernels/bf16.h"

namespace {

using tg::DType;
using tg::bfloat16;
using tg::float32;
using tg::float64;
using tg::int32;
using tg::Shape;
using tg::Tensor;
using i64 = std::int64_t;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr i64 kI64Max = std::numeric_limits<i64>::max();
constexpr i64 kI64Min = std::numeric_limits<i64>::min();
constexpr std::int32_t kI32Max = std::numeric_limits<std::int32_t>::max();
constexpr std::int32_t kI32Min = std::numeric_limits<std::int32_t>::min();
constexpr std::uint64_t kBaseSeed = 0x7a9e5eedULL;

// ---------------------------------------------------------------------------------------------
// Library bugs this fuzz found, all fixed: each entry, when true, names inputs the fuzz would steer
// around (a switch for the next bug found); the "[fuzz_regressions]" test asserts the correct
// behaviour for every entry.
struct KnownBugs {
  // div(x, s) multiplies by 1/s: for a subnormal s, 1/s overflows, so 0 / s gives NaN and
  // 1e-300 / 1e-310 gives inf (float32: s = 1e-40).
  bool div_scalar_subnormal = false;
  // relu(NaN) returns 0 (the kernel's x > 0 ? x : 0); PyTorch's relu and the other ops here
  // propagate NaN. The fuzz feeds relu no NaN.
  bool relu_nan = false;
  // layer_norm / batch_norm of a constant row of large values: the mean (sum / n in double) is not
  // exactly the value, the variance is then the rounding error squared, far above eps, so x_hat is
  // +-1 instead of 0 (a float64 row of three 1e30 gives -1, -1, -1; any |x| whose mean rounding
  // error exceeds sqrt(eps), about 1e13 and up). The fuzz keeps constant rows below 1e10.
  bool norm_constant_large_row = false;
  // causal_attention with an empty output returns before recording: the output of a requires-grad
  // qkv does not require grad, so backward() on it (or on a loss built from it) throws.
  bool attention_empty_not_on_tape = false;
  // slice: (end - start + step - 1) overflows for step near INT64_MAX (UB; in release a wrong,
  // empty result: slice(x(5), 0, 0, 5, INT64_MAX) has shape (0,) instead of (1,)).
  bool slice_step_overflow = false;
  // split(x, sizes): the sum of sizes overflows (UB); {INT64_MAX, INT64_MAX, 5} "sums" to 3 and is
  // accepted for a dim of size 3, returning pieces of sizes 3, 0, ... .
  bool split_sizes_overflow = false;
  // reshape: the element count of the target shape overflows (UB); (2^62 + 1, 4) is accepted for a
  // 4-element tensor, giving a tensor whose shape claims 2^64 + 4 elements over 4 elements of data.
  bool reshape_numel_overflow = false;
  // composite::causal_attention divides C by n_head without checking it: n_head = 0 is an integer
  // division by zero (SIGFPE). The fused op refuses it with tg::Error.
  bool composite_attention_zero_heads = false;
  // prms_k(n, p) converts ceil(n p) to int64 without a range check: NaN, inf or a huge p is an
  // undefined float-to-int conversion; composite::rms_norm passes p through unchecked.
  bool prms_k_nonfinite_p = false;
  // composite::causal_attention refuses a qkv of width 0 (C = 0, valid for the fused op, which
  // returns an empty (B, T, 0)): its scale 1 / sqrt(C / n_head) is inf, which
  // scaled_causal_softmax refuses.
  bool composite_attention_zero_width = false;
  // scaled_causal_softmax (and causal_attention, same kernel) in builds with FMA (-march=native):
  // the compiler contracts sc * x[j] - m into fma(sc, x[j], -m), so the row maximum's exponent is
  // the rounding error of its product instead of 0. A row whose largest |scale * x| exceeds ~1.5e9
  // (float32) gives NaN instead of a one-hot row (e.g. x = [-1/3], scale = 3e10); smaller ones
  // carry a relative error up to |scale * x| 2^-25 (5e-4 at 1e4 in float32).
  bool causal_softmax_fma = false;
};
constexpr KnownBugs kKnownBugs{};

// ---------------------------------------------------------------------------------------------
// Randomness.

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : g_(seed) {}
  i64 range(i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(g_); }  // inclusive
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(g_) < p; }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(g_); }
  template <class T>
  T pick(std::initializer_list<T> xs) {
    return *(xs.begin() + range(0, static_cast<i64>(xs.size()) - 1));
  }
  template <class T>
  void shuffle(std::vector<T>& v) { std::shuffle(v.begin(), v.end(), g_); }

 private:
  std::mt19937_64 g_;
};

// A value as a tensor of dtype dt stores it (float32 saturates to +-inf: an out-of-range
// double-to-float conversion is undefined in C++, so the test never performs one).
// bfloat16 stores the float32 value rounded to 8 significant bits, to nearest, ties to even (in
// the default rounding mode nearbyint rounds so), with float32's exponent range: its subnormals are
// multiples of 2^-133, and a value that rounds beyond the largest finite float32 is infinite.
double as_dtype(double v, DType dt) {
  if (dt == float64 || std::isnan(v)) return v;
  if (dt == int32) return v;
  if (std::isfinite(v) && std::fabs(v) > FLT_MAX) return v > 0 ? kInf : -kInf;
  const double f = static_cast<double>(static_cast<float>(v));
  if (dt != bfloat16 || f == 0 || std::isinf(f)) return f;
  int e = 0;
  (void)std::frexp(f, &e);  // f = m 2^e, 0.5 <= |m| < 1: 8 significant bits are steps of 2^(e-8)
  const double q = std::ldexp(1.0, std::max(e - 8, -133));
  const double b = std::nearbyint(f / q) * q;
  return std::fabs(b) > FLT_MAX ? std::copysign(kInf, b) : b;
}

// Normal numbers, or (when specials) sometimes a special: signed zeros, 1e30 (its square
// overflows float32), float32's largest finite value, subnormals of float32 and float64, 1e200
// (infinite in float32), NaN and both infinities.
double draw_value(Rng& r, bool specials, double scale) {
  if (specials && r.chance(0.2))
    return r.pick({0.0, -0.0, 1e30, -1e30, 3.4e38, 1e-30, -1e-40, 1e-310, 1e200, kNaN, kInf, -kInf});
  return r.normal() * scale;
}

// A scalar argument: ordinary values, zero, huge, tiny, subnormal, infinite and NaN.
double draw_scalar(Rng& r) {
  if (r.chance(0.5)) return std::round(r.normal() * 300) / 100;
  return r.pick({0.0, -0.0, 1.0, -2.5, 1e30, 1e300, 1e-30, 1e-300, 1e-40, 1e-310, kInf, -kInf, kNaN});
}

Tensor filled(const Shape& s, DType dt, const std::function<double()>& gen) {
  Tensor t = Tensor::empty(s, dt);
  const i64 n = t.numel();
  if (dt == float32) {
    float* p = t.data<float>();
    for (i64 i = 0; i < n; ++i) p[i] = static_cast<float>(as_dtype(gen(), dt));
  } else if (dt == float64) {
    double* p = t.data<double>();
    for (i64 i = 0; i < n; ++i) p[i] = gen();
  } else if (dt == bfloat16) {
    auto* p = static_cast<tg::kernels::bf16*>(t.raw_data());
    for (i64 i = 0; i < n; ++i) p[i] = tg::kernels::to_bf16(static_cast<float>(as_dtype(gen(), float32)));
  } else {
    std::int32_t* p = t.data<std::int32_t>();
    for (i64 i = 0; i < n; ++i) p[i] = static_cast<std::int32_t>(gen());
  }
  return t;
}

// Random values for a tensor: ints small; floats normal, with specials in about a third of the tensors.
Tensor random_tensor(Rng& r, const Shape& s, DType dt, bool allow_specials = true) {
  if (dt == int32)
    return filled(s, dt, [&] { return static_cast<double>(r.chance(0.05) ? r.pick({kI32Max, kI32Min}) : r.range(-2, 6)); });
  const bool specials = allow_specials && r.chance(0.35);
  const double scale = r.pick({1.0, 1.0, 3.0});
  return filled(s, dt, [&] { return draw_value(r, specials, scale); });
}

i64 rand_dim(Rng& r) { return r.chance(0.07) ? 0 : r.pick<i64>({1, 1, 2, 2, 3, 3, 4, 5}); }

Shape rand_shape(Rng& r, int min_nd = 0, int max_nd = 4) {
  Shape s;
  const i64 nd = r.range(min_nd, max_nd);
  for (i64 d = 0; d < nd; ++d) s.push_back(rand_dim(r));
  return s;
}

DType float_dtype(Rng& r) { return r.chance(0.5) ? float32 : float64; }
// Mostly float; sometimes int32 or bfloat16, which float ops must refuse.
DType any_dtype(Rng& r, double p_int = 0.07) {
  return r.chance(p_int) ? r.pick({int32, bfloat16}) : float_dtype(r);
}
DType other_dtype(Rng& r, DType dt) {
  return dt == float32 ? r.pick({float64, int32})
         : dt == float64 ? r.pick({float32, int32})
                            : float_dtype(r);
}

// A random input: sometimes undefined; float inputs require grad half of the time.
Tensor input(Rng& r, const Shape& s, DType dt, double p_undefined = 0.03) {
  if (r.chance(p_undefined)) return Tensor();
  Tensor t = random_tensor(r, s, dt);
  if (tg::is_floating(dt) && r.chance(0.5)) t.requires_grad_();
  return t;
}

// A shape that broadcasts against s: a suffix of s with some dims set to 1, sometimes with an
// extra leading dim.
Shape broadcast_partner(Rng& r, const Shape& s, bool allow_extra = true) {
  Shape out;
  const int keep = static_cast<int>(r.range(0, s.ndim()));
  if (allow_extra && keep == s.ndim() && s.ndim() < 4 && r.chance(0.2)) out.push_back(r.chance(0.5) ? 1 : rand_dim(r));
  for (int d = s.ndim() - keep; d < s.ndim(); ++d) out.push_back(r.chance(0.3) ? 1 : s[d]);
  return out;
}

bool is_float(const Tensor& t) { return t.defined() && tg::is_floating(t.dtype()); }
std::vector<double> values(const Tensor& t) { return t.defined() ? t.to_vector<double>() : std::vector<double>(); }

// ---------------------------------------------------------------------------------------------
// Describing a call (shown by INFO on failure).

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream s;
  s << t.dtype() << t.shape();
  if (t.requires_grad()) s << " requires_grad";
  if (t.numel() <= 16) {
    s << " [";
    const std::vector<double> v = t.to_vector<double>();
    for (std::size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
    s << "]";
  }
  return s.str();
}

template <class T>
std::string fmt(const std::vector<T>& v) {
  std::ostringstream s;
  s << "{";
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "}";
  return s.str();
}

class Call {
 public:
  Call(std::uint64_t seed, const std::string& op) { s_ << "TAPEGRAD_FUZZ_SEED=" << seed << "  " << op << ":"; }
  Call& t(const char* name, const Tensor& x) {
    s_ << "\n  " << name << " = " << describe(x);
    return *this;
  }
  template <class T>
  Call& operator()(const char* name, const T& v) {
    s_ << "\n  " << name << " = " << v;
    return *this;
  }
  std::string str() const { return s_.str(); }

 private:
  std::ostringstream s_;
};

// ---------------------------------------------------------------------------------------------
// Bookkeeping and the call harness.

struct OpStats {
  long calls = 0, ok = 0, refused = 0, checked = 0, backward = 0, backward_refused = 0, twin_grads = 0;
};
std::map<std::string, OpStats>& stats() {
  static std::map<std::string, OpStats> m;
  return m;
}

enum class Expect { ok, error, either };

const char* expect_name(Expect e) { return e == Expect::ok ? "valid" : e == Expect::error ? "invalid" : "either"; }

// Runs one call. A tg::Error is a refusal (a failure when the oracle says the call is valid);
// anything else thrown fails the test. Returns the result when the call succeeded and was not
// expected to fail.
template <class F>
auto attempt(const std::string& op, Expect expect, F&& f) -> std::optional<std::invoke_result_t<F&>> {
  OpStats& s = stats()[op];
  ++s.calls;
  INFO("oracle: " << expect_name(expect));
  try {
    auto out = f();
    ++s.ok;
    if (expect == Expect::error) {
      FAIL_CHECK(op << " accepted arguments it must refuse");
      return std::nullopt;
    }
    return out;
  } catch (const tg::Error& e) {
    ++s.refused;
    if (expect == Expect::ok) FAIL_CHECK(op << " refused valid arguments: " << e.what());
  } catch (const std::exception& e) {
    FAIL_CHECK(op << " threw a std::exception that is not tg::Error: " << e.what());
  } catch (...) {
    FAIL_CHECK(op << " threw something that is not a std::exception");
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Comparing with the reference.

// Expected values (exact math in double on the stored inputs) and, per element, the scale of the
// rounding error the dtype may add (sum of |terms|, |result|, ...); mag = inf: do not compare.
// exact: finite values must be equal (copies, gathers, conversions).
struct Ref {
  std::vector<double> val, mag;
  bool exact = false;
  void add(double v, double m) {
    val.push_back(v);
    mag.push_back(m);
  }
  void zeros(std::size_t n) {
    val.assign(n, 0.0);
    mag.assign(n, 0.0);
  }
};

// |x| for finite x, else 0: a non-finite term makes the result an exact NaN or infinity, compared exactly.
double fin(double x) { return std::isfinite(x) ? std::fabs(x) : 0.0; }

// Beyond this error scale float32 (float64) arithmetic may overflow an intermediate that the double
// reference does not, so such elements are not compared.
double max_scale(DType dt) { return dt == float32 ? 1e37 : 1e300; }
double rtol_of(DType dt) { return dt == float32 ? 1e-5 : dt == float64 ? 1e-11 : 0.0; }
// Subnormal-sized slack: float32's exp flushes below e^-87.3, where the true value is < 1.2e-38.
double atol_of(DType dt) { return dt == float32 ? 1e-37 : dt == float64 ? 1e-300 : 0.0; }

// "" when y agrees with the reference, else the first mismatches.
std::string compare(const Tensor& y, const Ref& ref, double tol_factor = 1.0) {
  const std::vector<double> got = y.to_vector<double>();
  std::ostringstream s;
  s.precision(17);
  if (got.size() != ref.val.size()) {
    s << " element count " << got.size() << " vs reference " << ref.val.size();
    return s.str();
  }
  const DType dt = y.dtype();
  const double rtol = ref.exact ? 0.0 : rtol_of(dt) * tol_factor, atol = ref.exact ? 0.0 : atol_of(dt);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = ref.val[i], g = got[i];
    const double m = std::max(ref.mag[i], fin(e));
    if (!(m <= max_scale(dt))) continue;
    bool ok;
    if (std::isnan(e)) ok = std::isnan(g);
    else if (std::isinf(e)) ok = g == e;
    else ok = std::isfinite(g) && std::fabs(g - e) <= atol + rtol * m;
    if (!ok && bad++ < 4) s << "\n    [" << i << "] got " << g << ", expected " << e << " (scale " << m << ")";
  }
  if (bad == 0) return "";
  std::ostringstream head;
  head << " " << bad << " of " << got.size() << " elements differ:" << s.str();
  return head.str();
}

// Dtype and shape always; values when a reference is given.
void check_output(const std::string& op, const Tensor& y, DType dt, const Shape& shape, const Ref* ref,
                  double tol_factor = 1.0, bool count = true) {
  REQUIRE(y.defined());
  CHECK(y.dtype() == dt);
  INFO(op << ": output " << y.dtype() << y.shape() << ", expected " << dt << shape);
  CHECK(y.shape() == shape);
  if (!ref || !(y.shape() == shape) || y.dtype() != dt) return;
  const std::string m = compare(y, *ref, tol_factor);
  INFO(op << " values:" << m);
  CHECK(m.empty());
  if (count) ++stats()[op].checked;
}

// The gradient of x (after backward) against a reference; shape problems are reported by run_backward.
void check_grad(const std::string& op, const Tensor& x, const Ref& ref, double tol_factor = 1.0) {
  if (!x.defined() || !x.requires_grad()) return;
  const Tensor g = x.grad();
  if (!g.defined() || !(g.shape() == x.shape())) return;
  const std::string m = compare(g, ref, tol_factor);
  INFO(op << " gradient of " << x.dtype() << x.shape() << ":" << m);
  CHECK(m.empty());
}

// When a differentiable input requires grad and the output is float, the output must be on the tape
// and backward with a random upstream gradient must give every such input a gradient of its own
// shape and dtype, or throw tg::Error. Returns the upstream gradient when backward ran.
// upstream: the gradient to use instead of a random one.
std::optional<Tensor> run_backward(Rng& r, const std::string& op, const Tensor& out,
                                   const std::vector<Tensor>& diff_inputs, bool skip_tracking_check = false,
                                   const Tensor* upstream = nullptr) {
  bool any = false;
  for (const Tensor& t : diff_inputs) any = any || (t.defined() && t.requires_grad());
  if (!out.defined() || !tg::is_floating(out.dtype()) || !any) {
    if (out.defined() && !any) CHECK_FALSE(out.requires_grad());
    return std::nullopt;
  }
  if (!out.requires_grad()) {
    if (!skip_tracking_check) FAIL_CHECK(op << ": the output does not require grad although an input does");
    return std::nullopt;
  }
  Tensor g = upstream ? *upstream : random_tensor(r, out.shape(), out.dtype(), false);
  OpStats& s = stats()[op];
  try {
    out.backward(g);
    ++s.backward;
  } catch (const tg::Error&) {
    ++s.backward_refused;
    return std::nullopt;
  } catch (const std::exception& e) {
    FAIL_CHECK(op << ": backward threw a std::exception that is not tg::Error: " << e.what());
    return std::nullopt;
  } catch (...) {
    FAIL_CHECK(op << ": backward threw something that is not a std::exception");
    return std::nullopt;
  }
  for (const Tensor& t : diff_inputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    const Tensor gr = t.grad();
    INFO(op << ": gradient of input " << t.dtype() << t.shape() << " is "
            << (gr.defined() ? gr.shape().str() : std::string("undefined")));
    CHECK(gr.defined());
    if (!gr.defined()) continue;
    CHECK(gr.shape() == t.shape());
    CHECK(gr.dtype() == t.dtype());
  }
  return g;
}

// The leaves' gradients (copies), then cleared so that the next backward starts from zero.
std::vector<Tensor> collect_grads(const std::vector<Tensor>& leaves) {
  std::vector<Tensor> out;
  for (Tensor t : leaves) {  // a copy of the handle shares the autograd slot
    const bool has = t.defined() && t.requires_grad() && t.grad().defined();
    out.push_back(has ? t.grad().clone() : Tensor());
    if (t.defined()) t.zero_grad();
  }
  return out;
}

// A fused op's gradients against its composite twin's (now in the leaves) for the same upstream
// gradient: equal NaN positions, finite entries within a tolerance relative to the largest entry or
// to the upstream gradient (where the true gradient is 0, e.g. layer_norm over one feature, both are
// rounding noise).
void check_twin_grads(const std::string& op, const std::vector<Tensor>& leaves, const std::vector<Tensor>& fused,
                      const Tensor& upstream) {
  double up = 0;
  for (double v : upstream.to_vector<double>()) up = std::max(up, fin(v));
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    if (!fused[i].defined()) continue;
    const Tensor gc = leaves[i].grad();
    if (!gc.defined() || !(gc.shape() == fused[i].shape())) continue;  // reported by run_backward
    const std::vector<double> a = fused[i].to_vector<double>(), b = gc.to_vector<double>();
    double scale = up;
    for (std::size_t k = 0; k < a.size(); ++k) scale = std::max({scale, fin(a[k]), fin(b[k])});
    const double tol = (gc.dtype() == float32 ? 1e-3 : 1e-8) * scale;
    std::size_t bad = 0;
    std::ostringstream first;
    first.precision(17);
    for (std::size_t k = 0; k < a.size(); ++k) {
      const bool ok = (std::isnan(a[k]) && std::isnan(b[k])) || std::fabs(a[k] - b[k]) <= tol;
      if (!ok && bad++ < 4) first << "\n    [" << k << "] fused " << a[k] << ", composite " << b[k];
    }
    INFO(op << ": gradient of input " << i << " " << gc.dtype() << gc.shape() << " differs from the composite twin's in "
            << bad << " of " << a.size() << " entries (tolerance " << tol << "):" << first.str());
    CHECK(bad == 0);
    ++stats()[op].twin_grads;
  }
}

// The inputs' data when a call starts; at the end of the call's scope (after the op and its
// backward) it must be unchanged: no op writes into its inputs (batch_norm's running statistics,
// updated in place by design, are not passed here).
class Unchanged {
 public:
  explicit Unchanged(std::vector<Tensor> ts) : ts_(std::move(ts)) {
    for (const Tensor& t : ts_) before_.push_back(values(t));
  }
  Unchanged(const Unchanged&) = delete;
  Unchanged& operator=(const Unchanged&) = delete;
  ~Unchanged() {
    if (std::uncaught_exceptions() > 0) return;
    for (std::size_t i = 0; i < ts_.size(); ++i) {
      const std::vector<double> now = values(ts_[i]);
      bool same = now.size() == before_[i].size();
      for (std::size_t k = 0; same && k < now.size(); ++k)
        same = now[k] == before_[i][k] || (std::isnan(now[k]) && std::isnan(before_[i][k]));
      INFO("input " << i << " (" << describe(ts_[i]) << ") was modified by the op or its backward");
      CHECK(same);
    }
  }

 private:
  std::vector<Tensor> ts_;
  std::vector<std::vector<double>> before_;
};

// ---------------------------------------------------------------------------------------------
// Index helpers for the references.

// Calls f(index, flat) for every element of s in row-major order.
template <class F>
void for_each_index(const Shape& s, F&& f) {
  const i64 n = s.numel();
  std::vector<i64> idx(static_cast<std::size_t>(s.ndim()), 0);
  for (i64 flat = 0; flat < n; ++flat) {
    f(static_cast<const std::vector<i64>&>(idx), flat);
    for (int d = s.ndim() - 1; d >= 0; --d) {
      if (++idx[static_cast<std::size_t>(d)] < s[d]) break;
      idx[static_cast<std::size_t>(d)] = 0;
    }
  }
}

i64 flat_of(const Shape& s, const std::vector<i64>& idx) {
  i64 f = 0;
  for (int d = 0; d < s.ndim(); ++d) f = f * s[d] + idx[static_cast<std::size_t>(d)];
  return f;
}

// NumPy broadcasting of two shapes, or nullopt.
std::optional<Shape> broadcast_shape(const Shape& a, const Shape& b) {
  const int nd = std::max(a.ndim(), b.ndim());
  Shape out;
  for (int i = 0; i < nd; ++i) {
    const int ia = i - (nd - a.ndim()), ib = i - (nd - b.ndim());
    const i64 da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) return std::nullopt;
    out.push_back(da == 1 ? db : da);
  }
  return out;
}

// The flat index of `in` that broadcasting reads for the output index out_idx.
i64 broadcast_source(const Shape& in, const std::vector<i64>& out_idx) {
  const int off = static_cast<int>(out_idx.size()) - in.ndim();
  i64 f = 0;
  for (int d = 0; d < in.ndim(); ++d) f = f * in[d] + (in[d] == 1 ? 0 : out_idx[static_cast<std::size_t>(d + off)]);
  return f;
}

// out[k] = x[src[k]]: the reference of a data-movement op, and its gradient dx[src[k]] += g[k].
Ref gather_ref(const std::vector<double>& xv, const std::vector<i64>& src) {
  Ref ref;
  ref.exact = true;
  for (i64 s : src) ref.add(xv[static_cast<std::size_t>(s)], 0.0);
  return ref;
}
Ref scatter_ref(const std::vector<double>& gv, const std::vector<i64>& src, std::size_t n) {
  Ref ref;
  ref.zeros(n);
  for (std::size_t k = 0; k < src.size(); ++k) {
    ref.val[static_cast<std::size_t>(src[k])] += gv[k];
    ref.mag[static_cast<std::size_t>(src[k])] += fin(gv[k]);
  }
  return ref;
}

Shape shape_of(const std::vector<i64>& dims) { return Shape(dims); }

// ---------------------------------------------------------------------------------------------
// Elementwise binary ops, with broadcasting.

void fuzz_binary(Rng& r, std::uint64_t seed) {
  static const char* const kNames[] = {"add", "sub", "mul", "div"};
  const int op = static_cast<int>(r.range(0, 3));
  const std::string name = kNames[op];
  const DType dt = any_dtype(r);
  const DType dt_b = r.chance(0.05) ? other_dtype(r, dt) : dt;
  Shape sa = rand_shape(r), sb = r.chance(0.1) ? rand_shape(r) : broadcast_partner(r, sa);
  if (r.chance(0.5)) std::swap(sa, sb);
  Tensor a = input(r, sa, dt);
  const bool same = a.defined() && r.chance(0.05);  // add(a, a): both gradients land in one buffer
  Tensor b = same ? a : input(r, sb, dt_b);
  const bool use_operator = r.chance(0.5);
  const std::optional<Shape> out = a.defined() && b.defined() ? broadcast_shape(a.shape(), b.shape()) : std::nullopt;
  const bool valid = out && is_float(a) && a.dtype() == b.dtype();
  const std::string c = Call(seed, name).t("a", a).t("b", b)("b is a", same).str();
  INFO(c);
  const Unchanged unchanged({a, b});
  const auto y = attempt(name, valid ? Expect::ok : Expect::error, [&] {
    switch (op) {
      case 0: return use_operator ? a + b : tg::add(a, b);
      case 1: return use_operator ? a - b : tg::sub(a, b);
      case 2: return use_operator ? a * b : tg::mul(a, b);
      default: return use_operator ? a / b : tg::div(a, b);
    }
  });
  if (!y) return;
  const std::vector<double> av = values(a), bv = values(b);
  Ref ref;
  std::vector<std::array<i64, 2>> src;  // (index in a, index in b) per output element
  for_each_index(*out, [&](const std::vector<i64>& idx, i64) {
    const i64 ia = broadcast_source(a.shape(), idx), ib = broadcast_source(b.shape(), idx);
    src.push_back({ia, ib});
    const double x = av[static_cast<std::size_t>(ia)], z = bv[static_cast<std::size_t>(ib)];
    switch (op) {
      case 0: ref.add(x + z, fin(x) + fin(z)); break;
      case 1: ref.add(x - z, fin(x) + fin(z)); break;
      case 2: ref.add(x * z, fin(x * z)); break;
      default: ref.add(x / z, fin(x / z)); break;
    }
  });
  check_output(name, *y, a.dtype(), *out, &ref);
  const auto g = run_backward(r, name, *y, {a, b});
  if (!g) return;
  // da = sum over broadcast positions of g * d op / da, likewise db.
  const std::vector<double> gv = g->to_vector<double>();
  Ref ga, gb;
  ga.zeros(av.size());
  gb.zeros(bv.size());
  for (std::size_t k = 0; k < src.size(); ++k) {
    const auto ia = static_cast<std::size_t>(src[k][0]), ib = static_cast<std::size_t>(src[k][1]);
    const double x = av[ia], z = bv[ib], gk = gv[k];
    double pa = 1, pb = 1;
    if (op == 1) pb = -1;
    if (op == 2) pa = z, pb = x;
    if (op == 3) pa = 1 / z, pb = -x / (z * z);
    ga.val[ia] += gk * pa;
    ga.mag[ia] += fin(gk * pa) + (op == 3 ? fin(gk * x / z / z) : 0.0);
    gb.val[ib] += gk * pb;
    gb.mag[ib] += fin(gk * pb) + (op == 3 ? fin(gk * pa * pa * x) : 0.0);
  }
  if (same) {
    for (std::size_t i = 0; i < ga.val.size(); ++i) {
      ga.val[i] += gb.val[i];
      ga.mag[i] += gb.mag[i];
    }
    check_grad(name, a, ga);
    return;
  }
  check_grad(name, a, ga);
  check_grad(name, b, gb);
}

// ---------------------------------------------------------------------------------------------
// Scalar forms: x + s, x - s, x * s, x / s, s - x, s / x.

void fuzz_scalar(Rng& r, std::uint64_t seed) {
  static const char* const kNames[] = {"add(scalar)", "sub(scalar)", "mul(scalar)", "div(scalar)", "rsub", "rdiv"};
  const int op = static_cast<int>(r.range(0, 5));
  const std::string name = kNames[op];
  const DType dt = any_dtype(r);
  double s = draw_scalar(r);
  // steer around div_scalar_subnormal: a divisor whose reciprocal overflows the dtype
  const double lim = dt == float32 ? 4 / FLT_MAX : 4 / DBL_MAX;
  if (op == 3 && kKnownBugs.div_scalar_subnormal && as_dtype(s, dt) != 0 && std::fabs(as_dtype(s, dt)) < lim)
    s = dt == float32 ? 1e-30 : 1e-300;
  Tensor x = input(r, rand_shape(r), dt);
  const bool use_operator = r.chance(0.5);
  const bool valid = is_float(x) && !std::isnan(s) && !(op == 3 && s == 0);
  const std::string c = Call(seed, name).t("x", x)("s", s).str();
  INFO(c);
  const Unchanged unchanged({x});
  const auto y = attempt(name, valid ? Expect::ok : Expect::error, [&] {
    switch (op) {
      case 0: return use_operator ? x + s : tg::add(x, s);
      case 1: return use_operator ? x - s : tg::sub(x, s);
      case 2: return use_operator ? x * s : tg::mul(x, s);
      case 3: return use_operator ? x / s : tg::div(x, s);
      case 4: return use_operator ? s - x : tg::rsub(s, x);
      default: return use_operator ? s / x : tg::rdiv(s, x);
    }
  });
  if (!y) return;
  // The scalar takes the tensor's dtype (as in PyTorch): float32 x + 1e300 is x + inf.
  const double st = as_dtype(s, x.dtype());
  const std::vector<double> xv = values(x);
  Ref ref;
  for (double v : xv) {
    switch (op) {
      case 0: ref.add(v + st, fin(v) + fin(st)); break;
      case 1: ref.add(v - st, fin(v) + fin(st)); break;
      case 2: ref.add(v * st, fin(v * st)); break;
      case 3: ref.add(v / st, fin(v / st)); break;
      case 4: ref.add(st - v, fin(v) + fin(st)); break;
      default: ref.add(st / v, fin(st / v)); break;
    }
  }
  check_output(name, *y, x.dtype(), x.shape(), &ref);
  const auto g = run_backward(r, name, *y, {x});
  if (!g) return;
  const std::vector<double> gv = g->to_vector<double>();
  Ref gx;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    double d = 1;
    if (op == 2) d = st;
    if (op == 3) d = 1 / st;
    if (op == 4) d = -1;
    if (op == 5) d = -st / (xv[i] * xv[i]);
    gx.add(gv[i] * d, op == 5 && !(std::fabs(xv[i]) < 1e15 && std::fabs(xv[i]) > 1e-15) ? kInf : fin(gv[i] * d));
  }
  check_grad(name, x, gx);
}

// ---------------------------------------------------------------------------------------------
// Elementwise unary ops.

void fuzz_unary(Rng& r, std::uint64_t seed) {
  static const char* const kNames[] = {"neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs",
                                       "tanh", "sigmoid", "relu", "gelu", "gelu(tanh)", "silu"};
  const int op = static_cast<int>(r.range(0, 12));
  const std::string name = kNames[op];
  const DType dt = any_dtype(r);
  Tensor x = input(r, rand_shape(r), dt);
  if (op == 9 && kKnownBugs.relu_nan && x.defined() && tg::is_floating(x.dtype())) {
    // steer around relu(NaN) = 0: replace NaN inputs by 0
    Tensor clean = filled(x.shape(), x.dtype(), [&, v = values(x), i = std::size_t(0)]() mutable {
      const double e = v[i++];
      return std::isnan(e) ? 0.0 : e;
    });
    if (x.requires_grad()) clean.requires_grad_();
    x = clean;
  }
  const double p = r.chance(0.85) ? r.pick({0.0, 1.0, 2.0, 3.0, -1.0, 0.5, -0.5, 1.5, -2.0, 2.5, 0.1})
                                  : r.pick({kNaN, kInf, -kInf, 1e300});
  const char* approx = op == 11 ? "tanh" : r.chance(0.9) ? "none" : r.pick<const char*>({"sigmoid", "", "TANH", nullptr});
  const bool valid = is_float(x) && !(op == 5 && !std::isfinite(p)) &&
                     !(op == 10 && (approx == nullptr || std::string(approx) != "none"));
  Call call(seed, name);
  call.t("x", x);
  if (op == 5) call("p", p);
  if (op == 10) call("approximate", approx ? std::string("\"") + approx + "\"" : std::string("nullptr"));
  INFO(call.str());
  const Unchanged unchanged({x});
  const auto y = attempt(name, valid ? Expect::ok : Expect::error, [&] {
    switch (op) {
      case 0: return r.chance(0.5) ? -x : tg::neg(x);
      case 1: return tg::exp(x);
      case 2: return tg::log(x);
      case 3: return tg::sqrt(x);
      case 4: return tg::rsqrt(x);
      case 5: return tg::pow(x, p);
      case 6: return tg::abs(x);
      case 7: return tg::tanh(x);
      case 8: return tg::sigmoid(x);
      case 9: return tg::relu(x);
      case 12: return tg::silu(x);
      default: return tg::gelu(x, approx);
    }
  });
  if (!y) return;
  const DType t = x.dtype();
  const double pt = as_dtype(p, t);  // the exponent in the tensor's dtype
  constexpr double kC = 0.7978845608028654;  // sqrt(2 / pi)
  const std::vector<double> xv = values(x);
  Ref ref, dref;  // forward values, and the derivative with its error scale
  for (double v : xv) {
    double f = 0, d = 0, dm = 0;
    switch (op) {
      case 0: f = -v, d = -1; break;
      case 1: f = std::exp(v), d = f, dm = fin(f); break;
      case 2: f = std::log(v), d = 1 / v; break;
      case 3: f = std::sqrt(v), d = 0.5 / f; break;
      case 4: f = 1 / std::sqrt(v), d = -0.5 * f * f * f; break;
      case 5: f = std::pow(v, pt), d = pt == 0 ? 0.0 : pt * std::pow(v, pt - 1); break;
      case 6: f = std::fabs(v), d = v > 0 ? 1.0 : v < 0 ? -1.0 : 0.0; break;
      case 7: f = std::tanh(v), d = 1 - f * f, dm = f * f; break;  // 1 - y^2 cancels near |y| = 1
      case 8: f = 1 / (1 + std::exp(-v)), d = f * (1 - f), dm = f; break;
      case 9: f = v > 0 ? v : (std::isnan(v) ? v : 0.0), d = v > 0 ? 1.0 : 0.0; break;
      case 12: {  // silu: x s, slope s (1 + x (1 - s)); float32's s has fast_exp's 2 ulp
        const double s = 1 / (1 + std::exp(-v));
        f = v * s, d = s * (1 + v * (1 - s)), dm = 1 + fin(v) * s * (1 - s);
        break;
      }
      case 10: {
        const double cdf = 0.5 * (1 + std::erf(v / std::sqrt(2.0)));
        f = v * cdf;
        d = cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2 * std::numbers::pi);
        dm = 1;  // float32 uses an erf approximation with absolute error 5e-7
        break;
      }
      default: {
        const double th = std::tanh(kC * (v + 0.044715 * v * v * v));
        f = 0.5 * v * (1 + th);
        d = 0.5 * (1 + th) + 0.5 * v * (1 - th * th) * kC * (1 + 3 * 0.044715 * v * v);
        dm = 1 + fin(0.5 * v * kC * (1 + 3 * 0.044715 * v * v));  // what multiplies 1 - tanh^2, which cancels
        break;
      }
    }
    // gelu is x Phi(x), silu x sigmoid(x): the rounding scale is |x| (1 + tanh(u) cancels for large
    // negative x)
    ref.add(f, op >= 10 ? fin(v) + fin(f) : fin(f));
    // derivatives are compared where the input is finite and moderate: for |x| beyond 1e15 the
    // formulas overflow intermediates (x^3) differently in float32 and float64
    // (log, sqrt, rsqrt and pow have 1/x-like derivatives that overflow for tiny x)
    const bool moderate = std::isfinite(v) && std::fabs(v) < 1e15 && !(op >= 2 && op <= 5 && std::fabs(v) <= 1e-15);
    dref.add(d, moderate ? fin(d) + dm : kInf);
  }
  check_output(name, *y, t, x.shape(), &ref);
  const auto g = run_backward(r, name, *y, {x});
  if (!g) return;
  const std::vector<double> gv = g->to_vector<double>();
  Ref gx;
  for (std::size_t i = 0; i < xv.size(); ++i) gx.add(gv[i] * dref.val[i], fin(gv[i]) * dref.mag[i]);
  check_grad(name, x, gx);
}

// ---------------------------------------------------------------------------------------------
// Reductions: sum, mean, var, max over random axes.

// Which dims a reduction over `axes` reduces, or nullopt when the axes are invalid.
std::optional<std::vector<bool>> reduced_dims(const std::vector<int>& axes, int nd) {
  std::vector<bool> red(static_cast<std::size_t>(nd), axes.empty());
  for (int a : axes) {
    if (a < -nd || a >= nd) return std::nullopt;
    const auto k = static_cast<std::size_t>(a < 0 ? a + nd : a);
    if (red[k]) return std::nullopt;
    red[k] = true;
  }
  return red;
}

std::vector<int> rand_axes(Rng& r, int nd) {
  std::vector<int> axes;
  if (r.chance(0.2)) return axes;  // all axes
  for (int d = 0; d < nd; ++d)
    if (r.chance(0.5)) axes.push_back(r.chance(0.3) ? d - nd : d);
  r.shuffle(axes);
  if (!axes.empty() && r.chance(0.08)) {  // the same axis twice, maybe through its negative alias
    const int a = axes[0];
    axes.push_back(r.chance(0.5) ? a : (a < 0 ? a + nd : a - nd));
  }
  if (r.chance(0.08)) axes.push_back(r.pick({nd, -nd - 1, 100, -100}));
  return axes;
}

void fuzz_reduce(Rng& r, std::uint64_t seed) {
  static const char* const kNames[] = {"sum", "mean", "var", "max"};
  const int op = static_cast<int>(r.range(0, 3));
  const std::string name = kNames[op];
  Tensor x = input(r, rand_shape(r), any_dtype(r));
  const int nd = x.dim();
  const std::vector<int> axes = rand_axes(r, nd);
  const bool keepdim = r.chance(0.5);
  const int correction = r.pick({1, 1, 1, 0, 2, -1, 1000});
  const bool use_method = op <= 1 && r.chance(0.3);
  Call call(seed, name);
  call.t("x", x)("axes", fmt(axes))("keepdim", keepdim);
  if (op == 2) call("correction", correction);
  INFO(call.str());
  const Unchanged unchanged({x});

  const auto red = reduced_dims(axes, nd);
  Expect expect = is_float(x) && red && !(op == 2 && correction < 0) ? Expect::ok : Expect::error;
  // A 0-d tensor with axis 0 or -1: PyTorch accepts it, tapegrad refuses; either is fine.
  const bool scalar_axes =
      is_float(x) && nd == 0 && !axes.empty() && std::all_of(axes.begin(), axes.end(), [](int a) { return a == 0 || a == -1; });
  if (scalar_axes) expect = Expect::either;
  Shape out;
  i64 R = 1;
  std::vector<i64> group;  // output flat index of each input element
  if (expect == Expect::ok) {
    for (int d = 0; d < nd; ++d) {
      if ((*red)[static_cast<std::size_t>(d)]) {
        R *= x.shape()[d];
        if (keepdim) out.push_back(1);
      } else {
        out.push_back(x.shape()[d]);
      }
    }
    for_each_index(x.shape(), [&](const std::vector<i64>& idx, i64) {
      i64 o = 0;
      for (int d = 0; d < nd; ++d)
        if (!(*red)[static_cast<std::size_t>(d)]) o = o * x.shape()[d] + idx[static_cast<std::size_t>(d)];
      group.push_back(o);
    });
    // Empty reductions with no identity (mean, max) and var without enough elements: tapegrad
    // refuses them, PyTorch returns NaN or fails; either is accepted, and values are not compared.
    if ((op == 1 || op == 3) && R == 0) expect = Expect::either;
    if (op == 2 && R - correction <= 0) expect = Expect::either;
  }
  const auto y = attempt(name, expect, [&] {
    switch (op) {
      case 0: return use_method ? x.sum(axes, keepdim) : tg::sum(x, axes, keepdim);
      case 1: return use_method ? x.mean(axes, keepdim) : tg::mean(x, axes, keepdim);
      case 2: return tg::var(x, axes, keepdim, correction);
      default: return tg::max(x, axes, keepdim);
    }
  });
  if (!y || scalar_axes) return;
  const std::vector<double> xv = values(x);
  const auto n_out = static_cast<std::size_t>(out.numel());
  std::vector<std::vector<double>> groups(n_out);
  for (std::size_t i = 0; i < xv.size(); ++i) groups[static_cast<std::size_t>(group[i])].push_back(xv[i]);
  Ref ref;
  std::vector<double> mu(n_out, 0.0);
  for (std::size_t o = 0; o < n_out; ++o) {
    const std::vector<double>& v = groups[o];
    double s = 0, sa = 0, sq = 0, mx = -kInf;
    bool nan = false;
    for (double e : v) {
      s += e;
      sa += fin(e);
      sq += fin(e) * fin(e);
      nan = nan || std::isnan(e);
      mx = std::max(mx, e);
    }
    mu[o] = s / static_cast<double>(R);
    if (op == 0) ref.add(s, sa);
    else if (op == 1) ref.add(s / static_cast<double>(R), sa / static_cast<double>(R));
    else if (op == 2) {
      double m2 = 0;
      for (double e : v) m2 += (e - mu[o]) * (e - mu[o]);
      const double denom = static_cast<double>(R - correction);
      ref.add(m2 / denom, denom > 0 ? sq / denom : kInf);
    } else {
      ref.add(nan ? kNaN : mx, R > 0 ? 0.0 : kInf);
    }
  }
  const bool compare_values = expect == Expect::ok;  // "either" cases: shape only
  check_output(name, *y, x.dtype(), out, compare_values ? &ref : nullptr);
  const auto g = run_backward(r, name, *y, {x});
  if (!g || !compare_values || op == 3) return;
  // sum / mean: each element receives its output's gradient (/ R); var: 2 (x - mean) / (R - c).
  const std::vector<double> gv = g->to_vector<double>();
  Ref gx;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const auto o = static_cast<std::size_t>(group[i]);
    if (op == 0) gx.add(gv[o], fin(gv[o]));
    else if (op == 1) gx.add(gv[o] / static_cast<double>(R), fin(gv[o]) / static_cast<double>(R));
    else {
      const double k = 2.0 / static_cast<double>(R - correction);
      double mx = 0;
      for (double e : groups[o]) mx = std::max(mx, fin(e));
      gx.add(k * gv[o] * (xv[i] - mu[o]), fin(k * gv[o]) * (fin(xv[i]) + mx));
    }
  }
  check_grad(name, x, gx);
}

// ---------------------------------------------------------------------------------------------
// matmul with transpose flags and broadcast batch dims.

void fuzz_matmul(Rng& r, std::uint64_t seed) {
  const bool same = r.chance(0.06);  // matmul(a, a, ta, !ta): a Gram matrix, both gradients into a
  const i64 M = rand_dim(r), K = rand_dim(r), N = same ? M : rand_dim(r);
  const bool ta = r.chance(0.3), tb = same ? !ta : r.chance(0.3);
  const Shape batch = rand_shape(r, 0, 2);
  Shape sa = broadcast_partner(r, batch, false), sb = broadcast_partner(r, batch, false);
  sa.push_back(ta ? K : M);
  sa.push_back(ta ? M : K);
  sb.push_back(tb ? N : K);
  sb.push_back(tb ? K : N);
  if (r.chance(0.1)) sb = rand_shape(r);  // most likely mismatched
  if (r.chance(0.05)) sa = rand_shape(r, 0, 1);  // fewer than 2 dims
  DType dt = any_dtype(r, 0.05);
  Tensor a = input(r, sa, dt), b = same ? a : input(r, sb, r.chance(0.05) ? other_dtype(r, dt) : dt);
  const std::string c = Call(seed, "matmul").t("a", a).t("b", b)("b is a", same)("trans_a", ta)("trans_b", tb).str();
  INFO(c);
  const Unchanged unchanged({a, b});
  // oracle
  std::optional<Shape> out;
  i64 am = 0, ak = 0, bk = 0, bn = 0;
  Shape ab, bb;  // batch parts
  if (is_float(a) && is_float(b) && a.dtype() == b.dtype() && a.dim() >= 2 && b.dim() >= 2) {
    const i64 ar = a.shape()[a.dim() - 2], ac = a.shape()[a.dim() - 1];
    const i64 br = b.shape()[b.dim() - 2], bc = b.shape()[b.dim() - 1];
    am = ta ? ac : ar, ak = ta ? ar : ac, bk = tb ? bc : br, bn = tb ? br : bc;
    for (int d = 0; d < a.dim() - 2; ++d) ab.push_back(a.shape()[d]);
    for (int d = 0; d < b.dim() - 2; ++d) bb.push_back(b.shape()[d]);
    if (ak == bk) {
      out = broadcast_shape(ab, bb);
      if (out) {
        out->push_back(am);
        out->push_back(bn);
      }
    }
  }
  const auto y = attempt("matmul", out ? Expect::ok : Expect::error, [&] { return tg::matmul(a, b, ta, tb); });
  if (!y) return;
  const std::vector<double> av = values(a), bv = values(b);
  Shape ob = *broadcast_shape(ab, bb);
  const i64 Kd = ak, Md = am, Nd = bn;
  // element (m, k) of op(A) within A's matrix, as a flat index of a
  auto a_at = [&](i64 mat, i64 m, i64 k) { return mat * Md * Kd + (ta ? k * Md + m : m * Kd + k); };
  auto b_at = [&](i64 mat, i64 k, i64 n) { return mat * Kd * Nd + (tb ? n * Kd + k : k * Nd + n); };
  Ref ref;
  std::vector<std::array<i64, 2>> mats;  // (a matrix, b matrix) per output batch entry
  for_each_index(ob, [&](const std::vector<i64>& idx, i64) {
    mats.push_back({broadcast_source(ab, idx), broadcast_source(bb, idx)});
  });
  for (const auto& mt : mats)
    for (i64 m = 0; m < Md; ++m)
      for (i64 n = 0; n < Nd; ++n) {
        double s = 0, mag = 0;
        for (i64 k = 0; k < Kd; ++k) {
          const double t = av[static_cast<std::size_t>(a_at(mt[0], m, k))] * bv[static_cast<std::size_t>(b_at(mt[1], k, n))];
          s += t;
          mag += fin(t);
        }
        ref.add(s, mag);
      }
  check_output("matmul", *y, a.dtype(), *out, &ref);
  const auto g = run_backward(r, "matmul", *y, {a, b});
  if (!g) return;
  // d op(A) = dC op(B)^T and d op(B) = op(A)^T dC, summed over the batch entries that share a matrix.
  const std::vector<double> gv = g->to_vector<double>();
  Ref ga, gb;
  ga.zeros(av.size());
  gb.zeros(bv.size());
  for (std::size_t e = 0; e < mats.size(); ++e)
    for (i64 m = 0; m < Md; ++m)
      for (i64 n = 0; n < Nd; ++n) {
        const double gk = gv[static_cast<std::size_t>((static_cast<i64>(e) * Md + m) * Nd + n)];
        for (i64 k = 0; k < Kd; ++k) {
          const auto ia = static_cast<std::size_t>(a_at(mats[e][0], m, k));
          const auto ib = static_cast<std::size_t>(b_at(mats[e][1], k, n));
          ga.val[ia] += gk * bv[ib];
          ga.mag[ia] += fin(gk * bv[ib]);
          gb.val[ib] += av[ia] * gk;
          gb.mag[ib] += fin(av[ia] * gk);
        }
      }
  if (same) {
    for (std::size_t i = 0; i < ga.val.size(); ++i) ga.val[i] += gb.val[i], ga.mag[i] += gb.mag[i];
    check_grad("matmul", a, ga);
    return;
  }
  check_grad("matmul", a, ga);
  check_grad("matmul", b, gb);
}

// ---------------------------------------------------------------------------------------------
// softmax / log_softmax over the last axis.

// Max-subtracted softmax of one row in double (a NaN or +inf makes the row NaN; -inf entries get 0;
// an all -inf row is NaN, as in PyTorch). Returns the log-sum-exp terms for log_softmax too.
void softmax_row(const std::vector<double>& z, std::vector<double>& p, std::vector<double>& logp) {
  double mx = -kInf;
  for (double e : z) mx = e > mx ? e : mx;
  bool nan = false;
  for (double e : z) nan = nan || std::isnan(e);
  double s = 0;
  for (double e : z) s += std::exp(e - mx);
  p.assign(z.size(), 0.0);
  logp.assign(z.size(), 0.0);
  for (std::size_t j = 0; j < z.size(); ++j) {
    p[j] = nan ? kNaN : std::exp(z[j] - mx) / s;
    logp[j] = nan ? kNaN : (z[j] - mx) - std::log(s);
  }
}

void fuzz_softmax(Rng& r, std::uint64_t seed) {
  const bool log = r.chance(0.5);
  const std::string name = log ? "log_softmax" : "softmax";
  Tensor x = input(r, rand_shape(r), any_dtype(r));
  const int nd = x.dim();
  const int axis = r.chance(0.7) ? -1 : r.pick({nd - 1, 0, 1, -nd, nd, -nd - 1, 7});
  const std::string c = Call(seed, name).t("x", x)("axis", axis).str();
  INFO(c);
  const Unchanged unchanged({x});
  const bool valid = is_float(x) && nd >= 1 && axis >= -nd && axis < nd && (axis < 0 ? axis + nd : axis) == nd - 1;
  const auto y = attempt(name, valid ? Expect::ok : Expect::error,
                         [&] { return log ? tg::log_softmax(x, axis) : tg::softmax(x, axis); });
  if (!y) return;
  const std::vector<double> xv = values(x);
  const i64 C = x.shape()[nd - 1], rows = C ? x.numel() / C : 0;
  Ref ref;
  std::vector<double> yv_ref;
  std::vector<bool> row_finite;
  for (i64 rr = 0; rr < rows; ++rr) {
    const std::vector<double> z(xv.begin() + rr * C, xv.begin() + (rr + 1) * C);
    std::vector<double> p, lp;
    softmax_row(z, p, lp);
    double mx = -kInf;
    bool finite = true;
    for (double e : z) mx = std::max(mx, e), finite = finite && std::isfinite(e);
    row_finite.push_back(finite);
    for (i64 j = 0; j < C; ++j) {
      if (log) ref.add(lp[static_cast<std::size_t>(j)], fin(z[static_cast<std::size_t>(j)] - mx) + fin(lp[static_cast<std::size_t>(j)]) + 1);
      else ref.add(p[static_cast<std::size_t>(j)], 1.0);
      yv_ref.push_back(p[static_cast<std::size_t>(j)]);
    }
  }
  check_output(name, *y, x.dtype(), x.shape(), &ref);
  const auto g = run_backward(r, name, *y, {x});
  if (!g) return;
  // softmax: dx = y (g - sum g y);  log_softmax: dx = g - softmax(x) sum g.  Finite rows only.
  const std::vector<double> gv = g->to_vector<double>();
  Ref gx;
  for (i64 rr = 0; rr < rows; ++rr) {
    double dot = 0, gs = 0, ga = 0;
    for (i64 j = 0; j < C; ++j) {
      const auto k = static_cast<std::size_t>(rr * C + j);
      dot += gv[k] * yv_ref[k];
      gs += gv[k];
      ga += std::fabs(gv[k]);
    }
    for (i64 j = 0; j < C; ++j) {
      const auto k = static_cast<std::size_t>(rr * C + j);
      const double d = log ? gv[k] - yv_ref[k] * gs : yv_ref[k] * (gv[k] - dot);
      gx.add(d, row_finite[static_cast<std::size_t>(rr)] ? ga + std::fabs(gv[k]) : kInf);
    }
  }
  check_grad(name, x, gx);
}

// ---------------------------------------------------------------------------------------------
// masked_fill and causal_mask.

void fuzz_masked_fill(Rng& r, std::uint64_t seed) {
  Tensor x = input(r, rand_shape(r), any_dtype(r));
  const Shape ms = r.chance(0.1) ? rand_shape(r) : broadcast_partner(r, x.shape());
  const DType mdt = r.chance(0.06) ? float_dtype(r) : int32;
  Tensor mask = r.chance(0.03) ? Tensor() : filled(ms, mdt, [&] { return static_cast<double>(r.pick({0, 0, 0, 1, -1, 7, kI32Min})); });
  const double value = draw_scalar(r);
  const std::string c = Call(seed, "masked_fill").t("x", x).t("mask", mask)("value", value).str();
  INFO(c);
  const Unchanged unchanged({x, mask});
  bool valid = is_float(x) && mask.defined() && mask.dtype() == int32 && mask.dim() <= x.dim();
  for (int d = 0; valid && d < mask.dim(); ++d) {
    const i64 m = mask.shape()[d], n = x.shape()[x.dim() - mask.dim() + d];
    valid = m == n || m == 1;
  }
  const auto y = attempt("masked_fill", valid ? Expect::ok : Expect::error, [&] { return tg::masked_fill(x, mask, value); });
  if (!y) return;
  const std::vector<double> xv = values(x), mv = values(mask);
  Ref ref;
  ref.exact = true;
  std::vector<bool> masked;
  for_each_index(x.shape(), [&](const std::vector<i64>& idx, i64 flat) {
    const bool m = mv[static_cast<std::size_t>(broadcast_source(mask.shape(), idx))] != 0;
    masked.push_back(m);
    ref.add(m ? as_dtype(value, x.dtype()) : xv[static_cast<std::size_t>(flat)], 0.0);
  });
  check_output("masked_fill", *y, x.dtype(), x.shape(), &ref);
  const auto g = run_backward(r, "masked_fill", *y, {x});
  if (!g) return;
  const std::vector<double> gv = g->to_vector<double>();
  Ref gx;
  gx.exact = true;
  for (std::size_t i = 0; i < gv.size(); ++i) gx.add(masked[i] ? 0.0 : gv[i], 0.0);
  check_grad("masked_fill", x, gx);
}

void fuzz_causal_mask(Rng& r, std::uint64_t seed) {
  // Sizes whose (T, T) element count overflows int64 or exceeds any memory must be refused before
  // allocating; 1e9 is not tried (a legitimate 4 EB request, refused by the allocator).
  const i64 T = r.chance(0.85) ? r.range(-2, 6) : r.pick<i64>({kI64Min, -1, i64(1) << 32, 3037000500LL, kI64Max});
  INFO(Call(seed, "causal_mask")("T", T).str());
  const Expect expect = T < 0 ? Expect::error : T <= 6 ? Expect::ok : Expect::either;
  const auto y = attempt("causal_mask", expect, [&] { return tg::causal_mask(T); });
  if (!y || T > 6) return;
  Ref ref;
  ref.exact = true;
  for (i64 i = 0; i < T; ++i)
    for (i64 j = 0; j < T; ++j) ref.add(j > i ? 1.0 : 0.0, 0.0);
  check_output("causal_mask", *y, int32, Shape{T, T}, &ref);
}

// ---------------------------------------------------------------------------------------------
// embedding and cross_entropy: int32 indices, including out-of-range ones.

void fuzz_embedding(Rng& r, std::uint64_t seed) {
  const i64 V = rand_dim(r), C = rand_dim(r);
  Shape ws{V, C};
  if (r.chance(0.06)) ws = r.chance(0.5) ? Shape{V} : Shape{V, C, 2};
  Tensor w = input(r, ws, any_dtype(r, 0.05));
  Shape is = rand_shape(r, 0, 3);
  if (r.chance(0.03)) is = r.chance(0.5) ? Shape{1, 1, 1, 1, 1, 1, 1} : Shape{1, 1, 1, 1, 1, 1, 1, 1};  // 7 or 8 dims
  const bool bad_ids = r.chance(0.12);
  const DType idt = r.chance(0.05) ? float_dtype(r) : int32;
  Tensor ids = r.chance(0.03) ? Tensor() : filled(is, idt, [&] {
    if (bad_ids && r.chance(0.4)) return static_cast<double>(r.pick<i64>({-1, V, V + 3, kI32Max, kI32Min}));
    return static_cast<double>(V > 0 ? r.range(0, V - 1) : 0);
  });
  const std::string c = Call(seed, "embedding").t("weight", w).t("ids", ids).str();
  INFO(c);
  const Unchanged unchanged({w, ids});
  bool valid = is_float(w) && w.dim() == 2 && ids.defined() && ids.dtype() == int32 && ids.dim() < 8;
  const std::vector<double> iv = values(ids);
  for (std::size_t i = 0; valid && i < iv.size(); ++i) valid = iv[i] >= 0 && iv[i] < static_cast<double>(V);
  const auto y = attempt("embedding", valid ? Expect::ok : Expect::error, [&] { return tg::embedding(w, ids); });
  if (!y) return;
  Shape out = ids.shape();
  out.push_back(C);
  std::vector<i64> src;
  for (double id : iv)
    for (i64 j = 0; j < C; ++j) src.push_back(static_cast<i64>(id) * C + j);
  const Ref ref = gather_ref(values(w), src);
  check_output("embedding", *y, w.dtype(), out, &ref);
  const auto g = run_backward(r, "embedding", *y, {w});
  if (g) check_grad("embedding", w, scatter_ref(g->to_vector<double>(), src, static_cast<std::size_t>(w.numel())));
}

void fuzz_cross_entropy(Rng& r, std::uint64_t seed) {
  const i64 V = rand_dim(r);
  Shape lead = rand_shape(r, 0, 2), ls = lead;
  ls.push_back(V);
  Tensor logits = input(r, r.chance(0.04) ? Shape{} : ls, any_dtype(r, 0.05));
  Shape ts = lead;
  if (r.chance(0.08)) ts = r.chance(0.5) ? ls : rand_shape(r, 0, 2);
  const i64 ignore = r.pick<i64>({-100, -100, -100, -1, 0, 2, i64(1) << 40, kI64Min});
  const bool ignore_fits = ignore >= kI32Min && ignore <= kI32Max;
  const int mode = static_cast<int>(r.range(0, 9));  // 0: out-of-range targets, 1: mostly ignored, else valid
  const DType tdt = r.chance(0.05) ? float_dtype(r) : int32;
  Tensor targets = r.chance(0.03) ? Tensor() : filled(ts, tdt, [&] {
    if (mode == 0 && r.chance(0.5)) return static_cast<double>(r.pick<i64>({-1, V, kI32Max, kI32Min, -100}));
    if (ignore_fits && (mode == 1 ? r.chance(0.8) : r.chance(0.15))) return static_cast<double>(ignore);
    return static_cast<double>(V > 0 ? r.range(0, V - 1) : 0);
  });
  const std::string c = Call(seed, "cross_entropy").t("logits", logits).t("targets", targets)("ignore_index", ignore).str();
  INFO(c);
  const Unchanged unchanged({logits, targets});
  bool valid = is_float(logits) && logits.dim() >= 1 && targets.defined() && targets.dtype() == int32;
  if (valid) {
    Shape want;
    for (int d = 0; d + 1 < logits.dim(); ++d) want.push_back(logits.shape()[d]);
    valid = targets.shape() == want;
  }
  const std::vector<double> tv = values(targets);
  i64 count = 0;
  for (std::size_t i = 0; valid && i < tv.size(); ++i) {
    if (tv[i] == static_cast<double>(ignore)) continue;
    valid = tv[i] >= 0 && tv[i] < static_cast<double>(V);
    ++count;
  }
  valid = valid && count > 0;  // every target ignored: tapegrad refuses (PyTorch returns NaN)
  const auto y = attempt("cross_entropy", valid ? Expect::ok : Expect::error, [&] { return tg::cross_entropy(logits, targets, ignore); });
  if (!y) return;
  const std::vector<double> xv = values(logits);
  double total = 0, mag = 0;
  std::vector<std::vector<double>> probs(tv.size());
  for (std::size_t rr = 0; rr < tv.size(); ++rr) {
    if (tv[rr] == static_cast<double>(ignore)) continue;
    const std::vector<double> z(xv.begin() + static_cast<i64>(rr) * V, xv.begin() + static_cast<i64>(rr + 1) * V);
    double mx = -kInf, s = 0;
    for (double e : z) mx = e > mx ? e : mx;
    for (double e : z) s += std::exp(e - mx);
    bool nan = false;
    for (double e : z) nan = nan || std::isnan(e);
    const double xt = z[static_cast<std::size_t>(tv[rr])];
    total += nan ? kNaN : mx + std::log(s) - xt;
    mag += fin(mx) + fin(std::log(s)) + fin(xt);
    std::vector<double> lp;
    softmax_row(z, probs[rr], lp);
  }
  Ref ref;
  ref.add(total / static_cast<double>(count), mag / static_cast<double>(count));
  check_output("cross_entropy", *y, logits.dtype(), Shape{}, &ref);
  const auto g = run_backward(r, "cross_entropy", *y, {logits});
  if (!g) return;
  // dx = (softmax(x) - onehot(t)) g / count on the rows that count, 0 on ignored rows.
  const double gs = g->item() / static_cast<double>(count);
  Ref gx;
  for (std::size_t rr = 0; rr < tv.size(); ++rr)
    for (i64 j = 0; j < V; ++j) {
      if (tv[rr] == static_cast<double>(ignore)) {
        gx.add(0.0, 0.0);
        continue;
      }
      const double p = probs[rr][static_cast<std::size_t>(j)];
      gx.add(gs * (p - (j == static_cast<i64>(tv[rr]) ? 1.0 : 0.0)), std::isfinite(p) ? fin(gs) * 2 : kInf);
    }
  check_grad("cross_entropy", logits, gx);
}

// ---------------------------------------------------------------------------------------------
// dropout: every element is either dropped (x * 0) or kept and scaled by 1 / (1 - p).

void fuzz_dropout(Rng& r, std::uint64_t seed) {
  Tensor x = input(r, rand_shape(r), any_dtype(r));
  const double p = r.chance(0.85) ? r.pick({0.0, 0.1, 0.5, 0.9, 1.0}) : r.pick({-0.1, 1.5, kNaN, kInf, -kInf});
  const bool train = r.chance(0.75);
  const std::string c = Call(seed, "dropout").t("x", x)("p", p)("train", train).str();
  INFO(c);
  const Unchanged unchanged({x});
  const bool valid = is_float(x) && p >= 0 && p <= 1;
  const auto y = attempt("dropout", valid ? Expect::ok : Expect::error, [&] { return tg::dropout(x, p, train); });
  if (!y) return;
  check_output("dropout", *y, x.dtype(), x.shape(), nullptr);
  if (y->shape() == x.shape() && y->dtype() == x.dtype()) {
    const std::vector<double> xv = values(x), yv = y->to_vector<double>();
    const bool identity = !train || p == 0;
    const double keep = p == 1 ? 0.0 : as_dtype(1.0 / (1.0 - p), x.dtype());
    auto same = [](double u, double v) { return (std::isnan(u) && std::isnan(v)) || u == v; };
    std::size_t bad = 0;
    for (std::size_t i = 0; i < xv.size(); ++i) {
      const double dropped = xv[i] * 0.0, kept = as_dtype(xv[i] * keep, x.dtype());
      const bool ok = identity ? same(yv[i], xv[i]) : same(yv[i], dropped) || (p < 1 && same(yv[i], kept));
      bad += !ok;
    }
    INFO("dropout: " << bad << " elements are neither x * 0 nor x / (1 - p)");
    CHECK(bad == 0);
    ++stats()["dropout"].checked;
  }
  run_backward(r, "dropout", *y, {x});
}

// ---------------------------------------------------------------------------------------------
// Shape ops: reshape, transpose, permute, slice, cat, split (both forms), to, clone.

// A target shape for reshape: usually a valid refactorisation of numel, maybe with one -1; sometimes
// a random (mismatched) shape, two -1s, or a negative dim.
std::vector<i64> reshape_target(Rng& r, i64 numel) {
  std::vector<i64> dims;
  if (r.chance(0.75)) {
    std::vector<i64> factors;
    i64 n = numel;
    for (i64 f = 2; n > 1 && f <= n; ++f)
      while (n % f == 0) factors.push_back(f), n /= f;
    const i64 nd = r.range(numel == 0 ? 1 : 0, 4);
    dims.assign(static_cast<std::size_t>(std::max<i64>(nd, factors.empty() ? nd : 1)), 1);
    for (i64 f : factors) dims[static_cast<std::size_t>(r.range(0, static_cast<i64>(dims.size()) - 1))] *= f;
    if (numel == 0) {
      for (i64& d : dims) d = rand_dim(r);
      dims[static_cast<std::size_t>(r.range(0, static_cast<i64>(dims.size()) - 1))] = 0;
    }
    if (!dims.empty() && r.chance(0.3)) dims[static_cast<std::size_t>(r.range(0, static_cast<i64>(dims.size()) - 1))] = -1;
  } else {
    for (i64 d = r.range(0, 4); d > 0; --d) dims.push_back(rand_dim(r));
    if (!dims.empty() && r.chance(0.4)) dims[0] = r.pick<i64>({-1, -2, kI64Min});
    if (dims.size() >= 2 && r.chance(0.2)) dims[1] = -1;
    // huge dims whose product overflows int64 are kept out while reshape_numel_overflow is open
    if (!kKnownBugs.reshape_numel_overflow && dims.size() >= 2 && r.chance(0.2))
      dims[0] = i64(1) << 62, dims[1] = r.pick<i64>({4, 5});
  }
  return dims;
}

// The reshape oracle: the resolved shape, or nullopt. Products are formed in 128 bits.
std::optional<std::vector<i64>> resolve_reshape(std::vector<i64> dims, i64 numel) {
  int infer = -1;
  __int128 known = 1;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == -1) {
      if (infer >= 0) return std::nullopt;
      infer = static_cast<int>(d);
    } else if (dims[d] < 0) {
      return std::nullopt;
    } else {
      known *= dims[d];
      if (known > (__int128(1) << 100)) known = __int128(1) << 100;
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) return std::nullopt;
    dims[static_cast<std::size_t>(infer)] = static_cast<i64>(numel / known);
    known *= dims[static_cast<std::size_t>(infer)];
  }
  if (known != numel) return std::nullopt;
  return dims;
}

// Source index of each output element of permute(x, perm) (perm already normalised).
std::vector<i64> permute_src(const Shape& s, const std::vector<int>& perm, Shape& out) {
  out = Shape();
  for (int p : perm) out.push_back(s[p]);
  std::vector<i64> src;
  for_each_index(out, [&](const std::vector<i64>& idx, i64) {
    std::vector<i64> xi(static_cast<std::size_t>(s.ndim()));
    for (std::size_t d = 0; d < perm.size(); ++d) xi[static_cast<std::size_t>(perm[d])] = idx[d];
    src.push_back(flat_of(s, xi));
  });
  return src;
}

// Source index of each output element of slice(x, dim, start, end, step) with Python's clamping;
// count is the output length along dim.
std::vector<i64> slice_src(const Shape& s, int dim, i64 start, i64 end, i64 step, i64& count) {
  const i64 n = s[dim];
  auto clampi = [n](i64 i) { return std::min<__int128>(n, std::max<__int128>(0, i < 0 ? __int128(i) + n : __int128(i))); };
  const __int128 s0 = clampi(start), e0 = clampi(end);
  count = e0 > s0 ? static_cast<i64>((e0 - s0 + step - 1) / step) : 0;
  Shape out = s;
  out[dim] = count;
  std::vector<i64> src;
  for_each_index(out, [&](const std::vector<i64>& idx, i64) {
    std::vector<i64> xi = idx;
    xi[static_cast<std::size_t>(dim)] = static_cast<i64>(s0) + idx[static_cast<std::size_t>(dim)] * step;
    src.push_back(flat_of(s, xi));
  });
  return src;
}

bool axis_ok(int a, int nd) { return nd > 0 && a >= -nd && a < nd; }
int norm(int a, int nd) { return a < 0 ? a + nd : a; }
int rand_axis(Rng& r, int nd) { return r.chance(0.85) ? static_cast<int>(r.range(-nd, std::max(nd - 1, 0))) : r.pick({nd, -nd - 1, 9, -9}); }

void fuzz_reshape(Rng& r, std::uint64_t seed) {
  Tensor x = input(r, rand_shape(r), any_dtype(r, 0.2));
  const std::vector<i64> dims = reshape_target(r, x.defined() ? x.numel() : 1);
  const bool use_method = r.chance(0.3);
  INFO(Call(seed, "reshape").t("x", x)("shape", fmt(dims)).str());
  const Unchanged unchanged({x});
  const auto want = x.defined() ? resolve_reshape(dims, x.numel()) : std::nullopt;
  const auto y = attempt("reshape", want ? Expect::ok : Expect::error,
                         [&] { return use_method ? x.reshape(shape_of(dims)) : tg::reshape(x, shape_of(dims)); });
  if (!y) return;
  std::vector<i64> src(static_cast<std::size_t>(x.numel()));
  std::iota(src.begin(), src.end(), i64(0));
  const Ref ref = gather_ref(values(x), src);
  check_output("reshape", *y, x.dtype(), shape_of(*want), &ref);
  CHECK(y->shares_storage(x));  // reshape is documented to share storage
  const auto g = run_backward(r, "reshape", *y, {x});
  if (g) check_grad("reshape", x, scatter_ref(g->to_vector<double>(), src, src.size()));
}

void fuzz_permute(Rng& r, std::uint64_t seed) {
  const bool transpose = r.chance(0.5);
  const std::string name = transpose ? "transpose" : "permute";
  Tensor x = input(r, rand_shape(r), any_dtype(r, 0.2));
  const int nd = x.dim();
  std::vector<int> dims(static_cast<std::size_t>(nd));
  std::iota(dims.begin(), dims.end(), 0);
  r.shuffle(dims);
  for (int& d : dims)
    if (r.chance(0.3)) d -= nd;
  if (r.chance(0.12)) {
    const int how = static_cast<int>(r.range(0, 3));
    if (how == 0) dims.push_back(0);
    else if (how == 1 && !dims.empty()) dims.pop_back();
    else if (how == 2 && nd >= 2) dims[0] = norm(dims[1], nd) - (r.chance(0.5) ? nd : 0);
    else dims.push_back(r.pick({nd, -nd - 1}));
  }
  const int d0 = rand_axis(r, nd), d1 = rand_axis(r, nd);
  const bool use_method = r.chance(0.3);
  Call call(seed, name);
  call.t("x", x);
  if (transpose) call("d0", d0)("d1", d1);
  else call("dims", fmt(dims));
  INFO(call.str());
  const Unchanged unchanged({x});
  std::optional<std::vector<int>> perm;
  Expect expect = Expect::error;
  if (x.defined()) {
    if (transpose) {
      if (axis_ok(d0, nd) && axis_ok(d1, nd)) {
        perm = std::vector<int>(static_cast<std::size_t>(nd));
        std::iota(perm->begin(), perm->end(), 0);
        std::swap((*perm)[static_cast<std::size_t>(norm(d0, nd))], (*perm)[static_cast<std::size_t>(norm(d1, nd))]);
        expect = Expect::ok;
      } else if (nd == 0 && (d0 == 0 || d0 == -1) && (d1 == 0 || d1 == -1)) {
        expect = Expect::either;  // PyTorch lets a 0-d tensor transpose dims 0 / -1
      }
    } else if (static_cast<int>(dims.size()) == nd) {
      std::vector<int> p;
      std::vector<bool> seen(static_cast<std::size_t>(nd), false);
      bool ok = true;
      for (int d : dims) {
        ok = ok && d >= -nd && d < nd && !seen[static_cast<std::size_t>(norm(d, nd))];
        if (!ok) break;
        seen[static_cast<std::size_t>(norm(d, nd))] = true;
        p.push_back(norm(d, nd));
      }
      if (ok) perm = p, expect = Expect::ok;
    }
  }
  const auto y = attempt(name, expect, [&] {
    if (transpose) return use_method ? x.transpose(d0, d1) : tg::transpose(x, d0, d1);
    return use_method ? x.permute(dims) : tg::permute(x, dims);
  });
  if (!y || !perm) return;
  Shape out;
  const std::vector<i64> src = permute_src(x.shape(), *perm, out);
  const Ref ref = gather_ref(values(x), src);
  check_output(name, *y, x.dtype(), out, &ref);
  const auto g = run_backward(r, name, *y, {x});
  if (g) check_grad(name, x, scatter_ref(g->to_vector<double>(), src, static_cast<std::size_t>(x.numel())));
}

void fuzz_slice(Rng& r, std::uint64_t seed) {
  Tensor x = input(r, rand_shape(r), any_dtype(r, 0.2));
  const int nd = x.dim();
  const int dim = rand_axis(r, nd);
  auto bound = [&] { return r.chance(0.8) ? r.range(-7, 7) : r.pick<i64>({kI64Min, kI64Max, -(i64(1) << 62), i64(1) << 62}); };
  const i64 start = bound(), end = bound();
  i64 step = r.chance(0.85) ? r.pick<i64>({1, 1, 1, 2, 3}) : r.pick<i64>({0, -1, kI64Min, i64(1) << 62, kI64Max, kI64Max - 1});
  if (kKnownBugs.slice_step_overflow && step > (i64(1) << 62)) step = i64(1) << 62;
  const bool use_method = r.chance(0.3);
  INFO(Call(seed, "slice").t("x", x)("dim", dim)("start", start)("end", end)("step", step).str());
  const Unchanged unchanged({x});
  const bool valid = x.defined() && axis_ok(dim, nd) && step >= 1;
  const auto y = attempt("slice", valid ? Expect::ok : Expect::error, [&] {
    return use_method ? x.slice(dim, start, end, step) : tg::slice(x, dim, start, end, step);
  });
  if (!y) return;
  i64 count = 0;
  const std::vector<i64> src = slice_src(x.shape(), norm(dim, nd), start, end, step, count);
  Shape out = x.shape();
  out[norm(dim, nd)] = count;
  const Ref ref = gather_ref(values(x), src);
  check_output("slice", *y, x.dtype(), out, &ref);
  const auto g = run_backward(r, "slice", *y, {x});
  if (g) check_grad("slice", x, scatter_ref(g->to_vector<double>(), src, static_cast<std::size_t>(x.numel())));
}

void fuzz_cat(Rng& r, std::uint64_t seed) {
  const Shape base = rand_shape(r, 1, 4);
  const int nd = base.ndim();
  const int dim = rand_axis(r, nd);
  const DType dt = any_dtype(r, 0.2);
  const i64 n = r.chance(0.04) ? 0 : r.range(1, 3);
  std::vector<Tensor> xs;
  for (i64 i = 0; i < n; ++i) {
    Shape s = base;
    if (axis_ok(dim, nd)) s[norm(dim, nd)] = rand_dim(r);
    if (r.chance(0.05)) s = rand_shape(r);  // likely mismatched outside dim (or 0-d)
    // sometimes an earlier tensor again: its gradient collects both slices
    xs.push_back(i > 0 && r.chance(0.08) ? xs[static_cast<std::size_t>(r.range(0, i - 1))]
                                         : input(r, s, r.chance(0.04) ? other_dtype(r, dt) : dt, 0.02));
  }
  Call call(seed, "cat");
  call("dim", dim);
  for (const Tensor& t : xs) call.t("x", t);
  INFO(call.str());
  const Unchanged unchanged(xs);
  bool valid = !xs.empty();
  for (const Tensor& t : xs) valid = valid && t.defined();
  Expect expect = Expect::error;
  if (valid) {
    const Tensor& x0 = xs[0];
    valid = axis_ok(dim, x0.dim());
    bool legacy_empty = false;  // PyTorch (legacy) skips 1-d empty tensors of another rank
    for (const Tensor& t : xs) {
      bool same = valid && t.dim() == x0.dim() && t.dtype() == x0.dtype();
      for (int d = 0; same && d < t.dim(); ++d) same = d == norm(dim, x0.dim()) || t.shape()[d] == x0.shape()[d];
      legacy_empty = legacy_empty || (!same && t.dim() == 1 && t.numel() == 0);
      valid = valid && same;
    }
    expect = valid ? Expect::ok : legacy_empty ? Expect::either : Expect::error;
  }
  const auto y = attempt("cat", expect, [&] { return tg::cat(xs, dim); });
  if (!y || expect != Expect::ok) return;
  const int d = norm(dim, xs[0].dim());
  Shape out = xs[0].shape();
  out[d] = 0;
  for (const Tensor& t : xs) out[d] += t.shape()[d];
  // output element -> (piece, flat index in the piece)
  std::vector<std::vector<double>> vals;
  for (const Tensor& t : xs) vals.push_back(values(t));
  Ref ref;
  ref.exact = true;
  std::vector<std::array<i64, 2>> src;
  for_each_index(out, [&](const std::vector<i64>& idx, i64) {
    i64 j = idx[static_cast<std::size_t>(d)];
    std::size_t piece = 0;
    while (j >= xs[piece].shape()[d]) j -= xs[piece++].shape()[d];
    std::vector<i64> pi = idx;
    pi[static_cast<std::size_t>(d)] = j;
    const i64 f = flat_of(xs[piece].shape(), pi);
    src.push_back({static_cast<i64>(piece), f});
    ref.add(vals[piece][static_cast<std::size_t>(f)], 0.0);
  });
  check_output("cat", *y, xs[0].dtype(), out, &ref);
  const auto g = run_backward(r, "cat", *y, xs);
  if (!g) return;
  const std::vector<double> gv = g->to_vector<double>();
  for (std::size_t p = 0; p < xs.size(); ++p) {
    Ref gx;  // the slices of every piece that is this tensor
    gx.zeros(static_cast<std::size_t>(xs[p].numel()));
    for (std::size_t k = 0; k < src.size(); ++k) {
      const Tensor& t = xs[static_cast<std::size_t>(src[k][0])];
      if (t.meta() && t.meta() == xs[p].meta()) {
        gx.val[static_cast<std::size_t>(src[k][1])] += gv[k];
        gx.mag[static_cast<std::size_t>(src[k][1])] += fin(gv[k]);
      }
    }
    check_grad("cat", xs[p], gx);
  }
}

void fuzz_split(Rng& r, std::uint64_t seed) {
  const bool by_sizes = r.chance(0.5);
  const std::string name = by_sizes ? "split(sizes)" : "split(size)";
  Tensor x = input(r, rand_shape(r), any_dtype(r, 0.2));
  const int nd = x.dim();
  const int dim = rand_axis(r, nd);
  const i64 n = axis_ok(dim, nd) ? x.shape()[norm(dim, nd)] : 3;
  const i64 split_size = r.chance(0.85) ? r.range(1, 4) : r.pick<i64>({0, -1, kI64Min, i64(1) << 40, kI64Max});
  std::vector<i64> sizes;
  for (i64 left = n; left > 0;) {  // a random partition of n, zeros included
    const i64 s = r.chance(0.15) ? 0 : r.range(1, left);
    sizes.push_back(s);
    left -= s;
  }
  if (r.chance(0.15)) sizes.push_back(0);
  if (r.chance(0.15)) {
    const int how = static_cast<int>(r.range(0, 2));
    if (how == 0) sizes.push_back(1);  // sums to n + 1
    else if (how == 1 && !sizes.empty()) sizes[0] = -sizes[0] - 1;
    else if (!kKnownBugs.split_sizes_overflow) sizes = {kI64Max, kI64Max, n + 2};  // wraps to n
  }
  INFO(Call(seed, name).t("x", x)("dim", dim)(by_sizes ? "sizes" : "split_size", by_sizes ? fmt(sizes) : std::to_string(split_size)).str());
  const Unchanged unchanged({x});
  bool valid = x.defined() && axis_ok(dim, nd);
  std::vector<i64> want;  // piece lengths
  if (by_sizes) {
    __int128 total = 0;
    for (i64 s : sizes) valid = valid && s >= 0, total += s;
    valid = valid && total == n;
    want = sizes;
  } else {
    valid = valid && split_size >= 1;
    for (i64 left = n; valid && left > 0; left -= split_size) want.push_back(std::min(left, split_size));
    if (want.empty()) want.push_back(0);  // an empty dim splits into one empty piece
  }
  const auto pieces = attempt(name, valid ? Expect::ok : Expect::error, [&] {
    return by_sizes ? tg::split(x, sizes, dim) : tg::split(x, split_size, dim);
  });
  if (!pieces) return;
  REQUIRE(pieces->size() == want.size());
  const int d = norm(dim, nd);
  const std::vector<double> xv = values(x);
  i64 off = 0;
  std::vector<std::vector<i64>> srcs;
  for (std::size_t p = 0; p < want.size(); ++p) {
    i64 count = 0;
    srcs.push_back(slice_src(x.shape(), d, off, off + want[p], 1, count));
    Shape out = x.shape();
    out[d] = want[p];
    const Ref ref = gather_ref(xv, srcs.back());
    check_output(name, (*pieces)[p], x.dtype(), out, &ref, 1.0, p == 0);
    off += want[p];
  }
  if (pieces->empty()) return;  // sizes {} for an empty dim
  const auto k = static_cast<std::size_t>(r.range(0, static_cast<i64>(pieces->size()) - 1));
  const auto g = run_backward(r, name, (*pieces)[k], {x});
  if (g) check_grad(name, x, scatter_ref(g->to_vector<double>(), srcs[k], xv.size()));
}

void fuzz_to_clone(Rng& r, std::uint64_t seed) {
  const bool clone = r.chance(0.3);
  const std::string name = clone ? "clone" : "to";
  const DType from = any_dtype(r, 0.25), to = r.pick({float32, float64, int32, bfloat16});
  Shape s = rand_shape(r);
  Tensor x = input(r, s, from);
  if (from != int32 && to == int32 && x.defined() && r.chance(0.6)) {
    // values an int32 can hold (fractions truncate toward zero), sometimes its extremes
    x = filled(s, from, [&] { return r.chance(0.9) ? std::round(r.normal() * 400) / 8 : r.pick({2147483647.0, -2147483648.0, -0.75}); });
    if (tg::is_floating(from) && r.chance(0.5)) x.requires_grad_();
  }
  const bool use_method = r.chance(0.3);
  Call call(seed, name);
  call.t("x", x);
  if (!clone) call("dtype", to);
  INFO(call.str());
  const Unchanged unchanged({x});
  const std::vector<double> xv = values(x);
  bool valid = x.defined();
  if (valid && !clone && to == int32 && from != int32)
    for (double v : xv) valid = valid && v > -2147483649.0 && v < 2147483648.0;  // NaN fails too
  const auto y = attempt(name, valid ? Expect::ok : Expect::error, [&] {
    if (clone) return use_method ? x.clone() : tg::clone(x);
    return use_method ? x.to(to) : tg::to(x, to);
  });
  if (!y) return;
  const DType out = clone ? from : to;
  Ref ref;
  ref.exact = true;
  for (double v : xv) ref.add(out == int32 ? std::trunc(v) : as_dtype(v, out), 0.0);
  check_output(name, *y, out, x.shape(), &ref);
  if (clone && x.numel() > 0) CHECK_FALSE(y->shares_storage(x));
  const auto g = run_backward(r, name, *y, {x});
  if (!g) return;
  Ref gx;
  gx.exact = true;
  for (double v : g->to_vector<double>()) gx.add(as_dtype(v, from), 0.0);
  check_grad(name, x, gx);
}

// ---------------------------------------------------------------------------------------------
// The fused norms, each followed by its composite twin on the same arguments.

// A per-feature parameter: undefined, (C,) of dtype dt, or (sometimes) of the wrong shape or dtype.
Tensor param(Rng& r, i64 C, DType dt, bool positive = false) {
  if (r.chance(0.3)) return Tensor();
  Shape s{C};
  DType pdt = dt;
  if (r.chance(0.06)) s = r.chance(0.5) ? Shape{C + 1} : Shape{1, C};
  if (r.chance(0.04)) pdt = other_dtype(r, dt);
  if (!tg::is_floating(pdt)) return random_tensor(r, s, pdt, false);  // (no NaN: refusals compare values)
  Tensor t = filled(s, pdt, [&] { return positive ? std::fabs(r.normal()) + 0.1 : r.normal(); });
  if (r.chance(0.4)) t.requires_grad_();
  return t;
}
bool param_ok(const Tensor& p, i64 C, DType dt) { return !p.defined() || (p.shape() == Shape{C} && p.dtype() == dt); }

double rand_eps(Rng& r) { return r.chance(0.85) ? r.pick({1e-5, 1e-5, 0.0, 1e-3, 1.0}) : r.pick({-1e-5, kNaN, kInf, 1e30}); }

// Input for a norm: random, or sometimes constant over each normalised group (group(flat index):
// a row for the row norms, a channel for batch_norm), where the exact x_hat is 0. While
// norm_constant_large_row is open the constants are ones whose mean is exact in double.
Tensor norm_input(Rng& r, const Shape& s, DType dt, const std::function<i64(i64)>& group) {
  if (!tg::is_floating(dt) || s.ndim() == 0 || !r.chance(0.12)) return input(r, s, dt);
  std::map<i64, double> constant;
  i64 k = 0;
  Tensor t = filled(s, dt, [&] {
    const i64 gi = group(k++);
    auto it = constant.find(gi);
    if (it == constant.end()) {
      const double v = kKnownBugs.norm_constant_large_row ? r.pick({0.0, 7.0, -2.5, 0.75, 1024.0})
                       : r.chance(0.5)                  ? r.normal() * 3
                                                        : r.pick({0.1, 1e9, 1e30, -1e30, 1e-30, 7.0});
      it = constant.emplace(gi, v).first;
    }
    return it->second;
  });
  if (r.chance(0.5)) t.requires_grad_();
  return t;
}

// Where a normalised group (listed by its element indices) is constant and finite, x - mean is 0
// exactly, so with eps > 0 the output is exactly the bias, whatever the magnitude of x; with eps = 0
// it is 0 / 0 and is not compared.
void constant_group_ref(Ref& ref, const std::vector<double>& xv, const std::vector<i64>& members, double eps,
                        const std::vector<double>& gv, const std::vector<double>& bv, const std::vector<i64>& feature) {
  if (members.empty()) return;
  const double v0 = xv[static_cast<std::size_t>(members[0])];
  for (i64 m : members)
    if (!(xv[static_cast<std::size_t>(m)] == v0) || !std::isfinite(v0)) return;
  for (i64 m : members) {
    const auto f = static_cast<std::size_t>(feature[static_cast<std::size_t>(m)]);
    const double g = gv.empty() ? 1.0 : gv[f], b = bv.empty() ? 0.0 : bv[f];
    ref.val[static_cast<std::size_t>(m)] = b;
    ref.mag[static_cast<std::size_t>(m)] = eps > 0 ? fin(b) + fin(g) : kInf;
  }
}

bool all_moderate(const std::vector<Tensor>& ts, double limit = 1e6) {
  for (const Tensor& t : ts)
    for (double v : values(t))
      if (!(std::fabs(v) < limit)) return false;
  return true;
}

// Affine row normalisation reference: y_j = (x_j - shift) * scale * g_j + b_j over rows of C
// features; shift and scale per row; error scale from |x - shift| and max|x| (the rounding of the
// mean) times scale.
void affine_row_ref(Ref& ref, const std::vector<double>& x, i64 C, const std::vector<double>& shift,
                    const std::vector<double>& scale, const std::vector<double>& gv, const std::vector<double>& bv) {
  const i64 rows = C ? static_cast<i64>(x.size()) / C : 0;
  for (i64 rr = 0; rr < rows; ++rr) {
    double mx = 0;
    for (i64 j = 0; j < C; ++j) mx = std::max(mx, fin(x[static_cast<std::size_t>(rr * C + j)]));
    const auto ru = static_cast<std::size_t>(rr);
    for (i64 j = 0; j < C; ++j) {
      const double xv = x[static_cast<std::size_t>(rr * C + j)];
      const double g = gv.empty() ? 1.0 : gv[static_cast<std::size_t>(j)], b = bv.empty() ? 0.0 : bv[static_cast<std::size_t>(j)];
      const double y = (xv - shift[ru]) * scale[ru] * g + b;
      ref.add(y, (fin(xv - shift[ru]) + mx) * fin(scale[ru]) * fin(g) + fin(b) + fin((xv - shift[ru]) * scale[ru]) * fin(g));
    }
  }
}

void fuzz_row_norm(Rng& r, std::uint64_t seed) {
  const bool rms = r.chance(0.5);
  const std::string name = rms ? "rms_norm" : "layer_norm";
  const DType dt = any_dtype(r, 0.05);
  const Shape s = rand_shape(r, r.chance(0.05) ? 0 : 1, 4);
  const i64 C = s.ndim() ? s[s.ndim() - 1] : 0;
  Tensor x = norm_input(r, s, dt, [C](i64 k) { return C ? k / C : 0; });
  Tensor w = param(r, C, dt), b = param(r, C, dt);
  const double eps = rand_eps(r);
  const double p = r.chance(0.8) ? r.pick({1.0, 1.0, 0.5, 0.25, 0.0625, 0.3, 1e-9}) : r.pick({0.0, -0.5, 1.5, kNaN, kInf});
  Call call(seed, name);
  call.t("x", x).t("weight", w).t("bias", b)("eps", eps);
  if (rms) call("p", p);
  INFO(call.str());
  const Unchanged unchanged({x, w, b});
  const bool valid = is_float(x) && x.dim() >= 1 && C > 0 && param_ok(w, C, x.dtype()) && param_ok(b, C, x.dtype()) &&
                     eps >= 0 && std::isfinite(eps) && (!rms || (p > 0 && p <= 1));
  const auto y = attempt(name, valid ? Expect::ok : Expect::error,
                         [&] { return rms ? tg::rms_norm(x, w, b, eps, p) : tg::layer_norm(x, w, b, eps); });
  Ref ref;
  if (valid) {
    const std::vector<double> xv = values(x);
    const i64 rows = x.numel() / C;
    // k = ceil(C p), at least 1 (the header's rule), computed here in long double
    const i64 k = rms ? std::max<i64>(1, static_cast<i64>(std::ceil(static_cast<long double>(C) * p - 1e-9L))) : C;
    std::vector<double> shift(static_cast<std::size_t>(rows), 0.0), scale(static_cast<std::size_t>(rows));
    for (i64 rr = 0; rr < rows; ++rr) {
      const auto row = xv.begin() + rr * C;
      double ms = 0;
      if (rms) {
        for (i64 j = 0; j < k; ++j) ms += row[j] * row[j];
        ms /= static_cast<double>(k);
      } else {
        double mu = 0;
        for (i64 j = 0; j < C; ++j) mu += row[j];
        mu /= static_cast<double>(C);
        for (i64 j = 0; j < C; ++j) ms += (row[j] - mu) * (row[j] - mu);
        ms /= static_cast<double>(C);
        shift[static_cast<std::size_t>(rr)] = mu;
      }
      scale[static_cast<std::size_t>(rr)] = 1 / std::sqrt(ms + eps);
    }
    affine_row_ref(ref, xv, C, shift, scale, values(w), values(b));
    if (!rms) {
      std::vector<i64> feature(xv.size());
      for (std::size_t k = 0; k < xv.size(); ++k) feature[k] = static_cast<i64>(k) % C;
      for (i64 rr = 0; rr < rows; ++rr) {
        std::vector<i64> members(static_cast<std::size_t>(C));
        std::iota(members.begin(), members.end(), rr * C);
        constant_group_ref(ref, xv, members, eps, values(w), values(b), feature);
      }
    }
  }
  const std::vector<Tensor> leaves{x, w, b};
  std::optional<Tensor> g;
  if (y) {
    check_output(name, *y, x.dtype(), x.shape(), &ref);
    g = run_backward(r, name, *y, leaves);
  }
  const std::vector<Tensor> fused_grads = collect_grads(leaves);
  // The composite twin: valid arguments must work and agree (within float32 rounding of its
  // separate steps, on moderate inputs), gradients included; invalid ones may be accepted (it
  // checks less) or throw.
  if (rms && kKnownBugs.prms_k_nonfinite_p && !(std::fabs(p) < 1e6)) return;
  const std::string cname = "composite::" + name;
  const auto yc = attempt(cname, valid ? Expect::ok : Expect::either, [&] {
    return rms ? tg::composite::rms_norm(x, w, b, eps, p) : tg::composite::layer_norm(x, w, b, eps);
  });
  if (!yc || !valid) return;
  const bool comparable = all_moderate({x}) && eps > 0;
  check_output(cname, *yc, x.dtype(), x.shape(), comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, cname, *yc, leaves, false, g ? &*g : nullptr);
  if (g && gc && comparable) check_twin_grads(name, leaves, fused_grads, *g);
}

void fuzz_batch_norm(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  const bool channels_last = r.chance(0.3);
  Shape s = channels_last ? rand_shape(r, 1, 4) : rand_shape(r, 2, 3);
  if (r.chance(0.05)) s = rand_shape(r, 0, 4);
  const int nd = s.ndim();
  const int cdim = channels_last ? nd - 1 : 1;
  const i64 C = nd > cdim && cdim >= 0 ? s[cdim] : 1;
  const i64 inner = !channels_last && nd == 3 ? s[2] : 1;  // (N, C, L): channel = (k / L) mod C
  Tensor x = norm_input(r, s, dt, [C, inner](i64 k) { return C ? (k / std::max<i64>(inner, 1)) % C : 0; });
  Tensor w = param(r, C, dt), b = param(r, C, dt);
  Tensor rm, rv;
  if (r.chance(0.6)) {
    rm = param(r, C, dt);
    rv = r.chance(0.93) ? param(r, C, dt, true) : (rm.defined() ? Tensor() : param(r, C, dt, true));
    if (rm.defined() && r.chance(0.8)) rv = filled(rm.shape(), rm.dtype(), [&] { return std::fabs(r.normal()) + 0.5; });
    if (rm.defined() && rm.requires_grad()) rm = rm.detach();  // running stats are buffers
    if (rv.defined() && rv.requires_grad()) rv = rv.detach();
  }
  const bool training = r.chance(0.6);
  const double momentum = r.chance(0.9) ? r.pick({0.1, 0.0, 1.0, 0.5}) : r.pick({-0.1, 1.5, kNaN});
  const double eps = rand_eps(r);
  INFO(Call(seed, "batch_norm").t("x", x).t("running_mean", rm).t("running_var", rv).t("weight", w).t("bias", b)(
           "training", training)("momentum", momentum)("eps", eps)("channels_last", channels_last).str());
  const Unchanged unchanged({x, w, b});
  const std::vector<double> rm0 = values(rm), rv0 = values(rv);
  bool valid = is_float(x) && (channels_last ? nd >= 1 : (nd == 2 || nd == 3));
  const i64 R = valid && C > 0 ? x.numel() / C : 0;
  const bool batch_stats = training || !rm.defined();
  valid = valid && param_ok(w, C, x.dtype()) && param_ok(b, C, x.dtype()) && param_ok(rm, C, x.dtype()) &&
          param_ok(rv, C, x.dtype()) && eps >= 0 && std::isfinite(eps) && rm.defined() == rv.defined() &&
          momentum >= 0 && momentum <= 1 && !(batch_stats && R <= 1);
  const auto y = attempt("batch_norm", valid ? Expect::ok : Expect::error, [&] {
    return tg::batch_norm(x, rm, rv, w, b, training, momentum, eps, channels_last);
  });
  if (!y) {
    // a refused call changes nothing
    CHECK(values(rm) == rm0);
    CHECK(values(rv) == rv0);
    return;
  }
  // statistics per channel over the R rows of the channels-last view
  const std::vector<double> xv = values(x);
  std::vector<i64> chan;
  for_each_index(x.shape(), [&](const std::vector<i64>& idx, i64) { chan.push_back(idx[static_cast<std::size_t>(channels_last ? nd - 1 : 1)]); });
  std::vector<double> mu(static_cast<std::size_t>(C), 0.0), var(static_cast<std::size_t>(C), 0.0), mx(static_cast<std::size_t>(C), 0.0);
  for (std::size_t i = 0; i < xv.size(); ++i) mu[static_cast<std::size_t>(chan[i])] += xv[i] / static_cast<double>(R);
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const auto c = static_cast<std::size_t>(chan[i]);
    var[c] += (xv[i] - mu[c]) * (xv[i] - mu[c]) / static_cast<double>(R);
    mx[c] = std::max(mx[c], fin(xv[i]));
  }
  const std::vector<double> gv = values(w), bv = values(b);
  Ref ref;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const auto c = static_cast<std::size_t>(chan[i]);
    const double shift = batch_stats ? mu[c] : rm0[c];
    const double scale = 1 / std::sqrt((batch_stats ? var[c] : rv0[c]) + eps);
    const double g = gv.empty() ? 1.0 : gv[c], bb = bv.empty() ? 0.0 : bv[c];
    ref.add((xv[i] - shift) * scale * g + bb, (fin(xv[i] - shift) + mx[c]) * fin(scale) * fin(g) + fin(bb));
  }
  if (batch_stats) {
    std::vector<std::vector<i64>> members(static_cast<std::size_t>(C));
    for (std::size_t i = 0; i < xv.size(); ++i) members[static_cast<std::size_t>(chan[i])].push_back(static_cast<i64>(i));
    for (const auto& m : members) constant_group_ref(ref, xv, m, eps, gv, bv, chan);
  }
  check_output("batch_norm", *y, x.dtype(), x.shape(), &ref);
  if (rm.defined()) {
    // training updates running stats in place (unbiased variance), eval leaves them alone
    Ref rmr, rvr;
    for (std::size_t c = 0; c < static_cast<std::size_t>(C); ++c) {
      if (!training) {
        rmr.add(rm0[c], 0.0);
        rvr.add(rv0[c], 0.0);
        continue;
      }
      const double m = momentum, unbias = static_cast<double>(R) / static_cast<double>(R - 1);
      rmr.add((1 - m) * rm0[c] + m * mu[c], fin((1 - m) * rm0[c]) + fin(m * mu[c]) + m * mx[c]);
      rvr.add((1 - m) * rv0[c] + m * var[c] * unbias, fin((1 - m) * rv0[c]) + fin(m * var[c] * unbias) + m * mx[c] * mx[c] * unbias);
    }
    const std::string m1 = compare(rm, rmr), m2 = compare(rv, rvr);
    INFO("running_mean:" << m1 << "\nrunning_var:" << m2);
    CHECK((m1.empty() && m2.empty()));
  }
  const std::vector<Tensor> leaves{x, w, b};
  const auto g = run_backward(r, "batch_norm", *y, leaves);
  const std::vector<Tensor> fused_grads = collect_grads(leaves);
  // The composite reshapes to (-1, C), which a zero-channel input cannot do. Training uses batch
  // statistics and eval the running ones, which the fused eval call left alone: same reference.
  const auto yc = attempt("composite::batch_norm", C > 0 ? Expect::ok : Expect::either,
                          [&] { return tg::composite::batch_norm(x, rm, rv, w, b, training, eps, channels_last); });
  if (!yc) return;
  const bool comparable = all_moderate({x}) && eps > 0;
  check_output("composite::batch_norm", *yc, x.dtype(), x.shape(), comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, "composite::batch_norm", *yc, leaves, false, g ? &*g : nullptr);
  if (g && gc && comparable) check_twin_grads("batch_norm", leaves, fused_grads, *g);
}

void fuzz_weight_norm(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  const i64 out = rand_dim(r);
  Shape vs{out, rand_dim(r)}, gs{out};
  if (r.chance(0.06)) vs = rand_shape(r);
  if (r.chance(0.06)) gs = r.chance(0.5) ? Shape{out, 1} : Shape{out + 1};
  Tensor v = input(r, vs, dt), g = input(r, gs, r.chance(0.04) ? other_dtype(r, dt) : dt);
  INFO(Call(seed, "weight_norm").t("v", v).t("g", g).str());
  const Unchanged unchanged({v, g});
  const bool valid = is_float(v) && is_float(g) && v.dtype() == g.dtype() && v.dim() == 2 && g.shape() == Shape{v.shape()[0]};
  const auto y = attempt("weight_norm", valid ? Expect::ok : Expect::error, [&] { return tg::weight_norm(v, g); });
  Ref ref;
  if (valid) {
    const std::vector<double> vv = values(v), gv = values(g);
    const i64 rows = v.shape()[0], in = v.shape()[1];
    for (i64 i = 0; i < rows; ++i) {
      double s = 0;
      for (i64 j = 0; j < in; ++j) s += vv[static_cast<std::size_t>(i * in + j)] * vv[static_cast<std::size_t>(i * in + j)];
      const double nm = std::sqrt(s);
      for (i64 j = 0; j < in; ++j) {
        const double e = vv[static_cast<std::size_t>(i * in + j)], gi = gv[static_cast<std::size_t>(i)];
        // g v is formed in the tensor's dtype before the division: include it in the scale
        ref.add(gi * e / nm, fin(gi * e / nm) + (fin(gi * e) > max_scale(dt) ? kInf : 0.0));
      }
    }
  }
  const std::vector<Tensor> leaves{v, g};
  std::optional<Tensor> up;
  if (y) {
    check_output("weight_norm", *y, v.dtype(), v.shape(), &ref);
    up = run_backward(r, "weight_norm", *y, leaves);
  }
  const std::vector<Tensor> fused_grads = collect_grads(leaves);
  const auto yc = attempt("composite::weight_norm", valid ? Expect::ok : Expect::either, [&] { return tg::composite::weight_norm(v, g); });
  if (!yc || !valid) return;
  const bool comparable = all_moderate({v, g});
  check_output("composite::weight_norm", *yc, v.dtype(), v.shape(), comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, "composite::weight_norm", *yc, leaves, false, up ? &*up : nullptr);
  if (up && gc && comparable) check_twin_grads("weight_norm", leaves, fused_grads, *up);
}

void fuzz_causal_softmax(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  const i64 T = rand_dim(r);
  Shape s = rand_shape(r, 0, 2);
  s.push_back(T);
  s.push_back(T);
  if (r.chance(0.08)) s = rand_shape(r);  // rarely square
  Tensor x = input(r, s, dt);
  const double scale = r.chance(0.85) ? r.pick({1.0, 0.5, 0.125, 0.0, -1.0, 10.0}) : r.pick({1e30, kNaN, kInf, -kInf});
  INFO(Call(seed, "scaled_causal_softmax").t("x", x)("scale", scale).str());
  const Unchanged unchanged({x});
  const int nd = x.dim();
  const bool valid = is_float(x) && nd >= 2 && x.shape()[nd - 1] == x.shape()[nd - 2] && std::isfinite(scale);
  const auto y = attempt("scaled_causal_softmax", valid ? Expect::ok : Expect::error,
                         [&] { return tg::scaled_causal_softmax(x, scale); });
  Ref ref;
  if (valid) {
    const std::vector<double> xv = values(x);
    const i64 n = x.shape()[nd - 1], rows = n ? x.numel() / n : 0;
    const double st = as_dtype(scale, x.dtype());
    for (i64 rr = 0; rr < rows; ++rr) {
      const i64 i = rr % n;
      std::vector<double> z;
      double zmax = 0;
      for (i64 j = 0; j <= i; ++j) {
        z.push_back(as_dtype(st * xv[static_cast<std::size_t>(rr * n + j)], x.dtype()));  // scale * x in dtype
        zmax = std::max(zmax, std::fabs(z.back()));
      }
      std::vector<double> p, lp;
      softmax_row(z, p, lp);
      // steer around causal_softmax_fma: rows whose scores are large enough for the error to show
      const bool fma_bug = kKnownBugs.causal_softmax_fma && zmax > (x.dtype() == float32 ? 300 : 1e5);
      for (i64 j = 0; j < n; ++j) ref.add(j <= i ? p[static_cast<std::size_t>(j)] : 0.0, fma_bug && j <= i ? kInf : 1.0);
    }
  }
  std::optional<Tensor> g;
  if (y) {
    check_output("scaled_causal_softmax", *y, x.dtype(), x.shape(), &ref);
    g = run_backward(r, "scaled_causal_softmax", *y, {x});
  }
  const std::vector<Tensor> fused_grads = collect_grads({x});
  const auto yc = attempt("composite::scaled_causal_softmax", valid ? Expect::ok : Expect::either,
                          [&] { return tg::composite::scaled_causal_softmax(x, scale); });
  if (!yc || !valid) return;
  const bool comparable = all_moderate({x}, 30 / std::max(std::fabs(scale), 1.0));  // scores within +-30
  check_output("composite::scaled_causal_softmax", *yc, x.dtype(), x.shape(), comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, "composite::scaled_causal_softmax", *yc, {x}, false, g ? &*g : nullptr);
  if (g && gc && comparable) check_twin_grads("scaled_causal_softmax", {x}, fused_grads, *g);
}

void fuzz_attention(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  const i64 H = r.pick<i64>({1, 1, 2, 3}), hs = r.pick<i64>({0, 1, 1, 2, 3}), C = H * hs;
  const i64 B = rand_dim(r), T = rand_dim(r);
  Shape s{B, T, 3 * C};
  if (r.chance(0.08)) s = r.chance(0.5) ? rand_shape(r) : Shape{B, T, 3 * C + 1};
  Tensor qkv = input(r, s, dt);
  i64 n_head = H;
  if (r.chance(0.1)) n_head = r.pick<i64>({0, -1, kI64Min, H + 1, 7});
  INFO(Call(seed, "causal_attention").t("qkv", qkv)("n_head", n_head).str());
  const Unchanged unchanged({qkv});
  const bool shape_ok = is_float(qkv) && qkv.dim() == 3 && qkv.shape()[2] % 3 == 0;
  const i64 Cq = shape_ok ? qkv.shape()[2] / 3 : 0;
  const bool valid = shape_ok && n_head > 0 && Cq % n_head == 0;
  const auto y = attempt("causal_attention", valid ? Expect::ok : Expect::error, [&] { return tg::causal_attention(qkv, n_head); });
  Ref ref;
  if (valid) {
    // per batch and head: S = q k^T / sqrt(hs), causal softmax, y = P v; all in double
    const std::vector<double> xv = values(qkv);
    const i64 Bq = qkv.shape()[0], Tq = qkv.shape()[1], hq = Cq / n_head, ld = 3 * Cq;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hq));
    std::vector<double> out(static_cast<std::size_t>(Bq * Tq * Cq)), mag(out.size());
    for (i64 bb = 0; bb < Bq; ++bb)
      for (i64 h = 0; h < n_head; ++h)
        for (i64 i = 0; i < Tq; ++i) {
          auto at = [&](i64 t, i64 part, i64 e) { return xv[static_cast<std::size_t>(bb * Tq * ld + t * ld + part * Cq + h * hq + e)]; };
          std::vector<double> z, p, lp;
          double zmax = 0;
          for (i64 j = 0; j <= i; ++j) {
            double sdot = 0, sabs = 0;
            for (i64 e = 0; e < hq; ++e) sdot += at(i, 0, e) * at(j, 1, e), sabs += fin(at(i, 0, e) * at(j, 1, e));
            z.push_back(sdot * scale);
            zmax = std::max(zmax, sabs * scale);
          }
          softmax_row(z, p, lp);
          for (i64 e = 0; e < hq; ++e) {
            double acc = 0, am = 0;
            for (i64 j = 0; j <= i; ++j) acc += p[static_cast<std::size_t>(j)] * at(j, 2, e), am += fin(at(j, 2, e));
            const auto o = static_cast<std::size_t>(bb * Tq * Cq + i * Cq + h * hq + e);
            out[o] = acc;
            mag[o] = am * (1 + zmax);  // an error in a score moves P relatively by about that much
          }
        }
    const bool finite = all_moderate({qkv}, 1e15);
    for (std::size_t o = 0; o < out.size(); ++o) ref.add(out[o], finite ? mag[o] : kInf);
  }
  std::optional<Tensor> g;
  if (y) {
    check_output("causal_attention", *y, qkv.dtype(), Shape{qkv.shape()[0], qkv.shape()[1], Cq}, &ref);
    g = run_backward(r, "causal_attention", *y, {qkv}, kKnownBugs.attention_empty_not_on_tape && y->numel() == 0);
  }
  const std::vector<Tensor> fused_grads = collect_grads({qkv});
  if (kKnownBugs.composite_attention_zero_heads && n_head == 0) return;
  const bool zero_width = kKnownBugs.composite_attention_zero_width && Cq == 0;
  const auto yc = attempt("composite::causal_attention", valid && !zero_width ? Expect::ok : Expect::either,
                          [&] { return tg::composite::causal_attention(qkv, n_head); });
  if (!yc || !valid) return;
  const bool comparable = all_moderate({qkv}, 100);
  check_output("composite::causal_attention", *yc, qkv.dtype(), Shape{qkv.shape()[0], qkv.shape()[1], Cq},
               comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, "composite::causal_attention", *yc, {qkv}, false, g ? &*g : nullptr);
  if (g && gc && comparable) check_twin_grads("causal_attention", {qkv}, fused_grads, *g);
}

// ---------------------------------------------------------------------------------------------
// The LLaMA ops: swiglu (and composite::silu), rope, rope_tables. silu itself is a unary op above.

// silu(v) = v sigmoid(v) and its slope s (1 + v (1 - s)), in double.
double silu_of(double v) { return v / (1 + std::exp(-v)); }
double silu_slope(double v) {
  const double s = 1 / (1 + std::exp(-v));
  return s * (1 + v * (1 - s));
}

// swiglu's gradient reference: d gate = dy up silu'(gate), d up = dy silu(gate), compared where
// the operands are finite and moderate.
Ref swiglu_grad_ref(const std::vector<double>& xv, const std::vector<double>& gv, i64 F) {
  Ref gx;
  gx.zeros(xv.size());
  const i64 rows = F ? static_cast<i64>(xv.size()) / (2 * F) : 0;
  for (i64 rr = 0; rr < rows; ++rr)
    for (i64 j = 0; j < F; ++j) {
      const auto a = static_cast<std::size_t>(rr * 2 * F + j), b = a + static_cast<std::size_t>(F);
      const double gate = xv[a], up = xv[b], d = gv[static_cast<std::size_t>(rr * F + j)];
      const bool moderate = std::isfinite(gate) && std::isfinite(up) && std::fabs(gate) < 1e15 && fin(up * d) < 1e30;
      gx.val[a] = d * up * silu_slope(gate);
      gx.mag[a] = moderate ? fin(d * up) * (1 + fin(gate)) : kInf;
      gx.val[b] = d * silu_of(gate);
      gx.mag[b] = moderate ? fin(d) * (1 + fin(gate)) : kInf;
    }
  return gx;
}

void fuzz_swiglu(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  Shape s = rand_shape(r, r.chance(0.05) ? 0 : 1, 4);
  if (s.ndim() > 0 && r.chance(0.85)) s[s.ndim() - 1] = 2 * r.pick<i64>({0, 1, 1, 2, 3});
  Tensor x = input(r, s, dt);
  INFO(Call(seed, "swiglu").t("x", x).str());
  const Unchanged unchanged({x});
  const bool valid = is_float(x) && x.dim() >= 1 && x.shape()[x.dim() - 1] % 2 == 0;
  const auto y = attempt("swiglu", valid ? Expect::ok : Expect::error, [&] { return tg::swiglu(x); });
  Ref ref;
  Shape out;
  const std::vector<double> xv = values(x);
  const i64 F = valid ? x.shape()[x.dim() - 1] / 2 : 0;
  if (valid) {
    out = x.shape();
    out[out.ndim() - 1] = F;
    for (i64 k = 0; k < out.numel(); ++k) {
      const auto a = static_cast<std::size_t>(k / F * 2 * F + k % F), b = a + static_cast<std::size_t>(F);
      ref.add(silu_of(xv[a]) * xv[b], fin(xv[a] * xv[b]));
    }
  }
  std::optional<Tensor> g;
  if (y) {
    check_output("swiglu", *y, x.dtype(), out, &ref);
    g = run_backward(r, "swiglu", *y, {x});
    if (g) check_grad("swiglu", x, swiglu_grad_ref(xv, g->to_vector<double>(), F));
  }
  const std::vector<Tensor> fused_grads = collect_grads({x});
  const auto yc = attempt("composite::swiglu", valid ? Expect::ok : Expect::error, [&] { return tg::composite::swiglu(x); });
  if (yc && valid) {
    const bool comparable = all_moderate({x}, 100);
    check_output("composite::swiglu", *yc, x.dtype(), out, comparable ? &ref : nullptr, 20);
    const auto gc = run_backward(r, "composite::swiglu", *yc, {x}, false, g ? &*g : nullptr);
    if (g && gc && comparable) check_twin_grads("swiglu", {x}, fused_grads, *g);
  }
  collect_grads({x});
  // composite::silu, x * sigmoid(x), on the same x against silu's values
  const auto ys = attempt("composite::silu", is_float(x) ? Expect::ok : Expect::error, [&] { return tg::composite::silu(x); });
  if (!ys) return;
  Ref sref;
  for (double v : xv) sref.add(silu_of(v), fin(v));
  check_output("composite::silu", *ys, x.dtype(), x.shape(), &sref);
  run_backward(r, "composite::silu", *ys, {x});
}

// rope's reference: per row at position p = pos0 + t, each pair (a, b) = (x[j], x[j + hs/2]) of
// the first R columns becomes (a c1 - b s1, b c2 + a s2); the rest is copied. For the gradient,
// the transposed map of dy: (g1 c1 + g2 s2, g2 c2 - g1 s1), the rest dy.
Ref rope_ref(const std::vector<double>& xv, const std::vector<double>& cv, const std::vector<double>& sv, i64 rows,
             i64 T, i64 D, i64 hs, i64 R, i64 pos0, bool transposed) {
  Ref ref;
  ref.zeros(xv.size());
  const i64 half = hs / 2;
  for (i64 row = 0; row < rows; ++row) {
    const i64 p = pos0 + row % T;
    auto tab = [&](const std::vector<double>& t, i64 j) { return t[static_cast<std::size_t>(p * hs + j)]; };
    for (i64 h = 0; h < R; h += hs)
      for (i64 j = 0; j < half; ++j) {
        const auto i1 = static_cast<std::size_t>(row * D + h + j), i2 = i1 + static_cast<std::size_t>(half);
        const double a = xv[i1], b = xv[i2], c1 = tab(cv, j), s1 = tab(sv, j), c2 = tab(cv, j + half),
                     s2 = tab(sv, j + half);
        ref.val[i1] = transposed ? a * c1 + b * s2 : a * c1 - b * s1;
        ref.mag[i1] = transposed ? fin(a * c1) + fin(b * s2) : fin(a * c1) + fin(b * s1);
        ref.val[i2] = transposed ? b * c2 - a * s1 : b * c2 + a * s2;
        ref.mag[i2] = transposed ? fin(b * c2) + fin(a * s1) : fin(b * c2) + fin(a * s2);
      }
    for (i64 k = R; k < D; ++k) {
      const auto o = static_cast<std::size_t>(row * D + k);
      ref.val[o] = xv[o];
      ref.mag[o] = fin(xv[o]);
    }
  }
  return ref;
}

// rope with tables of any values (the kernel applies [[c1, -s1], [s2, c2]] to each pair, a
// rotation for rope_tables' tables); bad head sizes, rotated, pos0 and tables among them. (Tables
// that require grad, constants to rope, are in test_llama_ops.cpp.)
void fuzz_rope(Rng& r, std::uint64_t seed) {
  const DType dt = any_dtype(r, 0.05);
  const i64 hs = r.chance(0.9) ? r.pick<i64>({2, 2, 4, 6}) : r.pick<i64>({0, 3, -2, kI64Max});
  const bool hs_ok = hs > 0 && hs % 2 == 0 && hs < 100;
  const i64 heads = r.pick<i64>({0, 1, 1, 2, 3}), D = (hs_ok ? heads * hs : 4) + (r.chance(0.05) ? 1 : 0);
  const i64 B = rand_dim(r), T = rand_dim(r);
  Shape s = r.chance(0.3) ? Shape{T, D} : Shape{B, T, D};
  if (r.chance(0.05)) s = rand_shape(r);
  Tensor x = input(r, s, dt);
  i64 rotated = -1;
  if (r.chance(0.6) && hs_ok) rotated = r.range(0, heads) * hs;
  else if (r.chance(0.1)) rotated = r.pick<i64>({1, -2, D + 2, kI64Max, kI64Min});
  const i64 pos0 = r.chance(0.93) ? r.range(0, 3) : r.pick<i64>({-1, kI64Max, kI64Min});
  const bool x_ok = is_float(x) && (x.dim() == 2 || x.dim() == 3);
  const i64 Tx = x_ok ? x.shape()[x.dim() - 2] : T, Dx = x_ok ? x.shape()[x.dim() - 1] : 0;
  // tables: long enough or one or two short, hs wide or not, x's dtype or not, cos and sin alike or not
  i64 P = pos0 >= 0 && pos0 < 100 ? pos0 + Tx + r.range(0, 2) : r.range(0, 4);
  if (r.chance(0.05)) P = std::max<i64>(0, P - r.range(1, 2));
  const i64 W = r.chance(0.95) && hs_ok ? hs : r.pick<i64>({1, 2, 8});
  const DType tdt = r.chance(0.04) ? other_dtype(r, dt) : dt;
  Tensor cos = r.chance(0.02) ? Tensor() : random_tensor(r, Shape{P, W}, tdt, false);
  Tensor sin = random_tensor(r, r.chance(0.03) ? Shape{P + 1, W} : Shape{P, W}, tdt, false);
  INFO(Call(seed, "rope").t("x", x).t("cos", cos).t("sin", sin)("head_size", hs)("rotated", rotated)("pos0", pos0).str());
  const Unchanged unchanged({x, cos, sin});
  const i64 R = rotated == -1 ? Dx : rotated;
  const bool valid = x_ok && hs > 0 && hs % 2 == 0 && Dx % hs == 0 && rotated >= -1 && R <= Dx && R % hs == 0 &&
                     pos0 >= 0 && cos.defined() && cos.dtype() == x.dtype() && sin.dtype() == x.dtype() &&
                     cos.dim() == 2 && cos.shape()[1] == hs && sin.shape() == cos.shape() && cos.shape()[0] - Tx >= pos0;
  const auto y = attempt("rope", valid ? Expect::ok : Expect::error, [&] { return tg::rope(x, cos, sin, hs, rotated, pos0); });
  const i64 rows = valid ? x.numel() / std::max<i64>(Dx, 1) : 0;
  const std::vector<double> cv = values(cos), sv = values(sin);
  const Ref ref = valid ? rope_ref(values(x), cv, sv, rows, Tx, Dx, hs, R, pos0, false) : Ref{};
  std::optional<Tensor> g;
  if (y) {
    check_output("rope", *y, x.dtype(), x.shape(), &ref);
    g = run_backward(r, "rope", *y, {x});
    if (g) check_grad("rope", x, rope_ref(g->to_vector<double>(), cv, sv, rows, Tx, Dx, hs, R, pos0, true));
  }
  const std::vector<Tensor> fused_grads = collect_grads({x});
  const auto yc = attempt("composite::rope", valid ? Expect::ok : Expect::error,
                          [&] { return tg::composite::rope(x, cos, sin, hs, rotated, pos0); });
  if (!yc || !valid) return;
  const bool comparable = all_moderate({x}, 1e6);
  check_output("composite::rope", *yc, x.dtype(), x.shape(), comparable ? &ref : nullptr, 20);
  const auto gc = run_backward(r, "composite::rope", *yc, {x}, false, g ? &*g : nullptr);
  if (g && gc && comparable) check_twin_grads("rope", {x}, fused_grads, *g);
}

// rope_tables: cos and sin of p theta^(-2j / hs), both halves alike.
void fuzz_rope_tables(Rng& r, std::uint64_t seed) {
  const i64 P = r.chance(0.9) ? r.pick<i64>({0, 1, 3, 7}) : r.pick<i64>({-1, kI64Min});
  const i64 hs = r.chance(0.9) ? r.pick<i64>({2, 4, 6, 8}) : r.pick<i64>({0, 1, 5, -2, kI64Min});
  const double theta = r.chance(0.9) ? r.pick({10000.0, 500000.0, 1.0, 0.5}) : r.pick({0.0, -1.0, kInf, kNaN});
  const DType dt = any_dtype(r, 0.1);
  INFO(Call(seed, "rope_tables")("max_pos", P)("head_size", hs)("theta", theta)("dtype", dt).str());
  const bool valid = P >= 0 && hs > 0 && hs % 2 == 0 && theta > 0 && std::isfinite(theta) && tg::is_floating(dt);
  const auto t = attempt("rope_tables", valid ? Expect::ok : Expect::error, [&] { return tg::rope_tables(P, hs, theta, dt); });
  if (!t) return;
  Ref rc, rs;
  for (i64 p = 0; p < P; ++p)
    for (i64 k = 0; k < hs; ++k) {
      const double j = static_cast<double>(k % (hs / 2));
      const double angle = static_cast<double>(p) * std::pow(theta, -2.0 * j / static_cast<double>(hs));
      // float32 rounds the angle to float32 first: an error of about |angle| 2^-24
      rc.add(std::cos(angle), 1 + angle);
      rs.add(std::sin(angle), 1 + angle);
    }
  check_output("rope_tables", t->first, dt, Shape{P, hs}, &rc);
  check_output("rope_tables", t->second, dt, Shape{P, hs}, &rs, 1.0, false);
}

// prms_k: k = ceil(n p), at least 1, for p in (0, 1].
void fuzz_prms_k(Rng& r, std::uint64_t seed) {
  // p = num / den, or a power of two (n p exact in double); the answer is computed in integers
  const i64 n = r.range(0, 1000);
  const i64 num = r.range(1, 64), den = r.range(num, 64), e = r.range(0, 40);
  const bool rational = r.chance(0.6);
  const double p = rational ? static_cast<double>(num) / static_cast<double>(den) : std::ldexp(1.0, -static_cast<int>(e));
  INFO(Call(seed, "prms_k")("n", n)("p", p).str());
  const auto k = attempt("prms_k", Expect::ok, [&] { return tg::prms_k(n, p); });
  if (!k) return;
  const i64 ceil_np = rational ? (n * num + den - 1) / den : (n + (i64(1) << e) - 1) >> e;
  CHECK(*k == std::max<i64>(1, ceil_np));
  ++stats()["prms_k"].checked;
}

// ---------------------------------------------------------------------------------------------
// Large inputs (above the kernels' parallel threshold of 32768 elements of work): one thread and
// the full pool must give the same outputs and gradients, up to the last bits where per-thread
// partial sums and BLAS differ (the README's promise); dropout draws the same mask for any thread
// count. The tiny tensors above never reach the parallel loops.

int g_pool_threads = 1;  // the thread count the process started with

// Max |a - b| within tol * max(|a|, |b|) over all entries, NaN where NaN.
std::string compare_runs(const Tensor& a, const Tensor& b, double tol) {
  std::ostringstream s;
  s.precision(17);
  if (!a.defined() || !b.defined()) return a.defined() == b.defined() ? "" : " defined in only one run";
  if (!(a.shape() == b.shape())) {
    s << " shapes differ: " << a.shape() << " vs " << b.shape();
    return s.str();
  }
  const std::vector<double> u = a.to_vector<double>(), v = b.to_vector<double>();
  double scale = 0;
  for (std::size_t k = 0; k < u.size(); ++k) scale = std::max({scale, fin(u[k]), fin(v[k])});
  std::size_t bad = 0;
  for (std::size_t k = 0; k < u.size(); ++k) {
    const bool ok = (std::isnan(u[k]) && std::isnan(v[k])) || std::fabs(u[k] - v[k]) <= tol * scale;
    if (!ok && bad++ < 4) s << "\n    [" << k << "] 1 thread " << u[k] << ", " << g_pool_threads << " threads " << v[k];
  }
  if (!bad) return "";
  std::ostringstream head;
  head << " " << bad << " entries differ:" << s.str();
  return head.str();
}

void fuzz_threads(Rng& r, std::uint64_t seed) {
  static const char* const kNames[] = {"add", "mul", "exp", "gelu", "sum", "var", "max", "softmax", "log_softmax",
                                       "masked_fill", "dropout", "embedding", "cross_entropy", "layer_norm", "rms_norm",
                                       "batch_norm", "weight_norm", "scaled_causal_softmax", "causal_attention",
                                       "matmul", "permute"};
  const int op = static_cast<int>(seed % 21);  // consecutive seeds: every op in turn
  const std::string name = kNames[op];
  const DType dt = float_dtype(r);
  const i64 R = r.range(52, 64), C = 640;  // 33k to 41k elements
  auto leaf = [&](const Shape& s) { return random_tensor(r, s, dt, false).requires_grad_(); };
  const Tensor x = op == 17 ? leaf({R / 4, 64, 64}) : op == 18 ? leaf({R / 16, 64, 96}) : leaf({R, C});
  const Tensor row = leaf({C}), row2 = leaf({C}), col = leaf({R});
  const Tensor big = op == 1 ? leaf({R, C}) : Tensor(), w2 = op == 19 ? leaf({C, 48}) : Tensor();
  const Tensor mask = op == 9 ? filled({R, C}, int32, [&] { return static_cast<double>(r.range(0, 1)); }) : Tensor();
  const Tensor ids = filled({2 * R}, int32, [&] { return static_cast<double>(r.range(0, R - 1)); });
  const Tensor targets = filled({R}, int32, [&] { return static_cast<double>(r.chance(0.1) ? -100 : r.range(0, C - 1)); });
  const int axis = static_cast<int>(r.range(0, 1));
  const double p = r.pick({1.0, 0.5, 0.1});
  INFO(Call(seed, "threads: " + name).t("x", x)("threads", g_pool_threads)("axis", axis)("p", p).str());
  const std::vector<Tensor> leaves{x, row, row2, col, big, w2};
  auto run = [&](int threads) {
    tg::set_num_threads(threads);
    tg::manual_seed(seed);
    Tensor y;
    switch (op) {
      case 0: y = x + row; break;
      case 1: y = x * big; break;
      case 2: y = tg::exp(x); break;
      case 3: y = tg::gelu(x); break;
      case 4: y = tg::sum(x, {axis}); break;
      case 5: y = tg::var(x, {axis}); break;
      case 6: y = tg::max(x, {axis}, true); break;
      case 7: y = tg::softmax(x); break;
      case 8: y = tg::log_softmax(x); break;
      case 9: y = tg::masked_fill(x, mask, -1.5); break;
      case 10: y = tg::dropout(x, 0.3); break;
      case 11: y = tg::embedding(x, ids); break;
      case 12: y = tg::cross_entropy(x, targets); break;
      case 13: y = tg::layer_norm(x, row, row2); break;
      case 14: y = tg::rms_norm(x, row, row2, 1e-5, p); break;
      case 15: y = tg::batch_norm(x, Tensor(), Tensor(), row, row2, true); break;
      case 16: y = tg::weight_norm(x, col); break;
      case 17: y = tg::scaled_causal_softmax(x, 0.3); break;
      case 18: y = tg::causal_attention(x, 2); break;
      case 19: y = tg::matmul(x, w2); break;
      default: y = tg::permute(x, {1, 0}); break;
    }
    Rng gr(seed + 1);  // the same upstream gradient in both runs
    y.backward(random_tensor(gr, y.shape(), y.dtype(), false));
    tg::set_num_threads(1);
    return std::pair{y.detach(), collect_grads(leaves)};
  };
  const auto one = attempt("threads", Expect::ok, [&] { return run(1); });
  const auto pool = attempt("threads", Expect::ok, [&] { return run(g_pool_threads); });
  tg::set_num_threads(1);
  if (!one || !pool) return;
  const double tol = dt == float32 ? 1e-5 : 1e-12;
  std::string m = compare_runs(one->first, pool->first, tol);
  INFO(name << " output:" << m);
  CHECK(m.empty());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    m = compare_runs(one->second[i], pool->second[i], tol);
    INFO(name << " gradient of input " << i << ":" << m);
    CHECK(m.empty());
  }
  ++stats()["threads"].checked;
}

// ---------------------------------------------------------------------------------------------

struct Family {
  const char* name;
  void (*run)(Rng&, std::uint64_t);
  int iterations;
  bool threaded = false;  // every 8th call with the full thread pool (matmul's batch loop runs in parallel)
};

const Family kFamilies[] = {
    {"binary", fuzz_binary, 2600},
    {"scalar", fuzz_scalar, 1500},
    {"unary", fuzz_unary, 2600},
    {"reduce", fuzz_reduce, 2000},
    {"matmul", fuzz_matmul, 1000, true},
    {"softmax", fuzz_softmax, 700},
    {"masked_fill", fuzz_masked_fill, 500},
    {"causal_mask", fuzz_causal_mask, 100},
    {"embedding", fuzz_embedding, 500},
    {"cross_entropy", fuzz_cross_entropy, 700},
    {"dropout", fuzz_dropout, 400},
    {"reshape", fuzz_reshape, 600},
    {"permute", fuzz_permute, 800},
    {"slice", fuzz_slice, 700},
    {"cat", fuzz_cat, 500},
    {"split", fuzz_split, 700},
    {"to_clone", fuzz_to_clone, 600},
    {"row_norm", fuzz_row_norm, 1200},
    {"batch_norm", fuzz_batch_norm, 900},
    {"weight_norm", fuzz_weight_norm, 400},
    {"causal_softmax", fuzz_causal_softmax, 500},
    {"attention", fuzz_attention, 600, true},
    {"prms_k", fuzz_prms_k, 200},
    {"threads", fuzz_threads, 42},
    {"swiglu", fuzz_swiglu, 700},
    {"rope", fuzz_rope, 1000},
    {"rope_tables", fuzz_rope_tables, 200},
};

// Every public op of ops.h, as counted above.
const char* const kAllOps[] = {
    "add", "sub", "mul", "div", "add(scalar)", "sub(scalar)", "mul(scalar)", "div(scalar)", "rsub", "rdiv",
    "neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "tanh", "sigmoid", "relu", "gelu", "gelu(tanh)",
    "sum", "mean", "var", "max", "matmul", "softmax", "log_softmax", "masked_fill", "causal_mask",
    "embedding", "cross_entropy", "dropout", "layer_norm", "rms_norm", "prms_k", "batch_norm", "weight_norm",
    "scaled_causal_softmax", "causal_attention", "composite::layer_norm", "composite::rms_norm",
    "composite::batch_norm", "composite::weight_norm", "composite::scaled_causal_softmax",
    "composite::causal_attention", "reshape", "transpose", "permute", "slice", "cat", "split(size)",
    "split(sizes)", "to", "clone", "silu", "swiglu", "rope", "rope_tables", "composite::silu", "composite::swiglu",
    "composite::rope"};

std::uint64_t seed_of(std::size_t family, int i) { return kBaseSeed + family * 1000000ULL + static_cast<std::uint64_t>(i); }

// Restores the default generator (dropout draws from it; each call reseeds it for replay) and the
// thread count. The fuzz runs single-threaded: tiny tensors never reach the kernels' parallel
// thresholds, and waking a pool for each of thousands of tiny calls costs seconds on a loaded machine.
struct GlobalStateGuard {
  tg::Generator& gen = tg::default_generator();
  const std::uint64_t seed = gen.seed(), offset = gen.offset();
  const int threads = tg::get_num_threads();
  GlobalStateGuard() { tg::set_num_threads(1); }
  ~GlobalStateGuard() {
    gen.set_state(seed, offset);
    tg::set_num_threads(threads);
    tg::tape().clear();  // graphs whose backward was refused or never run
  }
};

}  // namespace

TEST_CASE("fuzz: public ops under random shapes, dtypes, axes and values succeed correctly or throw tg::Error",
          "[fuzz]") {
  const char* only_env = std::getenv("TAPEGRAD_FUZZ_SEED");  // replay a single call
  const bool replay = only_env != nullptr;
  const std::uint64_t only = replay ? std::strtoull(only_env, nullptr, 10) : 0;
  stats().clear();
  {
    const GlobalStateGuard guard;
    g_pool_threads = std::max(guard.threads, 2);  // two threads even on one core: still a different schedule
    for (std::size_t f = 0; f < std::size(kFamilies); ++f)
      for (int i = 0; i < kFamilies[f].iterations; ++i) {
        const std::uint64_t seed = seed_of(f, i);
        if (replay && only != seed) continue;
        Rng r(seed);
        tg::manual_seed(seed);
        const bool threaded = kFamilies[f].threaded && i % 8 == 0;
        if (threaded) tg::set_num_threads(guard.threads);
        kFamilies[f].run(r, seed);
        if (threaded) tg::set_num_threads(1);
        // Nothing of this call is alive any more: an empty tape keeps calls independent (a replay
        // sees the same tape) and backward fast (it walks the tape down from its root's node).
        tg::tape().clear();
      }
  }

  long calls = 0, ok = 0, refused = 0, checked = 0, bwd = 0, bwd_refused = 0;
  std::ostringstream per_op;
  for (const auto& [op, s] : stats()) {
    calls += s.calls, ok += s.ok, refused += s.refused, checked += s.checked, bwd += s.backward, bwd_refused += s.backward_refused;
    per_op << "\n  " << op << ": " << s.calls << " calls, " << s.ok << " ok (" << s.checked << " checked), " << s.refused
           << " refused, backward " << s.backward << " ok / " << s.backward_refused << " refused";
    if (s.twin_grads) per_op << ", " << s.twin_grads << " gradients matched the composite twin's";
  }
  std::printf("op fuzz (base seed %llu): %ld calls, %ld succeeded (%ld value-checked), %ld refused with tg::Error; "
              "backward %ld ran, %ld refused; per op:%s\n",
              static_cast<unsigned long long>(kBaseSeed), calls, ok, checked, refused, bwd, bwd_refused, per_op.str().c_str());
  if (replay) return;
  REQUIRE(calls >= 10000);
  REQUIRE(ok > 1000);
  REQUIRE(checked > 1000);
  REQUIRE(refused > 1000);
  REQUIRE(bwd > 1000);
  for (const char* op : kAllOps) {
    INFO("op " << op);
    const OpStats s = stats().count(op) ? stats()[op] : OpStats{};
    CHECK(s.calls >= 30);
    CHECK(s.ok >= 1);
  }
}

// The correct behaviour for each entry of kKnownBugs: regression tests for the bugs the fuzz found.
TEST_CASE("fuzz regressions: the correct behaviour for each bug the fuzz found", "[fuzz_regressions]") {
  SECTION("div_scalar_subnormal: x / s for a subnormal s") {
    const Tensor x = tg::tensor({0.0, 1e-300, -2.0}, {3}, tg::float64);
    tgtest::check_close(tg::div(x, 1e-310), {0.0, 1e-300 / 1e-310, -kInf});
    const Tensor xf = tg::tensor({0.0, 1e-30}, {2}, tg::float32);
    tgtest::check_close(tg::div(xf, 1e-40), {0.0, static_cast<double>(1e-30f / 1e-40f)});
  }
  SECTION("relu_nan: relu propagates NaN") {
    CHECK(std::isnan(tg::relu(tg::tensor({kNaN}, {1})).item()));
  }
  SECTION("norm_constant_large_row: a constant row normalises to 0") {
    const Tensor x = tg::full({1, 3}, 1e30, tg::float64);
    tgtest::check_close(tg::layer_norm(x, Tensor(), Tensor()), {0.0, 0.0, 0.0});
    tgtest::check_close(tg::batch_norm(tg::full({3, 1}, 1e30, tg::float64), Tensor(), Tensor(), Tensor(), Tensor(), true),
                        {0.0, 0.0, 0.0});
  }
  SECTION("attention_empty_not_on_tape: an empty output of a requires-grad qkv is on the tape") {
    Tensor qkv = tg::zeros({2, 0, 6}, tg::float64);
    qkv.requires_grad_();
    const Tensor y = tg::causal_attention(qkv, 2);
    CHECK(y.requires_grad());
  }
  SECTION("slice_step_overflow: a step near INT64_MAX takes one element") {
    const Tensor x = tg::arange(5, tg::float64);
    CHECK(tg::slice(x, 0, 0, 5, kI64Max).shape() == Shape{1});
  }
  SECTION("split_sizes_overflow: sizes whose sum overflows are refused") {
    REQUIRE_TG_ERROR(tg::split(tg::arange(3, tg::float64), std::vector<i64>{kI64Max, kI64Max, 5}, 0), "split");
  }
  SECTION("reshape_numel_overflow: a target shape whose element count overflows is refused") {
    REQUIRE_TG_ERROR(tg::reshape(tg::arange(4, tg::float64), Shape{(i64(1) << 62) + 1, 4}), "reshape");
    REQUIRE_TG_ERROR(tg::reshape(tg::zeros({0}), Shape{i64(1) << 32, i64(1) << 32}), "reshape");
  }
  SECTION("prms_k_nonfinite_p: composite::rms_norm refuses a non-finite p as rms_norm does") {
    REQUIRE_TG_ERROR(tg::composite::rms_norm(tg::ones({2, 4}), Tensor(), Tensor(), 1e-5, kNaN), "p");
  }
  SECTION("composite_attention_zero_width: a qkv of width 0 gives an empty output") {
    CHECK(tg::composite::causal_attention(tg::ones({2, 3, 0}), 1).shape() == Shape{2, 3, 0});
  }
  SECTION("causal_softmax_fma: huge scores give a one-hot row, not NaN") {
    for (const auto& [dt, scale] : {std::pair{tg::float32, 3e10}, std::pair{tg::float64, 3e30}}) {
      const Tensor x = tg::tensor({-1.0 / 3, 0.0, 0.0, 0.0}, {2, 2}, dt);
      tgtest::check_close(tg::scaled_causal_softmax(x, scale), {1.0, 0.0, 0.5, 0.5});
    }
  }
  SECTION("composite_attention_zero_heads: n_head = 0 is refused with tg::Error (was SIGFPE)") {
    REQUIRE_TG_ERROR(tg::composite::causal_attention(tg::ones({1, 2, 6}), 0), "n_head");
  }
}
