// The AVX2 + FMA float32 product: its register tile, run by the shared driver (sgemm_driver.h);
// sgemm_avx2.h explains the layering and why.
#include "kernels/sgemm_avx2.h"

#ifdef TG_SGEMM_AVX2
#define TG_SGEMM_TARGET "avx2,fma"
#include "kernels/sgemm_driver.h"

TG_SGEMM_BEGIN_TARGET(TG_SGEMM_TARGET)

namespace tg::kernels::sgemm_avx2 {

namespace {

using i64 = std::int64_t;

struct Tile {
  static constexpr int MR = 6;      // rows of C per kernel call
  static constexpr int NR = 16;     // columns of C per kernel call (two ymm)
  // K per block, as the AVX-512 tile's (the same K blocks give the same bits): a 16-column panel
  // of B is kc x 64 bytes, 48 KB at kc = 768, streamed from L2 in order; fewer, longer blocks read
  // and write C fewer times (docs/matmul.md)
  static constexpr i64 KC = 768;
  static constexpr i64 MC = 144;    // rows of C per block: 144 x 768 floats of A = 432 KB, under half a 1 MB L2
  static constexpr i64 NC = 2048;   // columns of B packed at once: 6 MB at kc = 768
  static constexpr bool kAhead = false;  // no slice of the next panel (gemm.h's Ahead): not measured with this tile

  // The 6 x 16 tile C[0..mv) x [0..nv) = alpha * sum_k a(i, k) b(k, j) + beta * C, over k < kc.
  // b(k, j) = Bp[k * 16 + j] (a packed, 32-byte aligned panel). ROWS: a(i, k) = A[i * lda + k]
  // (six rows of A read in place); else a(i, k) = A[k * lda + i] (a packed panel, lda = 6).
  // Written out by hand, one named register per accumulator and one pointer per row of A: the same
  // loop over arrays (c[6][2], A + i * lda) compiles to indexed addressing, which is slower on the
  // GPT's shapes. (The AVX-512 tiles are written over arrays, for either shape: the 14 x 32
  // tile's 14 rows cannot each have a pointer in 16 general registers.)
  template <bool ROWS>
  static void kernel(i64 kc, const float* __restrict A, i64 lda, const float* __restrict Bp, float* C, i64 ldc,
                     float alpha, float beta, int mv, int nv, const Ahead&) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const i64 row = ROWS ? lda : 1, step = ROWS ? 1 : lda;
    prefetch_tile(C, ldc, mv, nv);
    const float *a0 = A, *a1 = A + row, *a2 = A + 2 * row, *a3 = A + 3 * row, *a4 = A + 4 * row, *a5 = A + 5 * row;
#pragma GCC unroll 4
    for (i64 k = 0; k < kc; ++k) {
      const __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8);
      __m256 a = _mm256_broadcast_ss(a0);
      c00 = _mm256_fmadd_ps(a, b0, c00);
      c01 = _mm256_fmadd_ps(a, b1, c01);
      a = _mm256_broadcast_ss(a1);
      c10 = _mm256_fmadd_ps(a, b0, c10);
      c11 = _mm256_fmadd_ps(a, b1, c11);
      a = _mm256_broadcast_ss(a2);
      c20 = _mm256_fmadd_ps(a, b0, c20);
      c21 = _mm256_fmadd_ps(a, b1, c21);
      a = _mm256_broadcast_ss(a3);
      c30 = _mm256_fmadd_ps(a, b0, c30);
      c31 = _mm256_fmadd_ps(a, b1, c31);
      a = _mm256_broadcast_ss(a4);
      c40 = _mm256_fmadd_ps(a, b0, c40);
      c41 = _mm256_fmadd_ps(a, b1, c41);
      a = _mm256_broadcast_ss(a5);
      c50 = _mm256_fmadd_ps(a, b0, c50);
      c51 = _mm256_fmadd_ps(a, b1, c51);
      a0 += step;
      a1 += step;
      a2 += step;
      a3 += step;
      a4 += step;
      a5 += step;
      Bp += NR;
    }
    // A full tile goes straight to C; an edge tile to a buffer, then its valid part to C.
    alignas(32) float edge[MR * NR];
    const bool full = mv == MR && nv == NR;
    float* dst = full ? C : edge;
    const i64 ld = full ? ldc : NR;
    const bool read_c = full && beta != 0.0f;
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    auto put = [&](int i, __m256 x0, __m256 x1) {
      float* r = dst + i * ld;
      x0 = _mm256_mul_ps(va, x0);
      x1 = _mm256_mul_ps(va, x1);
      if (read_c) {
        x0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r), x0);
        x1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r + 8), x1);
      }
      _mm256_storeu_ps(r, x0);
      _mm256_storeu_ps(r + 8, x1);
    };
    put(0, c00, c01);
    put(1, c10, c11);
    put(2, c20, c21);
    put(3, c30, c31);
    put(4, c40, c41);
    put(5, c50, c51);
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
void sgemm_unpacked(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc) {
  sgemm_driver::sgemm_unpacked(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void sgemm_parallel(const Gemm<float>& p) { Driver::sgemm_parallel(p); }
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q) { Driver::sgemm_pair_parallel(p, q); }

}  // namespace tg::kernels::sgemm_avx2

TG_SGEMM_END_TARGET
#endif
