#pragma once
// RMSNorm's float32 rows with AVX2 and FMA: the row helpers of the fast path of rms_norm_forward /
// rms_norm_backward (kernels/norms_fast.h, which runs them when the binary is built for such a
// CPU, -march=native on x86-64, and the row length C and the statistic's length k are multiples
// of 8). kernels/norms.h has the reference loops, which the tests compare this path with.
//
// Why intrinsics. The portable backward makes three passes over each row (the row sum in double,
// the gain-gradient sum, dx) and converts every product to double for the row sum; the forward
// converts every x to double for its sum of squares. Both are memory-bound loops that still lose
// time to that arithmetic. This path makes the sums in one pass, in float arithmetic inside chunks
// of 32 elements, and streams large outputs (the timings: docs/performance.md). GCC does not
// vectorise a loop that keeps float partials and widens them once per chunk, hence intrinsics.
//
// Accuracy: the products and the sums inside a chunk of 32 elements are float (each lane adds
// four products, two accumulators of two), the chunks' sums are added in double. That is at most
// about four float roundings per term before the double sum takes over, as the 16-row blocks of
// the parameter sums (norms_fast.h); the portable path rounds each product once, then sums in
// double.
//
// Non-temporal stores: outputs of kStreamBytes and more are written with _mm256_stream_ps, which
// sends full cache lines to memory without first reading them in (a plain store of a line that is
// not cached reads it first: a third more memory traffic for a pass that reads one array and
// writes one). An output that large does not stay in cache for its consumer anyway; smaller ones
// (every activation of the GPT) are stored normally so their consumer finds them in cache.
#if defined(__AVX2__) && defined(__FMA__)
#define TG_RMS_AVX2 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace tg::kernels::rms_avx2 {

inline constexpr std::int64_t kStreamBytes = std::int64_t{16} << 20;  // well past L2, a share of L3

// The fast path's conditions on the shapes; dst must also be 32-byte aligned to stream.
inline bool fits(std::int64_t C, std::int64_t k) { return C % 8 == 0 && k % 8 == 0 && k > 0; }
inline bool streamable(const float* dst, std::int64_t bytes) {
  return bytes >= kStreamBytes && (reinterpret_cast<std::uintptr_t>(dst) & 31) == 0;
}

inline double hsum(__m256d a, __m256d b) {
  alignas(32) double q[4];
  _mm256_store_pd(q, _mm256_add_pd(a, b));
  return (q[0] + q[1]) + (q[2] + q[3]);
}
// A chunk's 8 float lanes into the double sums: the only conversions of the path.
inline void widen_add(__m256 v, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

// sum_{j < n} f(j) for an 8-lane float term f(j): two float accumulators over chunks of 32, each
// chunk widened into double. n % 8 == 0.
template <class F>
inline double chunked_sum(std::int64_t n, F&& f) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
    const std::int64_t end = std::min(n, j0 + 32);
    __m256 sa = _mm256_setzero_ps(), sb = _mm256_setzero_ps();
    std::int64_t j = j0;
    for (; j + 16 <= end; j += 16) {
      sa = _mm256_add_ps(sa, f(j));
      sb = _mm256_add_ps(sb, f(j + 8));
    }
    if (j < end) sa = _mm256_add_ps(sa, f(j));
    widen_add(_mm256_add_ps(sa, sb), lo, hi);
  }
  return hsum(lo, hi);
}

template <bool Stream>
inline void store(float* d, __m256 v) {
  if constexpr (Stream) _mm256_stream_ps(d, v);
  else _mm256_storeu_ps(d, v);
}
// Streamed stores are weakly ordered: a fence makes them visible before another thread reads them.
inline void fence() { _mm_sfence(); }

// Forward row: returns sum_{j < k} a_j^2 (k % 8 == 0), nothing written.
inline double sum_squares(const float* xr, std::int64_t k) {
  return chunked_sum(k, [&](std::int64_t j) {
    const __m256 a = _mm256_loadu_ps(xr + j);
    return _mm256_mul_ps(a, a);
  });
}
// Forward row: y = a rt g (+ b).
template <bool Stream>
inline void scale_row(const float* xr, const float* gg, const float* b, float rt, std::int64_t C, float* yr) {
  const __m256 r8 = _mm256_set1_ps(rt);
  for (std::int64_t j = 0; j < C; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), r8), _mm256_loadu_ps(gg + j));
    store<Stream>(yr + j, b ? _mm256_add_ps(v, _mm256_loadu_ps(b + j)) : v);
  }
}

// Backward row, one pass over a and dy: returns s = sum_j g_j dy_j a_j, adds dy a rt into pg and
// dy into pb (each when not null).
inline double backward_sums(const float* xr, const float* gr, const float* gg, float rt, std::int64_t C, float* pg,
                            float* pb) {
  const __m256 r8 = _mm256_set1_ps(rt);
  return chunked_sum(C, [&](std::int64_t j) {
    const __m256 d = _mm256_loadu_ps(gr + j);
    const __m256 p = _mm256_mul_ps(d, _mm256_loadu_ps(xr + j));
    if (pg) _mm256_storeu_ps(pg + j, _mm256_fmadd_ps(p, r8, _mm256_loadu_ps(pg + j)));
    if (pb) _mm256_storeu_ps(pb + j, _mm256_add_ps(_mm256_loadu_ps(pb + j), d));
    return _mm256_mul_ps(p, _mm256_loadu_ps(gg + j));
  });
}
// Backward row, the row still in L1: dx_j = g_j dy_j rt - [j < k] a_j c2, written.
template <bool Stream>
inline void backward_dx(const float* xr, const float* gr, const float* gg, float rt, float c2, std::int64_t C,
                        std::int64_t k, float* dr) {
  const __m256 r8 = _mm256_set1_ps(rt), c8 = _mm256_set1_ps(c2);
  for (std::int64_t j = 0; j < C; j += 8) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(gr + j), _mm256_loadu_ps(gg + j)), r8);
    if (j < k) v = _mm256_fnmadd_ps(_mm256_loadu_ps(xr + j), c8, v);
    store<Stream>(dr + j, v);
  }
}

}  // namespace tg::kernels::rms_avx2
#endif
