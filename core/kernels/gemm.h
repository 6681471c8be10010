#pragma once
// C = alpha * op(A) op(B) + beta * C, row-major, op(X) = X or X^T. M x N result, K inner.
// gemm() runs float32 products through our own AVX2 + FMA kernel where the build has them
// (sgemm_avx2.h), float64 ones and other builds' through OpenBLAS (cblas_sgemm / cblas_dgemm), and
// splits large products across the OpenMP team itself (gemm.cpp); gemm_naive() is the reference
// both are tested against: a plain triple loop accumulating in double.
#include <algorithm>
#include <cstdint>

namespace tg::kernels {

template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc);

// What a product may skip, for causal attention's square products (M = K or M = N):
//   lower_c: only C(i, j) with j <= i is needed; tiles wholly above the diagonal are not computed
//            and those elements of C are left unspecified (S = q k^T, dP = dY v^T: the causal
//            softmax reads only j <= i);
//   lower_a: op(A)(i, k) = 0 for k > i (P v, dS k: P and dS are 0 above the diagonal);
//   upper_a: op(A)(i, k) = 0 for k < i (P^T dY, dS^T q).
// gemm_tri gives gemm's result on every element the caller may read (with finite operands: a
// skipped 0 * inf would have made a NaN); where the build has no own float32 kernel, or the
// product is split across the team, it is gemm itself.
enum class Tri { none, lower_c, lower_a, upper_a };
template <class T>
void gemm_tri(Tri tri, bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
              const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc);

// A product's epilogue: work on C's elements once they are final, done while a block of C is still
// in the cache of the thread that computed it (a fused activation, kernels/mlp.h). fn(ctx, r0, r1,
// c0, c1) is called exactly once for each element of C, over blocks of rows [r0, r1) x columns
// [c0, c1) that together cover C, after the element's whole sum is stored (also for K = 0 and
// alpha = 0, where C = beta C). Blocks may run on several threads at once, and never overlap.
// With rows set, every block spans whole rows (c0 = 0, c1 = N): for work that pairs columns far
// apart, as SwiGLU's gate and up halves.
struct Epilogue {
  void (*fn)(const void* ctx, std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) = nullptr;
  const void* ctx = nullptr;
  bool rows = false;
  explicit operator bool() const { return fn != nullptr; }
  void operator()(std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) const { fn(ctx, r0, r1, c0, c1); }
  // The whole of an M x N C at once (the paths that do not cut C into blocks).
  void whole(std::int64_t M, std::int64_t N) const {
    if (fn && M > 0 && N > 0) fn(ctx, 0, M, 0, N);
  }
};

// Asks for the lines of a register tile of C, rows [0, mv) x columns [0, nv), ld floats apart,
// before a kernel sums into it: the tile is written (and read, after the first block of K) only at
// the end, and without the hint each of its rows waits there for memory when C is larger than the
// cache. A hint only: it changes no result.
inline void prefetch_tile(const float* C, std::int64_t ld, int mv, int nv) {
  for (int i = 0; i < mv; ++i) {
    const float* r = C + i * ld;
    for (int j = 0; j < nv; j += 16) __builtin_prefetch(r + j, 1);
    __builtin_prefetch(r + nv - 1, 1);  // the row's last line, when it starts inside a line
  }
}

// A run of 64-byte lines that a register tile asks for into L2 as it runs (prefetcht1), one line
// every 1, 2 or 4 steps of its loop over k: part of the panel of B that the next tiles read. A
// product's packed B is often larger than L2 (6.3-25 MB for the GPT-2-small MLP's products), so
// without it each panel's first tile reads the panel from L3 or memory, at a pace the hardware
// prefetcher, which restarts at every 4 KB page, does not keep up with (docs/performance.md, "The
// next panel of B in L2"). A hint only: it changes no result. (Attention's RowsAhead, attention.h,
// does the same for rows far apart, spread over a work item's tile pairs.)
struct Ahead {
  const char* p = nullptr;    // the next line to ask for
  const char* end = nullptr;  // past the last
  std::int64_t mask = 3;      // a line at each step k with (k & mask) == mask

  // Tile t of `tiles` takes the t-th of equal slices of the whole lines of [next, next + bytes),
  // asked for at the slowest of the three rates that covers its slice in `steps` steps (at most a
  // line a step: a slice of more lines than steps is asked for in part). next null: nothing.
  static Ahead slice(const void* next, std::int64_t bytes, std::int64_t tiles, std::int64_t t, std::int64_t steps) {
    if (!next || bytes < 64 || tiles <= 0) return {};
    const std::int64_t lines = bytes / 64, per = (lines + tiles - 1) / tiles;
    const std::int64_t from = std::min(t * per, lines), to = std::min(from + per, lines);
    const auto* c = static_cast<const char*>(next);
    return {c + from * 64, c + to * 64, 4 * per <= steps ? 3 : 2 * per <= steps ? 1 : 0};
  }
  void step(std::int64_t k) {
    if ((k & mask) == mask && p < end) {
      __builtin_prefetch(p, 0, 2);  // locality 2: prefetcht1, into L2
      p += 64;
    }
  }
};

// Asks for rows [r, r + n) of x (cols elements each, leading dimension ld), clipped to rows: for
// loops that read a few hundred elements of a row at a time, rows far apart, a pattern the
// hardware prefetcher follows only late, so each row's first lines would wait for memory.
template <class T>
inline void prefetch_rows(const T* x, std::int64_t ld, std::int64_t r, std::int64_t n, std::int64_t rows,
                          std::int64_t cols) {
  for (std::int64_t i = r; i < r + n && i < rows; ++i)
    for (std::int64_t c = 0; c < cols; c += 64 / static_cast<std::int64_t>(sizeof(T))) __builtin_prefetch(x + i * ld + c);
}

// One product's arguments, as gemm's, for gemm_pair; ep, when set, runs on C's blocks as they
// are finished.
template <class T>
struct Gemm {
  bool ta, tb;
  std::int64_t M, N, K;
  T alpha;
  const T* A;
  std::int64_t lda;
  const T* B;
  std::int64_t ldb;
  T beta;
  T* C;
  std::int64_t ldc;
  Epilogue ep{};
};
template <class T>
void gemm(const Gemm<T>& g);
// gemm(p); gemm(q) for two products of about equal work, neither of which reads or writes the
// other's output, computed side by side by halves of the team (gemm.cpp says why).
template <class T>
void gemm_pair(const Gemm<T>& p, const Gemm<T>& q);

template <class T>
void gemm_naive(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
                std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const T a = trans_a ? A[k * lda + m] : A[m * lda + k];
        const T b = trans_b ? B[n * ldb + k] : B[k * ldb + n];
        acc += static_cast<double>(a) * b;
      }
      T& c = C[m * ldc + n];
      c = static_cast<T>(alpha * acc + (beta == T(0) ? T(0) : beta * c));  // beta 0 ignores C (BLAS rule)
    }
}

}  // namespace tg::kernels
