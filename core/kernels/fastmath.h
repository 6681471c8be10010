#pragma once
// Scalar math functions, no arrays: fast_exp(x) and fast_erf(x) for one float32 value, branch-free
// so that the loops calling them vectorise (libm's expf/erff are scalar calls), plus the clampf
// they share. The double overloads are libm's exp and erf, so templated kernels call one name and
// float64 keeps libm's precision.
//
// fast_exp: Cody-Waite range reduction x = n ln2 + r with ln2 split in two (Cephes' expf, Moshier
// 1992), a degree-6 polynomial for e^r on |r| <= ln2/2, and 2^n built in the exponent bits.
// Relative error below 2 ulp on [-87.3, 88.3]; 0 below (e^-87.3 is float's smallest normal),
// NaN stays NaN, +inf for x > 88.7.
// fast_erf: the rational minimax approximation of Eigen / XLA's float erf (odd polynomial of
// degree 13 over an even one of degree 8, on |x| <= 4, where erf is 1 to float precision beyond);
// absolute error below 5e-7.
#include <bit>
#include <cmath>
#include <cstdint>

namespace tg::kernels {

// Clamp with plain comparisons, one bound at a time: each is then a single vmaxps / vminps (whose
// rule, "the second operand when unordered", is exactly these expressions', so a NaN passes
// through). std::fmin/fmax are libm calls unless -ffast-math, and the nested form x < lo ? lo :
// x > hi ? hi : x compiles to compares and blends.
inline float clampf(float x, float lo, float hi) {
  const float a = x < lo ? lo : x;
  return a > hi ? hi : a;
}

inline float fast_exp(float x) {
  const float xc = clampf(x, -87.33654f, 88.3762626647949f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
  // NaN needs no test of its own: it passes the clamps and the polynomial. The two ends do: the
  // clamps alone would give float's smallest normal below (exp(-inf) = 0 is what masked softmax
  // entries rely on) and e^88.376 above.
  const float y = p * scale;
  const float lo = x < -87.33654f ? 0.0f : y;
  return x > 88.72283f ? INFINITY : lo;
}

inline float fast_erf(float x) {
  const float xc = clampf(x, -4.0f, 4.0f);
  const float x2 = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  p = p * xc;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return p / q;  // a NaN x is still NaN here (it passes the clamp)
}

// The same names for double, so templated kernels can call them: libm.
inline double fast_exp(double x) { return std::exp(x); }
inline double fast_erf(double x) { return std::erf(x); }

}  // namespace tg::kernels
