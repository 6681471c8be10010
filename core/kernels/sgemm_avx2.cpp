// The AVX2 + FMA float32 product; sgemm_avx2.h explains the layering and why.
#include "kernels/sgemm_avx2.h"

#ifdef TG_SGEMM_AVX2
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace tg::kernels::sgemm_avx2 {

namespace {

using i64 = std::int64_t;

constexpr int kMR = 6;     // rows of C per kernel call
constexpr int kNR = 16;    // columns of C per kernel call (two ymm)
constexpr i64 kKC = 256;   // K per block: a 16-column panel of B is kc x 64 bytes = 16 KB, half of L1
constexpr i64 kMC = 144;   // rows of C per block: 144 x 256 floats of A = 144 KB, a share of L2
constexpr i64 kNC = 2048;  // columns of B packed at once: 2 MB at kc = 256

// The 6 x 16 tile C[0..mv) x [0..nv) = alpha * sum_k a(i, k) b(k, j) + beta * C, over k < kc.
// b(k, j) = Bp[k * 16 + j] (a packed, 32-byte aligned panel). ROWS: a(i, k) = A[i * lda + k]
// (six rows of A read in place); else a(i, k) = A[k * lda + i] (a packed panel, lda = 6).
// Written out by hand, one named register per accumulator and one pointer per row of A: the same
// loop over arrays (c[6][2], A + i * lda) compiled to indexed addressing and ran 3-10% slower on
// the qkv product in three alternating runs.
template <bool ROWS>
void kernel(i64 kc, const float* __restrict A, i64 lda, const float* __restrict Bp, float* C, i64 ldc, float alpha,
            float beta, int mv, int nv) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const i64 row = ROWS ? lda : 1, step = ROWS ? 1 : lda;
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
    Bp += kNR;
  }
  // A full tile goes straight to C; an edge tile to a buffer, then its valid part to C.
  alignas(32) float edge[kMR * kNR];
  const bool full = mv == kMR && nv == kNR;
  float* dst = full ? C : edge;
  const i64 ld = full ? ldc : kNR;
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
        out = beta == 0.0f ? edge[i * kNR + j] : std::fma(beta, out, edge[i * kNR + j]);  // as the full tile
      }
}

// A last panel of fewer than 6 rows of op(A) = A, k in [0, kc), zero padded: Ap[k * 6 + i] =
// A[i * lda + k]. (A^T's last panel is packed with the rest, by pack_a_trans.)
void pack_a_edge(const float* A, i64 lda, int rows, i64 kc, float* Ap) {
  for (i64 k = 0; k < kc; ++k)
    for (int i = 0; i < kMR; ++i) Ap[k * kMR + i] = i < rows ? A[i * lda + k] : 0.0f;
}

// op(A) = A^T, mc rows by kc: row i of op(A) is column i of A, a(i, k) = A[k * lda + i]. Packed
// into panels of 6 rows, Ap[p * kc * 6 + k * 6 + i] = a(6 p + i, k), the last panel zero padded;
// A is read row by row (contiguous).
void pack_a_trans(const float* A, i64 lda, i64 mc, i64 kc, float* Ap) {
  const i64 panels = (mc + kMR - 1) / kMR, full = mc / kMR;
  // Eight rows of A at a time: they stay in L1 while every panel takes its 8 x 6 values, and each
  // panel is written 192 contiguous bytes at a time instead of 24.
  for (i64 k0 = 0; k0 < kc; k0 += 8) {
    const i64 k1 = std::min(kc, k0 + 8);
    for (i64 p = 0; p < full; ++p) {
      float* d = Ap + p * kc * kMR;
      for (i64 k = k0; k < k1; ++k) std::memcpy(d + k * kMR, A + k * lda + p * kMR, kMR * sizeof(float));
    }
    if (full < panels) {
      const i64 rows = mc - full * kMR;
      float* d = Ap + full * kc * kMR;
      for (i64 k = k0; k < k1; ++k)
        for (i64 i = 0; i < kMR; ++i) d[k * kMR + i] = i < rows ? A[k * lda + full * kMR + i] : 0.0f;
    }
  }
}

