#pragma once
// The autocast scope's state, internal to tapegrad_core (the public face: tapegrad/autocast.h).
#include <cstddef>

#include "tapegrad/tensor.h"

namespace tg::detail {

extern thread_local constinit bool t_autocast;

// w (float32) rounded to bfloat16, a tensor of dtype bfloat16 of w's shape. A parameter (a leaf
// that requires grad) is cast once per outermost AutocastGuard and the copy reused; anything else
// is cast afresh.
Tensor autocast_bf16(const Tensor& w);

// The number of parameters cast in the current scope (for the tests).
std::size_t autocast_cache_size();

}  // namespace tg::detail
