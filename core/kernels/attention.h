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
// unneeded (gemm_tri, kernels/gemm.h), and masked entries of P and dS are written as 0.
//
// bf16 (float32 only, the products of an autocast scope, tapegrad/autocast.h): every product
// operand (q, k, v, P, dy, dS) is rounded to bfloat16 (nearest, ties to even, kernels/bf16.h) and
// held in a float, so each product of two is exact in float32 and the sums are float32 ones; the
// softmax statistics (m, l, lse, D) and y stay float32. docs/attention.md derives the error bound.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/fastmath.h"
#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"

namespace tg::kernels {

inline constexpr std::int64_t kAttnTile = 64;  // Br = Bc

// The problem: shapes, the logits' factor (1 / sqrt(hs) in a transformer), the mask, and whether
// the products take bf16-rounded operands (T = float only).
struct AttnDims {
  std::int64_t B, Tn, C, H;
  double scale;
  bool causal;
  bool bf16;
  std::int64_t hs() const { return C / H; }
};

// x (rows, cols, leading dimension ld) -> out (rows, cols, leading dimension ldo): each value
// rounded to bf16 and held in T (float). out may be x (with ldo = ld).
template <class T>
void round_bf16_block(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, T* out, std::int64_t ldo) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      out[r * ldo + c] = static_cast<T>(to_float(to_bf16(static_cast<float>(x[r * ld + c]))));
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
  round_bf16_block(x, ld, rows, cols, buf, cols);
  return {buf, cols};
}

// Valid keys of query row i in the key tile starting at c0 of width bc (at least 1 when causal:
// tiles start at multiples of kAttnTile, so c0 <= the tile's first row <= i).
inline std::int64_t attn_valid(const AttnDims& d, std::int64_t i, std::int64_t c0, std::int64_t bc) {
  return d.causal ? std::min(bc, i + 1 - c0) : bc;
}

// ---- forward ----

template <class T>
struct FlashFwdScratch {
  std::vector<T> s, q, k, v, m, alpha;  // s (Br, Bc): S then P; q, k, v: bf16 copies; m, alpha (Br)
  std::vector<double> l;                // (Br)
  explicit FlashFwdScratch(std::int64_t hs)
      : s(kAttnTile * kAttnTile), q(kAttnTile * hs), k(kAttnTile * hs), v(kAttnTile * hs), m(kAttnTile), alpha(kAttnTile),
        l(kAttnTile) {}
};

// One row of one key tile in the online softmax: s (n valid of bc) holds q_i . k_j on entry and
// exp(scale q_i . k_j - m_i) (0 past n) on return; m, l updated, alpha = exp(m_old - m_new).
template <class T>
void online_softmax_row(T* s, std::int64_t n, std::int64_t bc, T sc, T& m, double& l, T& alpha) {
  // The scaled scores are stored (rounded) before the maximum is taken, so that the largest minus
  // the maximum is exactly 0 (kernels/softmax.h's causal_softmax_row says why).
  for (std::int64_t j = 0; j < n; ++j) s[j] *= sc;
  const T mt = row_max(s, n);
  const T mn = mt > m ? mt : m;
  alpha = m == mn ? T(1) : fast_exp(m - mn);  // m = -inf on the first tile: alpha = 0, unused
  l = l * alpha + exp_shifted(s, mn, s, n);
  m = mn;
  for (std::int64_t j = n; j < bc; ++j) s[j] = T(0);
}

// One (batch, head, query tile starting at row r0): y's and lse's rows r0 .. r0 + br.
template <class T>
void flash_forward_tile(const T* qkv, T* y, T* lse, const AttnDims& d, std::int64_t b, std::int64_t h,
                        std::int64_t r0, FlashFwdScratch<T>& w) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C, br = std::min(kAttnTile, Tn - r0);
  const T* head = qkv + b * Tn * ld + h * hs;  // q of row 0; k at + C, v at + 2C
  T* o = y + (b * Tn + r0) * C + h * hs;
  const T sc = static_cast<T>(d.scale);
  const TileOperand<T> q = tile_operand(d.bf16, head + r0 * ld, ld, br, hs, w.q.data());
  const std::int64_t kend = d.causal ? r0 + br : Tn;
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<T>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0);
  for (std::int64_t c0 = 0; c0 < kend; c0 += kAttnTile) {
    const std::int64_t bc = std::min(kAttnTile, kend - c0);
    const bool diag = d.causal && c0 == r0;  // the tile the mask cuts: br = bc there
    const TileOperand<T> k = tile_operand(d.bf16, head + C + c0 * ld, ld, bc, hs, w.k.data());
    const TileOperand<T> v = tile_operand(d.bf16, head + 2 * C + c0 * ld, ld, bc, hs, w.v.data());
    T* s = w.s.data();
    gemm_tri<T>(diag ? Tri::lower_c : Tri::none, false, true, br, bc, hs, T(1), q.p, q.ld, k.p, k.ld, T(0), s,
                kAttnTile);  // S = q k^T
    for (std::int64_t r = 0; r < br; ++r)
      online_softmax_row(s + r * kAttnTile, attn_valid(d, r0 + r, c0, bc), bc, sc, w.m[r], w.l[r], w.alpha[r]);
    if (c0 > 0)
      for (std::int64_t r = 0; r < br; ++r)
        if (w.alpha[r] != T(1))
          for (std::int64_t e = 0; e < hs; ++e) o[r * C + e] *= w.alpha[r];
    if (d.bf16) round_bf16_block(s, kAttnTile, br, bc, s, kAttnTile);
    gemm_tri<T>(diag ? Tri::lower_a : Tri::none, false, false, br, hs, bc, T(1), s, kAttnTile, v.p, v.ld,
                c0 > 0 ? T(1) : T(0), o, C);  // o = o alpha + P v
  }
  T* L = lse + (b * d.H + h) * Tn + r0;
  for (std::int64_t r = 0; r < br; ++r) {
    const T inv = static_cast<T>(1.0 / w.l[r]);
    for (std::int64_t e = 0; e < hs; ++e) o[r * C + e] *= inv;
    L[r] = static_cast<T>(w.m[r] + std::log(w.l[r]));
  }
}

