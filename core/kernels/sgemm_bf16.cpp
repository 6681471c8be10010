// The bf16 product accumulated in float32; sgemm_bf16.h says what it computes and how it is laid out.
#include "kernels/sgemm_bf16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/isa.h"
#include "kernels/parallel.h"
#include "kernels/sgemm_avx512.h"
#include "kernels/transpose.h"

#ifdef TG_KERNELS_X86  // isa.h: where the x86 kernels build, the float32 AVX-512 tile among them
#define TG_BF16_X86 1
#include <immintrin.h>
#endif

// The fma path's scalar helpers are compiled for AVX2 + FMA on x86, which its CPUs have (std::fma
// an instruction, loops of eight floats in one register), and for the build's target elsewhere.
#ifdef TG_BF16_X86
#define TG_BF16_AVX2 [[gnu::target("avx2,fma")]]
#else
#define TG_BF16_AVX2
#endif

namespace tg::kernels {

namespace {

using i64 = std::int64_t;
using u32 = std::uint32_t;
using u16 = std::uint16_t;

constexpr int kMR = 6;           // rows of C per kernel call
constexpr int kNR = 64;          // columns of C per kernel call: four zmm of 16 floats
// The fma path's tile with AVX-512F: the float32 product's 8 x 48 (block_product_fma).
constexpr int kFmaWideMR = 8, kFmaWideNR = 48;
// K per block (even). Every K block after the first reads C back and writes it again, and at
// vdpbf16ps's rate that traffic costs more than a panel of B outside L1 (up to 768 pairs x 64 x
// 4 bytes = 192 KB, streamed from L2 in order): so long blocks, one for each K <= 1536 (the
// transformer's 384, 768 and 1536 at widths 384 and 768; docs/matmul.md).
constexpr i64 kKC = 1536;
constexpr i64 kMC = 192;         // rows of C per block: 192 x 1536 bf16 of A = 576 KB, with a panel of B in L2
constexpr i64 kRowsMax = kMC;    // no block of rows is larger (pack_a_trans's row buffer)

// Blocks of about equal size, at most `most` each, rounded up to a multiple of `unit`.
i64 block(i64 n, i64 most, i64 unit) {
  const i64 parts = (n + most - 1) / most;
  return ((n + parts - 1) / parts + unit - 1) / unit * unit;
}

i64 round_up(i64 n, i64 unit) { return (n + unit - 1) / unit * unit; }

// ---- Packing (the same words for every path but the fma one, whose operands are split as they
// are packed, pack_split; the native paths pack B^T with AVX-512, pack_b_trans_native) -----------

// The packers ask for op(A)'s rows this many steps ahead (prefetch_rows, gemm.h).
constexpr i64 kPackAhead = 2;

inline u32 float_bits(float x) {
  u32 u;
  std::memcpy(&u, &x, 4);
  return u;
}
// The bf16 of x in the low half (lo) or in the high half with a zero low half (hi).
inline u32 lo_of(float x) { return bf16_round_bits(float_bits(x)) >> 16; }
inline u32 hi_of(float x) { return bf16_round_bits(float_bits(x)) & 0xFFFF0000u; }
inline u32 lo_of(bf16 x) { return x.bits; }
inline u32 hi_of(bf16 x) { return static_cast<u32>(x.bits) << 16; }

// One panel of op(B): k in [k0, k0 + kc), columns [n0, n0 + nc), nc <= 64, as pairs:
// Bp[p * 64 + j] = b(k0 + 2p, n0 + j) | b(k0 + 2p + 1, n0 + j) << 16 (bf16 bits), zero past kc and nc.
// b(k, j) = B[k * ld + j], or B[j * ld + k] when tb.
template <class T>
void pack_b_panel(bool tb, const T* B, i64 ld, i64 k0, i64 kc, i64 n0, i64 nc, u32* Bp) {
  const i64 pairs = (kc + 1) / 2, full = kc / 2;
  if (!tb) {
    for (i64 p = 0; p < pairs; ++p) {
      const T* r0 = B + (k0 + 2 * p) * ld + n0;
      u32* d = Bp + p * kNR;
      if (p < full)
        for (i64 j = 0; j < nc; ++j) d[j] = lo_of(r0[j]) | hi_of(r0[ld + j]);
      else
        for (i64 j = 0; j < nc; ++j) d[j] = lo_of(r0[j]);
      for (i64 j = nc; j < kNR; ++j) d[j] = 0;
    }
    return;
  }
  for (i64 j = 0; j < nc; ++j) {  // row n0 + j of B is column j of the panel, read in order
    const T* r = B + (n0 + j) * ld + k0;
    for (i64 p = 0; p < full; ++p) Bp[p * kNR + j] = lo_of(r[2 * p]) | hi_of(r[2 * p + 1]);
    if (full < pairs) Bp[full * kNR + j] = lo_of(r[2 * full]);
  }
  for (i64 p = 0; p < pairs; ++p)
    for (i64 j = nc; j < kNR; ++j) Bp[p * kNR + j] = 0;
}

#ifdef TG_BF16_X86
// Defined with the native kernel, under its target options (which the declaration repeats: GCC
// takes a template's target from its first declaration).
template <class T>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]] void pack_b_trans_native(const T* B, i64 ld, i64 k0,
                                                                                         i64 kc, i64 n0, i64 nc,
                                                                                         u32* Bp);
#endif

// native: the vdpbf16ps and AMX paths, which pack op(B) = B^T with AVX-512 (the same words).
void pack_b_panel(bool tb, const Bf16Operand& B, i64 k0, i64 kc, i64 n0, i64 nc, u32* Bp, bool native) {
#ifdef TG_BF16_X86
  if (native && tb) {
    if (B.f) pack_b_trans_native(B.f, B.ld, k0, kc, n0, nc, Bp);
    else pack_b_trans_native(B.h, B.ld, k0, kc, n0, nc, Bp);
    return;
  }
#else
  (void)native;
#endif
  if (B.f) pack_b_panel(tb, B.f, B.ld, k0, kc, n0, nc, Bp);
  else pack_b_panel(tb, B.h, B.ld, k0, kc, n0, nc, Bp);
}

// op(A) = A, rows [r0, r0 + mc), k in [k0, k0 + kc): bf16 rows of kcp = kc rounded up to even
// elements, Ap[i * kcp + k] = a(r0 + i, k0 + k), then zero rows up to a multiple of 6. A pair of
// row i is the 32-bit word i * kcp / 2 + p. Float rows go through the array conversion.
void pack_a_rows(const Bf16Operand& A, i64 r0, i64 mc, i64 k0, i64 kc, bf16* Ap, bool native) {
  const i64 kcp = round_up(kc, 2), mcp = round_up(mc, kMR);
  for (i64 i = 0; i < mc; ++i) {
    bf16* d = Ap + i * kcp;
    if (A.f) {
      const float* s = A.f + (r0 + i) * A.ld + k0;
      prefetch_rows(A.f + r0 * A.ld + k0, A.ld, i + kPackAhead, 1, mc, kc);
      if (native) bf16_impl::to_bf16_avx512(s, d, kc);
      else to_bf16(s, d, kc);  // the same bits at every level (bf16.h)
    } else {
      std::memcpy(d, A.h + (r0 + i) * A.ld + k0, static_cast<std::size_t>(kc) * sizeof(bf16));
    }
    if (kc < kcp) d[kc] = bf16{0};
  }
  if (mcp > mc) std::memset(Ap + mc * kcp, 0, static_cast<std::size_t>((mcp - mc) * kcp) * sizeof(bf16));
}

// op(A) = A^T, a(i, k) = A[k * ld + i], rows [r0, r0 + mc), k in [k0, k0 + kc): panels of 6 rows,
// Ap[(q * pairs + p) * 6 + i] = a(r0 + 6q + i, k0 + 2p) | a(r0 + 6q + i, k0 + 2p + 1) << 16, zero
// past mc and kc. Two rows of A at a time, each read in order.
template <class T>
void pack_a_trans(const T* A, i64 ld, i64 r0, i64 mc, i64 k0, i64 kc, u32* Ap) {
  const i64 pairs = (kc + 1) / 2, full = kc / 2, panels = (mc + kMR - 1) / kMR;
  u32 w[kRowsMax + kMR];
  for (i64 p = 0; p < pairs; ++p) {
    const T* s = A + (k0 + 2 * p) * ld + r0;
    prefetch_rows(A + k0 * ld + r0, ld, 2 * (p + kPackAhead), 2, kc, mc);
    if (p < full)
      for (i64 i = 0; i < mc; ++i) w[i] = lo_of(s[i]) | hi_of(s[ld + i]);
    else
      for (i64 i = 0; i < mc; ++i) w[i] = lo_of(s[i]);
    for (i64 i = mc; i < panels * kMR; ++i) w[i] = 0;
    for (i64 q = 0; q < panels; ++q) std::memcpy(Ap + (q * pairs + p) * kMR, w + q * kMR, kMR * sizeof(u32));
  }
}

