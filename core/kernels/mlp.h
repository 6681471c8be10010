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
// Under autocast (bf16 products) the epilogues are the _bf16 versions at the end.
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

// ---- Under autocast ----------------------------------------------------------------------------
// With bf16 products (inside an autocast scope) the MLP is PyTorch autocast's: the first product's
// output is a bf16 tensor there, so the activation reads pre rounded to bf16, and the gradient
// that flows back into pre is rounded to bf16 as well. The node then keeps pre as bf16 (half the
// bytes of the largest tensor it saves). The unfused twin spells the same thing out with public
// ops: linear, .to(bfloat16).to(float32), the activation, linear (composite::mlp).
//
// h is read only by products, which round it to bf16 while they pack it: the epilogues write it as
// bf16 directly, rounded by to_bf16 as the packing would, so the products read half the bytes and
// convert nothing, and the results are the same bits.
//
// The values go through chunks of kChunk on the stack.
constexpr std::int64_t kChunk = 256;

// Float values made in chunks and stored as bf16: make(t, j0, n) fills t[0, n) with the values of
// columns [j0, j0 + n), which go to out[j0, j0 + n).
template <class Make>
void store_bf16(bf16* out, std::int64_t j0, std::int64_t j1, Make&& make) {
  float t[kChunk];
  for (std::int64_t j = j0; j < j1; j += kChunk) {
    const std::int64_t n = std::min(kChunk, j1 - j);
    make(t, j, n);
    to_bf16(t, out + j, n);
  }
}

// t[0, n) = x[0, n) rounded to bf16 (as float; n <= kChunk; t may be x). From the product's float
// pre, whose bf16 bits also go to keep when it is set (the node's saved pre); from the saved bf16
// pre, exact.
inline void rounded(const float* x, bf16* keep, float* t, std::int64_t n) {
  bf16 b[kChunk];
  bf16* dst = keep ? keep : b;
  to_bf16(x, dst, n);
  to_float(dst, t, n);
}
inline void rounded(const bf16* x, bf16*, float* t, std::int64_t n) { to_float(x, t, n); }

// h (bf16) = gelu(rounded pre) on rows [r0, r1), columns [c0, c1). P: float, the forward's product
// output (its bf16 bits go to keep when set), or bf16, the saved pre (keep null).
template <class P>
void gelu_block_bf16(const P* pre, bf16* keep, bf16* h, std::int64_t H, std::int64_t r0, std::int64_t r1,
                     std::int64_t c0, std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * H, c0, c1, [&](float* t, std::int64_t j0, std::int64_t n) {
      const std::int64_t i = r * H + j0;
      rounded(pre + i, keep ? keep + i : nullptr, t, n);
      for (std::int64_t j = 0; j < n; ++j) t[j] = op.f(t[j]);
    });
}

// The backward's epilogue from the saved bf16 pre: h (bf16) = gelu(pre) and dpre (bf16) =
// dh gelu'(pre) rounded to bf16, as the unfused twin's .to() backward rounds it: the operand of
// the two products after it (which would round it anyway) and of the bias gradient's sums (bf16
// values are exact in double, so they are the sums of the rounded floats the twin adds).
inline void gelu_grad_block_bf16(const bf16* pre, const float* dh, bf16* dpre, bf16* h, std::int64_t H,
                                 std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
  const GeluErfOp op;
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * H, c0, c1, [&](float* t, std::int64_t j0, std::int64_t n) {
      const std::int64_t i = r * H + j0;
      float p[kChunk], g[kChunk];
      to_float(pre + i, p, n);
      for (std::int64_t j = 0; j < n; ++j) {
        float d;
        op.fdf(p[j], t[j], d);
        g[j] = dh[i + j] * d;
      }
      to_bf16(g, dpre + i, n);
    });
}

// h (bf16) = silu(gate) up from rounded pre on rows [r0, r1); P and keep as gelu_block_bf16.
template <class P>
void swiglu_rows_bf16(const P* pre, bf16* keep, bf16* h, std::int64_t F, std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * F, 0, F, [&](float* t, std::int64_t j0, std::int64_t n) {
      const std::int64_t g = r * 2 * F + j0, u = g + F;  // the gate's and the up projection's columns
      float gv[kChunk], uv[kChunk];
      rounded(pre + g, keep ? keep + g : nullptr, gv, n);
      rounded(pre + u, keep ? keep + u : nullptr, uv, n);
      for (std::int64_t j = 0; j < n; ++j) t[j] = swiglu_one(gv[j], uv[j]);
    });
}

// The backward's epilogue from the saved bf16 pre on rows [r0, r1): h (bf16) = silu(gate) up and
// dpre (bf16) = (dh up silu'(gate), dh silu(gate)) rounded to bf16, as gelu_grad_block_bf16's.
inline void swiglu_grad_rows_bf16(const bf16* pre, const float* dh, bf16* dpre, bf16* h, std::int64_t F,
                                  std::int64_t r0, std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r)
    store_bf16(h + r * F, 0, F, [&](float* t, std::int64_t j0, std::int64_t n) {
      const std::int64_t g = r * 2 * F + j0, u = g + F;
      float x[2 * kChunk], dx[2 * kChunk];  // a chunk's gate then up, as swiglu_grad_row reads them
      to_float(pre + g, x, n);
      to_float(pre + u, x + n, n);
      for (std::int64_t j = 0; j < n; ++j) t[j] = swiglu_one(x[j], x[n + j]);
      swiglu_grad_row(x, dh + r * F + j0, dx, n);
      to_bf16(dx, dpre + g, n);
      to_bf16(dx + n, dpre + u, n);
    });
}

}  // namespace tg::kernels
