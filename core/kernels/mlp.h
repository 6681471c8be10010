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
//
// With bf16 products, h is read only by products, which round it to bf16 while they pack it: the
// epilogues then write h as bf16 (the overloads below with a bf16 h, float only), rounded by
// to_bf16 as the packing would, so the products read half the bytes and convert nothing, and the
// results are the same bits.
#include <algorithm>
#include <cstdint>

#include "kernels/bf16.h"
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

// Float values made in chunks on the stack and stored as bf16: make(t, j0, n) fills t[0, n) with
// the values of columns [j0, j0 + n), which go to out[j0, j0 + n).
template <class Make>
void store_bf16(bf16* out, std::int64_t j0, std::int64_t j1, Make&& make) {
  constexpr std::int64_t kChunk = 256;
  float t[kChunk];
  for (std::int64_t j = j0; j < j1; j += kChunk) {
    const std::int64_t n = std::min(kChunk, j1 - j);
    make(t, j, n);
    to_bf16(t, out + j, n);
  }
}

// gelu_block with h as bf16.
inline void gelu_block(const float* pre, bf16* h, std::int64_t H, std::int64_t r0, std::int64_t r1, std::int64_t c0,
                       std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * H, c0, c1, [&](float* t, std::int64_t j0, std::int64_t n) {
      for (std::int64_t j = 0; j < n; ++j) t[j] = op.f(pre[r * H + j0 + j]);
    });
}

// gelu_grad_block with h as bf16.
inline void gelu_grad_block(const float* pre, const float* dh, float* dpre, bf16* h, std::int64_t H, std::int64_t r0,
                            std::int64_t r1, std::int64_t c0, std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * H, c0, c1, [&](float* t, std::int64_t j0, std::int64_t n) {
      for (std::int64_t j = 0; j < n; ++j) {
        const std::int64_t i = r * H + j0 + j;
        float d;
        op.fdf(pre[i], t[j], d);
        dpre[i] = dh[i] * d;
      }
    });
}

// swiglu_rows and swiglu_grad_rows with h as bf16.
inline void swiglu_rows(const float* pre, bf16* h, std::int64_t F, std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * F, 0, F, [&](float* t, std::int64_t j0, std::int64_t n) {
      const float* g = pre + r * 2 * F + j0;  // the gate; the up projection F further
      for (std::int64_t j = 0; j < n; ++j) t[j] = swiglu_one(g[j], g[F + j]);
    });
}
inline void swiglu_grad_rows(const float* pre, const float* dh, float* dpre, bf16* h, std::int64_t F,
                             std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r) {  // a row at a time, as the float version: pre's row stays in cache
    swiglu_rows(pre, h, F, r, r + 1);
    swiglu_grad_row(pre + r * 2 * F, dh + r * F, dpre + r * 2 * F, F);
  }
}

}  // namespace tg::kernels
