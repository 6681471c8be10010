#pragma once
// Fused multi-head causal self-attention over a packed qkv activation, without copies.
//
// Shapes: B batch, T time (Tn in the code, where T is the element type), C channels, H heads,
// hs = C / H head size.
//   qkv  (B, T, 3C)    q, k, v side by side: head h of q is columns [h hs, (h+1) hs) of the first
//                      C, k and v the same blocks of the next two
//   y    (B, T, C)     the heads' outputs, head h in columns [h hs, (h+1) hs)
//   P    (B, H, T, T)  the causal softmax probabilities, saved for the backward; 0 above the
//                      diagonal. Null: the forward keeps each head's in a (T, T) scratch per
//                      thread and the backward recomputes them the same way (same bits), instead
//                      of B H T^2 kept from the forward to the backward
//   dy   (B, T, C)     gradient of y
//   dqkv (B, T, 3C)    gradient of qkv, laid out as qkv, written (=)
//   scale              the logits' factor, 1 / sqrt(hs) in a transformer
// The products read the head blocks in place through the leading dimension 3C and write y
// through leading dimension C, so the split, permute and merge of the composite version cost
// nothing. Per (batch, head):
//   S = q k^T * scale (T, T);  P = causal softmax(S);  y = P v.
// Backward, with dY the head's block of dy:
//   dP = dY v^T;  dv = P^T dY;  dS = scale * P * (dP - rowsum(dP * P));  dq = dS k;  dk = dS^T q.
// (batch, head) pairs write disjoint blocks, so they run in parallel; each gemm then runs on one
// thread, which suits these small products. P and dS are zero above the diagonal and the softmax
// reads only S's and dP's lower triangle, so every product skips the tiles a triangle makes zero
// or unneeded (gemm_tri, kernels/gemm.h): about 40% of the multiply-adds at T = 64.
// The causal softmax pair itself lives in kernels/softmax.h.
#include <cstdint>
#include <vector>

#include "kernels/gemm.h"
#include "kernels/parallel.h"
#include "kernels/softmax.h"

namespace tg::kernels {

// One head's probabilities: P = causal softmax(q k^T * scale) (T, T), q and k the head's blocks
// of qkv (leading dimension 3C); 0 above the diagonal.
template <class T>
void attention_probs(const T* q, T* p, std::int64_t Tn, std::int64_t C, std::int64_t hs, double scale) {
  const std::int64_t ld = 3 * C;
  gemm_tri<T>(Tri::lower_c, false, true, Tn, Tn, hs, T(1), q, ld, q + C, ld, T(0), p, Tn);  // S = q k^T, j <= i
  causal_softmax_forward(p, p, Tn, Tn, scale);                                          // in place, row i sees j <= i
}

// qkv (B, T, 3C) -> y (B, T, C), P (B, H, T, T) (or null)
template <class T>
void attention_forward(const T* qkv, T* y, T* P, std::int64_t B, std::int64_t Tn, std::int64_t C, std::int64_t H,
                       double scale) {
  const std::int64_t hs = C / H, ld = 3 * C;
  // y is zeroed in one pass and each head's P v added into its column block (beta = 1): a
  // beta = 0 product into a strided block zero-fills it row by row, T small memsets per head.
  fill_zero(y, B * Tn * C);
  parallel_for(B * H, B * H * Tn * Tn * hs, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<T> scratch(P ? 0 : static_cast<std::size_t>(Tn * Tn));
    for (std::int64_t bh = lo; bh < hi; ++bh) {
      const std::int64_t b = bh / H, h = bh % H;
      const T* q = qkv + b * Tn * ld + h * hs;
      const T* v = q + 2 * C;
      T* p = P ? P + bh * Tn * Tn : scratch.data();
      attention_probs(q, p, Tn, C, hs, scale);
      gemm_tri<T>(Tri::lower_a, false, false, Tn, hs, Tn, T(1), p, Tn, v, ld, T(1), y + b * Tn * C + h * hs, C);
    }
  });
}

// qkv (B, T, 3C), P (B, H, T, T) (or null: recomputed), dy (B, T, C) -> dqkv (B, T, 3C)
template <class T>
void attention_backward(const T* qkv, const T* P, const T* dy, T* dqkv, std::int64_t B, std::int64_t Tn,
                        std::int64_t C, std::int64_t H, double scale) {
  const std::int64_t hs = C / H, ld = 3 * C;
  // Every element of dqkv belongs to exactly one (b, h) and one of q, k, v. It is zeroed in one
  // pass first (as y in the forward), and every product adds into its block (beta = 1).
  fill_zero(dqkv, B * Tn * 3 * C);
  parallel_for(B * H, B * H * Tn * Tn * hs, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<T> dS(static_cast<std::size_t>(Tn * Tn)), scratch(P ? 0 : static_cast<std::size_t>(Tn * Tn));
    for (std::int64_t bh = lo; bh < hi; ++bh) {
      const std::int64_t b = bh / H, h = bh % H;
      const T* q = qkv + b * Tn * ld + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + b * Tn * ld + h * hs;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* p = P ? P + bh * Tn * Tn : scratch.data();
      if (!P) attention_probs(q, scratch.data(), Tn, C, hs, scale);
      const T* g = dy + b * Tn * C + h * hs;
      T* ds = dS.data();
      gemm_tri<T>(Tri::lower_c, false, true, Tn, Tn, hs, T(1), g, C, v, ld, T(0), ds, Tn);  // dP = dY v^T, j <= i
      gemm_tri<T>(Tri::upper_a, true, false, Tn, hs, Tn, T(1), p, Tn, g, C, T(1), dv, ld);  // dv += P^T dY
      // dS = scale * P * (dP - rowsum(dP * P)), in place over dP, 0 where masked: the scaled
      // causal softmax's backward (serial here, inside the parallel loop over heads)
      causal_softmax_backward(p, ds, ds, Tn, Tn, scale);
      gemm_tri<T>(Tri::lower_a, false, false, Tn, hs, Tn, T(1), ds, Tn, k, ld, T(1), dq, ld);  // dq += dS k
      gemm_tri<T>(Tri::upper_a, true, false, Tn, hs, Tn, T(1), ds, Tn, q, ld, T(1), dk, ld);  // dk += dS^T q
    }
  });
}

}  // namespace tg::kernels
