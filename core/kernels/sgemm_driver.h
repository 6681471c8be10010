// The Goto / BLIS driver shared by our float32 products (sgemm_avx2.h explains the layering and
// why): K blocks, row blocks, op(B) packed in panels, the team's sharing of one product and of a
// pair, and causal attention's triangles. What differs between instruction sets is the register
// tile, a traits type:
//
//   struct Tile {
//     static constexpr int MR, NR;        // rows and columns of C per kernel call (NR a multiple of 8)
//     static constexpr i64 KC, MC, NC;    // K per block, rows of C per block, columns of B per pack
//     static constexpr bool kAhead;       // whether the tile asks for the next panel (gemm.h's Ahead)
//     template <bool ROWS> static void kernel(kc, A, lda, Bp, C, ldc, alpha, beta, mv, nv, ahead);
//   };
//
// kernel computes the MR x NR tile C[0..mv) x [0..nv) = alpha sum_{k < kc} a(i, k) b(k, j) + beta C
// (beta = 0 ignores C) with b(k, j) = Bp[k * NR + j] (a packed panel, 32-byte aligned), and
// a(i, k) = A[i * lda + k] when ROWS (MR rows of A read in place), else A[k * lda + i] (a packed
// panel, lda = MR). Each element's sum runs over k in order, so a product's bits depend on KC only,
// not on which thread computes a tile or how C is cut.
//
// Included only by the files that define a tile (sgemm_avx2.cpp, sgemm_avx512.cpp), after they
// define TG_SGEMM_TARGET (e.g. "avx2,fma"): everything below is compiled for that instruction set
// (a target pragma, so the rest of the build needs no -m flags), and sits in an unnamed namespace,
// so each file gets its own copy and no inline function compiled for a wider instruction set can be
// merged by the linker into code that runs on a narrower CPU. The standard headers come before the
// pragma for the same reason: their templates stay compiled for the build's baseline.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "kernels/gemm.h"
#include "kernels/parallel.h"

#ifndef TG_SGEMM_TARGET
#error "define TG_SGEMM_TARGET before including sgemm_driver.h"
#endif
#define TG_SGEMM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define TG_SGEMM_BEGIN_TARGET(t) TG_SGEMM_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define TG_SGEMM_END_TARGET TG_SGEMM_PRAGMA(clang attribute pop)
#else
#define TG_SGEMM_BEGIN_TARGET(t) TG_SGEMM_PRAGMA(GCC push_options) TG_SGEMM_PRAGMA(GCC target(t))
#define TG_SGEMM_END_TARGET TG_SGEMM_PRAGMA(GCC pop_options)
#endif

TG_SGEMM_BEGIN_TARGET(TG_SGEMM_TARGET)