// In-register transpose of an 8 x 8 block: r[i] lane j -> r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);  // (r0 r1 interleaved, low halves of each lane pair)
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// op(B) = B: rows k in [k0, k1) of a block whose panels are pstride floats apart, all nc columns:
// Bp[q * pstride + k * 16 + j] = B[k * ldb + 16 q + j], the last panel zero padded. Row by row, so
// that B is read in its own order (whole rows: it often comes from memory, as the x that a
// weight gradient dy^T x reads back from the forward pass), each row scattered to the panels.
void pack_b_rows(const float* B, i64 ldb, i64 k0, i64 k1, i64 nc, float* Bp, i64 pstride) {
  const i64 full = nc / kNR, rest = nc - full * kNR;
  for (i64 k = k0; k < k1; ++k) {
    const float* s = B + k * ldb;
    float* d = Bp + k * kNR;
    for (i64 q = 0; q < full; ++q, s += kNR, d += pstride) {
      _mm256_store_ps(d, _mm256_loadu_ps(s));
      _mm256_store_ps(d + 8, _mm256_loadu_ps(s + 8));
    }
    if (rest)
      for (i64 j = 0; j < kNR; ++j) d[j] = j < rest ? s[j] : 0.0f;
  }
}

// op(B) rows k in [0, kc), columns [0, nc) -> panels of 16 columns, Bp[q * kc * 16 + k * 16 + j] =
// b(k, 16 q + j), the last panel zero padded. B points at b(0, 0); b(k, j) = B[k * ldb + j]
// (pack_b_rows), or B[j * ldb + k] when tb (then 16 x 8 blocks are read as rows and transposed in
// registers).
void pack_b(bool tb, const float* B, i64 ldb, i64 kc, i64 nc, float* Bp) {
  if (!tb) {
    pack_b_rows(B, ldb, 0, kc, nc, Bp, kNR * kc);
    return;
  }
  for (i64 c = 0; c < nc; c += kNR, Bp += kNR * kc) {
    const i64 cols = std::min<i64>(kNR, nc - c);
    const float* s = B + c * ldb;
    i64 k = 0;
    if (cols == kNR)
      for (; k + 8 <= kc; k += 8)
        for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h+7 of the panel: 8 rows of B, 8 k each
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + (8 * h + i) * ldb + k);
          transpose8(r);
          for (int i = 0; i < 8; ++i) _mm256_store_ps(Bp + (k + i) * kNR + 8 * h, r[i]);
        }
    for (; k < kc; ++k)
      for (i64 j = 0; j < kNR; ++j) Bp[k * kNR + j] = j < cols ? s[j * ldb + k] : 0.0f;
  }
}

// Per-thread packing buffers, grown on demand and kept (a training step's products reuse them).
// get() returns null when the memory is not there instead of throwing: it runs inside OpenMP
// regions, which an exception must not leave.
struct Buffer {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> p;
  i64 n = 0;
  float* get(i64 need) noexcept {
    if (need > n) {
      p.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<std::size_t>((need * 4 + 63) / 64 * 64))));
      n = p ? need : 0;
    }
    return p.get();
  }
};

// Blocks of about equal size, at most `most` each, rounded up to a multiple of `unit`.
i64 block(i64 n, i64 most, i64 unit) {
  const i64 parts = (n + most - 1) / most;
  return ((n + parts - 1) / parts + unit - 1) / unit * unit;
}

