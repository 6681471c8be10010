#pragma once
// Fused multi-head self-attention over a packed qkv activation, tiled as FlashAttention (Dao et
// al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
// algorithms 1 and 2, in FlashAttention-2's loop order: queries outside, keys inside, in the
// forward): the (T, T) scores and probabilities exist one (Br, Bc) tile at a time, never whole.
//
// Shapes: B batch, T time (Tn in the code, where T is the element type), C channels, H heads,
// hs = C / H head size, Br = Bc = kAttnTile rows and columns of a tile.
//   qkv  (B, T, 3C)  q, k, v side by side: head h of q is columns [h hs, (h+1) hs) of the first
//                    C, k and v the same blocks of the next two
//   y    (B, T, C)   the heads' outputs, head h in columns [h hs, (h+1) hs); saved for the backward
//   lse  (B, H, T)   per query row, log sum_j exp(s_ij): all the backward needs of the softmax
//   dy   (B, T, C)   gradient of y
//   dqkv (B, T, 3C)  gradient of qkv, laid out as qkv, written (=)
// The products read the head blocks in place through the leading dimension 3C and write y
// through leading dimension C.
//
// Per (batch, head), with s_ij = scale q_i . k_j over the keys row i sees (j <= i when causal):
//   forward, per query tile and then per key tile: m_i = max(m_i, max_j s_ij);
//     l_i = l_i exp(m_old - m_i) + sum_j exp(s_ij - m_i);  o_i = o_i exp(m_old - m_i) + sum_j
//     exp(s_ij - m_i) v_j;  at the end y_i = o_i / l_i and lse_i = m_i + log l_i. Every rescaling
//     multiplies o_i and l_i alike, so y_i = sum_j exp(s_ij - m) v_j / sum_j exp(s_ij - m) for the
//     final m: the softmax, whatever the order of the tiles.
//   backward, with P_ij = exp(s_ij - lse_i) recomputed per tile and D_i = dy_i . y_i
//     (= sum_j P_ij dP_ij, the softmax backward's row sum):
//     dv_j += P^T dy;  dP = dy v^T;  dS = scale P * (dP - D);  dq_i += dS k;  dk_j += dS^T q.
// Work: forward items are (batch, head, query tile), backward items (batch, head) with key tiles
// outside and query tiles inside; each item alone writes its rows of y, lse and dqkv, in a fixed
// order, so the bits do not depend on the number of threads. Causal: key tiles past the query
// tile's diagonal are not visited; the diagonal tile's products skip what the mask makes zero or
// unneeded (tile_product, with gemm_tri's Tri), and masked entries of P and dS are written as 0.
// attention_naive_forward / _backward, at the end, are the reference the tests hold these to.
//
// bf16 (float32 only, the products of an autocast scope, tapegrad/autocast.h): every product
// operand (q, k, v, P, dy, dS) is rounded to bfloat16 (nearest, ties to even, kernels/bf16.h) and
// the sums are float32 ones; the softmax statistics (m, l, lse, D) and y stay float32. Two paths:
// where isa() >= avx512_bf16 the products run on vdpbf16ps, the operands as bf16 pairs in words
// (attention_dpbf16.h, "native" below); elsewhere the rounded operands are held in floats, so each
// product of two is exact in float32, and go through tile_product. docs/attention.md derives the
// error bound, which holds for both.
#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/attention_dpbf16.h"
#include "kernels/bf16.h"
#include "kernels/fastmath.h"
#include "kernels/gemm.h"  // Tri
#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "kernels/transpose.h"

