// Neural-network ops: softmax, log_softmax, masked_fill, causal_mask, embedding, cross_entropy, dropout.
#include <cmath>

#include "dispatch.h"
#include "kernels/index.h"
#include "kernels/softmax.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"
#include "tapegrad/random.h"

namespace tg {

using namespace kernels;
using detail::dispatch_float;

namespace {

void check_last_axis(const char* op, const Tensor& x, int axis) {
  detail::check_float(op, x);
  if (x.dim() == 0) fail(op, "needs at least 1 dim, got a 0-d tensor");
  const int a = detail::norm_axis(op, axis, x.dim(), x.shape());
  if (a != x.dim() - 1) fail(op, "only the last axis is supported, got axis ", axis, " for shape ", x.shape());
}

struct SoftmaxSaved { Tensor y; };  // the output: softmax's derivative is written in y

template <bool Log>
Tensor softmax_impl(const char* op, const Tensor& x, int axis) {
  check_last_axis(op, x, axis);
  const std::int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    if constexpr (Log) log_softmax_forward(x.data<T>(), y.data<T>(), rows, C);
    else softmax_forward(x.data<T>(), y.data<T>(), rows, C);
  });
  if (should_record({&x})) {
    record(op, {&x}, {&y}, SoftmaxSaved{y.detach()}, [rows, C](Node& n, const SoftmaxSaved& s) {
      Tensor dx = n.new_grad(0);
      dispatch_float("softmax", s.y.dtype(), [&](auto z) {
        using T = decltype(z);
        if constexpr (Log) log_softmax_backward(s.y.data<T>(), n.grad_out().data<T>(), dx.data<T>(), rows, C);
        else softmax_backward(s.y.data<T>(), n.grad_out().data<T>(), dx.data<T>(), rows, C);
      });
      n.pass_grad(0, std::move(dx));
    });
  }
  return y;
}

// Expands an int32 mask broadcastable to `shape` into a full-size 0/1 mask.
Tensor expand_mask(const char* op, const Tensor& mask, const Shape& shape) {
  if (mask.dim() > shape.ndim()) fail(op, "mask ", mask.shape(), " has more dims than the input ", shape);
  std::int64_t st[8] = {};
  const int off = shape.ndim() - mask.dim();
  std::int64_t acc = 1;
  for (int d = shape.ndim() - 1; d >= 0; --d) {
    const int k = d - off;
    if (k >= 0 && mask.shape()[k] != shape[d] && mask.shape()[k] != 1)
      fail(op, "mask ", mask.shape(), " cannot be broadcast to the input ", shape);
    st[d] = (k < 0 || mask.shape()[k] == 1) ? 0 : acc;
    if (k >= 0) acc *= mask.shape()[k];
  }
  std::vector<std::int64_t> sh(shape.begin(), shape.end());
  Tensor m = Tensor::empty(shape, int32);
  permute_copy<std::int32_t>(mask.data<std::int32_t>(), m.data<std::int32_t>(), shape.ndim(), sh.data(), st);
  return m;
}

}  // namespace

Tensor softmax(const Tensor& x, int axis) { return softmax_impl<false>("softmax", x, axis); }
Tensor log_softmax(const Tensor& x, int axis) { return softmax_impl<true>("log_softmax", x, axis); }

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  detail::check_float("masked_fill", x);
  detail::check_defined("masked_fill", mask, "mask");
  if (mask.dtype() != int32) fail("masked_fill", "mask must be int32, got ", mask.dtype(), " ", mask.shape());
  const Tensor m = expand_mask("masked_fill", mask, x.shape());
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  const std::int32_t* mp = m.data<std::int32_t>();
  const std::int64_t n = x.numel();
  dispatch_float("masked_fill", x.dtype(), [&](auto z) {
    using T = decltype(z);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    const T v = static_cast<T>(value);
    kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) yp[i] = mp[i] ? v : xp[i];
    });
  });
  if (should_record({&x})) {
    struct Saved { Tensor mask; };  // int32, x's shape: dx = mask ? 0 : dy
    record("masked_fill", {&x}, {&y}, Saved{m}, [n](Node& nd, const Saved& s) {
      const Tensor& dy = nd.grad_out();  // read before new_grad, which may hand out dy's own buffer
      Tensor dx = nd.new_grad(0);
      const std::int32_t* mk = s.mask.data<std::int32_t>();
      dispatch_float("masked_fill", dx.dtype(), [&](auto z) {
        using T = decltype(z);
        const T* g = dy.data<T>();
        T* d = dx.data<T>();
        kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t i = lo; i < hi; ++i) d[i] = mk[i] ? T(0) : g[i];
        });
      });
      nd.pass_grad(0, std::move(dx));
    }).may_reuse_grad_out();  // dx[i] is written after dy[i] is read
  }
  return y;
}

