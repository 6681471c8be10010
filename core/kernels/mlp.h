#pragma once
// The transformer MLP's activations as product epilogues (ops/mlp.cpp, kernels/gemm.h's
// Epilogue): each runs on a block of the product's output while the block is still in the cache
// of the thread that computed it, instead of in a pass of its own over memory.
//
// Shapes: rows of the MLP's input; H the first product's width; F the activation's width.
//   pre   (rows, H)   the first product's output: x w1^T + b1
//   h     (rows, F)   the activation: GELU, F = H; SwiGLU, F = H / 2 (gate columns [0, F), up [F, 2F))
//   dh    (rows, F)   gradient of h (the backward's dy w2)
//   dpre  (rows, H)   gradient of pre, written (=); for GELU it may be dh's buffer
// Each element is the same formula as the unfused ops' kernels (elementwise.h's GeluErfOp,
// llama.h's swiglu_forward / swiglu_backward), so the fused MLP gives their bits.
#include <cstdint>

#include "kernels/elementwise.h"
#include "kernels/llama.h"

namespace tg::kernels {

// h = gelu(pre) = pre Phi(pre) on rows [r0, r1), columns [c0, c1).
template <class T>
void gelu_block(const T* pre, T* h, std::int64_t H, std::int64_t r0, std::int64_t r1, std::int64_t c0,
                std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t c = c0; c < c1; ++c) h[r * H + c] = op.f(pre[r * H + c]);
}

// The backward's epilogue: h = gelu(pre) (for dw2 = dy^T h) and dpre = dh gelu'(pre), gelu'(x) =
// Phi(x) + x phi(x), from one evaluation of erf and exp, on rows [r0, r1), columns [c0, c1); dpre
// may be dh.
template <class T>
void gelu_grad_block(const T* pre, const T* dh, T* dpre, T* h, std::int64_t H, std::int64_t r0, std::int64_t r1,
                     std::int64_t c0, std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t c = c0; c < c1; ++c) {
      T d;
      op.fdf(pre[r * H + c], h[r * H + c], d);
      dpre[r * H + c] = dh[r * H + c] * d;
    }
}

// h = silu(gate) up on rows [r0, r1): pre's row r is (gate, up), F columns each.
template <class T>
void swiglu_rows(const T* pre, T* h, std::int64_t F, std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r) swiglu_row(pre + r * 2 * F, h + r * F, F);
}

// The backward's epilogue: h = silu(gate) up and dpre = (dh up silu'(gate), dh silu(gate)) on rows
// [r0, r1).
template <class T>
void swiglu_grad_rows(const T* pre, const T* dh, T* dpre, T* h, std::int64_t F, std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r) {
    swiglu_row(pre + r * 2 * F, h + r * F, F);
    swiglu_grad_row(pre + r * 2 * F, dh + r * F, dpre + r * 2 * F, F);
  }
}

}  // namespace tg::kernels