namespace tg::kernels {

inline constexpr std::int64_t kAttnTile = 64;  // Br = Bc
static_assert(kAttnTile % 2 == 0, "tiles start at even rows: a tile's bf16 pairs are its head's (attention_dpbf16.h)");

// The problem: shapes, the logits' factor (1 / sqrt(hs) in a transformer), the mask, and whether
// the products take bf16-rounded operands (T = float only).
struct AttnDims {
  std::int64_t B, Tn, C, H;
  double scale;
  bool causal;
  bool bf16;
  std::int64_t hs() const { return C / H; }
};

// A head's rows are 3C (or C) apart, pages apart at GPT-2's widths, where the hardware's stride
// prefetcher does not follow: without a hint each first touch of a row waits for memory (a
// quarter of the backward's time at GPT-2 small's widths, in its transposes, bf16 copies and row
// sums). The row loops ask for rows this far ahead (prefetch_rows, gemm.h; the transposes, which
// take 8 rows at a time, twice as far); the tiles ask for the next work item's rows (RowsAhead).
inline constexpr std::int64_t kPrefetchAhead = 8;  // rows

// The rows of the work item a thread runs next, asked for into L2 a slice at a time while the
// current item's tiles run: a head's rows are 3C or C floats apart, pages apart at GPT-2's widths,
// so the hardware prefetcher does not follow them, and the first touch of each row would wait for
// memory (asked for all at once, the requests would queue behind each other). Up to eight segments
// of a row, each some values of it: in the backward q, k, v, dy, y and dq, dk, dv of the next head;
// in the forward q, k, v and y of the next query tile (the vdpbf16ps forward, whose items make
// their operands' words first, takes none).
struct RowsAhead {
  struct Segment {
    const char* p;
    std::int64_t ld, bytes;  // row stride and bytes per row
  };
  Segment seg[8] = {};
  int n = 0;
  std::int64_t rows = 0, done = 0;
  template <class X>
  void add(const X* p, std::int64_t ld, std::int64_t cols) {
    assert(n < 8);
    seg[n++] = {reinterpret_cast<const char*>(p), ld * static_cast<std::int64_t>(sizeof(X)),
                cols * static_cast<std::int64_t>(sizeof(X))};
  }
  // Rows [done, r): every line of each segment, the last one too when the segment starts inside a
  // line.
  void upto(std::int64_t r) {
    for (; done < std::min(r, rows); ++done)
      for (int i = 0; i < n; ++i) {
        const char* row = seg[i].p + done * seg[i].ld;
        for (std::int64_t b = 0; b < seg[i].bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
        if (seg[i].bytes > 0) __builtin_prefetch(row + seg[i].bytes - 1, 0, 2);
      }
  }
};

// x (rows, cols, leading dimension ld) -> out (rows, cols, leading dimension ldo): each value
// rounded to bf16 and held in T (float). out may be x (with ldo = ld).
template <class T>
void round_bf16_block(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, T* out, std::int64_t ldo) {
  if constexpr (std::is_same_v<T, float>) {
    // bf16_round_bits then the lower half cleared: the rounded value as a float, in a loop of
    // integer operations that vectorises (the array conversion of kernels/bf16.h would make two
    // passes through a bf16 buffer)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        out[r * ldo + c] = std::bit_cast<float>(bf16_round_bits(std::bit_cast<std::uint32_t>(x[r * ld + c])) & 0xFFFF0000u);
  } else {
    assert(false && "bf16 operands are float32 only");
  }
}

// A tile operand: x itself (leading dimension ld), or its bf16-rounded copy in buf (leading
// dimension cols).
template <class T>
struct TileOperand {
  const T* p;
  std::int64_t ld;
};
template <class T>
TileOperand<T> tile_operand(bool bf16, const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, T* buf) {
  if (!bf16) return {x, ld};
  prefetch_rows(x, ld, 0, kPrefetchAhead, rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    prefetch_rows(x, ld, r + kPrefetchAhead, 1, rows, cols);
    round_bf16_block(x + r * ld, ld, 1, cols, buf + r * cols, cols);
  }
  return {buf, cols};
}

// The same operand from a bf16 copy of x (bf16 only): to_float is exact, so these are the values
// that rounding x gives.
inline TileOperand<float> tile_operand(bool, const bf16* x, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                                       float* buf) {
  for (std::int64_t r = 0; r < rows; ++r) to_float(x + r * ld, buf + r * cols, cols);
  return {buf, cols};
}

// Valid keys of query row i in the key tile starting at c0 of width bc (at least 1 when causal:
// tiles start at multiples of kAttnTile, so c0 <= the tile's first row <= i).
inline std::int64_t attn_valid(const AttnDims& d, std::int64_t i, std::int64_t c0, std::int64_t bc) {
  return d.causal ? std::min(bc, i + 1 - c0) : bc;
}

// ---- tile products ----
// C (M, N) = op(A) B, or C += op(A) B (acc), for the tiles' sizes (M, N, K up to kAttnTile or hs):
// op(A)(i, k) = A[i si + k sk] (si = 1 reads a stored tile transposed), B and C row-major. Blocks
// of R rows by up to NV vectors of C stay in registers over the whole k loop: per k, NV vector
// loads of B and R broadcasts of A feed R NV multiply-adds (6 x 4: 10 loads for 24 with AVX-512),
// so the loop is bound by the multiply-adds, with no packing pass (kernels::gemm packs op(B) for
// each call, a pass as long as a quarter of the multiply-adds at these sizes: docs/attention.md
// has the measurement). The vectors are GCC's vector extension, one register wide.
// tri: what the causal mask lets a diagonal tile skip (gemm.h's Tri, same meanings): lower_c
// computes only columns up to each row block's last row; lower_a (A(i, k) = 0 for k > i) and
// upper_a (A(i, k) = 0 for k < i) shorten each row block's k range.

// The vector width and the vectors per row block follow the build's instruction set (-march;
// native by default): AVX-512's 32 registers hold 6 x 4 accumulators, AVX2's and SSE's 16 hold
// 4 x 2.
#if defined(__AVX512F__)
inline constexpr int kTileVecBytes = 64, kTileMaxVecs = 4, kTileRows = 6;
#elif defined(__AVX__)
inline constexpr int kTileVecBytes = 32, kTileMaxVecs = 2, kTileRows = 4;
#else
inline constexpr int kTileVecBytes = 16, kTileMaxVecs = 2, kTileRows = 4;
#endif
template <class T>
struct TileVec {
  typedef T type __attribute__((vector_size(kTileVecBytes), aligned(sizeof(T))));
};

// Unaligned vector load and store (memcpy of one register: a single instruction once inlined).
template <class V, class T>
[[gnu::always_inline]] inline V vec_load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V, class T>
[[gnu::always_inline]] inline void vec_store(T* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

template <class T>
struct StridedA {
  const T* p;
  std::int64_t si, sk;
};

// Rows [i0, i0 + R) and vectors [n0, n0 + NV W) of C, over k in [k0, k1).
template <class T, int R, int NV>
[[gnu::always_inline]] inline void tile_block(StridedA<T> A, std::int64_t i0, const T* B, std::int64_t ldb,
                                              std::int64_t n0, T* C, std::int64_t ldc, std::int64_t k0,
                                              std::int64_t k1, bool acc) {
  using V = typename TileVec<T>::type;
  constexpr std::int64_t W = sizeof(V) / sizeof(T);
  V c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? vec_load<V>(C + (i0 + r) * ldc + n0 + v * W) : V{};
  const T* a = A.p + i0 * A.si;
  for (std::int64_t k = k0; k < k1; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vec_load<V>(B + k * ldb + n0 + v * W);
    for (int r = 0; r < R; ++r) {
      const T ar = a[r * A.si + k * A.sk];
      for (int v = 0; v < NV; ++v) c[r][v] += ar * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) vec_store(C + (i0 + r) * ldc + n0 + v * W, c[r][v]);
}

// R rows of C: full vectors in groups of kTileMaxVecs, then the remaining vectors, then scalar
// columns.
template <class T, int R>
void tile_rows(StridedA<T> A, std::int64_t i0, const T* B, std::int64_t ldb, std::int64_t N, T* C,
               std::int64_t ldc, std::int64_t k0, std::int64_t k1, bool acc) {
  constexpr std::int64_t W = sizeof(typename TileVec<T>::type) / sizeof(T);
  const std::int64_t nv = N / W * W;
  std::int64_t n0 = 0;
  for (; n0 + kTileMaxVecs * W <= nv; n0 += kTileMaxVecs * W)
    tile_block<T, R, kTileMaxVecs>(A, i0, B, ldb, n0, C, ldc, k0, k1, acc);
  switch ((nv - n0) / W) {
    case 3: tile_block<T, R, 3>(A, i0, B, ldb, n0, C, ldc, k0, k1, acc); break;
    case 2: tile_block<T, R, 2>(A, i0, B, ldb, n0, C, ldc, k0, k1, acc); break;
    case 1: tile_block<T, R, 1>(A, i0, B, ldb, n0, C, ldc, k0, k1, acc); break;
    default: break;
  }
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t n = nv; n < N; ++n) {
      T s = acc ? C[(i0 + r) * ldc + n] : T(0);
      for (std::int64_t k = k0; k < k1; ++k) s += A.p[(i0 + r) * A.si + k * A.sk] * B[k * ldb + n];
      C[(i0 + r) * ldc + n] = s;
    }
}

template <class T>
void tile_product(Tri tri, std::int64_t M, std::int64_t N, std::int64_t K, StridedA<T> A, const T* B, std::int64_t ldb,
                  T* C, std::int64_t ldc, bool acc) {
  for (std::int64_t i0 = 0; i0 < M; i0 += kTileRows) {
    const std::int64_t rows = std::min<std::int64_t>(kTileRows, M - i0), last = i0 + rows;
    const std::int64_t k0 = tri == Tri::upper_a ? std::min(i0, K) : 0;
    const std::int64_t k1 = tri == Tri::lower_a ? std::min(last, K) : K;
    // lower_c: up to the block's last row, rounded up to whole vectors (the extra columns are
    // unspecified, as gemm_tri's), so no row block falls to the scalar column loop
    constexpr std::int64_t W = sizeof(typename TileVec<T>::type) / sizeof(T);
    const std::int64_t n = tri == Tri::lower_c ? std::min((last + W - 1) / W * W, N) : N;
    switch (rows) {
      case 6: tile_rows<T, 6>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
      case 5: tile_rows<T, 5>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
      case 4: tile_rows<T, 4>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
      case 3: tile_rows<T, 3>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
      case 2: tile_rows<T, 2>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
      default: tile_rows<T, 1>(A, i0, B, ldb, n, C, ldc, k0, k1, acc); break;
    }
  }
}

// x (rows, cols, leading dimension ld) -> out (cols, rows, leading dimension ldo), each value
// rounded to bf16 when bf16: k and v tiles transposed for the score products. Whole 8 x 8 blocks
// in registers (transpose8x8), the edges one value at a time.
template <class T>
void transpose_tile(bool bf16, const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, T* out,
                    std::int64_t ldo) {
  prefetch_rows(x, ld, 0, 2 * kPrefetchAhead, rows, cols);
  const std::int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (std::int64_t r = 0; r < r8; r += 8) {
    prefetch_rows(x, ld, r + 2 * kPrefetchAhead, 8, rows, cols);
    for (std::int64_t c = 0; c < c8; c += 8) transpose8x8(x + r * ld + c, ld, out + c * ldo + r, ldo);
    for (std::int64_t i = r; i < r + 8; ++i)
      for (std::int64_t c = c8; c < cols; ++c) out[c * ldo + i] = x[i * ld + c];
  }
  for (std::int64_t i = r8; i < rows; ++i)
    for (std::int64_t c = 0; c < cols; ++c) out[c * ldo + i] = x[i * ld + c];
  if (bf16) round_bf16_block(out, ldo, cols, rows, out, ldo);
}

// ---- forward ----

// One thread's forward buffers: s (Br, Bc): S then P; kt (hs, T rounded up to whole tiles, leading
// dimension kt_ld): k transposed; q, v (Br, hs): bf16-rounded copies (bf16 only); m, alpha, l
// (Br): the rows' running statistics. With vdpbf16ps (native), the products' operands as words
// (attention_dpbf16.h) in place of kt, q and v: qw (Br, ceil(hs / 2)) and pw (Br, Bc / 2) the query
// tile's q and P along their rows; kw per key tile (ceil(hs / 2), Bc) its k rows transposed, and vw
// (ceil(T / 2), hs) v down its columns. kt, kw and vw hold the whole of head (batch, head) number
// `bh` as far as key `keys`: a thread's items run a head's query tiles in turn, and each reuses the
// key tiles the ones before it made.
template <class T>
struct FlashFwdScratch {
  std::vector<T> s, kt, q, v, m, alpha;
  std::vector<double> l;
  std::vector<std::uint32_t> qw, pw, kw, vw;
  std::int64_t bh = -1, keys = 0;
  // kt's leading dimension: T rounded up to whole tiles, plus one 64-byte line, so that the rows of
  // k^T a score product reads (hs of them, kt_ld apart) fall in different sets of the L1 (a
  // power-of-two stride, as T = 256 or 1024 gives, puts them all in a few sets, more lines than
  // a set has ways).
  std::int64_t kt_ld;
  static std::int64_t kt_stride(std::int64_t Tn) {
    return (Tn + kAttnTile - 1) / kAttnTile * kAttnTile + 64 / static_cast<std::int64_t>(sizeof(T));
  }
  FlashFwdScratch(std::int64_t Tn, std::int64_t hs, bool bf16, bool nat)
      : s(kAttnTile * kAttnTile), kt(nat ? 0 : hs * kt_stride(Tn)),
        q(bf16 && !nat ? kAttnTile * hs : 0),
        v(q.size()), m(kAttnTile), alpha(kAttnTile), l(kAttnTile), qw(nat ? kAttnTile * ((hs + 1) / 2) : 0),
        pw(nat ? kAttnTile * kAttnTile / 2 : 0),
        kw(nat ? (Tn + kAttnTile - 1) / kAttnTile * kAttnTile * ((hs + 1) / 2) : 0), vw(nat ? (Tn + 1) / 2 * hs : 0),
        kt_ld(kt_stride(Tn)) {}
};

// Native: makes w.kw's and w.vw's words of head (b, h) for the keys [0, kend), reusing what the
// thread's previous item made for the same head. Q: float, or bf16 (qkv's bf16 copy).
template <class Q>
void key_words(const Q* head, const AttnDims& d, std::int64_t bh, std::int64_t kend, FlashFwdScratch<float>& w) {
  const std::int64_t C = d.C, hs = d.hs(), ld = 3 * C, hp = (hs + 1) / 2;
  if (w.bh != bh) w.bh = bh, w.keys = 0;
  for (; w.keys < kend; w.keys += kAttnTile) {  // whole tiles: keys is a multiple of kAttnTile
    const std::int64_t c0 = w.keys, bc = std::min(kAttnTile, d.Tn - c0);
    words_along_rows_t(head + C + c0 * ld, ld, bc, hs, w.kw.data() + c0 * hp, kAttnTile);
    words_down_cols(head + 2 * C + c0 * ld, ld, bc, hs, w.vw.data() + c0 / 2 * hs, hs);
  }
}

// One key tile's step of the online softmax over the query tile's rows: s holds the scores q_i .
// k_j (Br, Bc) on entry and P_ij = exp(scale q_i . k_j - m_i) (0 where masked) on return; each
// row's m, l and alpha = exp(m_old - m_new) are updated, and o's rows (leading dimension C) take
// the rescaling alpha. In passes over the tile's rows rather than row by row, so that each loop
// vectorises: the scaling and the maxima, then the rows' alphas (exponentials across rows), then
// the exponentials and their sums. The scaled scores are stored (rounded) before the maximum is
// taken, so that the largest minus the maximum is exactly 0 (kernels/softmax.h's
// causal_softmax_row says why). On the first tile m = -inf, so alpha = 0, and o (not yet
// written) is not rescaled.
template <class T>
void softmax_step(T* s, T* o, const AttnDims& d, std::int64_t r0, std::int64_t c0, std::int64_t br, std::int64_t bc,
                  FlashFwdScratch<T>& w) {
  const T sc = static_cast<T>(d.scale);
  T mn[kAttnTile];  // the rows' new maxima
  for (std::int64_t r = 0; r < br; ++r) {
    T* sr = s + r * kAttnTile;
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    for (std::int64_t j = 0; j < n; ++j) sr[j] *= sc;
    const T mt = row_max(sr, n);
    mn[r] = mt > w.m[r] ? mt : w.m[r];
  }
  for (std::int64_t r = 0; r < br; ++r) w.alpha[r] = w.m[r] == mn[r] ? T(1) : fast_exp(w.m[r] - mn[r]);
  for (std::int64_t r = 0; r < br; ++r) {
    T* sr = s + r * kAttnTile;
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    w.l[r] = w.l[r] * w.alpha[r] + exp_shifted(sr, mn[r], sr, n);
    w.m[r] = mn[r];
    for (std::int64_t j = n; j < bc; ++j) sr[j] = T(0);
  }
  if (c0 > 0)
    for (std::int64_t r = 0; r < br; ++r)
      if (w.alpha[r] != T(1))
        for (std::int64_t e = 0; e < d.hs(); ++e) o[r * d.C + e] *= w.alpha[r];
}

// The query tile's end: y_i = o_i / l_i and lse_i = m_i + log l_i.
template <class T>
void finish_rows(T* o, T* lse, const AttnDims& d, std::int64_t b, std::int64_t h, std::int64_t r0, std::int64_t br,
                 FlashFwdScratch<T>& w) {
  T* L = lse + (b * d.H + h) * d.Tn + r0;
  for (std::int64_t r = 0; r < br; ++r) {
    const T inv = static_cast<T>(1.0 / w.l[r]);
    for (std::int64_t e = 0; e < d.hs(); ++e) o[r * d.C + e] *= inv;
    L[r] = static_cast<T>(w.m[r] + std::log(w.l[r]));
  }
}

// One (batch, head, query tile starting at row r0): y's and lse's rows r0 .. r0 + br.
template <class T>
void flash_forward_tile(const T* qkv, T* y, T* lse, const AttnDims& d, std::int64_t b, std::int64_t h,
                        std::int64_t r0, FlashFwdScratch<T>& w, std::int64_t next = -1) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C, br = std::min(kAttnTile, Tn - r0);
  const T* head = qkv + b * Tn * ld + h * hs;  // q of row 0; k at + C, v at + 2C
  T* o = y + (b * Tn + r0) * C + h * hs;
  // The next item's query tile: its rows of q, k, v (the keys a causal tile adds) and y.
  RowsAhead ahead;
  if (next >= 0) {
    const std::int64_t tiles = (Tn + kAttnTile - 1) / kAttnTile, nbh = next / tiles, nr0 = next % tiles * kAttnTile;
    const T* nrow = qkv + (nbh / d.H * Tn + nr0) * ld + nbh % d.H * hs;
    for (int part = 0; part < 3; ++part) ahead.add(nrow + part * C, ld, hs);
    ahead.add(y + (nbh / d.H * Tn + nr0) * C + nbh % d.H * hs, C, hs);
    ahead.rows = std::min(kAttnTile, Tn - nr0);
  }
  const TileOperand<T> q = tile_operand(d.bf16, head + r0 * ld, ld, br, hs, w.q.data());
  const std::int64_t kend = d.causal ? r0 + br : Tn;
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<T>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0);
  if (w.bh != b * d.H + h) w.bh = b * d.H + h, w.keys = 0;
  for (; w.keys < kend; w.keys += kAttnTile)  // k transposed, each key tile once per head and thread
    transpose_tile(d.bf16, head + C + w.keys * ld, ld, std::min(kAttnTile, Tn - w.keys), hs, w.kt.data() + w.keys,
                   w.kt_ld);
  const std::int64_t key_tiles = (kend + kAttnTile - 1) / kAttnTile;
  for (std::int64_t c0 = 0; c0 < kend; c0 += kAttnTile) {
    const std::int64_t bc = std::min(kAttnTile, kend - c0);
    const bool diag = d.causal && c0 == r0;  // the tile the mask cuts: br = bc there
    ahead.upto((c0 / kAttnTile + 1) * ahead.rows / key_tiles);
    T* s = w.s.data();
    tile_product<T>(diag ? Tri::lower_c : Tri::none, br, bc, hs, {q.p, q.ld, 1}, w.kt.data() + c0, w.kt_ld, s,
                    kAttnTile, false);  // S = q k^T
    softmax_step(s, o, d, r0, c0, br, bc, w);
    const TileOperand<T> v = tile_operand(d.bf16, head + 2 * C + c0 * ld, ld, bc, hs, w.v.data());
    if (d.bf16) round_bf16_block(s, kAttnTile, br, bc, s, kAttnTile);
    tile_product<T>(diag ? Tri::lower_a : Tri::none, br, hs, bc, {s, kAttnTile, 1}, v.p, v.ld, o, C,
                    c0 > 0);  // o = o alpha + P v
  }
  finish_rows(o, lse, d, b, h, r0, br, w);
}

// flash_forward_tile on vdpbf16ps (float32, native): the same two products and softmax, the
// operands as words. qkv is float, or its bf16 copy.
template <class Q>
void flash_forward_tile_dpbf16(const Q* qkv, float* y, float* lse, const AttnDims& d, std::int64_t b, std::int64_t h,
                               std::int64_t r0, FlashFwdScratch<float>& w) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), hp = (hs + 1) / 2, ld = 3 * C, br = std::min(kAttnTile, Tn - r0);
  const Q* head = qkv + b * Tn * ld + h * hs;  // q of row 0; k at + C, v at + 2C
  float* o = y + (b * Tn + r0) * C + h * hs;
  const std::int64_t kend = d.causal ? r0 + br : Tn;
  words_along_rows(head + r0 * ld, ld, br, hs, w.qw.data(), hp);
  key_words(head, d, b * d.H + h, kend, w);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0);
  for (std::int64_t c0 = 0; c0 < kend; c0 += kAttnTile) {
    const std::int64_t bc = std::min(kAttnTile, kend - c0);
    const bool diag = d.causal && c0 == r0;
    float* s = w.s.data();
    tile_product_dpbf16(diag ? Tri::lower_c : Tri::none, br, bc, hs, w.qw.data(), hp, 1, w.kw.data() + c0 * hp,
                        kAttnTile, s, kAttnTile, false);  // S = q k^T
    softmax_step(s, o, d, r0, c0, br, bc, w);
    words_along_rows(s, kAttnTile, br, bc, w.pw.data(), kAttnTile / 2);
    tile_product_dpbf16(diag ? Tri::lower_a : Tri::none, br, hs, bc, w.pw.data(), kAttnTile / 2, 1,
                        w.vw.data() + c0 / 2 * hs, hs, o, C, c0 > 0);  // o = o alpha + P v
  }
  finish_rows(o, lse, d, b, h, r0, br, w);
}