// ---- The emulated kernel: vdpbf16ps's arithmetic in scalar code ---------------------------------

inline float bf16_lo(u32 w) { return to_float(bf16{static_cast<u16>(w)}); }
inline float bf16_hi(u32 w) { return to_float(bf16{static_cast<u16>(w >> 16)}); }
// A bf16 operand as vdpbf16ps reads it: subnormals as zero of their sign.
inline float daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

// acc + a b rounded to nearest even, then a zero of its sign if tiny: if the exact value, rounded
// to 24 bits at unbounded exponent, is below FLT_MIN = 2^-126 in magnitude (x86's tininess after
// rounding). a and b are normal bf16 or zero, acc normal or zero.
//
// r = fma(a, b, acc) is rounded on the subnormal grid (spacing 2^-149). |r| > FLT_MIN: the exact
// value is above FLT_MIN too, not tiny. |r| < FLT_MIN: the exact value is below FLT_MIN - 2^-150,
// which rounds below FLT_MIN, tiny. |r| == FLT_MIN: the exact value lies within 2^-150 of it, and
// is tiny when it is below FLT_MIN - 2^-151 (halfway to FLT_MIN - 2^-150; that tie goes to the
// even FLT_MIN). The residual s = (acc - r) + a b decides, and is computed exactly in double:
// acc - r is exact (both multiples of 2^-149, |acc| < 2^-96; a larger acc makes the exact sum a
// multiple of 2^-120, never this close to FLT_MIN), a b is exact (16 significant bits), and their
// sum, at most 2^-150 in magnitude, is either a b itself (acc = r) or, with |a b| >= 2^-150, a
// multiple of 2^-165: 16 bits.
inline float fma_ftz(float a, float b, float acc) {
  const float r = std::fma(a, b, acc);
  const float m = std::fabs(r);
  if (!(m <= FLT_MIN)) return r;  // normal, infinite or NaN
  if (m < FLT_MIN) return std::copysign(0.0f, r);
  if (std::fabs(acc) >= 0x1p-96f) return r;
  const double s = (static_cast<double>(acc) - static_cast<double>(r)) + static_cast<double>(a) * b;
  const bool tiny = (r > 0 ? s : -s) < -0x1p-151;
  return tiny ? std::copysign(0.0f, r) : r;
}

// A tile's sums to C: C = alpha acc (beta = 0) or fma(beta, C, alpha acc), as the native kernel.
inline void store(float x, float alpha, float beta, float& c) {
  const float v = alpha * x;
  c = beta == 0.0f ? v : std::fma(beta, c, v);
}

// One multiply-add step of a row of the tile, acc[j] = fma_ftz(a, b[j], acc[j]) for j < 64: the
// fused multiply-adds as one loop the compiler vectorises, then fma_ftz's checks only where a
// result is at most FLT_MIN in magnitude, or NaN (rare).
[[gnu::always_inline]] inline void step_row(float a, const float* b, float* acc) {
  alignas(64) float r[kNR];
  for (int j = 0; j < kNR; ++j) r[j] = std::fma(a, b[j], acc[j]);
  int rare = 0;  // an int: GCC vectorises an OR over ints, not over bools
  for (int j = 0; j < kNR; ++j) rare |= !(std::fabs(r[j]) > FLT_MIN);
  if (rare) [[unlikely]]
    for (int j = 0; j < kNR; ++j) r[j] = fma_ftz(a, b[j], acc[j]);
  for (int j = 0; j < kNR; ++j) acc[j] = r[j];
}

// The 6 x 64 tile over `pairs` pairs of k: the pair of row i, pair p is A[i * row + p * step];
// B's pair (p, j) is Bp[p * 64 + j]. Writes the mv x nv valid part of C. Rows past mv and columns
// past nv are zero padding, computed and dropped.
[[gnu::always_inline]] inline void kernel_emulated_body(i64 pairs, const u32* A, i64 row, i64 step, const u32* Bp,
                                                        float* C, i64 ldc, float alpha, float beta, int mv, int nv) {
  alignas(64) float acc[kMR][kNR] = {};
  alignas(64) float b0[kNR], b1[kNR];
  for (i64 p = 0; p < pairs; ++p) {
    for (int j = 0; j < kNR; ++j) {
      b0[j] = daz(bf16_lo(Bp[p * kNR + j]));
      b1[j] = daz(bf16_hi(Bp[p * kNR + j]));
    }
    for (int i = 0; i < mv; ++i) {
      const u32 a = A[i * row + p * step];
      step_row(daz(bf16_hi(a)), b1, acc[i]);  // the pair's odd k first, as vdpbf16ps
      step_row(daz(bf16_lo(a)), b0, acc[i]);
    }
  }
  for (int i = 0; i < mv; ++i)
    for (int j = 0; j < nv; ++j) store(acc[i][j], alpha, beta, C[i * ldc + j]);
}

// Compiled twice: for the build's target, and for AVX2 + FMA (std::fma a libm call without FMA).
void kernel_emulated(i64 pairs, const u32* A, i64 row, i64 step, const u32* Bp, float* C, i64 ldc, float alpha,
                     float beta, int mv, int nv) {
  kernel_emulated_body(pairs, A, row, step, Bp, C, ldc, alpha, beta, mv, nv);
}
#ifdef TG_BF16_X86
[[gnu::target("avx2,fma")]] void kernel_emulated_avx2(i64 pairs, const u32* A, i64 row, i64 step, const u32* Bp,
                                                       float* C, i64 ldc, float alpha, float beta, int mv, int nv) {
  kernel_emulated_body(pairs, A, row, step, Bp, C, ldc, alpha, beta, mv, nv);
}
#endif

// ---- The fused multiply-add kernels: vdpbf16ps's arithmetic at full speed without AVX512_BF16 ----
//
// A pair's two bf16 are exact in float32 (the word's high half with a zero low half, and the low
// half shifted up), and vdpbf16ps's step, acc = ftz(acc + a b) rounded to nearest even, is one
// float32 fused multiply-add with the MXCSR's flush-to-zero on: x86 flushes a result that is tiny
// after rounding, as vdpbf16ps does (Intel SDM vol. 1, the MXCSR's flush-to-zero and the SIMD
// numeric underflow exception; VDPBF16PS in vol. 2), and a tiny result never reaches the next
// step, so no input is subnormal either. Subnormal operands are
// made zeros of their sign when the pairs are split (below). So the operands are split once into
// float32 (per pair the odd k's values, then the even k's: rows of A, or 8-row panels of A^T,
// and 48-column panels of B for the AVX-512F tile, 6-row and 64-column panels for the AVX2 tile),
// and a float32 register tile runs with flush-to-zero on: every step the bits of the emulation
// above, at the float32 product's rate.

// A word's two halves as float32: the odd k's value (the high half) and the even k's (the low
// half), each a zero of its sign when subnormal, as vdpbf16ps reads them.
inline u32 daz_bits(u32 x) { return (x & 0x7F800000u) ? x : (x & 0x80000000u); }
inline u32 odd_half(u32 w) { return daz_bits(w & 0xFFFF0000u); }
inline u32 even_half(u32 w) { return daz_bits(w << 16); }

// A block's packed words (pack_a_rows' bf16 rows, `pairs` words apart, or pack_a_trans's 6-row
// panels) as 6-row panels of floats: Af[((q * pairs + p) * 6 + i) * 2 + h] is row 6q + i's pair p,
// h = 0 the odd k, h = 1 the even k. mcp, a multiple of 6, rows (the packers zero the rows past mc).
void split_a(const u32* Aw, bool ta, i64 mcp, i64 pairs, u32* Af) {
  for (i64 q = 0; q < mcp / kMR; ++q)
    for (i64 p = 0; p < pairs; ++p) {
      u32* d = Af + (q * pairs + p) * 2 * kMR;
      for (i64 i = 0; i < kMR; ++i) {
        const u32 w = ta ? Aw[(q * pairs + p) * kMR + i] : Aw[(q * kMR + i) * pairs + p];
        d[2 * i] = odd_half(w);
        d[2 * i + 1] = even_half(w);
      }
    }
}

