// Shape ops. reshape shares storage; permute, slice, cat and to copy (storage is always
// contiguous). Each backward moves the gradient back the way the data came.
#include <cstring>
#include <type_traits>

#include "dispatch.h"
#include "kernels/index.h"
#include "ops/internal.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

using namespace kernels;
using detail::dispatch_all;
using detail::dispatch_float;

namespace detail {

void permute_into(const Tensor& x, const std::vector<int>& perm, Tensor& y) {
  const std::vector<std::int64_t> xs = strides_of(x.shape());
  std::int64_t st[8] = {}, ys[8] = {};
  for (std::size_t d = 0; d < perm.size(); ++d) {
    st[d] = xs[static_cast<std::size_t>(perm[d])];
    ys[d] = y.shape()[static_cast<int>(d)];
  }
  const int nd = static_cast<int>(perm.size());
  dispatch_all(x.dtype(), [&](auto z) {
    using T = decltype(z);
    permute_copy<T>(static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), nd, ys, st);
  });
}

std::vector<int> inverse_perm(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (std::size_t d = 0; d < perm.size(); ++d) inv[static_cast<std::size_t>(perm[d])] = static_cast<int>(d);
  return inv;
}

}  // namespace detail

namespace {

// A bfloat16 tensor's gradient is bfloat16, and only the ops without arithmetic in their backward
// (to, reshape, clone) carry one; the others refuse to record rather than fail in backward().
void refuse_bf16_grad(const char* op, const Tensor& x) {
  if (x.dtype() == bfloat16 && x.requires_grad() && grad_enabled())
    fail(op, "cannot differentiate through a bfloat16 tensor ", x.shape(),
         " (only to, reshape and clone can); convert it with to(float32) first");
}


}  // namespace

Tensor reshape(const Tensor& x, const Shape& shape) {
  detail::check_defined("reshape", x);
  Shape s = shape;
  int infer = -1;
  std::int64_t known = 1;
  for (int d = 0; d < s.ndim(); ++d) {
    if (s[d] == -1) {
      if (infer >= 0) fail("reshape", "only one dimension can be -1, got ", shape);
      infer = d;
    } else if (s[d] < 0) {
      fail("reshape", "invalid dimension ", s[d], " in ", shape);
    } else if (__builtin_mul_overflow(known, s[d], &known)) {
      fail("reshape", "shape ", shape, " has more elements than an int64 holds");
    }
  }
  if (infer >= 0) {
    if (known == 0 || x.numel() % known != 0) fail("reshape", "cannot reshape ", x.shape(), " into ", shape);
    s[infer] = x.numel() / known;
  }
  if (s.numel() != x.numel()) fail("reshape", "cannot reshape ", x.shape(), " (", x.numel(), " elements) into ", shape);
  Tensor y = x.alias(s);
  if (should_record({&x}))
    record("reshape", {&x}, {&y}, [](Node& n) { n.pass_grad(0, Tensor(n.grad_out())); });  // dx = dy, x's shape
  return y;
}

Tensor clone(const Tensor& x) {
  detail::check_defined("clone", x);
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  if (x.nbytes()) std::memcpy(y.raw_data(), x.raw_data(), x.nbytes());
  if (should_record({&x}))
    record("clone", {&x}, {&y}, [](Node& n) { n.pass_grad(0, Tensor(n.grad_out())); });  // dx = dy
  return y;
}

Tensor permute(const Tensor& x, const std::vector<int>& dims) {
  detail::check_defined("permute", x);
  refuse_bf16_grad("permute", x);
  const int nd = x.dim();
  if (static_cast<int>(dims.size()) != nd) fail("permute", dims.size(), " dims given for a ", nd, "-d tensor ", x.shape());
  std::vector<int> perm(dims.size());
  std::vector<bool> seen(dims.size(), false);
  Shape out;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const int k = detail::norm_axis("permute", dims[d], nd, x.shape());
    if (seen[static_cast<std::size_t>(k)]) fail("permute", "dim ", dims[d], " repeated in the permutation of ", x.shape());
    seen[static_cast<std::size_t>(k)] = true;
    perm[d] = k;
    out.push_back(x.shape()[k]);
  }
  Tensor y = Tensor::empty(out, x.dtype());
  detail::permute_into(x, perm, y);
  if (should_record({&x}))
    record("permute", {&x}, {&y}, [inv = detail::inverse_perm(perm)](Node& n) {  // dx = dy permuted back
      Tensor dx = n.new_grad(0);
      detail::permute_into(n.grad_out(), inv, dx);
      n.pass_grad(0, std::move(dx));
    });
  return y;
}

Tensor transpose(const Tensor& x, int d0, int d1) {
  detail::check_defined("transpose", x);
  const int a = detail::norm_axis("transpose", d0, x.dim(), x.shape());
  const int b = detail::norm_axis("transpose", d1, x.dim(), x.shape());
  std::vector<int> perm(static_cast<std::size_t>(x.dim()));
  for (int d = 0; d < x.dim(); ++d) perm[static_cast<std::size_t>(d)] = d;
  std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(b)]);
  return permute(x, perm);
}

