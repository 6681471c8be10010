// The cores' multiply-add peaks, measured: each thread of the team runs independent chains of one
// instruction on registers (no memory traffic), so the rate is what the FMA pipes give. The
// products' fractions of peak (scripts/bench) divide by these.
//   fma_avx2:   vfmadd231ps on ymm, 8 lanes x 2 flops;
//   fma_avx512: vfmadd231ps on zmm, 16 lanes x 2 flops;
//   dpbf16:     vdpbf16ps on zmm, 16 lanes x 2 pairs x 2 flops;
//   amx_bf16:   tdpbf16ps on 16 x 16 tiles of float32 with 16 x 32 bf16 of A, 16 x 16 x 32 x 2 flops,
//               four independent accumulator tiles (as the product's 2 x 2 block).
// Twelve chains per thread cover the vector instructions' latency on two pipes.
#include "peak.h"

#include <omp.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TG_PEAK_X86 1
#endif

namespace bench {

namespace {

#ifdef TG_PEAK_X86
constexpr int kChains = 12;

__attribute__((target("avx512f"))) float lane0(__m512 v) { return _mm512_cvtss_f32(v); }

__attribute__((target("avx2,fma"))) float run_avx2(long iters) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (long i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
  return _mm256_cvtss_f32(s);
}

__attribute__((target("avx512f"))) float run_avx512(long iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  for (long i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return lane0(s);
}

__attribute__((target("avx512f,avx512bf16"))) float run_dpbf16(long iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c) * 1e-3f);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3800);
  for (long i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return lane0(s);
}

struct alignas(64) TileConfig {
  unsigned char palette = 1, start_row = 0, reserved[14] = {};
  unsigned short colsb[16] = {};
  unsigned char rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) float run_amx(long iters) {
  TileConfig t;
  for (int i = 0; i < 8; ++i) {
    t.colsb[i] = 64;
    t.rows[i] = 16;
  }
  _tile_loadconfig(&t);
  alignas(64) static thread_local unsigned short ones[16 * 32];
  for (auto& v : ones) v = 0x3800;  // bf16 2^-15: sums stay small
  alignas(64) float out[16 * 16];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  float s = out[0];
  _tile_stored(3, out, 64);
  return s + out[0];
}
#endif

}  // namespace

double peak_flops_per_iteration(PeakKind k) {
  switch (k) {
    case PeakKind::fma_avx2: return 12.0 * 8 * 2;
    case PeakKind::fma_avx512: return 12.0 * 16 * 2;
    case PeakKind::dpbf16: return 12.0 * 16 * 2 * 2;
    case PeakKind::amx_bf16: return 4.0 * 16 * 16 * 32 * 2;
  }
  return 0;
}

float run_peak(PeakKind k, long iters) {
#ifdef TG_PEAK_X86
  float sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
    switch (k) {
      case PeakKind::fma_avx2: sink += run_avx2(iters); break;
      case PeakKind::fma_avx512: sink += run_avx512(iters); break;
      case PeakKind::dpbf16: sink += run_dpbf16(iters); break;
      case PeakKind::amx_bf16: sink += run_amx(iters); break;
    }
  }
  return sink;
#else
  (void)k;
  (void)iters;
  return 0;
#endif
}

}  // namespace bench