Tensor causal_mask(std::int64_t T) {
  if (T < 0) fail("causal_mask", "size must be >= 0, got ", T);
  Tensor m = Tensor::empty(Shape{T, T}, int32);
  std::int32_t* p = m.data<std::int32_t>();
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t j = 0; j < T; ++j) p[i * T + j] = j > i;
  return m;
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  detail::check_float("embedding", weight);
  detail::check_defined("embedding", ids, "ids");
  if (weight.dim() != 2) fail("embedding", "weight must be 2-D (V, C), got ", weight.shape());
  if (ids.dtype() != int32) fail("embedding", "ids must be int32, got ", ids.dtype(), " ", ids.shape());
  if (ids.dim() >= Shape::kMaxDims) fail("embedding", "ids have too many dims: ", ids.shape());
  const std::int64_t V = weight.size(0), C = weight.size(1), rows = ids.numel();
  const std::int32_t* ip = ids.data<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r)
    if (ip[r] < 0 || ip[r] >= V) fail("embedding", "id ", ip[r], " at position ", r, " is out of range for a table of ", V, " rows ", weight.shape());
  Shape out = ids.shape();
  out.push_back(C);
  Tensor y = Tensor::empty(out, weight.dtype());
  dispatch_float("embedding", weight.dtype(), [&](auto z) {
    using T = decltype(z);
    embedding_forward(weight.data<T>(), ip, y.data<T>(), rows, C);
  });
  if (should_record({&weight})) {
    struct Saved { Tensor ids; };
    record("embedding", {&weight, &ids}, {&y}, Saved{ids.detach()}, [rows, V, C](Node& n, const Saved& s) {
      Tensor dw = n.new_grad(0);  // dw[v] = the sum of dy[r] over the rows r whose id is v
      dispatch_float("embedding", dw.dtype(), [&](auto z) {
        using T = decltype(z);
        embedding_backward(n.grad_out().data<T>(), s.ids.data<std::int32_t>(), dw.data<T>(), rows, V, C);
      });
      n.pass_grad(0, std::move(dw));
    });
  }
  return y;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index) {
  const char* op = "cross_entropy";
  detail::check_float(op, logits);
  detail::check_defined(op, targets, "targets");
  if (targets.dtype() != int32) fail(op, "targets must be int32, got ", targets.dtype(), " ", targets.shape());
  if (logits.dim() < 1) fail(op, "logits need at least 1 dim, got a 0-d tensor");
  Shape tshape;
  for (int d = 0; d + 1 < logits.dim(); ++d) tshape.push_back(logits.size(d));
  if (!(targets.shape() == tshape))
    fail(op, "targets ", targets.shape(), " do not match logits ", logits.shape(), " (expected ", tshape, ")");
  const std::int64_t V = logits.size(-1), rows = targets.numel();
  const std::int32_t* tp = targets.data<std::int32_t>();
  std::int64_t count = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (tp[r] == ignore_index) continue;
    if (tp[r] < 0 || tp[r] >= V) fail(op, "target ", tp[r], " at position ", r, " is out of range for ", V, " classes");
    ++count;
  }
  if (count == 0) fail(op, "all ", rows, " targets equal ignore_index ", ignore_index, "; the mean loss is undefined");
  Tensor lse = Tensor::empty(tshape, logits.dtype());
  Tensor y = Tensor::empty(Shape{}, logits.dtype());
  dispatch_float(op, logits.dtype(), [&](auto z) {
    using T = decltype(z);
    const double total = cross_entropy_forward(logits.data<T>(), tp, lse.data<T>(), rows, V, ignore_index);
    y.data<T>()[0] = static_cast<T>(total / static_cast<double>(count));
  });
  if (should_record({&logits})) {
    struct Saved { Tensor logits, targets, lse; };  // lse: each row's log-sum-exp
    record(op, {&logits, &targets}, {&y}, Saved{logits.detach(), targets.detach(), lse},
           [rows, V, count, ignore_index](Node& n, const Saved& s) {
             Tensor dx = n.new_grad(0);
             dispatch_float("cross_entropy", dx.dtype(), [&](auto z) {
               using T = decltype(z);
               const T scale = n.grad_out().data<T>()[0] / static_cast<T>(count);
               cross_entropy_backward(s.logits.data<T>(), s.targets.data<std::int32_t>(), s.lse.data<T>(), scale,
                                      dx.data<T>(), rows, V, ignore_index);
             });
             n.pass_grad(0, std::move(dx));
           });
  }
  return y;
}

Tensor dropout(const Tensor& x, double p, bool train) {
  detail::check_float("dropout", x);
  if (!(p >= 0 && p <= 1)) fail("dropout", "probability must be in [0, 1], got ", p);
  if (!train || p == 0) return x;
  Generator& g = default_generator();
  const std::int64_t n = x.numel();
  const std::uint64_t base = g.advance(static_cast<std::uint64_t>(n)), seed = g.seed();
  const double keep_scale = p == 1 ? 0.0 : 1.0 / (1.0 - p);
  Tensor mask = Tensor::empty(x.shape(), x.dtype());  // 0 or 1/(1-p)
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float("dropout", x.dtype(), [&](auto z) {
    using T = decltype(z);
    T* m = mask.data<T>();
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) {
        m[i] = Generator::uniform(seed, base + static_cast<std::uint64_t>(i)) < p ? T(0) : static_cast<T>(keep_scale);
        yp[i] = xp[i] * m[i];
      }
    });
  });
  if (should_record({&x})) {
    struct Saved { Tensor mask; };  // 0 or 1 / (1 - p) per element: dx = dy * mask
    record("dropout", {&x}, {&y}, Saved{mask}, [n](Node& nd, const Saved& s) {
      const Tensor& dy = nd.grad_out();  // read before new_grad, which may hand out dy's own buffer
      Tensor dx = nd.new_grad(0);
      dispatch_float("dropout", dx.dtype(), [&](auto z) {
        using T = decltype(z);
        const T* m = s.mask.data<T>();
        const T* g = dy.data<T>();
        T* d = dx.data<T>();
        kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t i = lo; i < hi; ++i) d[i] = g[i] * m[i];
        });
      });
      nd.pass_grad(0, std::move(dx));
    }).may_reuse_grad_out();  // dx[i] is written after dy[i] is read
  }
  return y;
}

}  // namespace tg
