#include "kernels/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/isa.h"
#include "kernels/parallel.h"
#include "kernels/sgemm_avx2.h"
#include "kernels/sgemm_avx512.h"

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

// Our own float32 product for the instruction set in use (isa.h): AVX-512's 14 x 32 or 8 x 48 tile or
// AVX2's 6 x 16 (sgemm_avx512.h, sgemm_avx2.h say why), through one driver; null on CPUs with
// neither, whose float32 products go to OpenBLAS.
struct OwnSgemm {
  void (*one)(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t, const float*,
              std::int64_t, float, float*, std::int64_t, Tri);
  void (*team)(const Gemm<float>&);
  void (*pair)(const Gemm<float>&, const Gemm<float>&);
};
const OwnSgemm* own_sgemm() {
#ifdef TG_KERNELS_X86
  static constexpr OwnSgemm avx512{sgemm_avx512::sgemm, sgemm_avx512::sgemm_parallel,
                                   sgemm_avx512::sgemm_pair_parallel};
  static constexpr OwnSgemm avx2{sgemm_avx2::sgemm, sgemm_avx2::sgemm_parallel, sgemm_avx2::sgemm_pair_parallel};
  const Isa level = isa();
  if (level >= Isa::avx512) return &avx512;
  if (level >= Isa::avx2) return &avx2;
#endif
  return nullptr;
}

// One single-threaded product: float32 through our own kernel where the CPU has one, everything
// else through OpenBLAS with the zero fill above.
void product(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
             std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (const OwnSgemm* own = own_sgemm()) own->one(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, Tri::none);
  else blas(ta, tb, M, N, K, alpha, A, lda, B, ldb, zero_c(beta, M, N, C, ldc), C, ldc);
}
void product(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha, const double* A,
             std::int64_t lda, const double* B, std::int64_t ldb, double beta, double* C, std::int64_t ldc) {
  blas(ta, tb, M, N, K, alpha, A, lda, B, ldb, zero_c(beta, M, N, C, ldc), C, ldc);
}

// Start of thread t's block when [0, D) is cut into nt parts at multiples of 16 (the width of the
// BLAS micro-kernels' tiles, so no thread gets a ragged tile in the middle of the matrix).
std::int64_t cut(std::int64_t D, int t, int nt) {
  if (t >= nt) return D;
  const std::int64_t c = (chunk_begin(D, t, nt) + 8) / 16 * 16;
  return c < D ? c : D;
}

// Worth cutting across the team: large enough that a team pays off, wide enough for two tiles.
template <class T>
bool split_worth(const Gemm<T>& g) {
  return std::max(g.M, g.N) >= 32 && worth_parallel(g.M * g.N * g.K / 16);
}
// The product is split across the team here, not inside OpenBLAS: each thread computes a block of
// rows of C (or of columns, when C is wider than tall) with a single-threaded BLAS call (OpenBLAS's
// OpenMP build runs serially inside a parallel region). OpenBLAS's own threading of these small
// products (K = 128 to 768) synchronises its threads through sched_yield loops after each packed
// panel, which a profile of the training step showed at about 5% of the step; the split has one
// barrier per call. Measured in the training benchmark, alternating the two ways step by step:
// 4 to 8% less time per step. Each thread also zero-fills its own block of C, which is then in its
// cache when the product starts. (float32 on AVX2 and AVX-512 CPUs goes to our own product's
// team versions instead, which pack op(B) once and deal the blocks of C out dynamically:
// sgemm_driver.h.)
template <class T>
void gemm_block(const Gemm<T>& g, int t, int nt) {
  const bool by_rows = g.M >= g.N;
  const std::int64_t D = by_rows ? g.M : g.N;
  const std::int64_t lo = cut(D, t, nt), hi = cut(D, t + 1, nt);
  if (lo >= hi) return;
  if (by_rows) {  // rows [lo, hi) of C need rows [lo, hi) of op(A)
    T* Cb = g.C + lo * g.ldc;
    product(g.ta, g.tb, hi - lo, g.N, g.K, g.alpha, g.ta ? g.A + lo : g.A + lo * g.lda, g.lda, g.B, g.ldb, g.beta, Cb,
            g.ldc);
  } else {  // columns [lo, hi) of C need columns [lo, hi) of op(B)
    T* Cb = g.C + lo;
    product(g.ta, g.tb, g.M, hi - lo, g.K, g.alpha, g.A, g.lda, g.tb ? g.B + lo * g.ldb : g.B + lo, g.ldb, g.beta, Cb,
            g.ldc);
  }
}
// The product with its epilogue: block by block where our own team version cuts C (it calls ep
// itself), on the whole C after the product everywhere else.
template <class T>
void run(const Gemm<T>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  if (!split_worth(g)) {  // one thread (OpenBLAS may still split a large float64 call)
    product(g.ta, g.tb, g.M, g.N, g.K, g.alpha, g.A, g.lda, g.B, g.ldb, g.beta, g.C, g.ldc);
    g.ep.whole(g.M, g.N);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (const OwnSgemm* own = own_sgemm()) {
      own->team(g);
      return;
    }
  }
#pragma omp parallel
  gemm_block(g, omp_get_thread_num(), omp_get_num_threads());
  g.ep.whole(g.M, g.N);
}
}  // namespace

