// Reductions: sum, mean, var, max over a set of axes. The axes are turned into an (O, R, I) view
// (core/kernels/reduce.h); a non-contiguous axis set is first permuted so the reduced axes come last.
#include <algorithm>

#include "dispatch.h"
#include "kernels/reduce.h"
#include "ops/internal.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

using namespace kernels;
using detail::dispatch_float;

namespace {

struct ReducePlan {
  std::vector<int> perm;  // empty when the reduced axes are contiguous
  Shape permuted;         // x's shape after perm
  std::int64_t O = 1, R = 1, I = 1;
  Shape out;              // result shape (keepdim or not)
};

ReducePlan plan_reduce(const char* op, const Shape& s, const std::vector<int>& axes_in, bool keepdim) {
  const int nd = s.ndim();
  std::vector<bool> red(static_cast<std::size_t>(nd), axes_in.empty());
  for (int a : axes_in) {
    const int k = detail::norm_axis(op, a, nd, s);
    if (red[static_cast<std::size_t>(k)]) fail(op, "axis ", a, " is given twice for shape ", s);
    red[static_cast<std::size_t>(k)] = true;
  }
  ReducePlan p;
  int first = -1, last = -1;
  for (int d = 0; d < nd; ++d)
    if (red[static_cast<std::size_t>(d)]) { if (first < 0) first = d; last = d; }
  bool contiguous = true;
  for (int d = first; d >= 0 && d <= last; ++d) contiguous = contiguous && red[static_cast<std::size_t>(d)];
  for (int d = 0; d < nd; ++d) {
    if (red[static_cast<std::size_t>(d)]) { if (keepdim) p.out.push_back(1); }
    else p.out.push_back(s[d]);
  }
  if (contiguous) {
    for (int d = 0; d < nd; ++d) {
      if (first >= 0 && d < first) p.O *= s[d];
      else if (first >= 0 && d <= last) p.R *= s[d];
      else if (first >= 0) p.I *= s[d];
    }
    return p;
  }
  for (int d = 0; d < nd; ++d) if (!red[static_cast<std::size_t>(d)]) p.perm.push_back(d);
  for (int d = 0; d < nd; ++d) if (red[static_cast<std::size_t>(d)]) p.perm.push_back(d);
  for (int d : p.perm) {
    p.permuted.push_back(s[d]);
    (red[static_cast<std::size_t>(d)] ? p.R : p.O) *= s[d];
  }
  return p;
}

// x in the (O, R, I) layout: x itself, or its permuted copy.
Tensor reduce_layout(const Tensor& x, const ReducePlan& p) {
  if (p.perm.empty()) return x.detach();
  Tensor xp = Tensor::empty(p.permuted, x.dtype());
  detail::permute_into(x, p.perm, xp);
  return xp;
}

// x's gradient: body(dx_layout, T{}) writes it whole in the (O, R, I) layout (into x's fresh
// gradient, or a buffer permuted back into it), and the tape takes it.
template <class F>
void backward_in_layout(Node& n, const ReducePlan& p, F&& body) {
  Tensor dx = n.new_grad(0);
  if (!dx.defined()) return;
  Tensor dxp = p.perm.empty() ? dx : Tensor::empty(p.permuted, dx.dtype());
  dispatch_float("backward", dx.dtype(), [&](auto z) { body(dxp, z); });
  if (!p.perm.empty()) detail::permute_into(dxp, detail::inverse_perm(p.perm), dx);
  n.pass_grad(0, std::move(dx));
}

void check_nonempty(const char* op, const Tensor& x, const ReducePlan& p) {
  if (p.R == 0 && p.O * p.I > 0) fail(op, "reduction over zero elements of shape ", x.shape());
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int>& axes, bool keepdim) {
  detail::check_float("sum", x);
  const ReducePlan p = plan_reduce("sum", x.shape(), axes, keepdim);
  Tensor y = Tensor::empty(p.out, x.dtype());
  dispatch_float("sum", x.dtype(), [&](auto z) {
    using T = decltype(z);
    sum_forward(reduce_layout(x, p).data<T>(), y.data<T>(), p.O, p.R, p.I, 1.0);
  });
  if (should_record({&x}))
    record("sum", {&x}, {&y}, [p](Node& n) {  // dx = dy, broadcast over the reduced axes
      backward_in_layout(n, p, [&](Tensor& dx, auto z) {
        using T = decltype(z);
        sum_backward(n.grad_out().data<T>(), dx.data<T>(), p.O, p.R, p.I, 1.0);
      });
    });
  return y;
}

Tensor mean(const Tensor& x, const std::vector<int>& axes, bool keepdim) {
  detail::check_float("mean", x);
  const ReducePlan p = plan_reduce("mean", x.shape(), axes, keepdim);
  check_nonempty("mean", x, p);
  const double scale = 1.0 / static_cast<double>(p.R);
  Tensor y = Tensor::empty(p.out, x.dtype());
  dispatch_float("mean", x.dtype(), [&](auto z) {
    using T = decltype(z);
    sum_forward(reduce_layout(x, p).data<T>(), y.data<T>(), p.O, p.R, p.I, scale);
  });
  if (should_record({&x}))
    record("mean", {&x}, {&y}, [p, scale](Node& n) {  // dx = dy / R
      backward_in_layout(n, p, [&](Tensor& dx, auto z) {
        using T = decltype(z);
        sum_backward(n.grad_out().data<T>(), dx.data<T>(), p.O, p.R, p.I, scale);
      });
    });
  return y;
}

Tensor var(const Tensor& x, const std::vector<int>& axes, bool keepdim, int correction) {
  detail::check_float("var", x);
  const ReducePlan p = plan_reduce("var", x.shape(), axes, keepdim);
  if (correction < 0) fail("var", "correction must be >= 0, got ", correction);
  if (p.R - correction <= 0)
    fail("var", "correction ", correction, " needs more than ", correction, " elements per reduction, got ", p.R,
         " for shape ", x.shape());
  Tensor y = Tensor::empty(p.out, x.dtype());
  Tensor mu = Tensor::empty(p.out, x.dtype());
  Tensor xl = reduce_layout(x, p);
  dispatch_float("var", x.dtype(), [&](auto z) {
    using T = decltype(z);
    var_forward(xl.data<T>(), y.data<T>(), mu.data<T>(), p.O, p.R, p.I, correction);
  });
  if (should_record({&x})) {
    struct Saved { Tensor x, mean; };  // x in the (O, R, I) layout
    record("var", {&x}, {&y}, Saved{xl, mu}, [p, correction](Node& n, const Saved& s) {  // writes dx
      backward_in_layout(n, p, [&](Tensor& dx, auto z) {
        using T = decltype(z);
        var_backward(s.x.data<T>(), s.mean.data<T>(), n.grad_out().data<T>(), dx.data<T>(), p.O, p.R, p.I, correction);
      });
    });
  }
  return y;
}

Tensor max(const Tensor& x, const std::vector<int>& axes, bool keepdim) {
  detail::check_float("max", x);
  const ReducePlan p = plan_reduce("max", x.shape(), axes, keepdim);
  check_nonempty("max", x, p);
  Tensor y = Tensor::empty(p.out, x.dtype());
  Tensor xl = reduce_layout(x, p);
  dispatch_float("max", x.dtype(), [&](auto z) {
    using T = decltype(z);
    max_forward(xl.data<T>(), y.data<T>(), p.O, p.R, p.I);
  });
  if (should_record({&x})) {
    struct Saved { Tensor x, y; };  // x in the (O, R, I) layout; y the maxima
    record("max", {&x}, {&y}, Saved{xl, y.detach()}, [p](Node& n, const Saved& s) {  // dx where x == max, else 0
      backward_in_layout(n, p, [&](Tensor& dx, auto z) {
        using T = decltype(z);
        max_backward(s.x.data<T>(), s.y.data<T>(), n.grad_out().data<T>(), dx.data<T>(), p.O, p.R, p.I);
      });
    });
  }
  return y;
}

}  // namespace tg
