#include "kernels/gemm.h"

#include <cblas.h>

#include <cstring>

#include "kernels/parallel.h"

namespace tg::kernels {

namespace {
CBLAS_TRANSPOSE tr(bool t) { return t ? CblasTrans : CblasNoTrans; }

// OpenBLAS applies beta != 1 in a pass of its own before the product (its generic "beta" kernel),
// which for beta = 0 stores the zeros one scalar at a time: 11% of a training step went there. A
// vectorised fill of C (in parallel when large) and beta = 1 give the same C = alpha op(A) op(B)
// (0 + x = x), with BLAS's rule that beta = 0 ignores what C held (NaN included) intact.
template <class T>
T zero_c(T beta, std::int64_t M, std::int64_t N, T* C, std::int64_t ldc) {
  if (beta != T(0) || M <= 0 || N <= 0) return beta;
  parallel_for(M, M * N, [&](std::int64_t lo, std::int64_t hi) {
    if (ldc == N) std::memset(C + lo * N, 0, static_cast<std::size_t>((hi - lo) * N) * sizeof(T));
    else
      for (std::int64_t m = lo; m < hi; ++m) std::memset(C + m * ldc, 0, static_cast<std::size_t>(N) * sizeof(T));
  });
  return T(1);
}
}  // namespace

template <>
void gemm<float>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
                 std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  beta = zero_c(beta, M, N, C, ldc);
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K),
              alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

template <>
void gemm<double>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha, const double* A,
                  std::int64_t lda, const double* B, std::int64_t ldb, double beta, double* C, std::int64_t ldc) {
  beta = zero_c(beta, M, N, C, ldc);
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K),
              alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace tg::kernels