namespace tg::kernels::sgemm_driver {
namespace {

using i64 = std::int64_t;

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
inline i64 block(i64 n, i64 most, i64 unit) {
  const i64 parts = (n + most - 1) / most;
  return ((n + parts - 1) / parts + unit - 1) / unit * unit;
}

// True when there is nothing to multiply: C is empty, or K = 0 or alpha = 0, where C = beta C is
// done here (A and B are not read: the BLAS rule).
inline bool no_product(i64 M, i64 N, i64 K, float alpha, float beta, float* C, i64 ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K > 0 && alpha != 0.0f) return false;
  for (i64 m = 0; m < M; ++m)
    for (i64 n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
  return true;
}
inline bool no_product(const Gemm<float>& g) { return no_product(g.M, g.N, g.K, g.alpha, g.beta, g.C, g.ldc); }

// The product without packing buffers: row by row of C, the k loop outside the j loop (vectorised
// over j). Slow, and its sums are rounded in another order.
inline void sgemm_unpacked(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda,
                           const float* B, i64 ldb, float beta, float* C, i64 ldc) {
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

template <class Tile>
struct Driver {
  static constexpr int MR = Tile::MR, NR = Tile::NR;
  static constexpr i64 KC = Tile::KC, MC = Tile::MC, NC = Tile::NC;
  static_assert(NR % 8 == 0 && MC % MR == 0);

  static inline thread_local Buffer tl_a, tl_b;  // per-thread packing buffers, kept between calls

  // A last panel of fewer than MR rows of op(A) = A, k in [0, kc), zero padded: Ap[k * MR + i] =
  // A[i * lda + k]. (A^T's last panel is packed with the rest, by pack_a_trans.)
  static void pack_a_edge(const float* A, i64 lda, int rows, i64 kc, float* Ap) {
    for (i64 k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? A[i * lda + k] : 0.0f;
  }

  // Whether MR rows of A, lda floats apart, read in place, crowd into one set of a 64-set L1 of
  // 64-byte lines (Zen 4's 32 KB 8-way, Zen 5's and recent Intel's 48 KB 12-way) beyond 8, the
  // smallest of those associativities: a stride of 3,072 floats (12 KB) puts all 14 rows of the
  // AVX-512 14 x 32 tile in one set, and each k step then misses in L1. Such rows are packed instead
  // (pack_a_rows): the same values in the same order, so the same bits. Fewer rows per set are read
  // in place, where packing costs more than the misses it saves (docs/matmul.md, measured in
  // docs/performance.md). Only a tile of more than 8 rows (AVX-512's 14 x 32) can crowd a set so.
  static bool rows_crowd_l1(i64 lda) {
    int in_set[64] = {};
    for (int i = 0; i < MR; ++i)
      if (++in_set[(static_cast<std::uint64_t>(i) * static_cast<std::uint64_t>(lda) * 4 / 64) % 64] > 8) return true;
    return false;
  }
  // Whether block_product packs every panel of op(A) (into Ap, rows x kc), not only the edge.
  static bool packs_a(bool ta, i64 lda) { return ta || rows_crowd_l1(lda); }

  // op(A) = A, mc rows by kc, into panels of MR rows as pack_a_trans's: Ap[p * kc * MR + k * MR + i]
  // = A[(MR p + i) * lda + k], the last panel zero padded.
  static void pack_a_rows(const float* A, i64 lda, i64 mc, i64 kc, float* Ap) {
    for (i64 p = 0; p * MR < mc; ++p) {
      const int rows = static_cast<int>(std::min<i64>(MR, mc - p * MR));
      if (rows < MR) {
        pack_a_edge(A + p * MR * lda, lda, rows, kc, Ap + p * kc * MR);
        continue;
      }
      float* d = Ap + p * kc * MR;
      const float* s = A + p * MR * lda;
      // Eight k at a time, eight rows at a time: an 8 x 8 block read as rows, transposed in
      // registers, written as eight runs of (up to) eight floats of the panel's k rows.
      i64 k = 0;
      for (; k + 8 <= kc; k += 8)
        for (int g = 0; g < MR; g += 8) {
          const int n = std::min(8, MR - g);
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = i < n ? _mm256_loadu_ps(s + (g + i) * lda + k) : _mm256_setzero_ps();
          transpose8(r);
          if (n == 8) {
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(d + (k + j) * MR + g, r[j]);
          } else {
            const __m256i first_n = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int j = 0; j < 8; ++j) _mm256_maskstore_ps(d + (k + j) * MR + g, first_n, r[j]);
          }
        }
      for (; k < kc; ++k)
        for (int i = 0; i < MR; ++i) d[k * MR + i] = s[i * lda + k];
    }
  }

  // op(A) = A^T, mc rows by kc: row i of op(A) is column i of A, a(i, k) = A[k * lda + i]. Packed
  // into panels of MR rows, Ap[p * kc * MR + k * MR + i] = a(MR p + i, k), the last panel zero
  // padded; A is read row by row (contiguous).
  static void pack_a_trans(const float* A, i64 lda, i64 mc, i64 kc, float* Ap) {
    const i64 panels = (mc + MR - 1) / MR, full = mc / MR;
    // Eight rows of A at a time: they stay in L1 while every panel takes its 8 x MR values, and
    // each panel is written 8 MR contiguous floats at a time instead of MR.
    for (i64 k0 = 0; k0 < kc; k0 += 8) {
      const i64 k1 = std::min(kc, k0 + 8);
      for (i64 p = 0; p < full; ++p) {
        float* d = Ap + p * kc * MR;
        for (i64 k = k0; k < k1; ++k) std::memcpy(d + k * MR, A + k * lda + p * MR, MR * sizeof(float));
      }
      if (full < panels) {
        const i64 rows = mc - full * MR;
        float* d = Ap + full * kc * MR;
        for (i64 k = k0; k < k1; ++k)
          for (i64 i = 0; i < MR; ++i) d[k * MR + i] = i < rows ? A[k * lda + full * MR + i] : 0.0f;
      }
    }
  }

  // op(B) = B: rows k in [k0, k1) of a block whose panels are pstride floats apart, all nc
  // columns: Bp[q * pstride + k * NR + j] = B[k * ldb + NR q + j], the last panel zero padded. Row
  // by row, so that B is read in its own order (whole rows: it often comes from memory, as the x
  // that a weight gradient dy^T x reads back from the forward pass), each row scattered to the
  // panels.
  static void pack_b_rows(const float* B, i64 ldb, i64 k0, i64 k1, i64 nc, float* Bp, i64 pstride) {
    const i64 full = nc / NR, rest = nc - full * NR;
    for (i64 k = k0; k < k1; ++k) {
      const float* s = B + k * ldb;
      float* d = Bp + k * NR;
      for (i64 q = 0; q < full; ++q, s += NR, d += pstride) std::memcpy(d, s, NR * sizeof(float));
      if (rest)
        for (i64 j = 0; j < NR; ++j) d[j] = j < rest ? s[j] : 0.0f;
    }
  }

  // op(B) rows k in [0, kc), columns [0, nc) -> panels of NR columns, Bp[q * kc * NR + k * NR + j]
  // = b(k, NR q + j), the last panel zero padded. B points at b(0, 0); b(k, j) = B[k * ldb + j]
  // (pack_b_rows), or B[j * ldb + k] when tb (then 8 x 8 blocks are read as rows of B and
  // transposed in registers).
  static void pack_b(bool tb, const float* B, i64 ldb, i64 kc, i64 nc, float* Bp) {
    if (!tb) {
      pack_b_rows(B, ldb, 0, kc, nc, Bp, NR * kc);
      return;
    }
    for (i64 c = 0; c < nc; c += NR, Bp += NR * kc) {
      const i64 cols = std::min<i64>(NR, nc - c);
      const float* s = B + c * ldb;
      i64 k = 0;
      if (cols == NR)
        for (; k + 8 <= kc; k += 8)
          for (int h = 0; h < NR / 8; ++h) {  // columns 8h .. 8h+7 of the panel: 8 rows of B, 8 k each
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + (8 * h + i) * ldb + k);
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_store_ps(Bp + (k + i) * NR + 8 * h, r[i]);
          }
      for (; k < kc; ++k)
        for (i64 j = 0; j < NR; ++j) Bp[k * NR + j] = j < cols ? s[j * ldb + k] : 0.0f;
    }
  }

  // Rows [r0, r1) of C times column panels [q0, q1) for one block of K: k in [pc, pc + kc) of
  // op(A), with op(B)'s rows of that block packed at Bk (panel q at Bk + q * pstride). be is the
  // beta of this block (the caller's for the first, 1 after). Ap: room for (r1 - r0) x kc floats
  // (rounded up to MR rows) when A is packed (ta, or rows_crowd_l1), else MR x kc (the edge
  // panel). tri lets a tile skip what a triangle makes zero or unneeded (gemm.h); c0 is the column
  // of C where panel 0 starts. When Tile::kAhead, the tiles on panel q ask for panel q + 1, and
  // those on the last panel for `after` (after_floats of it: the panel the caller runs next, or
  // null), each tile a slice (gemm.h's Ahead).
  static void block_product(bool ta, const float* A, i64 lda, i64 r0, i64 r1, i64 pc, i64 kc, const float* Bk,
                            i64 pstride, i64 q0, i64 q1, i64 N, float alpha, float be, float* C, i64 ldc, float* Ap,
                            Tri tri, i64 c0, const float* after = nullptr, i64 after_floats = 0) {
    const i64 mc = r1 - r0, mfull = mc / MR * MR;
    const int medge = static_cast<int>(mc - mfull);
    const i64 tiles = (mc + MR - 1) / MR;
    const float* Ablk = ta ? A + pc * lda + r0 : A + r0 * lda + pc;  // a(r0, pc)
    const bool packed = packs_a(ta, lda);
    if (ta) pack_a_trans(Ablk, lda, mc, kc, Ap);
    else if (packed) pack_a_rows(Ablk, lda, mc, kc, Ap);
    else if (medge) pack_a_edge(Ablk + mfull * lda, lda, medge, kc, Ap);
    for (i64 q = q0; q < q1; ++q) {
      const int nv = static_cast<int>(std::min<i64>(NR, N - q * NR));
      const float* Bj = Bk + q * pstride;
      float* Cj = C + r0 * ldc + q * NR;
      // The next panel, in equal slices, one a tile (tiles a triangle skips leave theirs).
      const float* next = q + 1 < q1 ? Bj + pstride : after;
      const i64 next_bytes = (q + 1 < q1 ? NR * kc : after_floats) * static_cast<i64>(sizeof(float));
      for (i64 ir = 0; ir < mc; ir += MR) {
        const int mv = static_cast<int>(std::min<i64>(MR, mc - ir));
        const Ahead ahead = Tile::kAhead ? Ahead::slice(next, next_bytes, tiles, ir / MR, kc) : Ahead{};
        // The tile's rows [r, r + mv) and its part of this K block, [off, off + len).
        const i64 r = r0 + ir;
        i64 off = 0, len = kc;
        if (tri == Tri::lower_c && c0 + q * NR > r + mv - 1) continue;     // wholly above the diagonal
        if (tri == Tri::lower_a) len = std::clamp<i64>(r + mv - pc, 0, kc);  // a(i, k) = 0 for k > i
        if (tri == Tri::upper_a) {                                         // a(i, k) = 0 for k < i
          off = std::clamp<i64>(r - pc, 0, kc);
          len = kc - off;
        }
        float* Ct = Cj + ir * ldc;
        const float* Bt = Bj + off * NR;
        if (packed) Tile::template kernel<false>(len, Ap + ir * kc + off * MR, MR, Bt, Ct, ldc, alpha, be, mv, nv, ahead);
        else if (mv == MR)
          Tile::template kernel<true>(len, Ablk + ir * lda + off, lda, Bt, Ct, ldc, alpha, be, MR, nv, ahead);
        else Tile::template kernel<false>(len, Ap + off * MR, MR, Bt, Ct, ldc, alpha, be, mv, nv, ahead);
      }
    }
  }

  static void sgemm(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc, Tri tri) {
    if (no_product(M, N, K, alpha, beta, C, ldc)) return;
    const i64 kcb = block(K, KC, 4), mcb = block(M, MC, MR);
    float* Ap = tl_a.get((packs_a(ta, lda) ? mcb : MR) * kcb);
    float* Bp = tl_b.get((std::min(NC, N) + NR - 1) / NR * NR * kcb);
    if (!Ap || !Bp) {  // no memory for the packed operands (this may run inside a parallel region)
      sgemm_unpacked(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
    for (i64 jc = 0; jc < N; jc += NC) {  // columns [jc, jc + nc): panels of B packed together
      const i64 nc = std::min(NC, N - jc);
      for (i64 pc = 0; pc < K; pc += kcb) {
        const i64 kc = std::min(kcb, K - pc);
        pack_b(tb, tb ? B + jc * ldb + pc : B + pc * ldb + jc, ldb, kc, nc, Bp);
        for (i64 ic = 0; ic < M; ic += mcb)
          block_product(ta, A, lda, ic, std::min(M, ic + mcb), pc, kc, Bp, NR * kc, 0, (nc + NR - 1) / NR, nc, alpha,
                        pc == 0 ? beta : 1.0f, C + jc, ldc, Ap, tri, jc);
      }
    }
  }

  // How the team shares one product: op(B) packed whole, unit by unit (units() says what a unit
  // is), then C cut into items, a block of rows by a run of column panels (or half a block, by
  // rows, for the team's last ones). An item runs the K blocks in order over its own part of C, so
  // no two threads ever write the same element.
  struct Plan {
    static constexpr i64 kSlab = 16;  // rows of B per packing unit when op(B) = B
    const Gemm<float>* g = nullptr;
    i64 kcb = 0, nkb = 0, panels = 0, pstride = 0, rows = 0, tiles = 0, row_blocks = 0, run = 0, items = 0;
    TailCut cut;  // the team's last items cut in two (parallel.h)
    bool ep_after = false;  // the epilogue runs on the whole of C after the items (whole_after())
    float* Bp = nullptr;  // panel q of K block b at Bp + (b * panels + q) * pstride

    Plan() = default;
    Plan(const Gemm<float>& p, int team) : g(&p) {
      kcb = block(p.K, KC, 4);
      nkb = (p.K + kcb - 1) / kcb;
      panels = (p.N + NR - 1) / NR;
      pstride = NR * kcb;
      // About four blocks a thread (the last `team` then cut in two: TailCut): blocks of whole
      // tiles of MR rows (4 to MC / MR tiles each; fewer where the count is then rounded up), as
      // many as a multiple of the team where there are enough (equal items then end together: 15
      // blocks on 2 threads leave one thread idle for a block's time), the tiles dealt out evenly;
      // then columns cut in runs of panels when there are too few row blocks. An epilogue on whole
      // rows keeps items whole rows, unless there are fewer row blocks than threads: it then runs
      // on all of C after the items.
      const i64 want = 4 * team;
      tiles = (p.M + MR - 1) / MR;
      const i64 most = std::clamp<i64>(((p.M + want - 1) / want + MR - 1) / MR, 4, MC / MR);  // tiles per block
      row_blocks = (tiles + most - 1) / most;
      if (row_blocks > team) row_blocks = std::min(tiles, (row_blocks + team - 1) / team * team);
      rows = (tiles + row_blocks - 1) / row_blocks * MR;  // the largest block
      ep_after = p.ep.rows && row_blocks < team;
      const i64 col_blocks =
          p.ep.rows && !ep_after ? 1 : std::clamp<i64>((want + row_blocks - 1) / row_blocks, 1, panels);
      run = (panels + col_blocks - 1) / col_blocks;
      // A pair of products (run_pair_on_team) cuts each product's last `team` items, though part
      // of the team serves each: the balance is a little looser there, the result the same.
      cut = TailCut(row_blocks * ((panels + run - 1) / run), team);
      items = cut.items();
    }
    // A unit of packing: one panel of one K block for B^T (read as rows of B, transposed), or
    // kSlab rows of one K block, all panels, for B.
    i64 slabs() const { return (kcb + kSlab - 1) / kSlab; }
    i64 units() const { return nkb * (g->tb ? panels : slabs()); }
    i64 b_floats() const { return nkb * panels * pstride; }
    i64 a_floats() const { return (packs_a(g->ta, g->lda) ? rows : MR) * kcb; }
    void pack(i64 u) const {
      const Gemm<float>& p = *g;
      if (p.tb) {
        const i64 b = u / panels, q = u % panels, pc = b * kcb, n0 = q * NR;
        pack_b(true, p.B + n0 * p.ldb + pc, p.ldb, std::min(kcb, p.K - pc), std::min<i64>(NR, p.N - n0),
               Bp + u * pstride);
      } else {
        const i64 b = u / slabs(), pc = b * kcb, k0 = u % slabs() * kSlab,
                  k1 = std::min({k0 + kSlab, kcb, p.K - pc});
        if (k0 < k1) pack_b_rows(p.B + pc * p.ldb, p.ldb, k0, k1, p.N, Bp + b * panels * pstride, pstride);
      }
    }
    void item(i64 i, float* Ap) const {
      const Gemm<float>& p = *g;
      const i64 b = cut.base_of(i), rb = b % row_blocks, cb = b / row_blocks;
      i64 t0 = rb * tiles / row_blocks, t1 = (rb + 1) * tiles / row_blocks;  // its tiles of MR rows
      cut.part(i, t0, t1);
      const i64 r0 = t0 * MR, r1 = std::min(p.M, t1 * MR);
      if (r0 >= r1) return;
      const i64 q0 = cb * run, q1 = std::min(panels, q0 + run);
      for (i64 kb = 0; kb < nkb; ++kb) {
        const i64 pc = kb * kcb;
        // After this block's last panel, the item reads the next block's first (q0).
        const bool more = kb + 1 < nkb;
        const float* after = more ? Bp + ((kb + 1) * panels + q0) * pstride : nullptr;
        const i64 after_floats = more ? NR * std::min(kcb, p.K - pc - kcb) : 0;
        block_product(p.ta, p.A, p.lda, r0, r1, pc, std::min(kcb, p.K - pc), Bp + kb * panels * pstride, pstride, q0,
                      q1, p.N, p.alpha, kb == 0 ? p.beta : 1.0f, p.C, p.ldc, Ap, Tri::none, 0, after, after_floats);
      }
      if (p.ep && !ep_after) p.ep(r0, r1, q0 * NR, std::min(p.N, q1 * NR));  // the item's part of C is final
    }
  };

  // The team's version of one product: op(B) packed once, by the team, then the items; units of
  // packing and items are both taken in turn from shared counters, so a thread slowed by a
  // neighbour on the machine takes fewer of each (the packed B is the same whoever packs it).
  static void sgemm_parallel(const Gemm<float>& p) {
    if (no_product(p)) return p.ep.whole(p.M, p.N);
    const int team = omp_get_max_threads();
    Plan plan(p, team);
    // The calling thread's buffers, allocated here where a failure can throw: its B buffer is
    // shared with the team, and with its A buffer it can take every item if no other thread gets one.
    plan.Bp = tl_b.get(plan.b_floats());
    if (!plan.Bp || !tl_a.get(plan.a_floats())) throw std::bad_alloc();
    std::atomic<i64> next_unit{0}, next{0};
#pragma omp parallel num_threads(team)
    {
      for (i64 u; (u = next_unit.fetch_add(1, std::memory_order_relaxed)) < plan.units();) plan.pack(u);
#pragma omp barrier
      float* Ap = tl_a.get(plan.a_floats());  // a thread without one takes no items
      for (i64 i; Ap && (i = next.fetch_add(1, std::memory_order_relaxed)) < plan.items;) plan.item(i, Ap);
    }
    if (plan.ep_after) p.ep.whole(p.M, p.N);
  }

  // Two independent products, side by side on the team (kernels::run_pair_on_team, parallel.h).
  static void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q) {
    const bool lp = !no_product(p), lq = !no_product(q);
    if (!lp || !lq) {
      if (lp) sgemm_parallel(p);
      else p.ep.whole(p.M, p.N);
      if (lq) sgemm_parallel(q);
      else q.ep.whole(q.M, q.N);
      return;
    }
    const int team = omp_get_max_threads();
    if (team < 2) {
      sgemm(p.ta, p.tb, p.M, p.N, p.K, p.alpha, p.A, p.lda, p.B, p.ldb, p.beta, p.C, p.ldc, Tri::none);
      p.ep.whole(p.M, p.N);
      sgemm(q.ta, q.tb, q.M, q.N, q.K, q.alpha, q.A, q.lda, q.B, q.ldb, q.beta, q.C, q.ldc, Tri::none);
      q.ep.whole(q.M, q.N);
      return;
    }
    Plan plan[2] = {Plan(p, team), Plan(q, team)};
    const i64 a_floats = std::max(plan[0].a_floats(), plan[1].a_floats());
    float* Bp = tl_b.get(plan[0].b_floats() + plan[1].b_floats());
    if (!Bp || !tl_a.get(a_floats)) throw std::bad_alloc();
    plan[0].Bp = Bp;
    plan[1].Bp = Bp + plan[0].b_floats();
    run_pair_on_team(plan, static_cast<double>(p.M * p.N * p.K), static_cast<double>(q.M * q.N * q.K), team,
                     [&] { return tl_a.get(a_floats); });
    if (plan[0].ep_after) p.ep.whole(p.M, p.N);
    if (plan[1].ep_after) q.ep.whole(q.M, q.N);
  }
};

}  // namespace
}  // namespace tg::kernels::sgemm_driver

TG_SGEMM_END_TARGET
