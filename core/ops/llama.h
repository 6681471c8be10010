#pragma once
// The argument checks that the LLaMA ops (core/ops/llama.cpp) share with their composite twins
// (core/ops/composite.cpp).
#include <cstdint>

#include "tapegrad/tensor.h"

namespace tg::detail {

// SwiGLU's x (..., 2F): returns F.
std::int64_t check_swiglu(const char* op, const Tensor& x);

// RoPE's x viewed as (B, Tn, D), and the columns it turns.
struct RopeDims {
  std::int64_t B, Tn, D, rotated;
};
// x (B, T, D) or (T, D), head_size even, rotated -1 or whole heads, the tables x's dtype and
// (P, head_size) with P >= pos0 + T.
RopeDims check_rope(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t hs,
                    std::int64_t rotated, std::int64_t pos0);

}  // namespace tg::detail