namespace {
// (outer, n, inner) view of x around `dim`.
void around(const Shape& s, int dim, std::int64_t& outer, std::int64_t& inner) {
  outer = inner = 1;
  for (int d = 0; d < dim; ++d) outer *= s[d];
  for (int d = dim + 1; d < s.ndim(); ++d) inner *= s[d];
}
// cat's backward: each input's gradient is its piece of dy, dx[o, j, i] = dy[o, off + j, i] (the
// forward's copy, read the other way), written into a fresh buffer.
void cat_backward(Node& n, const std::vector<std::int64_t>& offsets, std::int64_t outer, std::int64_t inner, int d,
                  std::int64_t total) {
  for (std::size_t i = 0; i < n.inputs().size(); ++i) {
    Tensor dx = n.new_grad(i);
    if (!dx.defined()) continue;
    const std::size_t item = itemsize(dx.dtype());
    const std::size_t row = static_cast<std::size_t>(n.input_shape(i)[d] * inner) * item;
    const char* g = static_cast<const char*>(n.grad_out().raw_data());
    char* dp = static_cast<char*>(dx.raw_data());
    for (std::int64_t o = 0; o < outer; ++o)
      if (row)
        std::memcpy(dp + static_cast<std::size_t>(o) * row,
                    g + static_cast<std::size_t>((o * total + offsets[i]) * inner) * item, row);
    n.pass_grad(i, std::move(dx));
  }
}

}  // namespace

Tensor slice(const Tensor& x, int dim, std::int64_t start, std::int64_t end, std::int64_t step) {
  detail::check_defined("slice", x);
  refuse_bf16_grad("slice", x);
  const int d = detail::norm_axis("slice", dim, x.dim(), x.shape());
  if (step < 1) fail("slice", "step must be >= 1, got ", step);
  const std::int64_t n = x.shape()[d];
  auto clampi = [n](std::int64_t i) { return std::min(n, std::max<std::int64_t>(0, i < 0 ? i + n : i)); };
  const std::int64_t s0 = clampi(start), e0 = clampi(end);
  const std::int64_t count = e0 > s0 ? 1 + (e0 - s0 - 1) / step : 0;  // ceil((e0 - s0) / step), no overflow
  Shape out = x.shape();
  out[d] = count;
  std::int64_t outer, inner;
  around(x.shape(), d, outer, inner);
  Tensor y = Tensor::empty(out, x.dtype());
  dispatch_all(x.dtype(), [&](auto z) {
    using T = decltype(z);
    slice_forward(static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), outer, n, inner, s0, step, count);
  });
  if (should_record({&x}))
    record("slice", {&x}, {&y}, [=](Node& nd) {  // dx = dy inside the slice, zero outside it
      Tensor dx = nd.new_grad(0);
      dispatch_float("slice", dx.dtype(), [&](auto z) {
        using T = decltype(z);
        slice_backward(nd.grad_out().data<T>(), dx.data<T>(), outer, n, inner, s0, step, count);
      });
      nd.pass_grad(0, std::move(dx));
    });
  return y;
}

