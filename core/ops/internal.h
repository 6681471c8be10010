#pragma once
// Helpers shared between op files (not part of the public API).
#include <vector>

#include "tapegrad/tensor.h"

namespace tg::detail {

// y (already allocated, shape x.shape permuted) = x with y's dim d taken from x's dim perm[d];
// accumulate adds into y instead of overwriting. Any dtype; no autograd.
void permute_into(const Tensor& x, const std::vector<int>& perm, Tensor& y, bool accumulate);

// The inverse permutation: inv[perm[d]] = d.
std::vector<int> inverse_perm(const std::vector<int>& perm);

}  // namespace tg::detail