// qkv (B, T, 3C) -> y (B, T, C), lse (B, H, T). With d.bf16 on vdpbf16ps (attention_dpbf16()),
// qkv may be its bf16 copy (what an autocast scope's op keeps for the backward): the words are
// the same bits, without rounding qkv a second time.
template <class T, class Q>
void flash_attention_forward(const Q* qkv, T* y, T* lse, const AttnDims& d) {
  assert((!d.bf16 || std::is_same_v<T, float>));
  static_assert(std::is_same_v<Q, T> || std::is_same_v<Q, bf16>, "qkv is T or its bf16 copy");
  const bool native = d.bf16 && attention_dpbf16();
  if constexpr (!std::is_same_v<Q, T>)  // only the words read a bf16 copy: no tile would run
    if (!native) throw std::logic_error("flash_attention_forward: a bf16 qkv needs bf16 products on vdpbf16ps");
  const std::int64_t hs = d.hs(), tiles = (d.Tn + kAttnTile - 1) / kAttnTile, items = d.B * d.H * tiles;
  if (hs == 0) {  // no channels: y is empty, and each row's softmax over zero scores is uniform
    for (std::int64_t r = 0; r < d.B * d.H * d.Tn; ++r) {
      const std::int64_t i = r % d.Tn;
      lse[r] = static_cast<T>(std::log(static_cast<double>(d.causal ? i + 1 : d.Tn)));
    }
    return;
  }
  parallel_for(items, d.B * d.H * d.Tn * d.Tn * hs, [&](std::int64_t lo, std::int64_t hi) {
    FlashFwdScratch<T> w(d.Tn, hs, d.bf16, native);
    for (std::int64_t it = lo; it < hi; ++it) {
      const std::int64_t bh = it / tiles, b = bh / d.H, h = bh % d.H, r0 = it % tiles * kAttnTile;
      if constexpr (std::is_same_v<T, float>)
        if (native) {
          flash_forward_tile_dpbf16(qkv, y, lse, d, b, h, r0, w);
          continue;
        }
      if constexpr (std::is_same_v<Q, T>) flash_forward_tile(qkv, y, lse, d, b, h, r0, w, it + 1 < hi ? it + 1 : -1);
    }
  });
}

