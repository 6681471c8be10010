// The fused row norms, RMSNorm and LayerNorm: each checks its arguments, runs its forward kernel and
// records one tape node whose backward runs the hand-derived backward kernel (BatchNorm and weight
// norm: core/ops/batch_norm.cpp). kernels/norms.h has the math, as
// plain reference loops; the ops run kernels/norms_fast.h, the same math blocked, threaded and
// vectorised (tested equal to the reference).
#include <cmath>

#include "dispatch.h"
#include "kernels/norms_fast.h"
#include "ops/internal.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

void detail::check_norm_param(const char* op, const char* what, const Tensor& p, const Tensor& x, std::int64_t C) {
  if (!p.defined()) return;
  if (!(p.shape() == Shape{C}))
    fail(op, what, " has shape ", p.shape(), " but the input ", x.shape(), " has ", C, " features");
  if (p.dtype() != x.dtype()) fail(op, what, " is ", p.dtype(), " but the input is ", x.dtype());
}

namespace fast = kernels::fast;
using detail::detached;
using detail::dispatch_float;
using detail::grad_ptr;
using detail::opt_ptr;

namespace {

// The checks shared by the row norms (over the last axis); returns the number of features C.
std::int64_t check_row_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_float(op, x);
  if (x.dim() < 1) fail(op, "needs at least 1 dim, got a 0-d tensor");
  const std::int64_t C = x.size(-1);
  if (C == 0) fail(op, "normalising over 0 features, input ", x.shape());
  detail::check_norm_param(op, "weight", weight, x, C);
  detail::check_norm_param(op, "bias", bias, x, C);
  if (!(eps >= 0) || !std::isfinite(eps)) fail(op, "eps must be finite and >= 0, got ", eps);
  return C;
}

}  // namespace

std::int64_t prms_k(std::int64_t n, double p) {
  if (!(p > 0 && p <= 1)) fail("prms_k", "p must be in (0, 1], got ", p);
  if (n < 0) fail("prms_k", "n must be >= 0, got ", n);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(static_cast<double>(n) * p - 1e-9)));
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, double p) {
  const char* op = "rms_norm";
  const std::int64_t C = check_row_norm(op, x, weight, bias, eps), rows = x.numel() / C;
  if (!(p > 0 && p <= 1)) fail(op, "p must be in (0, 1], got ", p);
  const std::int64_t k = prms_k(C, p);
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor rrms = Tensor::empty(Shape{rows}, x.dtype());  // 1 / rms of each row
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    fast::rms_norm_forward(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), rrms.data<T>(), rows, C, k, eps);
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, rrms; };  // weight undefined when absent
    record(p < 1 ? "prms_norm" : "rms_norm", {&x, &weight, &bias}, {&y}, Saved{x.detach(), detached(weight), rrms},
           [rows, C, k](Node& n, const Saved& s) {
             Tensor dx = n.new_grad(0), dw = n.new_grad(1), db = n.new_grad(2);
             dispatch_float("rms_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               fast::rms_norm_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.rrms.data<T>(), n.grad_out().data<T>(),
                                       grad_ptr<T>(dx), grad_ptr<T>(dw), grad_ptr<T>(db), rows, C, k);
             });
             n.pass_grad(0, std::move(dx)); n.pass_grad(1, std::move(dw)); n.pass_grad(2, std::move(db));
           });
  }
  return y;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "layer_norm";
  const std::int64_t C = check_row_norm(op, x, weight, bias, eps), rows = x.numel() / C;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor mean = Tensor::empty(Shape{rows}, float64), rstd = Tensor::empty(Shape{rows}, x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    fast::layer_norm_forward(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), mean.data<double>(),
                             rstd.data<T>(), rows, C, eps);
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, mean, rstd; };  // weight undefined when absent
    record(op, {&x, &weight, &bias}, {&y}, Saved{x.detach(), detached(weight), mean, rstd},
           [rows, C](Node& n, const Saved& s) {
             Tensor dx = n.new_grad(0), dw = n.new_grad(1), db = n.new_grad(2);
             dispatch_float("layer_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               fast::layer_norm_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.mean.data<double>(), s.rstd.data<T>(),
                                         n.grad_out().data<T>(), grad_ptr<T>(dx), grad_ptr<T>(dw), grad_ptr<T>(db),
                                         rows, C);
             });
             n.pass_grad(0, std::move(dx)); n.pass_grad(1, std::move(dw)); n.pass_grad(2, std::move(db));
           });
  }
  return y;
}

}  // namespace tg