Tensor cat(const std::vector<Tensor>& xs, int dim) {
  if (xs.empty()) fail("cat", "needs at least one tensor");
  for (std::size_t i = 0; i < xs.size(); ++i)
    if (!xs[i].defined()) fail("cat", "tensor ", i, " is undefined");
  const Tensor& x0 = xs[0];
  const int d = detail::norm_axis("cat", dim, x0.dim(), x0.shape());
  Shape out = x0.shape();
  out[d] = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const Tensor& t = xs[i];
    bool ok = t.dim() == x0.dim() && t.dtype() == x0.dtype();
    for (int k = 0; ok && k < t.dim(); ++k) ok = k == d || t.shape()[k] == x0.shape()[k];
    if (!ok) fail("cat", "tensor ", i, " ", t.dtype(), " ", t.shape(), " does not match tensor 0 ", x0.dtype(), " ", x0.shape(), " outside dim ", d);
    out[d] += t.shape()[d];
  }
  for (const Tensor& t : xs) refuse_bf16_grad("cat", t);
  std::int64_t outer, inner;
  around(out, d, outer, inner);
  Tensor y = Tensor::empty(out, x0.dtype());
  std::vector<std::int64_t> offsets;  // start of each piece along d
  std::int64_t off = 0;
  for (const Tensor& t : xs) {
    offsets.push_back(off);
    const std::int64_t nt = t.shape()[d];
    // y[o, off + j, i] = t[o, j, i]
    const std::size_t row = static_cast<std::size_t>(nt * inner) * itemsize(t.dtype());
    for (std::int64_t o = 0; o < outer; ++o)
      if (row) std::memcpy(static_cast<char*>(y.raw_data()) + static_cast<std::size_t>((o * out[d] + off) * inner) * itemsize(t.dtype()),
                           static_cast<const char*>(t.raw_data()) + static_cast<std::size_t>(o) * row, row);
    off += nt;
  }
  std::vector<const Tensor*> ins;
  bool rec = false;
  for (const Tensor& t : xs) {
    ins.push_back(&t);
    rec = rec || t.requires_grad();
  }
  if (rec && grad_enabled())
    record("cat", ins, {&y}, [offsets = std::move(offsets), outer, inner, d, total = out[d]](Node& n) {
      cat_backward(n, offsets, outer, inner, d, total);
    });
  return y;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<std::int64_t>& sizes, int dim) {
  detail::check_defined("split", x);
  const int d = detail::norm_axis("split", dim, x.dim(), x.shape());
  std::int64_t total = 0;
  for (std::int64_t s : sizes) {
    if (s < 0) fail("split", "negative size ", s);
    if (s > x.shape()[d] - total) {  // more than the dim holds (and the int64 sum might overflow)
      double sum = 0;
      for (std::int64_t v : sizes) sum += static_cast<double>(v);
      fail("split", "sizes sum to ", sum, " but dim ", d, " of ", x.shape(), " has ", x.shape()[d]);
    }
    total += s;
  }
  if (total != x.shape()[d]) fail("split", "sizes sum to ", total, " but dim ", d, " of ", x.shape(), " has ", x.shape()[d]);
  std::vector<Tensor> out;
  std::int64_t off = 0;
  for (std::int64_t s : sizes) {
    out.push_back(slice(x, d, off, off + s));
    off += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, std::int64_t split_size, int dim) {
  detail::check_defined("split", x);
  if (split_size < 1) fail("split", "split_size must be >= 1, got ", split_size);
  const int d = detail::norm_axis("split", dim, x.dim(), x.shape());
  std::vector<std::int64_t> sizes;
  for (std::int64_t left = x.shape()[d]; left > 0; left -= split_size) sizes.push_back(std::min(left, split_size));
  if (sizes.empty()) sizes.push_back(0);
  return split(x, sizes, d);
}

namespace {

// Refuses to convert x to int32 when a value has no int32 (outside its range, or NaN).
void check_fits_int32(const Tensor& x) {
  dispatch_all(x.dtype(), [&](auto z) {
    using S = decltype(z);
    if constexpr (!std::is_same_v<S, std::int32_t>) {
      const S* s = static_cast<const S*>(x.raw_data());
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        // Compare in double: the cast truncates toward zero, so the valid range is (-2^31 - 1, 2^31).
        // As S = float the bound -2147483649 would round to -2^31 and wrongly reject INT32_MIN.
        const double v = detail::to_double(s[i]);
        if (!(v > -2147483649.0 && v < 2147483648.0))
          fail("to", "value ", v, " at position ", i, " of ", x.dtype(), " ", x.shape(), " does not fit int32");
      }
    }
  });
}

// y = x converted elementwise. float32 <-> bfloat16 use the vectorised array conversions
// (kernels/bf16.h); the other pairs with bfloat16 go through double (detail::from_double).
void convert(const Tensor& x, Tensor& y) {
  const std::int64_t n = x.numel();
  if (x.dtype() == float32 && y.dtype() == bfloat16)
    return kernels::to_bf16(x.data<float>(), y.data<kernels::bf16>(), n);
  if (x.dtype() == bfloat16 && y.dtype() == float32)
    return kernels::to_float(x.data<kernels::bf16>(), y.data<float>(), n);
  dispatch_all(x.dtype(), [&](auto zs) {
    using S = decltype(zs);
    dispatch_all(y.dtype(), [&](auto zd) {
      using D = decltype(zd);
      const S* s = static_cast<const S*>(x.raw_data());
      D* o = static_cast<D*>(y.raw_data());
      if constexpr (std::is_same_v<S, kernels::bf16> || std::is_same_v<D, kernels::bf16>) {
        for (std::int64_t i = 0; i < n; ++i) o[i] = detail::from_double<D>(detail::to_double(s[i]));
      } else {
        for (std::int64_t i = 0; i < n; ++i) o[i] = static_cast<D>(s[i]);
      }
    });
  });
}

}  // namespace

Tensor to(const Tensor& x, DType dtype) {
  detail::check_defined("to", x);
  if (dtype == x.dtype()) return x;
  if (dtype == int32) check_fits_int32(x);
  Tensor y = Tensor::empty(x.shape(), dtype);
  convert(x, y);
  // Differentiable to every dtype but int32, as in PyTorch: the gradient comes back converted to
  // x's dtype (through bfloat16 it is rounded to bfloat16 on the way, as y's gradient is bfloat16).
  if (dtype != int32 && should_record({&x}))
    record("to", {&x}, {&y}, [from = x.dtype()](Node& nd) {  // dx = dy converted back to x's dtype
      nd.pass_grad(0, to(nd.grad_out().detach(), from));
    });
  return y;
}

}  // namespace tg