// ---- backward ----

// One thread's backward buffers: p, pb, dp (Br, Bc): P, its bf16-rounded copy (bf16 only), dP then
// dS; kt, vt (hs, Bc): the key tile's k and v transposed; D (T): the rows' dy . y; q, k, v, g
// (T, hs): the head's bf16-rounded operands (bf16 only).
// With vdpbf16ps (native), the operands as words (attention_dpbf16.h) in place of pb, kt, vt, q, k,
// v and g: qr, gr (T, ceil(hs / 2)) q's and dY's rows; qc, kc, gc (ceil(T / 2), hs) q, k and dY
// down their columns; kw, vw (ceil(hs / 2), Bc) the key tile's k and v rows transposed; pc, dsc
// (Br / 2, Bc) P and dS down their columns, sr (Br, Bc / 2) dS along its rows.
template <class T>
struct FlashBwdScratch {
  bool native;
  std::vector<T> p, pb, dp, kt, vt, D, q, k, v, g;
  std::vector<std::uint32_t> qr, gr, qc, kc, gc, kw, vw, pc, dsc, sr;
  FlashBwdScratch(std::int64_t Tn, std::int64_t hs, bool bf16, bool nat)
      : native(nat), p(kAttnTile * kAttnTile), pb(bf16 && !nat ? kAttnTile * kAttnTile : 0), dp(kAttnTile * kAttnTile),
        kt(nat ? 0 : hs * kAttnTile), vt(kt.size()), D(Tn), q(bf16 && !nat ? Tn * hs : 0), k(q.size()), v(q.size()),
        g(q.size()), qr(nat ? Tn * ((hs + 1) / 2) : 0), gr(qr.size()), qc(nat ? (Tn + 1) / 2 * hs : 0),
        kc(qc.size()), gc(qc.size()), kw(nat ? (hs + 1) / 2 * kAttnTile : 0), vw(kw.size()),
        pc(nat ? kAttnTile * kAttnTile / 2 : 0), dsc(pc.size()), sr(pc.size()) {}
};

