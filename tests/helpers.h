#pragma once
// Shared test helpers.
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <tapegrad/tapegrad.h>

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

// Largest |a - b| over all elements (shapes must match).
inline double max_abs_diff(const tg::Tensor& a, const tg::Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double m = 0;
  for (std::size_t i = 0; i < va.size(); ++i) m = std::max(m, std::fabs(va[i] - vb[i]));
  return m;
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