// qkv (B, T, 3C) -> y (B, T, C), lse (B, H, T)
template <class T>
void flash_attention_forward(const T* qkv, T* y, T* lse, const AttnDims& d) {
  assert((!d.bf16 || std::is_same_v<T, float>));
  const std::int64_t hs = d.hs(), tiles = (d.Tn + kAttnTile - 1) / kAttnTile, items = d.B * d.H * tiles;
  if (hs == 0) {  // no channels: y is empty, and each row's softmax over zero scores is uniform
    for (std::int64_t r = 0; r < d.B * d.H * d.Tn; ++r) {
      const std::int64_t i = r % d.Tn;
      lse[r] = static_cast<T>(std::log(static_cast<double>(d.causal ? i + 1 : d.Tn)));
    }
    return;
  }
  parallel_for(items, d.B * d.H * d.Tn * d.Tn * hs, [&](std::int64_t lo, std::int64_t hi) {
    FlashFwdScratch<T> w(hs);
    for (std::int64_t it = lo; it < hi; ++it) {
      const std::int64_t bh = it / tiles;
      flash_forward_tile(qkv, y, lse, d, bh / d.H, bh % d.H, it % tiles * kAttnTile, w);
    }
  });
}

// ---- backward ----

template <class T>
struct FlashBwdScratch {
  std::vector<T> p, pb, dp, D, q, k, v, g;  // p, pb, dp (Br, Bc); D (T); q, k, v, g (T, hs): bf16 copies
  FlashBwdScratch(std::int64_t Tn, std::int64_t hs, bool bf16)
      : p(kAttnTile * kAttnTile), pb(bf16 ? kAttnTile * kAttnTile : 0), dp(kAttnTile * kAttnTile), D(Tn),
        q(bf16 ? Tn * hs : 0), k(q.size()), v(q.size()), g(q.size()) {}
};