// P = exp(scale S - lse) over the tile's S in p (0 where masked), rounded as in the forward.
template <class T>
void probabilities_tile(T* p, const T* L, const AttnDims& d, std::int64_t r0, std::int64_t c0, std::int64_t br,
                        std::int64_t bc) {
  const T sc = static_cast<T>(d.scale);
  for (std::int64_t r = 0; r < br; ++r) {
    T* pr = p + r * kAttnTile;
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    for (std::int64_t j = 0; j < n; ++j) pr[j] *= sc;  // rounded as in the forward
    for (std::int64_t j = 0; j < n; ++j) pr[j] = fast_exp(pr[j] - L[r0 + r]);
    for (std::int64_t j = n; j < bc; ++j) pr[j] = T(0);
  }
}

// dS = scale P (dP - D) over the tile's dP in dp (0 where masked).
template <class T>
void score_grads_tile(const T* p, T* dp, const T* D, const AttnDims& d, std::int64_t r0, std::int64_t c0,
                      std::int64_t br, std::int64_t bc) {
  const T sc = static_cast<T>(d.scale);
  for (std::int64_t r = 0; r < br; ++r) {
    const T* pr = p + r * kAttnTile;
    T* dr = dp + r * kAttnTile;
    const T Di = D[r0 + r];
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    for (std::int64_t j = 0; j < n; ++j) dr[j] = sc * pr[j] * (dr[j] - Di);
    for (std::int64_t j = n; j < bc; ++j) dr[j] = T(0);
  }
}