// The fma path's values: a bf16 (or a float's bf16) as a float, a zero of its sign when subnormal.
TG_BF16_AVX2 inline u32 split_value(float x) { return daz_bits(hi_of(x)); }
TG_BF16_AVX2 inline u32 split_value(std::uint16_t h) { return daz_bits(static_cast<u32>(h) << 16); }

// The split packers ask for the rows they read this many rows ahead (prefetch_rows): each reads a
// few lines of a row, and the next row's a row of the operand further on, a stride the hardware
// prefetcher follows late.
constexpr i64 kSplitAhead = 8;

// A split panel of op(B) = B^T (the weight of a forward product), W columns wide, straight from B
// without the pair words between: D[(2p + h) * W + j] = b(k0 + 2p + 1 - h, n0 + j) as split_value
// makes it, b(k, j) = B[j * ld + k]: pair p's W odd-k values, then its W even-k values (row k of
// the block goes to row k ^ 1), zero past kc and nc. B is read as 8 x 8 blocks of its rows,
// transposed in registers (transpose8x8). W is 64 for the AVX2 tile's panels, 48 for the 8 x 48
// tile's. (op(B) = B is packed by whole rows, pack_split_rows.)
template <int W, class T>
TG_BF16_AVX2 void pack_split(const T* B, i64 ld, i64 k0, i64 kc, i64 n0, i64 nc, u32* D) {
  using S = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;  // bf16 read as its bits
  const S* b = reinterpret_cast<const S*>(B);
  const i64 k8 = kc / 8 * 8, j8 = nc / 8 * 8;
  alignas(32) S blk[64];
  for (i64 j = 0; j < j8; j += 8) {
    const S* r = b + (n0 + j) * ld + k0;  // row n0 + j of B: column j of the panel
    for (i64 k = 0; k < k8; k += 8) {
      transpose8x8(r + k, ld, blk, 8);  // blk[kk * 8 + jj] = b(k + kk, j + jj)
      for (int kk = 0; kk < 8; ++kk) {
        u32* d = D + ((k + kk) ^ 1) * W + j;
        for (int jj = 0; jj < 8; ++jj) d[jj] = split_value(blk[kk * 8 + jj]);
      }
    }
    for (i64 k = k8; k < kc; ++k)
      for (int jj = 0; jj < 8; ++jj) D[(k ^ 1) * W + j + jj] = split_value(r[jj * ld + k]);
  }
  for (i64 j = j8; j < nc; ++j)
    for (i64 k = 0; k < kc; ++k) D[(k ^ 1) * W + j] = split_value(b[(n0 + j) * ld + k0 + k]);
  for (i64 k = 0, rows = 2 * ((kc + 1) / 2); k < rows; ++k) {  // zeros past nc, and the row past an odd kc
    u32* d = D + (k ^ 1) * W;
    if (k >= kc) std::fill(d, d + W, u32{0});
    else std::fill(d + nc, d + W, u32{0});
  }
}

// Rows [k0, k1) of one K block's split panels from op(B) = B (k in [0, kc) of the block starting at
// row pc of B), laid out as pack_split's, panel q at D + q * pstride: each row of B read once,
// whole and in order, its values going to every panel (a panel at a time would read a few lines of
// each row, rows a page or more apart, and wait on memory for each); the last panel's columns past
// N zero, and with an odd kc the pad row too, by the call that ends the block. k0 is even, so a
// pair's rows are packed by one call.
template <int W, class T>
TG_BF16_AVX2 void pack_split_rows(const T* B, i64 ld, i64 pc, i64 kc, i64 k0, i64 k1, i64 N, u32* D, i64 pstride) {
  using S = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;  // bf16 read as its bits
  const S* b = reinterpret_cast<const S*>(B);
  const i64 full = N / W, rest = N - full * W, panels = full + (rest > 0);
  for (i64 k = k0; k < k1; ++k) {
    const S* r = b + (pc + k) * ld;
    u32* d = D + (k ^ 1) * W;
    for (i64 q = 0; q < full; ++q)
      for (int j = 0; j < W; ++j) d[q * pstride + j] = split_value(r[q * W + j]);
    if (rest)
      for (i64 j = 0; j < W; ++j) d[full * pstride + j] = j < rest ? split_value(r[full * W + j]) : u32{0};
  }
  if (k1 == kc && kc % 2)
    for (i64 q = 0; q < panels; ++q) std::fill_n(D + q * pstride + (kc ^ 1) * W, W, u32{0});
}

// op(A)'s block, rows [r0, r0 + mc) and k in [k0, k0 + kc), split for the 8 x 48 tile (values as
// pack_split makes them, kcp = kc rounded up to even, zero past mc, to a multiple of 8 rows, and
// past kc). A^T (a weight gradient's dy: a(i, k) = A[k * ld + i]) as panels of 8 rows,
// Af[(t * kcp + (k ^ 1)) * 8 + i] = a(r0 + 8t + i, k0 + k), read a row of A at a time, each
// row's mc values going to every panel. A (a(i, k) = A[i * ld + k]) as rows, Af[i * kcp + (k ^ 1)]
// = a(r0 + i, k0 + k), each row of A read and written in order, which the tile reads in place
// (tile_8x48's rows): no transpose.
template <class T>
TG_BF16_AVX2 void pack_a_split(bool ta, const T* A, i64 ld, i64 r0, i64 mc, i64 k0, i64 kc, u32* Af) {
  const i64 kcp = round_up(kc, 2), panels = (mc + 7) / 8, full = mc / 8;
  using S = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;  // bf16 read as its bits
  if (!ta) {
    const S* a = reinterpret_cast<const S*>(A) + r0 * ld + k0;
    for (i64 i = 0; i < mc; ++i) {
      const S* r = a + i * ld;
      prefetch_rows(a, ld, i + kSplitAhead, 1, mc, kc);
      u32* d = Af + i * kcp;
      for (i64 k = 0; k + 1 < kc; k += 2) {  // each pair's odd k first
        d[k] = split_value(r[k + 1]);
        d[k + 1] = split_value(r[k]);
      }
      if (kc % 2) {  // the last k goes to kc, the pad row to kc - 1
        d[kc] = split_value(r[kc - 1]);
        d[kc - 1] = 0;
      }
    }
    std::fill(Af + mc * kcp, Af + panels * 8 * kcp, u32{0});
    return;
  }
  const S* a = reinterpret_cast<const S*>(A) + k0 * ld + r0;
  for (i64 k = 0; k < kc; ++k) {
    const S* r = a + k * ld;
    prefetch_rows(a, ld, k + kSplitAhead, 1, kc, mc);
    for (i64 t = 0; t < full; ++t) {
      u32* d = Af + (t * kcp + (k ^ 1)) * 8;
      for (int i = 0; i < 8; ++i) d[i] = split_value(r[8 * t + i]);
    }
    if (full < panels) {
      u32* d = Af + (full * kcp + (k ^ 1)) * 8;
      for (i64 i = 0; i < 8; ++i) d[i] = 8 * full + i < mc ? split_value(r[8 * full + i]) : u32{0};
    }
  }
  if (kc < kcp)  // the odd kc's pad row
    for (i64 t = 0; t < panels; ++t) std::fill_n(Af + (t * kcp + (kc ^ 1)) * 8, 8, u32{0});
}

// The MXCSR with flush-to-zero on, rounding to nearest even and every exception masked, whatever
// the caller's MXCSR holds: vdpbf16ps ignores the MXCSR, always rounds so and never traps, and
// flush-to-zero applies only while underflow is masked (bits 7-12 the masks, 13-14 the rounding
// control, 15 flush-to-zero).
inline unsigned ftz_csr(unsigned csr) { return (csr & ~0x6000u) | 0x8000u | 0x1F80u; }

