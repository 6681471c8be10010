// Array conversions between float32 and bfloat16; bf16.h gives the rounding and why.
#include "kernels/bf16.h"

#include "kernels/isa.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define TG_BF16_X86 1
#include <immintrin.h>
#endif

namespace tg::kernels {

namespace bf16_impl {

void to_bf16_portable(const float* x, bf16* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
}

#ifdef TG_BF16_X86
// AVX-512F: the definition's integer rounding in 16 lanes, for CPUs without AVX512_BF16 (and for
// the subnormal lanes of the AVX512_BF16 conversion below), and the exact widening. The maskz_
// forms with every lane set keep GCC 12 from warning that the plain forms' undefined source is
// uninitialised.
#pragma GCC push_options
#pragma GCC target("avx512f")

namespace {

// The definition's rounding of 16 floats, u + 0x7FFF + ((u >> 16) & 1), the bf16 in each lane's
// low half; right for every lane but NaN, which the definition makes quiet (to_bf16_avx512f does;
// convert32 takes only subnormal lanes from it).
inline __m512i round_finite(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
  const __m512i odd = _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, u, 16), one);
  const __m512i t = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_maskz_srli_epi32(0xFFFF, t, 16);
}

}  // namespace

// The last n % 16 values by the scalar definition.
void to_bf16_avx512f(const float* x, bf16* y, std::int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000),
                quiet = _mm512_set1_epi32(0x00400000);
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    // a NaN stays a NaN, made quiet: (u | 0x00400000) >> 16
    const __m512i r = _mm512_mask_srli_epi32(round_finite(v), nan, _mm512_or_si512(u, quiet), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_maskz_cvtepi32_epi16(0xFFFF, r));
  }
  for (; i < n; ++i) y[i] = to_bf16(x[i]);
}

void to_float_avx512f(const bf16* x, float* y, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i h = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_si512(y + i, _mm512_maskz_slli_epi32(0xFFFF, h, 16));
  }
  for (; i < n; ++i) y[i] = to_float(x[i]);
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace {

// 32 floats (m selects which are loaded; the others read as 0) -> 32 bf16. vcvtne2ps2bf16 flushes
// float32 subnormals to zero; a block that holds one (|bits| in (0, 0x00800000)) is redone by the
// definition's integer rounding (round_finite).
inline __m512i convert32(const float* x, __mmask32 m) {
  const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m), x);
  const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m >> 16), x + 16);
  __m512i r = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), min_normal = _mm512_set1_epi32(0x00800000);
  const __m512i ulo = _mm512_and_si512(_mm512_castps_si512(lo), abs_mask);
  const __m512i uhi = _mm512_and_si512(_mm512_castps_si512(hi), abs_mask);
  const __mmask16 sub_lo = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(ulo, _mm512_set1_epi32(1)),
                                                   _mm512_sub_epi32(min_normal, _mm512_set1_epi32(1)));
  const __mmask16 sub_hi = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(uhi, _mm512_set1_epi32(1)),
                                                   _mm512_sub_epi32(min_normal, _mm512_set1_epi32(1)));
  if (sub_lo | sub_hi) [[unlikely]] {
    const __m512i idx = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                         13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // Each 32-bit lane's low half holds the bf16: gather the low halves of both vectors in order.
    const __m512i even = _mm512_add_epi16(idx, idx);
    const __m512i exact = _mm512_permutex2var_epi16(round_finite(lo), even, round_finite(hi));
    const __mmask32 sub = static_cast<__mmask32>(sub_lo) | (static_cast<__mmask32>(sub_hi) << 16);
    r = _mm512_mask_mov_epi16(r, sub, exact);
  }
  return r;
}

}  // namespace

void to_bf16_avx512(const float* x, bf16* y, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) _mm512_storeu_si512(y + i, convert32(x + i, ~__mmask32{0}));
  if (i < n) {
    const __mmask32 m = static_cast<__mmask32>((std::uint64_t{1} << (n - i)) - 1);
    _mm512_mask_storeu_epi16(y + i, m, convert32(x + i, m));
  }
}

#pragma GCC pop_options

#else
void to_bf16_avx512(const float* x, bf16* y, std::int64_t n) { to_bf16_portable(x, y, n); }
void to_bf16_avx512f(const float* x, bf16* y, std::int64_t n) { to_bf16_portable(x, y, n); }
void to_float_avx512f(const bf16* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = to_float(x[i]);
}
#endif

}  // namespace bf16_impl

void to_bf16(const float* x, bf16* y, std::int64_t n) {
#ifdef TG_BF16_X86
  if (isa() >= Isa::avx512_bf16) return bf16_impl::to_bf16_avx512(x, y, n);
  if (isa() >= Isa::avx512) return bf16_impl::to_bf16_avx512f(x, y, n);
#endif
  bf16_impl::to_bf16_portable(x, y, n);
}

void to_float(const bf16* x, float* y, std::int64_t n) {
#ifdef TG_BF16_X86
  if (isa() >= Isa::avx512) return bf16_impl::to_float_avx512f(x, y, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) y[i] = to_float(x[i]);
}

}  // namespace tg::kernels
