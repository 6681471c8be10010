#pragma once
// Helpers shared between op files (not part of the public API).
#include <cstring>
#include <vector>

#include "tapegrad/node.h"
#include "tapegrad/tensor.h"

namespace tg::detail {

// y (already allocated, shape x.shape permuted) = x with y's dim d taken from x's dim perm[d].
// Any dtype; no autograd.
void permute_into(const Tensor& x, const std::vector<int>& perm, Tensor& y);

// A norm's per-feature parameter (gain, bias, running statistic) must be undefined or (C,) of x's
// dtype: tg::Error naming the op and the shapes otherwise (core/ops/norms.cpp).
void check_norm_param(const char* op, const char* what, const Tensor& p, const Tensor& x, std::int64_t C);

// The inverse permutation: inv[perm[d]] = d.
std::vector<int> inverse_perm(const std::vector<int>& perm);

// A gradient buffer's data for a backward kernel to write (Node::new_grad), or null when the
// input needs no gradient (the kernel then skips it).
template <class T>
T* grad_ptr(Tensor& g) {
  return g.defined() ? g.data<T>() : nullptr;
}

// Input i's gradient is zero (an empty product, a result that does not depend on it): a
// zero-filled buffer handed to the tape, so that the input's gradient is defined.
inline void pass_zeros(const Node& n, std::size_t i) {
  Tensor g = n.new_grad(i);
  if (!g.defined()) return;
  if (g.nbytes()) std::memset(g.raw_data(), 0, g.nbytes());
  n.pass_grad(i, std::move(g));
}

}  // namespace tg::detail