// The AVX2 tile's sums, acc (6 x 64, row stride 64) = sum over `pairs` pairs of the two
// multiply-adds, the odd k first, from split panels: A's 12 floats per pair, B's 128, the tile in
// 12 ymm, 16 columns at a time. Called with flush-to-zero on (ftz_csr); never inlined, so no
// operation of its own moves outside that setting. (With AVX-512F the float32 product's 8 x 48
// tile sums instead: block_product_fma.)
#ifdef TG_BF16_X86
[[gnu::noinline, gnu::target("avx2,fma")]] void tile_fma256(i64 pairs, const float* A, const float* B, float* acc) {
  for (int j0 = 0; j0 < kNR; j0 += 16) {
    __m256 c[kMR][2];
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    const float* a = A;
    const float* b = B + j0;
    for (i64 p = 0; p < pairs; ++p) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 b0 = _mm256_load_ps(b + h * kNR), b1 = _mm256_load_ps(b + h * kNR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < kMR; ++i) {
          const __m256 ai = _mm256_broadcast_ss(a + 2 * i + h);
          c[i][0] = _mm256_fmadd_ps(ai, b0, c[i][0]);
          c[i][1] = _mm256_fmadd_ps(ai, b1, c[i][1]);
        }
      }
      a += 2 * kMR;
      b += 2 * kNR;
    }
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      _mm256_store_ps(acc + i * kNR + j0, c[i][0]);
      _mm256_store_ps(acc + i * kNR + j0 + 8, c[i][1]);
    }
  }
}
#endif

// ---- The native kernel: vdpbf16ps --------------------------------------------------------------

#ifdef TG_BF16_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

// As kernel_emulated, with 24 accumulators c[i][j] (row i, columns 16 j .. 16 j + 15) in zmm
// registers: per pair, 4 loads of B, 6 broadcasts of A's pair, 24 vdpbf16ps. ROWS: A is six bf16
// rows (row = words per row, step 1); else a packed panel of A^T (row 1, step 6).
template <bool ROWS>
void kernel_native(i64 pairs, const u32* A, i64 row, const u32* Bp, float* C, i64 ldc, float alpha, float beta,
                   int mv, int nv) {
  constexpr i64 step = ROWS ? 1 : kMR;
  __m512 c[kMR][4];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) c[i][j] = _mm512_setzero_ps();
  const u32* a[kMR];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i) a[i] = A + (ROWS ? i * row : i);
  prefetch_tile(C, ldc, mv, nv);
#pragma GCC unroll 2
  for (i64 p = 0; p < pairs; ++p) {
    __m512bh b[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) b[j] = reinterpret_cast<__m512bh>(_mm512_load_si512(Bp + 16 * j));
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(*a[i])));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], ai, b[j]);
      a[i] += step;
    }
    Bp += kNR;
  }
  // A full tile goes straight to C; an edge tile to a buffer, then its valid part to C.
  alignas(64) float edge[kMR * kNR];
  const bool full = mv == kMR && nv == kNR;
  float* dst = full ? C : edge;
  const i64 ld = full ? ldc : kNR;
  const bool read_c = full && beta != 0.0f;
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      float* r = dst + i * ld + 16 * j;
      __m512 x = _mm512_mul_ps(va, c[i][j]);
      if (read_c) x = _mm512_fmadd_ps(vb, _mm512_loadu_ps(r), x);
      _mm512_storeu_ps(r, x);
    }
  if (!full)
    for (int i = 0; i < mv; ++i)
      for (int j = 0; j < nv; ++j) {
        float& out = C[i * ldc + j];
        out = beta == 0.0f ? edge[i * kNR + j] : std::fma(beta, out, edge[i * kNR + j]);  // as the full tile
      }
}

// Sixteen rows of 16 words in r become its sixteen columns: 4 x 4 blocks within each 128-bit
// lane by 32- and 64-bit unpacks, then the lanes gathered across registers. (The maskz forms:
// GCC 12 warns of the plain forms' undefined merge operand.)
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_epi32(0xFFFF, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(0xFFFF, r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + m], lane L: rows 4i .. 4i + 3 of column 4L + m
    u[4 * i] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_maskz_unpacklo_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_maskz_unpackhi_epi64(0xFF, t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_maskz_shuffle_i32x4(0xFFFF, u[m], u[4 + m], 0x88);
    const __m512i x1 = _mm512_maskz_shuffle_i32x4(0xFFFF, u[m], u[4 + m], 0xDD);
    const __m512i y0 = _mm512_maskz_shuffle_i32x4(0xFFFF, u[8 + m], u[12 + m], 0x88);
    const __m512i y1 = _mm512_maskz_shuffle_i32x4(0xFFFF, u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_maskz_shuffle_i32x4(0xFFFF, x0, y0, 0x88);
    r[4 + m] = _mm512_maskz_shuffle_i32x4(0xFFFF, x1, y1, 0x88);
    r[8 + m] = _mm512_maskz_shuffle_i32x4(0xFFFF, x0, y0, 0xDD);
    r[12 + m] = _mm512_maskz_shuffle_i32x4(0xFFFF, x1, y1, 0xDD);
  }
}

// pack_b_panel's words with tb, vectorised (without tb the compiler vectorises the loop above).
// A row of B is a column of the panel, and its bf16 row already holds the column's words in order
// (pair p is elements 2p and 2p + 1): sixteen rows are rounded, 384 pairs at a time, and their
// 16 x 16 blocks of words transposed into the panel.
template <class T>
void pack_b_trans_native(const T* B, i64 ld, i64 k0, i64 kc, i64 n0, i64 nc, u32* Bp) {
  const i64 pairs = (kc + 1) / 2;
  assert(kc <= kKC);
  constexpr i64 kWords = 384;  // pairs per chunk: 16 rows x 384 words = 24 KB of stack
  alignas(64) u32 w[16][kWords];
  for (i64 j0 = 0; j0 < kNR; j0 += 16)
    for (i64 c0 = 0; c0 < pairs; c0 += kWords) {
      // This chunk's pairs [c0, c0 + cw) are k in [2 c0, 2 c0 + kn); rows past nc are zero.
      const i64 cw = std::min(kWords, pairs - c0), kn = std::min(2 * kWords, kc - 2 * c0);
      for (i64 i = 0; i < 16; ++i) {
        auto* row = reinterpret_cast<bf16*>(w[i]);
        const i64 j = j0 + i, values = j < nc ? kn : 0;
        if (values) bf16_impl::row_bf16(B + (n0 + j) * ld + k0 + 2 * c0, row, values);
        std::fill(row + values, row + 2 * round_up(cw, 16), bf16{0});
      }
      for (i64 p0 = 0; p0 < cw; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(w[i] + p0);
        transpose16(r);
        const i64 q1 = std::min<i64>(16, cw - p0);
        for (i64 q = 0; q < q1; ++q) _mm512_store_si512(Bp + (c0 + p0 + q) * kNR + j0, r[q]);
      }
    }
}

#pragma GCC pop_options
#endif


// ---- The AMX kernel: tdpbf16ps on tiles -----------------------------------------------------------

// Which kernel a product runs (sgemm_bf16.h).
using Path = bf16_impl::Path;

constexpr i64 kAmxK = 32;   // k per row of an A tile: 32 bf16 = 64 bytes, 16 pairs of a B tile
constexpr i64 kAmxM = 32;   // rows of C per kernel call: two tiles of 16 rows
static_assert(kKC % kAmxK == 0, "AMX's K blocks, rounded up to whole chunks, stay within kKC");

#ifdef TG_BF16_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

// The tile registers as the AMX kernel uses them (Intel SDM vol. 1, ch. 18, palette 1): tmm0-3
// hold C, 2 x 2 tiles of 16 x 16 floats; tmm4-5 two tiles of A, 16 rows x 32 bf16; tmm6-7 two
// tiles of B, 16 pairs x 16 columns, each pair (b(k, j), b(k+1, j)) one 32-bit word, as packed.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Loads the configuration on the calling thread (per thread, cheap beside a block's products).
void amx_configure() {
  TileConfig t;
  for (int i = 0; i < 8; ++i) {
    t.colsb[i] = 64;
    t.rows[i] = 16;
  }
  _tile_loadconfig(&t);
}

void amx_release() { _tile_release(); }

// acc (32 x 32, row stride 32) = sum over chunks of 32 k of a(i, k) b(k, j): A 32 packed rows of
// ka bf16, B a panel's 32 columns (a pair row every kNR words). Per chunk 2 tiles of A and 2 of B
// are loaded and 4 products accumulate, in the tile unit's own order (sgemm_bf16.h).
void amx_32x32(i64 chunks, const bf16* A, i64 ka, const u32* B, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const i64 sa = ka * 2, sb = kNR * 4;  // bytes between rows
  for (i64 c = 0; c < chunks; ++c) {
    _tile_loadd(4, A + c * kAmxK, sa);
    _tile_loadd(5, A + 16 * ka + c * kAmxK, sa);
    _tile_loadd(6, B + c * 16 * kNR, sb);
    _tile_loadd(7, B + c * 16 * kNR + 16, sb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  _tile_stored(2, acc + 16 * 32, 128);
  _tile_stored(3, acc + 16 * 32 + 16, 128);
}

// The valid mv x nv corner of acc to C: C = alpha acc (beta = 0) or fma(beta, C, alpha acc), as
// the vdpbf16ps kernel stores.
void amx_store(const float* acc, float* C, i64 ldc, float alpha, float beta, int mv, int nv) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const auto mask = [](int n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1); };
  const __mmask16 m[2] = {mask(nv), mask(nv - 16)};
  for (int i = 0; i < mv; ++i)
    for (int h = 0; h < 2; ++h) {
      if (!m[h]) continue;
      float* r = C + i * ldc + 16 * h;
      __m512 x = _mm512_mul_ps(va, _mm512_load_ps(acc + i * 32 + 16 * h));
      if (beta != 0.0f) x = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m[h], r), x);
      _mm512_mask_storeu_ps(r, m[h], x);
    }
}

