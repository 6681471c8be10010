#pragma once
// The checks and the scale shared by causal_attention and its composite twin (ops/composite.cpp).
#include <cstdint>

#include "tapegrad/tensor.h"

namespace tg::detail {

// qkv must be a float (B, T, 3C) whose width C is a positive multiple of H.
void check_attention(const char* op, const Tensor& qkv, std::int64_t H);
// 1 / sqrt(head size); 1 for zero-width heads, which have no scores to scale.
double attention_scale(std::int64_t hs);

}  // namespace tg::detail