// One (query tile r0, key tile c0) pair of one head: the five products and the softmax backward.
// q, k, g: the head's operands from row 0 (g: dy), w.kt and w.vt the key tile's k and v
// transposed; dq, dk, dv: the head's blocks of dqkv from row 0 (leading dimension 3C); L: the
// head's lse, w.D its row sums.
template <class T>
void flash_backward_pair(TileOperand<T> q, TileOperand<T> k, TileOperand<T> g, T* dq, T* dk,
                         T* dv, const T* L, const AttnDims& d, std::int64_t r0, std::int64_t c0,
                         FlashBwdScratch<T>& w) {
  const std::int64_t hs = d.hs(), ld = 3 * d.C, br = std::min(kAttnTile, d.Tn - r0), bc = std::min(kAttnTile, d.Tn - c0);
  const bool diag = d.causal && c0 == r0;
  // Each block of dqkv is written (=) by its first product and added to by the rest: dq_i first
  // at key tile 0, dk_j and dv_j at their key tile's first query tile.
  const bool first_i = r0 == (d.causal ? c0 : 0);
  const T *qi = q.p + r0 * q.ld, *kj = k.p + c0 * k.ld, *gi = g.p + r0 * g.ld;
  T *p = w.p.data(), *dp = w.dp.data(), *pb = d.bf16 ? w.pb.data() : p;
  tile_product<T>(diag ? Tri::lower_c : Tri::none, br, bc, hs, {qi, q.ld, 1}, w.kt.data(), kAttnTile, p, kAttnTile,
                  false);  // S = q_i k_j^T
  probabilities_tile(p, L, d, r0, c0, br, bc);
  if (d.bf16) round_bf16_block(p, kAttnTile, br, bc, pb, kAttnTile);
  tile_product<T>(diag ? Tri::upper_a : Tri::none, bc, hs, br, {pb, 1, kAttnTile}, gi, g.ld, dv + c0 * ld, ld,
                  !first_i);  // dv_j (+)= P^T dy_i
  tile_product<T>(diag ? Tri::lower_c : Tri::none, br, bc, hs, {gi, g.ld, 1}, w.vt.data(), kAttnTile, dp, kAttnTile,
                  false);  // dP = dy_i v_j^T
  score_grads_tile(p, dp, w.D.data(), d, r0, c0, br, bc);
  if (d.bf16) round_bf16_block(dp, kAttnTile, br, bc, dp, kAttnTile);
  tile_product<T>(diag ? Tri::lower_a : Tri::none, br, hs, bc, {dp, kAttnTile, 1}, kj, k.ld, dq + r0 * ld, ld,
                  c0 > 0);  // dq_i (+)= dS k_j
  tile_product<T>(diag ? Tri::upper_a : Tri::none, bc, hs, br, {dp, 1, kAttnTile}, qi, q.ld, dk + c0 * ld, ld,
                  !first_i);  // dk_j (+)= dS^T q_i
}

