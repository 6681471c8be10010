#include "kernels/gemm.h"

#include <cblas.h>

#include <cstring>

#include "kernels/parallel.h"

namespace tg::kernels {

namespace {
CBLAS_TRANSPOSE tr(bool t) { return t ? CblasTrans : CblasNoTrans; }
blasint bi(std::int64_t v) { return static_cast<blasint>(v); }

void blas(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A, std::int64_t lda,
          const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), bi(M), bi(N), bi(K), alpha, A, bi(lda), B, bi(ldb), beta, C, bi(ldc));
}
void blas(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha, const double* A,
          std::int64_t lda, const double* B, std::int64_t ldb, double beta, double* C, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), bi(M), bi(N), bi(K), alpha, A, bi(lda), B, bi(ldb), beta, C, bi(ldc));
}

// OpenBLAS applies beta != 1 in a pass of its own before the product (its generic "beta" kernel),
// which for beta = 0 stores the zeros one scalar at a time: 11% of a training step went there. A
// vectorised fill of C and beta = 1 give the same C = alpha op(A) op(B) (0 + x = x), with BLAS's
// rule that beta = 0 ignores what C held (NaN included) intact.
template <class T>
T zero_c(T beta, std::int64_t M, std::int64_t N, T* C, std::int64_t ldc) {
  if (beta != T(0) || M <= 0 || N <= 0) return beta;
  if (ldc == N) std::memset(C, 0, static_cast<std::size_t>(M * N) * sizeof(T));
  else
    for (std::int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<std::size_t>(N) * sizeof(T));
  return T(1);
}

// Start of thread t's block when [0, D) is cut into nt parts at multiples of 16 (the width of the
// BLAS micro-kernels' tiles, so no thread gets a ragged tile in the middle of the matrix).
std::int64_t cut(std::int64_t D, int t, int nt) {
  if (t >= nt) return D;
  const std::int64_t c = (chunk_begin(D, t, nt) + 8) / 16 * 16;
  return c < D ? c : D;
}
}  // namespace

// The product is split across the team here, not inside OpenBLAS: each thread computes a block of
// rows of C (or of columns, when C is wider than tall) with a single-threaded BLAS call (OpenBLAS's
// OpenMP build runs serially inside a parallel region). OpenBLAS's own threading of these small
// products (K = 128 to 768) synchronises its threads through sched_yield loops after each packed
// panel, which a profile of the training step showed at about 5% of the step; the split has one
// barrier per call. Measured in the training benchmark, alternating the two ways step by step:
// 4 to 8% less time per step. Each thread also zero-fills its own block of C, which is then in its
// cache when the product starts.
template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const bool by_rows = M >= N;
  const std::int64_t D = by_rows ? M : N;
  if (D < 32 || !worth_parallel(M * N * K / 16)) {  // one thread; OpenBLAS may still split a large call
    blas(ta, tb, M, N, K, alpha, A, lda, B, ldb, zero_c(beta, M, N, C, ldc), C, ldc);
    return;
  }
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const std::int64_t lo = cut(D, t, nt), hi = cut(D, t + 1, nt);
    if (lo < hi && by_rows) {  // rows [lo, hi) of C need rows [lo, hi) of op(A)
      T* Cb = C + lo * ldc;
      blas(ta, tb, hi - lo, N, K, alpha, ta ? A + lo : A + lo * lda, lda, B, ldb, zero_c(beta, hi - lo, N, Cb, ldc), Cb,
           ldc);
    } else if (lo < hi) {  // columns [lo, hi) of C need columns [lo, hi) of op(B)
      T* Cb = C + lo;
      blas(ta, tb, M, hi - lo, K, alpha, A, lda, tb ? B + lo * ldb : B + lo, ldb, zero_c(beta, M, hi - lo, Cb, ldc), Cb,
           ldc);
    }
  }
}

template void gemm<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                          const float*, std::int64_t, float, float*, std::int64_t);
template void gemm<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double, const double*, std::int64_t,
                           const double*, std::int64_t, double, double*, std::int64_t);

}  // namespace tg::kernels