// Rows [r0, r1) of C times column panels [q0, q1) for one block of K: k in [pc, pc + kc) of op(A),
// with op(B)'s rows of that block packed at Bk (panel q at Bk + q * pstride). be is the beta of
// this block (the caller's for the first, 1 after). Ap: room for (r1 - r0) x kc floats when ta,
// else 6 x kc (the edge panel). tri lets a tile skip what a triangle makes zero or unneeded
// (gemm.h); c0 is the column of C where panel 0 starts.
void block_product(bool ta, const float* A, i64 lda, i64 r0, i64 r1, i64 pc, i64 kc, const float* Bk, i64 pstride,
                   i64 q0, i64 q1, i64 N, float alpha, float be, float* C, i64 ldc, float* Ap, Tri tri, i64 c0) {
  const i64 mc = r1 - r0, mfull = mc / kMR * kMR;
  const int medge = static_cast<int>(mc - mfull);
  const float* Ablk = ta ? A + pc * lda + r0 : A + r0 * lda + pc;  // a(r0, pc)
  if (ta) pack_a_trans(Ablk, lda, mc, kc, Ap);
  else if (medge) pack_a_edge(Ablk + mfull * lda, lda, medge, kc, Ap);
  for (i64 q = q0; q < q1; ++q) {
    const int nv = static_cast<int>(std::min<i64>(kNR, N - q * kNR));
    const float* Bj = Bk + q * pstride;
    float* Cj = C + r0 * ldc + q * kNR;
    for (i64 ir = 0; ir < mc; ir += kMR) {
      const int mv = static_cast<int>(std::min<i64>(kMR, mc - ir));
      // The tile's rows [r, r + mv) and its part of this K block, [off, off + len).
      const i64 r = r0 + ir;
      i64 off = 0, len = kc;
      if (tri == Tri::lower_c && c0 + q * kNR > r + mv - 1) continue;  // wholly above the diagonal
      if (tri == Tri::lower_a) len = std::clamp<i64>(r + mv - pc, 0, kc);  // a(i, k) = 0 for k > i
      if (tri == Tri::upper_a) {                                         // a(i, k) = 0 for k < i
        off = std::clamp<i64>(r - pc, 0, kc);
        len = kc - off;
      }
      float* Ct = Cj + ir * ldc;
      const float* Bt = Bj + off * kNR;
      if (ta) kernel<false>(len, Ap + ir * kc + off * kMR, kMR, Bt, Ct, ldc, alpha, be, mv, nv);
      else if (mv == kMR) kernel<true>(len, Ablk + ir * lda + off, lda, Bt, Ct, ldc, alpha, be, kMR, nv);
      else kernel<false>(len, Ap + off * kMR, kMR, Bt, Ct, ldc, alpha, be, mv, nv);
    }
  }
}

// True when there is nothing to multiply: C is empty, or K = 0 or alpha = 0, where C = beta C is
// done here (A and B are not read: the BLAS rule).
bool no_product(i64 M, i64 N, i64 K, float alpha, float beta, float* C, i64 ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K > 0 && alpha != 0.0f) return false;
  for (i64 m = 0; m < M; ++m)
    for (i64 n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
  return true;
}
bool no_product(const Gemm<float>& g) { return no_product(g.M, g.N, g.K, g.alpha, g.beta, g.C, g.ldc); }

thread_local Buffer tl_a, tl_b;  // per-thread packing buffers, kept between calls

}  // namespace

// Row by row of C, the k loop outside the j loop (vectorised over j).
void sgemm_unpacked(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc) {
  for (i64 m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    for (i64 n = 0; n < N; ++n) c[n] = beta == 0.0f ? 0.0f : beta * c[n];
    for (i64 k = 0; k < K; ++k) {
      const float a = alpha * (ta ? A[k * lda + m] : A[m * lda + k]);
      if (tb)
        for (i64 n = 0; n < N; ++n) c[n] += a * B[n * ldb + k];
      else
        for (i64 n = 0; n < N; ++n) c[n] += a * B[k * ldb + n];
    }
  }
}

