#pragma once
// Shared test helpers.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>
#include <string>
#include <tapegrad/tapegrad.h>
// The tests use every feature, so they include every header.
#include <tapegrad/anomaly.h>
#include <tapegrad/autocast.h>
#include <tapegrad/checkpoint.h>
#include <tapegrad/hooks.h>
#include <tapegrad/memory.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

namespace tgtest {

// A float64 leaf with N(0, 1) entries (shifted/scaled), requiring grad, from its own seed.
inline tg::Tensor param64(const tg::Shape& shape, std::uint64_t seed, double scale = 1.0, double shift = 0.0) {
  tg::Generator g(seed);
  tg::Tensor t = tg::randn(shape, tg::float64, &g);
  double* p = t.data<double>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = p[i] * scale + shift;
  t.requires_grad_();
  return t;
}

// gradcheck must pass; on failure the report (per-input errors) is printed.
inline void require_gradcheck(const std::function<tg::Tensor(const std::vector<tg::Tensor>&)>& f,
                              const std::vector<tg::Tensor>& inputs, tg::GradcheckOptions opt = {}) {
  tg::GradcheckReport r = tg::gradcheck(f, inputs, opt);
  INFO(r.str());
  REQUIRE(r.ok);
  REQUIRE_FALSE(r.inputs.empty());
}

// Largest |a - b| over all elements (shapes must match). Equal infinities and NaN against NaN count
// as equal; a NaN or infinity against anything else gives +inf (std::max would drop a NaN).
inline double max_abs_diff(const tg::Tensor& a, const tg::Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double m = 0;
  for (std::size_t i = 0; i < va.size(); ++i) {
    if (va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i]))) continue;
    const double d = std::fabs(va[i] - vb[i]);
    m = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(m, d);
  }
  return m;
}

inline constexpr tg::DType kFloatTypes[] = {tg::float32, tg::float64};

// Every element of y within atol + rtol |expected| (float32 tolerances given, float64 1e-12);
// NaN and inf must match exactly. The first mismatches are printed on failure.
inline void check_close(const tg::Tensor& y, const std::vector<double>& expected, double rtol32 = 1e-5,
                        double atol32 = 1e-6) {
  REQUIRE(y.numel() == static_cast<std::int64_t>(expected.size()));
  const bool f32 = y.dtype() == tg::float32;
  const double rtol = f32 ? rtol32 : 1e-12, atol = f32 ? atol32 : 1e-12;
  const std::vector<double> v = y.to_vector<double>();
  std::size_t bad = 0;
  std::ostringstream first;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double e = expected[i];
    const bool ok = std::isnan(e) ? std::isnan(v[i])
                    : std::isinf(e) ? v[i] == e
                                    : std::fabs(v[i] - e) <= atol + rtol * std::fabs(e);
    if (!ok && bad++ < 5) first << "  element " << i << ": got " << v[i] << ", expected " << e << '\n';
  }
  INFO(y.dtype() << " " << y.shape() << ", " << bad << " of " << v.size() << " elements off:\n" << first.str());
  CHECK(bad == 0);
}

// A float64 leaf requiring grad with the given values.
inline tg::Tensor leaf64(const std::vector<double>& values, const tg::Shape& shape) {
  tg::Tensor t = tg::tensor(values, shape, tg::float64);
  t.requires_grad_();
  return t;
}

// The call throws tg::Error whose message contains every given fragment.
#define REQUIRE_TG_ERROR(expr, ...)                                                   \
  do {                                                                                \
    bool thrown_ = false;                                                             \
    try {                                                                             \
      (void)(expr);                                                                   \
    } catch (const tg::Error& e_) {                                                   \
      thrown_ = true;                                                                 \
      const std::string msg_ = e_.what();                                             \
      INFO("message: " << msg_);                                                      \
      for (const char* frag_ : {__VA_ARGS__}) CHECK(msg_.find(frag_) != std::string::npos); \
    }                                                                                 \
    INFO("expected tg::Error from: " #expr);                                          \
    REQUIRE(thrown_);                                                                 \
  } while (0)

}  // namespace tgtest