template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  run(Gemm<T>{ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc});
}
template <class T>
void gemm(const Gemm<T>& g) {
  run(g);
}

template <class T>
void gemm_tri(Tri tri, bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
              std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    const Gemm<float> g{ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
    const OwnSgemm* own = own_sgemm();
    if (own && M > 0 && N > 0 && !split_worth(g)) {
      own->one(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, tri);
      return;
    }
  }
  (void)tri;  // the whole product: what tri would skip is zero or not read
  gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Two independent products in one parallel region, the team cut in two in proportion to their
// work (with two threads: one product each, whole); one after the other on the whole team when
// either is too small to split, inside a parallel region, or with one thread. The two products of
// a Linear's backward, dx = dy w and dw = dy^T x, have the same number of multiply-adds, so with
// two threads each gets an equal share without cutting a product: no operand is packed twice
// (each thread of a split product packs the whole shared operand) and one barrier serves both.
// (With two threads and unequal products the larger one sets the time: meant for equal pairs.)
// (docs/performance.md has the measurement.) float32 on AVX2 and AVX-512 CPUs: the same
// start, then a thread that finishes its product takes what is left of the other's
// (sgemm_driver.h's sgemm_pair_parallel), so unequal pairs work too.
template <class T>
void gemm_pair(const Gemm<T>& p, const Gemm<T>& q) {
  const int nt = omp_get_max_threads();
  if (nt < 2 || omp_in_parallel() || p.M <= 0 || p.N <= 0 || q.M <= 0 || q.N <= 0 || !split_worth(p) ||
      !split_worth(q)) {
    run(p);
    run(q);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (const OwnSgemm* own = own_sgemm()) {
      own->pair(p, q);
      return;
    }
  }
  const double wp = static_cast<double>(p.M * p.N * p.K), wq = static_cast<double>(q.M * q.N * q.K);
  const int np = std::clamp(static_cast<int>(std::lround(nt * wp / (wp + wq))), 1, nt - 1);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    if (n < 2) {  // the runtime gave fewer threads than asked
      gemm_block(p, 0, 1);
      gemm_block(q, 0, 1);
    } else {
      const int split = std::min(np, n - 1);
      if (t < split) gemm_block(p, t, split);
      else gemm_block(q, t - split, n - split);
    }
  }
  p.ep.whole(p.M, p.N);
  q.ep.whole(q.M, q.N);
}

template void gemm<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                          const float*, std::int64_t, float, float*, std::int64_t);
template void gemm<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double, const double*, std::int64_t,
                           const double*, std::int64_t, double, double*, std::int64_t);
template void gemm_tri<float>(Tri, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                              std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);
template void gemm_tri<double>(Tri, bool, bool, std::int64_t, std::int64_t, std::int64_t, double, const double*,
                               std::int64_t, const double*, std::int64_t, double, double*, std::int64_t);
template void gemm<float>(const Gemm<float>&);
template void gemm<double>(const Gemm<double>&);
template void gemm_pair<float>(const Gemm<float>&, const Gemm<float>&);
template void gemm_pair<double>(const Gemm<double>&, const Gemm<double>&);

}  // namespace tg::kernels