void sgemm(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B, i64 ldb,
           float beta, float* C, i64 ldc, Tri tri) {
  if (no_product(M, N, K, alpha, beta, C, ldc)) return;
  const i64 kcb = block(K, kKC, 4), mcb = block(M, kMC, kMR);
  float* Ap = tl_a.get((ta ? mcb : kMR) * kcb);
  float* Bp = tl_b.get((std::min(kNC, N) + kNR - 1) / kNR * kNR * kcb);
  if (!Ap || !Bp) {  // no memory for the packed operands (this may run inside a parallel region)
    sgemm_unpacked(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  for (i64 jc = 0; jc < N; jc += kNC) {  // columns [jc, jc + nc): panels of B packed together
    const i64 nc = std::min(kNC, N - jc);
    for (i64 pc = 0; pc < K; pc += kcb) {
      const i64 kc = std::min(kcb, K - pc);
      pack_b(tb, tb ? B + jc * ldb + pc : B + pc * ldb + jc, ldb, kc, nc, Bp);
      for (i64 ic = 0; ic < M; ic += mcb)
        block_product(ta, A, lda, ic, std::min(M, ic + mcb), pc, kc, Bp, kNR * kc, 0, (nc + kNR - 1) / kNR, nc,
                      alpha, pc == 0 ? beta : 1.0f, C + jc, ldc, Ap, tri, jc);
    }
  }
}

namespace {

// How the team shares one product: op(B) packed whole, unit by unit (units() says what a unit
// is), then C cut into items, a block of rows by a run of column panels. An item runs the K blocks
// in order over its own part of C, so no two threads ever write the same element.
struct Plan {
  const Gemm<float>* g = nullptr;
  i64 kcb = 0, nkb = 0, panels = 0, pstride = 0, rows = 0, row_blocks = 0, run = 0, items = 0;
  float* Bp = nullptr;  // panel q of K block b at Bp + (b * panels + q) * pstride

  Plan() = default;
  Plan(const Gemm<float>& p, int team) : g(&p) {
    kcb = block(p.K, kKC, 4);
    nkb = (p.K + kcb - 1) / kcb;
    panels = (p.N + kNR - 1) / kNR;
    pstride = kNR * kcb;
    // About four items a thread: rows in multiples of 6 (at least 24, at most kMC), then columns
    // cut in runs of panels when there are too few row blocks.
    const i64 want = 4 * team;
    rows = std::clamp<i64>(((p.M + want - 1) / want + kMR - 1) / kMR * kMR, 4 * kMR, kMC);
    row_blocks = (p.M + rows - 1) / rows;
    const i64 col_blocks = std::clamp<i64>((want + row_blocks - 1) / row_blocks, 1, panels);
    run = (panels + col_blocks - 1) / col_blocks;
    items = row_blocks * ((panels + run - 1) / run);
  }
  // A unit of packing: one panel of one K block for B^T (read as rows of B, transposed), or 16
  // rows of one K block, all panels, for B.
  i64 slabs() const { return (kcb + kNR - 1) / kNR; }
  i64 units() const { return nkb * (g->tb ? panels : slabs()); }
  i64 b_floats() const { return nkb * panels * pstride; }
  i64 a_floats() const { return (g->ta ? rows : kMR) * kcb; }
  void pack(i64 u) const {
    const Gemm<float>& p = *g;
    if (p.tb) {
      const i64 b = u / panels, q = u % panels, pc = b * kcb, n0 = q * kNR;
      pack_b(true, p.B + n0 * p.ldb + pc, p.ldb, std::min(kcb, p.K - pc), std::min<i64>(kNR, p.N - n0),
             Bp + u * pstride);
    } else {
      const i64 b = u / slabs(), pc = b * kcb, k0 = u % slabs() * kNR, k1 = std::min({k0 + kNR, kcb, p.K - pc});
      if (k0 < k1) pack_b_rows(p.B + pc * p.ldb, p.ldb, k0, k1, p.N, Bp + b * panels * pstride, pstride);
    }
  }
  void item(i64 i, float* Ap) const {
    const Gemm<float>& p = *g;
    const i64 rb = i % row_blocks, cb = i / row_blocks;
    const i64 r0 = rb * rows, r1 = std::min(p.M, r0 + rows), q0 = cb * run, q1 = std::min(panels, q0 + run);
    for (i64 b = 0; b < nkb; ++b) {
      const i64 pc = b * kcb;
      block_product(p.ta, p.A, p.lda, r0, r1, pc, std::min(kcb, p.K - pc), Bp + b * panels * pstride, pstride, q0, q1,
                    p.N, p.alpha, b == 0 ? p.beta : 1.0f, p.C, p.ldc, Ap, Tri::none, 0);
    }
  }
};

}  // namespace

// The team's version of one product: op(B) packed once, by the team (its units dealt out in turn),
// then the items taken in turn from a shared counter, so a thread slowed by a neighbour on the
// machine takes fewer.
void sgemm_parallel(const Gemm<float>& p) {
  if (no_product(p)) return;
  const int team = omp_get_max_threads();
  Plan plan(p, team);
  // The calling thread's buffers, allocated here where a failure can throw: its B buffer is shared
  // with the team, and with its A buffer it can take every item if no other thread gets one.
  plan.Bp = tl_b.get(plan.b_floats());
  if (!plan.Bp || !tl_a.get(plan.a_floats())) throw std::bad_alloc();
  std::atomic<i64> next{0};
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (i64 u = t; u < plan.units(); u += nt) plan.pack(u);
#pragma omp barrier
    float* Ap = tl_a.get(plan.a_floats());  // a thread without one takes no items
    for (i64 i; Ap && (i = next.fetch_add(1, std::memory_order_relaxed)) < plan.items;) plan.item(i, Ap);
  }
}

// Two independent products (a Linear's dx = dy w and dw = dy^T x). The team is cut in two in
// proportion to their work (with two threads: one product each), each part packs its own product's
// op(B) and takes its items; a thread whose product has no items left then takes the other's, once
// that product's B is packed (a counter of packed units says so). Each thread so works from its
// own L2 for most of the call, and neither waits for the other at the end: one product per thread
// with no exchange (the previous gemm_pair) left the first thread idle 2.7 ms a training step
// (the weight gradient's packing of dy^T makes it the slower one), the second 0.7 ms; with the
// exchange the pairs took 3% less time (the two ways alternating call by call, three runs).
// (Tried: both products' items from one counter, all threads packing both: 8% slower per step,
// median of 10 alternating rounds, as each thread then read the other's packed B from L3.)
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q) {
  const bool lp = !no_product(p), lq = !no_product(q);
  if (!lp || !lq) {
    if (lp) sgemm_parallel(p);
    if (lq) sgemm_parallel(q);
    return;
  }
  const int team = omp_get_max_threads();
  if (team < 2) {
    sgemm(p.ta, p.tb, p.M, p.N, p.K, p.alpha, p.A, p.lda, p.B, p.ldb, p.beta, p.C, p.ldc);
    sgemm(q.ta, q.tb, q.M, q.N, q.K, q.alpha, q.A, q.lda, q.B, q.ldb, q.beta, q.C, q.ldc);
    return;
  }
  Plan plan[2] = {Plan(p, team), Plan(q, team)};
  const i64 a_floats = std::max(plan[0].a_floats(), plan[1].a_floats());
  float* Bp = tl_b.get(plan[0].b_floats() + plan[1].b_floats());
  if (!Bp || !tl_a.get(a_floats)) throw std::bad_alloc();
  plan[0].Bp = Bp;
  plan[1].Bp = Bp + plan[0].b_floats();
  const double wp = static_cast<double>(p.M * p.N * p.K), wq = static_cast<double>(q.M * q.N * q.K);
  const int np = std::clamp(static_cast<int>(std::lround(team * wp / (wp + wq))), 1, team - 1);
  std::atomic<i64> next[2] = {0, 0}, packed[2] = {0, 0};
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Thread t's own product and its rank in that product's part of the team. With a team of
    // one (the runtime gave fewer threads than asked) the thread packs both.
    const int split = std::min(np, nt - 1);
    const int own = nt < 2 || t < split ? 0 : 1;
    for (int j = 0; j < 2; ++j) {
      if (nt >= 2 && j != own) continue;
      const int rank = nt < 2 ? 0 : (j == 0 ? t : t - split), size = nt < 2 ? 1 : (j == 0 ? split : nt - split);
      for (i64 u = rank; u < plan[j].units(); u += size) {
        plan[j].pack(u);
        packed[j].fetch_add(1, std::memory_order_release);
      }
    }
    float* Ap = tl_a.get(a_floats);  // a thread without one takes no items
    for (int k = 0; Ap && k < 2; ++k) {
      const int j = k == 0 ? own : 1 - own;
      if (next[j].load(std::memory_order_relaxed) >= plan[j].items) continue;
      while (packed[j].load(std::memory_order_acquire) < plan[j].units()) _mm_pause();
      for (i64 i; (i = next[j].fetch_add(1, std::memory_order_relaxed)) < plan[j].items;) plan[j].item(i, Ap);
    }
  }
}

}  // namespace tg::kernels::sgemm_avx2
#endif