// flash_backward_pair on vdpbf16ps (float32, native): the same five products and softmax
// backward, the operands as words. w.qr, gr, qc, kc, gc hold the head's words, w.kw and w.vw the
// key tile's; tiles start at even rows, so a tile's pairs are the head's pairs from its first row.
inline void flash_backward_pair_dpbf16(float* dq, float* dk, float* dv, const float* L, const AttnDims& d,
                                       std::int64_t r0, std::int64_t c0, FlashBwdScratch<float>& w) {
  const std::int64_t hs = d.hs(), hp = (hs + 1) / 2, ld = 3 * d.C, br = std::min(kAttnTile, d.Tn - r0),
                     bc = std::min(kAttnTile, d.Tn - c0);
  const bool diag = d.causal && c0 == r0, first_i = r0 == (d.causal ? c0 : 0);  // as flash_backward_pair
  float *p = w.p.data(), *dp = w.dp.data();
  const std::uint32_t *qc = w.qc.data() + r0 / 2 * hs, *gc = w.gc.data() + r0 / 2 * hs, *kc = w.kc.data() + c0 / 2 * hs;
  tile_product_dpbf16(diag ? Tri::lower_c : Tri::none, br, bc, hs, w.qr.data() + r0 * hp, hp, 1, w.kw.data(),
                      kAttnTile, p, kAttnTile, false);  // S = q_i k_j^T
  probabilities_tile(p, L, d, r0, c0, br, bc);
  words_down_cols(p, kAttnTile, br, bc, w.pc.data(), kAttnTile);
  tile_product_dpbf16(diag ? Tri::upper_a : Tri::none, bc, hs, br, w.pc.data(), 1, kAttnTile, gc, hs, dv + c0 * ld,
                      ld, !first_i);  // dv_j (+)= P^T dy_i
  tile_product_dpbf16(diag ? Tri::lower_c : Tri::none, br, bc, hs, w.gr.data() + r0 * hp, hp, 1, w.vw.data(),
                      kAttnTile, dp, kAttnTile, false);  // dP = dy_i v_j^T
  score_grads_tile(p, dp, w.D.data(), d, r0, c0, br, bc);
  words_along_rows(dp, kAttnTile, br, bc, w.sr.data(), kAttnTile / 2);
  // sr's rows are dS's bf16 values in order (its words along rows): dS^T's words come from them,
  // without rounding dS again.
  words_down_cols(reinterpret_cast<const bf16*>(w.sr.data()), kAttnTile, br, bc, w.dsc.data(), kAttnTile);
  tile_product_dpbf16(diag ? Tri::lower_a : Tri::none, br, hs, bc, w.sr.data(), kAttnTile / 2, 1, kc, hs,
                      dq + r0 * ld, ld, c0 > 0);  // dq_i (+)= dS k_j
  tile_product_dpbf16(diag ? Tri::upper_a : Tri::none, bc, hs, br, w.dsc.data(), 1, kAttnTile, qc, hs, dk + c0 * ld,
                      ld, !first_i);  // dk_j (+)= dS^T q_i
}

// One (batch, head): its blocks of dqkv, key tiles outside, query tiles inside. qkv and y are T,
// or (bf16 only) their bf16 copies.
template <class T, class Q, class Y>
void flash_backward_head(const Q* qkv, const Y* y, const T* lse, const T* dy, T* dqkv, const AttnDims& d,
                         std::int64_t b, std::int64_t h, FlashBwdScratch<T>& w, std::int64_t next_bh = -1) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C;
  // The next head's rows, spread over this head's tile pairs (ahead.upto before each pair).
  RowsAhead ahead;
  const std::int64_t tiles = (Tn + kAttnTile - 1) / kAttnTile;
  const std::int64_t pairs = d.causal ? tiles * (tiles + 1) / 2 : tiles * tiles;
  std::int64_t pair = 0;
  if (next_bh >= 0) {
    const std::int64_t nb = next_bh / d.H, nh = next_bh % d.H;
    for (int part = 0; part < 3; ++part) {
      ahead.add(qkv + nb * Tn * ld + part * C + nh * hs, ld, hs);
      ahead.add(dqkv + nb * Tn * ld + part * C + nh * hs, ld, hs);
    }
    ahead.add(dy + nb * Tn * C + nh * hs, C, hs);
    ahead.add(y + nb * Tn * C + nh * hs, C, hs);
    ahead.rows = Tn;
  }
  auto next_pair = [&] { ahead.upto(++pair * Tn / pairs); };
  const Q* head = qkv + b * Tn * ld + h * hs;
  const T* gy = dy + b * Tn * C + h * hs;
  const Y* yy = y + b * Tn * C + h * hs;
  for (std::int64_t i = 0; i < Tn; ++i) {  // D_i = dy_i . y_i
    prefetch_rows(gy, C, i + kPrefetchAhead, 1, Tn, hs);
    prefetch_rows(yy, C, i + kPrefetchAhead, 1, Tn, hs);
    w.D[static_cast<std::size_t>(i)] = static_cast<T>(
        sum16(hs, [&](std::int64_t e) { return static_cast<double>(gy[i * C + e]) * widen(yy[i * C + e]); }));
  }
  T* dq = dqkv + b * Tn * ld + h * hs;
  const T* L = lse + (b * d.H + h) * Tn;
  if constexpr (std::is_same_v<T, float>)
    if (w.native) {  // on vdpbf16ps: the head's words, then each key tile's k and v rows transposed
      const std::int64_t hp = (hs + 1) / 2;
      words_along_rows(head, ld, Tn, hs, w.qr.data(), hp);
      words_along_rows(gy, C, Tn, hs, w.gr.data(), hp);
      words_down_cols(head, ld, Tn, hs, w.qc.data(), hs);
      words_down_cols(head + C, ld, Tn, hs, w.kc.data(), hs);
      words_down_cols(gy, C, Tn, hs, w.gc.data(), hs);
      for (std::int64_t c0 = 0; c0 < Tn; c0 += kAttnTile) {
        const std::int64_t bc = std::min(kAttnTile, Tn - c0);
        words_along_rows_t(head + C + c0 * ld, ld, bc, hs, w.kw.data(), kAttnTile);
        words_along_rows_t(head + 2 * C + c0 * ld, ld, bc, hs, w.vw.data(), kAttnTile);
        for (std::int64_t r0 = d.causal ? c0 : 0; r0 < Tn; r0 += kAttnTile) {
          next_pair();
          flash_backward_pair_dpbf16(dq, dq + C, dq + 2 * C, L, d, r0, c0, w);
        }
      }
      return;
    }
  const TileOperand<T> q = tile_operand(d.bf16, head, ld, Tn, hs, w.q.data());
  const TileOperand<T> k = tile_operand(d.bf16, head + C, ld, Tn, hs, w.k.data());
  const TileOperand<T> v = tile_operand(d.bf16, head + 2 * C, ld, Tn, hs, w.v.data());
  const TileOperand<T> g = tile_operand(d.bf16, gy, C, Tn, hs, w.g.data());
  for (std::int64_t c0 = 0; c0 < Tn; c0 += kAttnTile) {
    const std::int64_t bc = std::min(kAttnTile, Tn - c0);
    transpose_tile(false, k.p + c0 * k.ld, k.ld, bc, hs, w.kt.data(), kAttnTile);
    transpose_tile(false, v.p + c0 * v.ld, v.ld, bc, hs, w.vt.data(), kAttnTile);
    for (std::int64_t r0 = d.causal ? c0 : 0; r0 < Tn; r0 += kAttnTile) {
      next_pair();
      flash_backward_pair(q, k, g, dq, dq + C, dq + 2 * C, L, d, r0, c0, w);
    }
  }
}