// op(A) = A^T for the tiles, from S, the block's k rows as bf16 (S[k * ms + i] = a(r0 + i, k0 + k),
// ka rows, zero past kc and past mc, ms a multiple of 16): Ap's row i is the 32-bit words
// (S[2p][i], S[2p + 1][i]) for p < ka / 2. Sixteen i at a time, a pair's words are made in a
// register (the two rows widened to 32 bits, the second shifted up) and scattered down the
// sixteen rows of Ap.
void transpose_pairs_amx(const bf16* S, i64 ms, i64 ka, bf16* Ap) {
  const i64 words = ka / 2;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(words)));
  auto* out = reinterpret_cast<int*>(Ap);
  for (i64 i0 = 0; i0 < ms; i0 += 16)
    for (i64 p = 0; p < words; ++p) {
      // The maskz forms: GCC 12 warns of the plain forms' undefined merge operand.
      const __m512i a = _mm512_maskz_cvtepu16_epi32(
          0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + 2 * p * ms + i0)));
      const __m512i b = _mm512_maskz_cvtepu16_epi32(
          0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + (2 * p + 1) * ms + i0)));
      _mm512_i32scatter_epi32(out + i0 * words + p, rows, _mm512_or_si512(a, _mm512_maskz_slli_epi32(0xFFFF, b, 16)),
                              4);
    }
}

#pragma GCC pop_options
#endif

// op(A), rows [r0, r0 + mc), k in [k0, k0 + kc), for the tiles: bf16 rows of ka = kc rounded up
// to 32, zero past kc, then zero rows up to a multiple of 32. a(i, k) = A[i * ld + k], or
// A[k * ld + i] when ta (then A is read row by row and written by columns).
template <class T>
void pack_a_amx(bool ta, const T* A, i64 ld, i64 r0, i64 mc, i64 k0, i64 kc, bf16* Ap) {
  const i64 ka = round_up(kc, kAmxK), ma = round_up(mc, kAmxM);
  if (!ta) {  // row by row
    for (i64 i = 0; i < mc; ++i) {
      const T* s = A + (r0 + i) * ld + k0;
      bf16* d = Ap + i * ka;
      if constexpr (std::is_same_v<T, float>) {
#ifdef TG_BF16_X86
        bf16_impl::to_bf16_avx512(s, d, kc);
#else
        bf16_impl::to_bf16_portable(s, d, kc);
#endif
      } else {
        std::memcpy(d, s, static_cast<std::size_t>(kc) * sizeof(bf16));
      }
      std::fill(d + kc, d + ka, bf16{0});
    }
    std::fill(Ap + mc * ka, Ap + ma * ka, bf16{0});
    return;
  }
#ifdef TG_BF16_X86
  // Each k row of A converted (or copied) as a whole into S, the room after Ap's ma x ka (the
  // plan's a_bytes), then turned into Ap's rows.
  const i64 ms = round_up(mc, 16);
  bf16* S = Ap + ma * ka;
  std::fill(S, S + ka * ms, bf16{0});
  for (i64 k = 0; k < kc; ++k) {
    const T* s = A + (k0 + k) * ld + r0;
    bf16* d = S + k * ms;
    if constexpr (std::is_same_v<T, float>) bf16_impl::to_bf16_avx512(s, d, mc);
    else std::memcpy(d, s, static_cast<std::size_t>(mc) * sizeof(bf16));
  }
  transpose_pairs_amx(S, ms, ka, Ap);
  std::fill(Ap + ms * ka, Ap + ma * ka, bf16{0});
#else
  (void)A, (void)ld, (void)r0, (void)k0, (void)ma;
#endif
}

// ---- Blocks ------------------------------------------------------------------------------------

// Rows [r0, r1) of C times column panels [q0, q1) for one block of K, k in [pc, pc + kc), op(B)'s
// panels of that block at Bk + q * pstride (words). be: this block's beta. Ap: room for
// round_up(r1 - r0, 6) x kc bf16.
// The AMX version: Ap has room for round_up(r1 - r0, 32) x round_up(kc, 32) bf16, and each panel
// of Bk zero pairs up to round_up(kc, 32) / 2.
void block_product_amx(const GemmBf16& g, i64 r0, i64 r1, i64 pc, i64 kc, const u32* Bk, i64 pstride, i64 q0,
                       i64 q1, float be, void* Ap) {
#ifdef TG_BF16_X86
  const i64 mc = r1 - r0, ka = round_up(kc, kAmxK);
  auto* Ab = static_cast<bf16*>(Ap);
  if (g.A.f) pack_a_amx(g.ta, g.A.f, g.A.ld, r0, mc, pc, kc, Ab);
  else pack_a_amx(g.ta, g.A.h, g.A.ld, r0, mc, pc, kc, Ab);
  amx_configure();
  alignas(64) float acc[kAmxM * 32];
  for (i64 q = q0; q < q1; ++q)
    for (i64 h = 0; h < kNR / 32; ++h) {
      const i64 col = q * kNR + 32 * h;
      if (col >= g.N) break;
      const int nv = static_cast<int>(std::min<i64>(32, g.N - col));
      for (i64 ir = 0; ir < mc; ir += kAmxM) {
        amx_32x32(ka / kAmxK, Ab + ir * ka, ka, Bk + q * pstride + 32 * h, acc);
        amx_store(acc, g.C + (r0 + ir) * g.ldc + col, g.ldc, g.alpha, be,
                  static_cast<int>(std::min<i64>(kAmxM, mc - ir)), nv);
      }
    }
  // The tile state goes back to its initial (unused) state, so the thread's context switches
  // stop saving 8 KB of tiles; the next block loads the configuration again.
  amx_release();
#else
  (void)g, (void)r0, (void)r1, (void)pc, (void)kc, (void)Bk, (void)pstride, (void)q0, (void)q1, (void)be, (void)Ap;
#endif
}

// The stores of a tile's sums, C = alpha acc (beta = 0) or fma(beta, C, alpha acc), as the
// native kernel's: acc's rows are ld_acc floats apart.
TG_BF16_AVX2 void store_tile(const float* acc, i64 ld_acc, float* C, i64 ldc, float alpha, float beta, int mv,
                             int nv) {
  for (int i = 0; i < mv; ++i)
    for (int j = 0; j < nv; ++j) store(acc[i * ld_acc + j], alpha, beta, C[i * ldc + j]);
}

// op(A)'s block, rows [r0, r0 + mc) and k in [pc, pc + kc), as pair words at Ap: pack_a_trans's
// 6-row panels when ta, else pack_a_rows' bf16 rows (native: converted with AVX512_BF16).
void pack_a_words(const GemmBf16& g, i64 r0, i64 mc, i64 pc, i64 kc, u32* Ap, bool native) {
  if (!g.ta) return pack_a_rows(g.A, r0, mc, pc, kc, reinterpret_cast<bf16*>(Ap), native);
  if (g.A.f) pack_a_trans(g.A.f, g.A.ld, r0, mc, pc, kc, Ap);
  else pack_a_trans(g.A.h, g.A.ld, r0, mc, pc, kc, Ap);
}

