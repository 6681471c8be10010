// The AVX-512 float32 product: its register tile, run by the shared driver (sgemm_driver.h);
// sgemm_avx512.h says why this tile.
#include "kernels/sgemm_avx512.h"

#ifdef TG_SGEMM_AVX512
#define TG_SGEMM_TARGET "avx512f,avx2,fma"
#include "kernels/sgemm_driver.h"

TG_SGEMM_BEGIN_TARGET(TG_SGEMM_TARGET)

namespace tg::kernels::sgemm_avx512 {

namespace {

using i64 = std::int64_t;

struct Tile {
  static constexpr int MR = 14;     // rows of C per kernel call
  static constexpr int NR = 32;     // columns of C per kernel call (two zmm)
  static constexpr i64 KC = 768;    // K per block, as the AVX2 tile's: a panel of B is kc x 128 bytes = 96 KB
  static constexpr i64 MC = 140;    // rows of C per block: 140 x 768 floats of A = 420 KB, under half a 1 MB L2
  static constexpr i64 NC = 2048;   // columns of B packed at once: 6 MB at kc = 768

  // The MR x 32 tile C[0..mv) x [0..nv) = alpha * sum_k a(i, k) b(k, j) + beta * C, over k < kc
  // (sgemm_driver.h gives the operands' layout). Each row's two accumulators take a(i, k) as a
  // broadcast, b(k, 0..16) and b(k, 16..32) from the packed panel.
  template <bool ROWS>
  static void kernel(i64 kc, const float* __restrict A, i64 lda, const float* __restrict Bp, float* C, i64 ldc,
                     float alpha, float beta, int mv, int nv) {
    __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
    const i64 row = ROWS ? lda : 1, step = ROWS ? 1 : lda;
    prefetch_tile(C, ldc, mv, nv);
#pragma GCC unroll 2
    for (i64 k = 0; k < kc; ++k) {
      const __m512 b0 = _mm512_load_ps(Bp), b1 = _mm512_load_ps(Bp + 16);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(A[i * row]);
        c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
        c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
      }
      A += step;
      Bp += NR;
    }
    // A full tile goes straight to C; an edge tile to a buffer, then its valid part to C.
    alignas(64) float edge[MR * NR];
    const bool full = mv == MR && nv == NR;
    float* dst = full ? C : edge;
    const i64 ld = full ? ldc : NR;
    const bool read_c = full && beta != 0.0f;
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      float* r = dst + i * ld;
      __m512 x0 = _mm512_mul_ps(va, c0[i]), x1 = _mm512_mul_ps(va, c1[i]);
      if (read_c) {
        x0 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(r), x0);
        x1 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(r + 16), x1);
      }
      _mm512_storeu_ps(r, x0);
      _mm512_storeu_ps(r + 16, x1);
    }
    if (!full)
      for (int i = 0; i < mv; ++i)
        for (int j = 0; j < nv; ++j) {
          float& out = C[i * ldc + j];
          out = beta == 0.0f ? edge[i * NR + j] : std::fma(beta, out, edge[i * NR + j]);  // as the full tile
        }
  }
};

using Driver = sgemm_driver::Driver<Tile>;

}  // namespace

void sgemm(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B, i64 ldb,
           float beta, float* C, i64 ldc, Tri tri) {
  Driver::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, tri);
}
void sgemm_parallel(const Gemm<float>& p) { Driver::sgemm_parallel(p); }
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q) { Driver::sgemm_pair_parallel(p, q); }

}  // namespace tg::kernels::sgemm_avx512

TG_SGEMM_END_TARGET
#endif