// qkv (B, T, 3C), y (B, T, C), lse (B, H, T), dy (B, T, C) -> dqkv (B, T, 3C). With d.bf16, qkv
// may be the bf16 copy of the forward's (what an autocast scope's op keeps: half the memory, and
// the same bits, since the products round their operands to bf16 anyway), and y its bf16 copy
// too, which then gives D_i = dy_i . y_i from y rounded to bf16 (docs/attention.md's bound).
template <class T, class Q, class Y>
void flash_attention_backward(const Q* qkv, const Y* y, const T* lse, const T* dy, T* dqkv, const AttnDims& d) {
  assert((!d.bf16 || std::is_same_v<T, float>));
  assert((std::is_same_v<Q, T> || (d.bf16 && std::is_same_v<Q, bf16>)));
  assert((std::is_same_v<Y, T> || (d.bf16 && std::is_same_v<Y, bf16>)));
  // Every element of dqkv belongs to exactly one (b, h) and one of q, k, v, whose products write
  // it (flash_backward_pair); with hs = 0, dqkv is empty.
  if (d.hs() == 0) return;
  const bool native = d.bf16 && attention_dpbf16();
  parallel_for(d.B * d.H, d.B * d.H * d.Tn * d.Tn * d.hs(), [&](std::int64_t lo, std::int64_t hi) {
    FlashBwdScratch<T> w(d.Tn, d.hs(), d.bf16, native);
    for (std::int64_t bh = lo; bh < hi; ++bh)
      flash_backward_head(qkv, y, lse, dy, dqkv, d, bh / d.H, bh % d.H, w, bh + 1 < hi ? bh + 1 : -1);
  });
}

// ---- the naive reference: whole rows of scores, sums in double ----

// qkv (B, T, 3C) -> y (B, T, C), lse (B, H, T); d.bf16 is ignored (exact operands).
template <class T>
void attention_naive_forward(const T* qkv, T* y, T* lse, const AttnDims& d) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C;
  std::vector<double> z(static_cast<std::size_t>(Tn));
  for (std::int64_t b = 0; b < d.B; ++b)
    for (std::int64_t h = 0; h < d.H; ++h)
      for (std::int64_t i = 0; i < Tn; ++i) {
        const T* qi = qkv + (b * Tn + i) * ld + h * hs;
        const std::int64_t n = d.causal ? i + 1 : Tn;
        double m = -std::numeric_limits<double>::infinity(), l = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          const T* kj = qkv + (b * Tn + j) * ld + C + h * hs;
          double s = 0;
          for (std::int64_t e = 0; e < hs; ++e) s += static_cast<double>(qi[e]) * kj[e];
          z[static_cast<std::size_t>(j)] = s * d.scale;
          m = std::max(m, s * d.scale);
        }
        for (std::int64_t j = 0; j < n; ++j) l += std::exp(z[static_cast<std::size_t>(j)] - m);
        for (std::int64_t e = 0; e < hs; ++e) {
          double acc = 0;
          for (std::int64_t j = 0; j < n; ++j)
            acc += std::exp(z[static_cast<std::size_t>(j)] - m) * qkv[(b * Tn + j) * ld + 2 * C + h * hs + e];
          y[(b * Tn + i) * C + h * hs + e] = static_cast<T>(acc / l);
        }
        lse[(b * d.H + h) * Tn + i] = static_cast<T>(m + std::log(l));
      }
}

// qkv (B, T, 3C), dy (B, T, C) -> dqkv (B, T, 3C), from the probabilities of each whole row.
template <class T>
void attention_naive_backward(const T* qkv, const T* dy, T* dqkv, const AttnDims& d) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C;
  std::vector<double> g(static_cast<std::size_t>(d.B * Tn * ld), 0.0);
  auto x = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t e) {
    return static_cast<double>(qkv[(b * Tn + t) * ld + part * C + h * hs + e]);
  };
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t e) -> double& {
    return g[static_cast<std::size_t>((b * Tn + t) * ld + part * C + h * hs + e)];
  };
  std::vector<double> p(static_cast<std::size_t>(Tn)), dp(p.size());
  for (std::int64_t b = 0; b < d.B; ++b)
    for (std::int64_t h = 0; h < d.H; ++h)
      for (std::int64_t i = 0; i < Tn; ++i) {
        const std::int64_t n = d.causal ? i + 1 : Tn;
        double m = -std::numeric_limits<double>::infinity(), l = 0, D = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (std::int64_t e = 0; e < hs; ++e) s += x(b, i, 0, h, e) * x(b, j, 1, h, e);
          p[static_cast<std::size_t>(j)] = s * d.scale;
          m = std::max(m, s * d.scale);
        }
        for (std::int64_t j = 0; j < n; ++j) l += (p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - m));
        for (std::int64_t j = 0; j < n; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          p[jj] /= l;
          double s = 0;
          for (std::int64_t e = 0; e < hs; ++e) s += static_cast<double>(dy[(b * Tn + i) * C + h * hs + e]) * x(b, j, 2, h, e);
          dp[jj] = s;
          D += p[jj] * s;
        }
        for (std::int64_t j = 0; j < n; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          const double ds = d.scale * p[jj] * (dp[jj] - D);
          for (std::int64_t e = 0; e < hs; ++e) {
            at(b, j, 2, h, e) += p[jj] * static_cast<double>(dy[(b * Tn + i) * C + h * hs + e]);
            at(b, i, 0, h, e) += ds * x(b, j, 1, h, e);
            at(b, j, 1, h, e) += ds * x(b, i, 0, h, e);
          }
        }
      }
  for (std::size_t r = 0; r < g.size(); ++r) dqkv[r] = static_cast<T>(g[r]);
}

}  // namespace tg::kernels