// The fused multiply-add version; wide (the Plan's): with AVX-512F the float32 product's 8 x 48
// tile runs (sgemm_avx512.h's tile_8x48, one register tile for both precisions; docs/performance.md
// compares it with a 6 x 64 AVX-512 tile), A split straight into rows at Ap, which the
// tile reads in place, or A^T into 8-row panels (pack_a_split), and B into panels 48 columns wide
// (Plan::pack_rows, Plan::pack_panel), over kcp = 2 x pairs steps of k, the odd k of each pair
// first. Without, the AVX2 6 x 64 tile runs, from the block's packed words at Ap split into 6-row
// panels after them (split_a). Flush-to-zero is on while a tile sums, and the caller's MXCSR back
// for the stores.
void block_product_fma(const GemmBf16& g, bool wide, i64 r0, i64 r1, i64 pc, i64 kc, const u32* Bk, i64 pstride,
                       i64 q0, i64 q1, float be, void* Ap) {
#ifdef TG_BF16_X86
  const i64 mc = r1 - r0, pairs = (kc + 1) / 2;
  if (wide) {
    constexpr int MR = kFmaWideMR, NR = kFmaWideNR;
    const i64 kcp = 2 * pairs, tiles = (mc + MR - 1) / MR;
    auto* Af = static_cast<u32*>(Ap);
    if (g.A.f) pack_a_split(g.ta, g.A.f, g.A.ld, r0, mc, pc, kc, Af);
    else pack_a_split(g.ta, g.A.h, g.A.ld, r0, mc, pc, kc, Af);
    alignas(64) float acc[MR * NR];
    // The next panel of this block, in equal slices, one a tile (a block's last panel asks for
    // nothing: the GPT's products have one K block, or two, in bf16).
    const i64 next_bytes = kcp * NR * static_cast<i64>(sizeof(float));
    for (i64 q = q0; q < q1; ++q) {
      const int nv = static_cast<int>(std::min<i64>(NR, g.N - q * NR));
      const auto* Bj = reinterpret_cast<const float*>(Bk + q * pstride);
      const u32* next = q + 1 < q1 ? Bk + (q + 1) * pstride : nullptr;
      for (i64 t = 0; t < tiles; ++t) {
        float* Ct = g.C + (r0 + t * MR) * g.ldc + q * NR;
        const int mv = static_cast<int>(std::min<i64>(MR, mc - t * MR));
        prefetch_tile(Ct, g.ldc, mv, nv);  // the tile's C lines arrive while it sums, as the native kernel's
        const unsigned csr = _mm_getcsr();  // read per tile: the stores' flags stay raised
        _mm_setcsr(ftz_csr(csr));
        // A's 8 rows of this tile, as rows (A) or a panel (A^T): 8 kcp floats either way.
        sgemm_avx512::tile_8x48(kcp, reinterpret_cast<const float*>(Af + t * kcp * MR), !g.ta, kcp, Bj, acc,
                                Ahead::slice(next, next_bytes, tiles, t, kcp));
        _mm_setcsr(csr);
        store_tile(acc, NR, Ct, g.ldc, g.alpha, be, mv, nv);
      }
    }
    return;
  }
  const i64 mcp = round_up(mc, kMR);
  auto* Aw = static_cast<u32*>(Ap);
  pack_a_words(g, r0, mc, pc, kc, Aw, false);
  u32* Af = Aw + mcp * pairs;
  split_a(Aw, g.ta, mcp, pairs, Af);
  alignas(64) float acc[kMR * kNR];
  for (i64 q = q0; q < q1; ++q) {
    const int nv = static_cast<int>(std::min<i64>(kNR, g.N - q * kNR));
    const auto* Bj = reinterpret_cast<const float*>(Bk + q * pstride);
    for (i64 ir = 0; ir < mc; ir += kMR) {
      const auto* At = reinterpret_cast<const float*>(Af + ir * 2 * pairs);
      float* Ct = g.C + (r0 + ir) * g.ldc + q * kNR;
      const int mv = static_cast<int>(std::min<i64>(kMR, mc - ir));
      prefetch_tile(Ct, g.ldc, mv, nv);
      const unsigned csr = _mm_getcsr();
      _mm_setcsr(ftz_csr(csr));
      tile_fma256(pairs, At, Bj, acc);
      _mm_setcsr(csr);
      store_tile(acc, kNR, Ct, g.ldc, g.alpha, be, mv, nv);
    }
  }
#else
  (void)g, (void)wide, (void)r0, (void)r1, (void)pc, (void)kc, (void)Bk, (void)pstride, (void)q0, (void)q1, (void)be,
      (void)Ap;
#endif
}

// wide: the Plan's, for the fma path (its panels' layout).
void block_product(const GemmBf16& g, Path path, bool wide, i64 r0, i64 r1, i64 pc, i64 kc, const u32* Bk,
                   i64 pstride, i64 q0, i64 q1, float be, void* Ap) {
  if (path == Path::amx) return block_product_amx(g, r0, r1, pc, kc, Bk, pstride, q0, q1, be, Ap);
  if (path == Path::fma) return block_product_fma(g, wide, r0, r1, pc, kc, Bk, pstride, q0, q1, be, Ap);
  const bool native = path == Path::dpbf16;
  const i64 mc = r1 - r0, pairs = (kc + 1) / 2;
  pack_a_words(g, r0, mc, pc, kc, static_cast<u32*>(Ap), native);
  const u32* Aw = static_cast<const u32*>(Ap);
#ifdef TG_BF16_X86
  const bool avx2 = !native && isa() >= Isa::avx2;
#else
  constexpr bool avx2 = false;
  auto kernel_emulated_avx2 = kernel_emulated;
#endif
  const i64 row = g.ta ? 1 : pairs, step = g.ta ? kMR : 1;
  for (i64 q = q0; q < q1; ++q) {
    const int nv = static_cast<int>(std::min<i64>(kNR, g.N - q * kNR));
    const u32* Bj = Bk + q * pstride;
    for (i64 ir = 0; ir < mc; ir += kMR) {
      const int mv = static_cast<int>(std::min<i64>(kMR, mc - ir));
      const u32* At = g.ta ? Aw + ir * pairs : Aw + ir * row;  // both: 6 rows x pairs words apart
      float* Ct = g.C + (r0 + ir) * g.ldc + q * kNR;
#ifdef TG_BF16_X86
      if (native) {
        if (g.ta) kernel_native<false>(pairs, At, 1, Bj, Ct, g.ldc, g.alpha, be, mv, nv);
        else kernel_native<true>(pairs, At, row, Bj, Ct, g.ldc, g.alpha, be, mv, nv);
        continue;
      }
#endif
      if (avx2) kernel_emulated_avx2(pairs, At, row, step, Bj, Ct, g.ldc, g.alpha, be, mv, nv);
      else kernel_emulated(pairs, At, row, step, Bj, Ct, g.ldc, g.alpha, be, mv, nv);
    }
  }
}

// True when there is nothing to multiply: C is empty, or K = 0 or alpha = 0, where C = beta C is
// done here (A and B are not read: the BLAS rule).
bool no_product(const GemmBf16& g) {
  if (g.M <= 0 || g.N <= 0) return true;
  if (g.K > 0 && g.alpha != 0.0f) return false;
  for (i64 m = 0; m < g.M; ++m)
    for (i64 n = 0; n < g.N; ++n) {
      float& c = g.C[m * g.ldc + n];
      c = g.beta == 0.0f ? 0.0f : g.beta * c;
    }
  return true;
}

// Per-thread packing buffers, grown on demand and kept. get() returns null instead of throwing
// (it runs inside OpenMP regions, which an exception must not leave).
struct Buffer {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> p;
  i64 n = 0;
  void* get(i64 bytes) noexcept {
    if (bytes > n) {
      p.reset(std::aligned_alloc(64, static_cast<std::size_t>((bytes + 63) / 64 * 64)));
      n = p ? bytes : 0;
    }
    return p.get();
  }
};
thread_local Buffer tl_a, tl_b;

