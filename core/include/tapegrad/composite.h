#pragma once
// The composite twins of the fused ops (tapegrad/ops.h): the same functions built from primitive
// ops, whose gradient comes from the tape rather than a hand-derived kernel (core/ops/composite.cpp).
// The tests hold each fused op equal to its twin; a learner reads a twin as the op's definition.
#include <cstdint>

#include "tapegrad/tensor.h"

namespace tg {

namespace composite {
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5, double p = 1.0);
// Batch statistics (training) when running stats are undefined or training; running stats otherwise.
// Does not update running statistics.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double eps = 1e-5, bool channels_last = false);
Tensor weight_norm(const Tensor& v, const Tensor& g);
Tensor scaled_causal_softmax(const Tensor& x, double scale);
// split, permute, two batched matmuls and a masked softmax: the textbook version
Tensor causal_attention(const Tensor& qkv, std::int64_t n_head);
Tensor silu(const Tensor& x);    // x * sigmoid(x)
Tensor swiglu(const Tensor& x);  // silu(gate slice) * up slice
// the reference's q * cos + rotate_half(q) * sin on the (B, H, T, hs) layout: slices, permutes, cat
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t head_size, std::int64_t rotated = -1,
            std::int64_t pos0 = 0);
// the MLP's three ops in turn: linear, gelu (erf) or swiglu, linear, and the residual's add (the
// unfused path; ops.h's mlp gives its bits); under autocast pre goes through .to(bfloat16) and
// back before the activation, as PyTorch autocast's bf16 linear output
Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const char* activation = "gelu", const Tensor& residual = Tensor());
}  // namespace composite

}  // namespace tg