// One (query tile r0, key tile c0) pair of one head: the five products and the softmax backward.
// q, k, v, g: the head's operands from row 0 (g: dy); dq, dk, dv: the head's blocks of dqkv from
// row 0 (leading dimension 3C); L: the head's lse, D its row sums.
template <class T>
void flash_backward_pair(TileOperand<T> q, TileOperand<T> k, TileOperand<T> v, TileOperand<T> g, T* dq, T* dk,
                         T* dv, const T* L, const AttnDims& d, std::int64_t r0, std::int64_t c0,
                         FlashBwdScratch<T>& w) {
  const std::int64_t hs = d.hs(), ld = 3 * d.C, br = std::min(kAttnTile, d.Tn - r0), bc = std::min(kAttnTile, d.Tn - c0);
  const bool diag = d.causal && c0 == r0;
  const T sc = static_cast<T>(d.scale);
  const T *qi = q.p + r0 * q.ld, *kj = k.p + c0 * k.ld, *vj = v.p + c0 * v.ld, *gi = g.p + r0 * g.ld;
  T *p = w.p.data(), *dp = w.dp.data(), *pb = d.bf16 ? w.pb.data() : p;
  gemm_tri<T>(diag ? Tri::lower_c : Tri::none, false, true, br, bc, hs, T(1), qi, q.ld, kj, k.ld, T(0), p, kAttnTile);
  for (std::int64_t r = 0; r < br; ++r) {  // P = exp(scale S - lse), 0 where masked
    T* pr = p + r * kAttnTile;
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    for (std::int64_t j = 0; j < n; ++j) pr[j] *= sc;  // rounded as in the forward
    for (std::int64_t j = 0; j < n; ++j) pr[j] = fast_exp(pr[j] - L[r0 + r]);
    for (std::int64_t j = n; j < bc; ++j) pr[j] = T(0);
  }
  if (d.bf16) round_bf16_block(p, kAttnTile, br, bc, pb, kAttnTile);
  gemm_tri<T>(diag ? Tri::upper_a : Tri::none, true, false, bc, hs, br, T(1), pb, kAttnTile, gi, g.ld, T(1),
              dv + c0 * ld, ld);  // dv_j += P^T dy_i
  gemm_tri<T>(diag ? Tri::lower_c : Tri::none, false, true, br, bc, hs, T(1), gi, g.ld, vj, v.ld, T(0), dp,
              kAttnTile);  // dP = dy_i v_j^T
  for (std::int64_t r = 0; r < br; ++r) {  // dS = scale P (dP - D), over dP; 0 where masked
    const T* pr = p + r * kAttnTile;
    T* dr = dp + r * kAttnTile;
    const T Di = w.D[static_cast<std::size_t>(r0 + r)];
    const std::int64_t n = attn_valid(d, r0 + r, c0, bc);
    for (std::int64_t j = 0; j < n; ++j) dr[j] = sc * pr[j] * (dr[j] - Di);
    for (std::int64_t j = n; j < bc; ++j) dr[j] = T(0);
  }
  if (d.bf16) round_bf16_block(dp, kAttnTile, br, bc, dp, kAttnTile);
  gemm_tri<T>(diag ? Tri::lower_a : Tri::none, false, false, br, hs, bc, T(1), dp, kAttnTile, kj, k.ld, T(1),
              dq + r0 * ld, ld);  // dq_i += dS k_j
  gemm_tri<T>(diag ? Tri::upper_a : Tri::none, true, false, bc, hs, br, T(1), dp, kAttnTile, qi, q.ld, T(1),
              dk + c0 * ld, ld);  // dk_j += dS^T q_i
}

// One (batch, head): its blocks of dqkv, key tiles outside, query tiles inside.
template <class T>
void flash_backward_head(const T* qkv, const T* y, const T* lse, const T* dy, T* dqkv, const AttnDims& d,
                         std::int64_t b, std::int64_t h, FlashBwdScratch<T>& w) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C;
  const T* head = qkv + b * Tn * ld + h * hs;
  const T* gy = dy + b * Tn * C + h * hs;
  const T* yy = y + b * Tn * C + h * hs;
  for (std::int64_t i = 0; i < Tn; ++i)  // D_i = dy_i . y_i
    w.D[static_cast<std::size_t>(i)] = static_cast<T>(
        sum16(hs, [&](std::int64_t e) { return static_cast<double>(gy[i * C + e]) * yy[i * C + e]; }));
  const TileOperand<T> q = tile_operand(d.bf16, head, ld, Tn, hs, w.q.data());
  const TileOperand<T> k = tile_operand(d.bf16, head + C, ld, Tn, hs, w.k.data());
  const TileOperand<T> v = tile_operand(d.bf16, head + 2 * C, ld, Tn, hs, w.v.data());
  const TileOperand<T> g = tile_operand(d.bf16, gy, C, Tn, hs, w.g.data());
  T* dq = dqkv + b * Tn * ld + h * hs;
  const T* L = lse + (b * d.H + h) * Tn;
  for (std::int64_t c0 = 0; c0 < Tn; c0 += kAttnTile)
    for (std::int64_t r0 = d.causal ? c0 : 0; r0 < Tn; r0 += kAttnTile)
      flash_backward_pair(q, k, v, g, dq, dq + C, dq + 2 * C, L, d, r0, c0, w);
}

// qkv (B, T, 3C), y (B, T, C), lse (B, H, T), dy (B, T, C) -> dqkv (B, T, 3C)
template <class T>
void flash_attention_backward(const T* qkv, const T* y, const T* lse, const T* dy, T* dqkv, const AttnDims& d) {
  assert((!d.bf16 || std::is_same_v<T, float>));
  // Every element of dqkv belongs to exactly one (b, h) and one of q, k, v: zeroed in one pass,
  // then every product adds into its block (beta = 1).
  fill_zero(dqkv, d.B * d.Tn * 3 * d.C);
  if (d.hs() == 0) return;
  parallel_for(d.B * d.H, d.B * d.H * d.Tn * d.Tn * d.hs(), [&](std::int64_t lo, std::int64_t hi) {
    FlashBwdScratch<T> w(d.Tn, d.hs(), d.bf16);
    for (std::int64_t bh = lo; bh < hi; ++bh) flash_backward_head(qkv, y, lse, dy, dqkv, d, bh / d.H, bh % d.H, w);
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