// How one product is cut: K blocks of kcb (even, fixed by K alone: the order of every sum), op(B)
// packed whole (panel q of K block b at Bp + (b * panels + q) * pstride words), C cut into items,
// a block of rows by a run of column panels (or half a block, by rows, for the team's last ones:
// TailCut, parallel.h). An item runs the K blocks in order over its own part of C, so no two
// threads write the same element, and each element's sum is the same whoever computes it.
struct Plan {
  const GemmBf16* g = nullptr;
  Path path = Path::emulated;
  bool wide = false;  // the fma path's 8 x 48 tile: panels of 48 columns, blocks of 8-row units
  i64 nr = kNR;       // columns of a panel of B
  i64 kcb = 0, nkb = 0, panels = 0, pstride = 0, rows = 0, unit = 0, units_m = 0, row_blocks = 0, run = 0, items = 0;
  TailCut cut;  // the team's last items cut in two (parallel.h)
  bool ep_after = false;  // the epilogue runs on the whole of C after the items
  u32* Bp = nullptr;

  Plan() = default;
  Plan(const GemmBf16& p, Path pa, int team) : g(&p), path(pa) {
    // AMX: K blocks of whole chunks of 32 (a B panel's pairs fill whole tiles) and rows in
    // multiples of 32 (two tiles of A).
    const bool amx = path == Path::amx;
    wide = path == Path::fma && isa() >= Isa::avx512;  // the fma path runs on x86 only (path_in_use)
    nr = wide ? kFmaWideNR : kNR;
    unit = amx ? kAmxM : wide ? kFmaWideMR : kMR;
    kcb = block(p.K, kKC, amx ? kAmxK : 2);
    nkb = (p.K + kcb - 1) / kcb;
    panels = (p.N + nr - 1) / nr;
    pstride = nr * (kcb / 2) * (path == Path::fma ? 2 : 1);  // words; the fma path's panels are split
    // About four blocks a thread (the last `team` then cut in two: TailCut): blocks of whole
    // units of rows (6, 8 for the 8 x 48 tile, or 32 for AMX; at most kMC rows), as many as a
    // multiple of the team where there are enough, the units dealt out evenly; then columns cut in
    // runs of panels when there are too few row blocks. An epilogue on whole rows as in the
    // float32 driver's plan (sgemm_driver.h).
    const i64 want = 4 * team;
    units_m = (p.M + unit - 1) / unit;
    const i64 most = team == 1 ? block(p.M, kMC, unit) / unit
                               : std::clamp<i64>(round_up((p.M + want - 1) / want, unit), amx ? unit : 4 * unit, kMC) / unit;
    row_blocks = (units_m + most - 1) / most;
    if (team > 1 && row_blocks > team) row_blocks = std::min(units_m, (row_blocks + team - 1) / team * team);
    rows = (units_m + row_blocks - 1) / row_blocks * unit;  // the largest block
    ep_after = p.ep.rows && team > 1 && row_blocks < team;
    const i64 col_blocks =
        p.ep.rows && !ep_after ? 1 : std::clamp<i64>((want + row_blocks - 1) / row_blocks, 1, panels);
    run = team == 1 ? panels : (panels + col_blocks - 1) / col_blocks;
    cut = TailCut(row_blocks * ((panels + run - 1) / run), team);
    items = cut.items();
  }
  i64 unit_start(i64 rb) const { return rb * units_m / row_blocks; }  // block rb's first unit of rows
  i64 row_start(i64 rb) const { return unit_start(rb) * unit; }       // and its first row
  // A unit of packing: one panel of one K block; on the fma path with op(B) = B, kSlab rows of one
  // K block, all panels (pack_rows: B's rows read whole, in order).
  static constexpr i64 kSlab = 16;  // even: a pair's two rows in one slab
  bool by_rows() const { return path == Path::fma && !g->tb; }
  i64 slabs() const { return (kcb + kSlab - 1) / kSlab; }
  i64 units() const { return nkb * (by_rows() ? slabs() : panels); }
  i64 b_bytes() const { return nkb * panels * pstride * 4; }
  // AMX with A^T: room for the block's k rows as bf16 too, after its packed rows (pack_a_amx).
  // The fma path's AVX2 tile: room for the split floats too, after the words (block_product_fma).
  // The 8 x 48 tile's path: the split floats alone (pack_a_split).
  i64 a_bytes() const {
    if (wide) return round_up(rows, kFmaWideMR) * kcb * 4;
    return round_up(rows, path == Path::amx ? kAmxM : kMR) * kcb * 2 *
           (path == Path::amx && g->ta ? 2 : path == Path::fma ? 3 : 1);
  }
  void pack(i64 u) const {
    if (!by_rows()) return pack_panel(u / panels, u % panels, Bp + u * pstride);
    const i64 b = u / slabs(), k0 = u % slabs() * kSlab;
    pack_rows(b, k0, k0 + kSlab, Bp + b * panels * pstride);
  }
  // Rows [k0, k1) of K block b (clipped to the block), every panel, panel 0 at d (by_rows()).
  void pack_rows(i64 b, i64 k0, i64 k1, u32* d) const {
    const i64 pc = b * kcb, kc = std::min(kcb, g->K - pc);
    if (k0 >= std::min(k1, kc)) return;
    auto rows = [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (g->B.f) pack_split_rows<W>(g->B.f, g->B.ld, pc, kc, k0, std::min(k1, kc), g->N, d, pstride);
      else pack_split_rows<W>(g->B.h, g->B.ld, pc, kc, k0, std::min(k1, kc), g->N, d, pstride);
    };
    if (wide) rows(std::integral_constant<int, kFmaWideNR>{});
    else rows(std::integral_constant<int, kNR>{});
  }
  // Panel q of K block b (not by_rows()); for AMX with zero pairs up to the block's last whole
  // chunk of 32.
  void pack_panel(i64 b, i64 q, u32* d) const {
    const i64 pc = b * kcb, kc = std::min(kcb, g->K - pc), n0 = q * nr, nc = std::min(nr, g->N - n0);
    if (path == Path::fma) {  // op(B) = B^T here
      auto panel = [&](auto w) {
        constexpr int W = decltype(w)::value;
        if (g->B.f) pack_split<W>(g->B.f, g->B.ld, pc, kc, n0, nc, d);
        else pack_split<W>(g->B.h, g->B.ld, pc, kc, n0, nc, d);
      };
      if (wide) return panel(std::integral_constant<int, kFmaWideNR>{});
      return panel(std::integral_constant<int, kNR>{});
    }
    pack_b_panel(g->tb, g->B, pc, kc, n0, std::min<i64>(kNR, g->N - n0), d, path != Path::emulated);
    if (path == Path::amx) std::fill(d + (kc + 1) / 2 * kNR, d + round_up(kc, kAmxK) / 2 * kNR, u32{0});
  }
  void item(i64 i, void* Ap) const {
    const i64 bi = cut.base_of(i), rb = bi % row_blocks, cb = bi / row_blocks;
    i64 u0 = unit_start(rb), u1 = unit_start(rb + 1);
    cut.part(i, u0, u1);
    const i64 r0 = u0 * unit, r1 = std::min(g->M, u1 * unit), q0 = cb * run, q1 = std::min(panels, q0 + run);
    if (r0 >= r1) return;
    for (i64 b = 0; b < nkb; ++b) {
      const i64 pc = b * kcb;
      block_product(*g, path, wide, r0, r1, pc, std::min(kcb, g->K - pc), Bp + b * panels * pstride, pstride, q0, q1,
                    b == 0 ? g->beta : 1.0f, Ap);
    }
    if (g->ep && !ep_after) g->ep(r0, r1, q0 * nr, std::min(g->N, q1 * nr));  // the item's part of C is final
  }
};

