#include "kernels/gemm.h"

#include <cblas.h>

namespace tg::kernels {

namespace {
CBLAS_TRANSPOSE tr(bool t) { return t ? CblasTrans : CblasNoTrans; }
}  // namespace

template <>
void gemm<float>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
                 std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K),
              alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

template <>
void gemm<double>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha, const double* A,
                  std::int64_t lda, const double* B, std::int64_t ldb, double beta, double* C, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K),
              alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace tg::kernels
