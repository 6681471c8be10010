#pragma once
// Helpers shared between op files (not part of the public API).
#include <vector>

#include "tapegrad/node.h"
#include "tapegrad/tensor.h"

namespace tg::detail {

// y (already allocated, shape x.shape permuted) = x with y's dim d taken from x's dim perm[d];
// accumulate adds into y instead of overwriting. Any dtype; no autograd.
void permute_into(const Tensor& x, const std::vector<int>& perm, Tensor& y, bool accumulate);

// The inverse permutation: inv[perm[d]] = d.
std::vector<int> inverse_perm(const std::vector<int>& perm);

// dx (+)= dy, same number of elements (reshape, clone, the float casts' identity part, a
// checkpointed segment's input): a copy into a fresh gradient, an add into one that holds another
// path's part. Float dtypes and bfloat16.
void accumulate_flat(const Tensor& dy, GradDest dx);

}  // namespace tg::detail