#ifdef TG_BF16_X86
// Whether the fma kernel of this width gives fma_ftz's bits on this CPU, where the flushes decide
// them: one pair per element, acc = ftz(0 + a1 b1) = +-FLT_MIN (a1 = +-2^-63, b1 = 2^-63), then
// acc = ftz(acc + a0 b0) with products of 2^-153 to 2^-125 of either sign and zero, ties and the
// values beside them among them. A CPU, hypervisor or emulator that ignores the MXCSR's flush-to-zero,
// or detects tininess before rounding, fails it.
bool fma_flush_exact(bool wide) {
  const int MR = wide ? kFmaWideMR : kMR, NR = wide ? kFmaWideNR : kNR;
  alignas(64) float A[2 * kFmaWideMR], B[2 * kNR], acc[kFmaWideMR * kNR];  // room for either tile
  // a(i, h) of the tile's panel of A, h = 0 the odd k, 1 the even k: the 8 x 48 tile's k-major
  // panel, or the 6 x 64 tile's pairs of floats per row.
  auto a = [&](int i, int h) -> float& { return wide ? A[h * MR + i] : A[2 * i + h]; };
  const float t = 0x1p-75f;
  const float a0[kFmaWideMR] = {-t, t * (1 + 0x1p-5f), -t, t, -t * 1.5f, t * (1 - 0x1p-8f), -t * (1 + 0x1p-6f), t * 0.75f};
  for (int i = 0; i < MR; ++i) {
    a(i, 0) = i % 2 ? -0x1p-63f : 0x1p-63f;  // the odd k: a1
    a(i, 1) = a0[i];                          // the even k: a0
  }
  const float b0[16] = {0x1p-76f, 0x1p-76f * (1 + 0x1p-4f), 0x1p-77f, 0x1p-75f, 0x1p-52f, 0x1p-74f, 0x1p-78f,
                        0x1p-76f * 1.5f, -0x1p-76f, -0x1p-75f, 0x1p-76f * (1 - 0x1p-7f), 0x1p-51f, 0x1p-60f,
                        -0x1p-77f, 0x1p-76f * (1 + 0x1p-7f), 0.0f};
  for (int j = 0; j < NR; ++j) {
    B[j] = 0x1p-63f;           // the odd k: b1
    B[NR + j] = b0[j % 16];    // the even k: b0
  }
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(ftz_csr(csr));
  if (wide) sgemm_avx512::tile_8x48(2, A, false, 0, B, acc, Ahead{});
  else tile_fma256(1, A, B, acc);
  _mm_setcsr((ftz_csr(csr) & ~0x8040u));  // the reference: nearest even, no flush-to-zero, no DAZ
  bool same = true;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      same &= float_bits(fma_ftz(a(i, 1), B[NR + j], fma_ftz(a(i, 0), B[j], 0.0f))) == float_bits(acc[i * NR + j]);
  _mm_setcsr(csr);
  return same;
}
#endif

// The fastest path isa() allows (the fma path where its flushes check out, once per tile).
Path path_in_use() {
#ifdef TG_BF16_X86
  if (isa() >= Isa::amx_bf16) return Path::amx;
  if (isa() >= Isa::avx512_bf16) return Path::dpbf16;
  if (isa() >= Isa::avx512) {
    static const bool exact = fma_flush_exact(true);
    if (exact) return Path::fma;
  } else if (isa() >= Isa::avx2) {
    static const bool exact = fma_flush_exact(false);
    if (exact) return Path::fma;
  }
#endif
  return Path::emulated;
}

// Large enough to share: at least 2^21 multiply-adds (about 10 us on one core at vdpbf16ps's
// rate, several times the cost of starting the team), and rows or columns to cut.
bool split_worth(const GemmBf16& g) { return std::max(g.M, g.N) >= 32 && worth_parallel(g.M * g.N * g.K / 64); }

// The product on the calling thread: B packed one K block at a time (the same panels and sums as
// the team's plan), then every row block.
void single(const GemmBf16& g, Path path) {
  if (no_product(g)) return g.ep.whole(g.M, g.N);
  Plan plan(g, path, 1);
  void* Ap = tl_a.get(plan.a_bytes());
  plan.Bp = static_cast<u32*>(tl_b.get(plan.panels * plan.pstride * 4));
  if (!Ap || !plan.Bp) throw std::bad_alloc();
  for (i64 b = 0; b < plan.nkb; ++b) {
    const i64 pc = b * plan.kcb, kc = std::min(plan.kcb, g.K - pc);
    if (plan.by_rows()) plan.pack_rows(b, 0, kc, plan.Bp);
    else
      for (i64 q = 0; q < plan.panels; ++q) plan.pack_panel(b, q, plan.Bp + q * plan.pstride);
    for (i64 rb = 0; rb < plan.row_blocks; ++rb)
      block_product(g, path, plan.wide, plan.row_start(rb), std::min(g.M, plan.row_start(rb + 1)), pc, kc, plan.Bp,
                    plan.pstride, 0, plan.panels, b == 0 ? g.beta : 1.0f, Ap);
  }
  g.ep.whole(g.M, g.N);
}

// The team's version: op(B) packed once by the team, then items taken from a shared counter (a
// thread slowed by another program on the machine takes fewer).
void team_product(const GemmBf16& g, Path path) {
  if (no_product(g)) return g.ep.whole(g.M, g.N);
  const int team = omp_get_max_threads();
  Plan plan(g, path, team);
  plan.Bp = static_cast<u32*>(tl_b.get(plan.b_bytes()));
  if (!plan.Bp || !tl_a.get(plan.a_bytes())) throw std::bad_alloc();
  std::atomic<i64> next{0};
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (i64 u = t; u < plan.units(); u += nt) plan.pack(u);
#pragma omp barrier
    void* Ap = tl_a.get(plan.a_bytes());  // a thread without one takes no items
    for (i64 i; Ap && (i = next.fetch_add(1, std::memory_order_relaxed)) < plan.items;) plan.item(i, Ap);
  }
  if (plan.ep_after) g.ep.whole(g.M, g.N);
}

}  // namespace

void gemm_bf16(const GemmBf16& g) {
  const Path path = path_in_use();
  if (split_worth(g) && omp_get_max_threads() > 1 && !omp_in_parallel()) team_product(g, path);
  else single(g, path);
}

// With two threads or more: side by side on the team (kernels::run_pair_on_team, parallel.h).
void gemm_bf16_pair(const GemmBf16& p, const GemmBf16& q) {
  const int team = omp_get_max_threads();
  if (team < 2 || omp_in_parallel() || !split_worth(p) || !split_worth(q)) {
    gemm_bf16(p);
    gemm_bf16(q);
    return;
  }
  const bool lp = !no_product(p), lq = !no_product(q);  // no_product has done C = beta C where true
  if (!lp || !lq) {
    if (lp) team_product(p, path_in_use());
    else p.ep.whole(p.M, p.N);
    if (lq) team_product(q, path_in_use());
    else q.ep.whole(q.M, q.N);
    return;
  }
  const Path path = path_in_use();
  Plan plan[2] = {Plan(p, path, team), Plan(q, path, team)};
  const i64 a_bytes = std::max(plan[0].a_bytes(), plan[1].a_bytes());
  auto* Bp = static_cast<u32*>(tl_b.get(plan[0].b_bytes() + plan[1].b_bytes()));
  if (!Bp || !tl_a.get(a_bytes)) throw std::bad_alloc();
  plan[0].Bp = Bp;
  plan[1].Bp = Bp + plan[0].b_bytes() / 4;
  run_pair_on_team(plan, static_cast<double>(p.M * p.N * p.K), static_cast<double>(q.M * q.N * q.K), team,
                   [&] { return tl_a.get(a_bytes); });
  if (plan[0].ep_after) p.ep.whole(p.M, p.N);
  if (plan[1].ep_after) q.ep.whole(q.M, q.N);
}

void gemm_bf16_naive(const GemmBf16& g) {
  auto at = [](const Bf16Operand& X, i64 idx) {
    const float v = X.f ? to_float(to_bf16(X.f[idx])) : to_float(X.h[idx]);
    return std::fabs(v) < FLT_MIN ? 0.0 : static_cast<double>(v);
  };
  for (i64 m = 0; m < g.M; ++m)
    for (i64 n = 0; n < g.N; ++n) {
      double acc = 0;
      for (i64 k = 0; k < g.K; ++k)
        acc += at(g.A, g.ta ? k * g.A.ld + m : m * g.A.ld + k) * at(g.B, g.tb ? n * g.B.ld + k : k * g.B.ld + n);
      float& c = g.C[m * g.ldc + n];
      c = static_cast<float>(g.alpha * acc + (g.beta == 0.0f ? 0.0 : static_cast<double>(g.beta) * c));
    }
}

Path bf16_impl::path_in_use() { return kernels::path_in_use(); }

bool bf16_impl::path_allowed(Path path) {
  switch (path) {
    case Path::emulated: return true;
#ifdef TG_BF16_X86
    case Path::fma: return isa() >= Isa::avx2;
    case Path::dpbf16: return isa() >= Isa::avx512_bf16;
    case Path::amx: return isa() >= Isa::amx_bf16;
#endif
    default: return false;
  }
}

void bf16_impl::gemm_bf16_single(const GemmBf16& g, Path path) {
  if (!path_allowed(path)) throw std::logic_error("gemm_bf16_single: a path this CPU or isa() does not allow");
  single(g, path);
}

}  // namespace tg::kernels
