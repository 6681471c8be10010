// The vectorisable float32 exp and erf against libm (their naive reference).
#include <cmath>
#include <limits>

#include "helpers.h"
#include "kernels/fastmath.h"

using tg::kernels::fast_erf;
using tg::kernels::fast_exp;

TEST_CASE("fast_exp is within 2 ulp of expf over the float range") {
  double worst = 0;
  for (float x = -87.0f; x < 88.0f; x += 0.000731f) {
    const double ref = std::exp(static_cast<double>(x));
    const double ulp = std::nextafter(static_cast<float>(ref), INFINITY) - static_cast<float>(ref);
    worst = std::max(worst, std::fabs(fast_exp(x) - ref) / ulp);
  }
  INFO("worst error in ulp: " << worst);
  CHECK(worst < 2.0);
  CHECK(fast_exp(0.0f) == 1.0f);
  CHECK(fast_exp(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(fast_exp(-100.0f) == 0.0f);
  CHECK(std::isinf(fast_exp(100.0f)));
  CHECK(std::isnan(fast_exp(std::nanf(""))));
  CHECK(fast_exp(std::numeric_limits<float>::infinity()) == std::numeric_limits<float>::infinity());
  CHECK(std::isfinite(fast_exp(88.3f)));
  // The same specials through a loop the compiler vectorises (vmaxps / vminps and one blend):
  // every lane as the scalar call.
  const float inf = std::numeric_limits<float>::infinity();
  float in[16] = {-inf, -100.f, -87.4f, -87.3f, -1.f, 0.f, 1e-8f, 1.f, 20.f, 88.3f, 88.5f, 100.f, inf, std::nanf(""), -0.f, 3.f};
  float out[16];
  for (int i = 0; i < 16; ++i) out[i] = fast_exp(in[i]);
  for (int i = 0; i < 16; ++i) {
    INFO("x = " << in[i]);
    const float s = fast_exp(static_cast<float>(in[i] + 0.0f * static_cast<float>(i)));
    CHECK(((std::isnan(out[i]) && std::isnan(s)) || out[i] == s));
    if (in[i] < -87.34f) CHECK(out[i] == 0.0f);
    if (in[i] > 88.8f) CHECK(out[i] == inf);
  }
}

TEST_CASE("fast_erf is within 5e-7 of erf") {
  double worst = 0;
  for (float x = -10.0f; x < 10.0f; x += 0.0001237f)
    worst = std::max(worst, std::fabs(fast_erf(x) - std::erf(static_cast<double>(x))));
  INFO("worst absolute error: " << worst);
  CHECK(worst < 5e-7);
  CHECK(fast_erf(0.0f) == 0.0f);
  CHECK(fast_erf(-1.5f) == -fast_erf(1.5f));
  CHECK(std::isnan(fast_erf(std::nanf(""))));
  CHECK(fast_erf(std::numeric_limits<float>::infinity()) == 1.0f);
  CHECK(fast_erf(-std::numeric_limits<float>::infinity()) == -1.0f);
  // double keeps libm
  CHECK(fast_erf(0.3) == std::erf(0.3));
  CHECK(fast_exp(0.3) == std::exp(0.3));
}
