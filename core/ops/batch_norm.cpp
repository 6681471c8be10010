// BatchNorm and weight normalisation as fused ops: each checks its arguments, runs its forward
// kernel and records one tape node whose backward runs the hand-derived backward kernel
// (kernels/norms.h has the math as plain loops; these run kernels/norms_fast.h).
#include <cmath>
#include <vector>

#include "dispatch.h"
#include "kernels/norms_fast.h"
#include "ops/internal.h"
#include "ops/recompute.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

namespace fast = kernels::fast;
using detail::detached;
using detail::dispatch_float;
using detail::grad_ptr;
using detail::opt_ptr;

namespace {
// batch_norm's forward over the channels-last (R, C) view: the running statistics (eval), or the
// batch's, which also update the running ones when training.
template <class T>
void batch_norm_forward(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                        const Tensor& bias, bool training, double momentum, double eps, Tensor& y, Tensor& mean,
                        Tensor& rstd, std::int64_t R, std::int64_t C) {
  const T *g = opt_ptr<T>(weight), *b = opt_ptr<T>(bias);
  if (!training && running_mean.defined())
    return fast::batch_norm_forward_eval(x.data<T>(), g, b, y.data<T>(), running_mean.data<T>(), running_var.data<T>(),
                                         mean.data<double>(), rstd.data<T>(), R, C, eps);
  std::vector<double> var(static_cast<std::size_t>(C));
  fast::batch_norm_forward(x.data<T>(), g, b, y.data<T>(), mean.data<double>(), rstd.data<T>(), var.data(), R, C, eps);
  if (training && running_mean.defined())
    detail::update_state_once([&] {
      fast::batch_norm_update_running(Tensor(running_mean).data<T>(), Tensor(running_var).data<T>(), mean.data<double>(),
                                      var.data(), R, C, momentum);
    });
}
}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps, bool channels_last) {
  const char* op = "batch_norm";
  detail::check_float(op, x);
  if (!channels_last && x.dim() == 3)  // (N, C, L): the channels-last view (N, L, C) and back (two copies)
    return transpose(batch_norm(transpose(x, 1, 2), running_mean, running_var, weight, bias, training, momentum, eps, true), 1, 2);
  if (!channels_last && x.dim() != 2) fail(op, "expects (N, C) or (N, C, L) input (or channels_last), got ", x.shape());
  if (x.dim() < 1) fail(op, "needs at least 1 dim, got a 0-d tensor");
  const std::int64_t C = x.size(-1), R = C ? x.numel() / C : 0;
  for (auto [what, p] : {std::pair{"weight", &weight}, {"bias", &bias}, {"running_mean", &running_mean},
                         {"running_var", &running_var}})
    detail::check_norm_param(op, what, *p, x, C);
  if (!(eps >= 0) || !std::isfinite(eps)) fail(op, "eps must be finite and >= 0, got ", eps);
  if (running_mean.defined() != running_var.defined()) fail(op, "running_mean and running_var must be given together");
  if (!(momentum >= 0 && momentum <= 1)) fail(op, "momentum must be in [0, 1], got ", momentum);
  const bool batch_stats = training || !running_mean.defined();
  if (batch_stats && R <= 1) fail(op, "expected more than 1 value per channel when training, got input ", x.shape());
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor mean = Tensor::empty(Shape{C}, float64), rstd = Tensor::empty(Shape{C}, x.dtype());  // per channel
  dispatch_float(op, x.dtype(), [&](auto z) {
    batch_norm_forward<decltype(z)>(x, running_mean, running_var, weight, bias, training, momentum, eps, y, mean, rstd, R,
                                    C);
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, mean, rstd; };  // weight undefined when absent
    record(batch_stats ? "batch_norm" : "batch_norm_eval", {&x, &weight, &bias}, {&y},
           Saved{x.detach(), detached(weight), mean, rstd}, [R, C, batch_stats](Node& n, const Saved& s) {
             Tensor dx = n.new_grad(0), dw = n.new_grad(1), db = n.new_grad(2);
             dispatch_float("batch_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               fast::batch_norm_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.mean.data<double>(), s.rstd.data<T>(),
                                         n.grad_out().data<T>(), grad_ptr<T>(dx), grad_ptr<T>(dw), grad_ptr<T>(db), R,
                                         C, batch_stats);
             });
             n.pass_grad(0, std::move(dx)); n.pass_grad(1, std::move(dw)); n.pass_grad(2, std::move(db));
           });
  }
  return y;
}

Tensor weight_norm(const Tensor& v, const Tensor& g) {
  const char* op = "weight_norm";
  detail::check_float(op, v);
  detail::check_float(op, g);
  detail::check_same_dtype(op, v, g);
  if (v.dim() != 2) fail(op, "v must be 2-D (out, in), got ", v.shape());
  if (!(g.shape() == Shape{v.size(0)})) fail(op, "g must have shape (", v.size(0), ",) for v ", v.shape(), ", got ", g.shape());
  const std::int64_t rows = v.size(0), n = v.size(1);
  Tensor w = Tensor::empty(v.shape(), v.dtype()), norm = Tensor::empty(Shape{rows}, v.dtype());  // norm: |v_i|
  dispatch_float(op, v.dtype(), [&](auto z) {
    using T = decltype(z);
    fast::weight_norm_forward(v.data<T>(), g.data<T>(), w.data<T>(), norm.data<T>(), rows, n);
  });
  if (should_record({&v, &g})) {
    struct Saved { Tensor v, g, norm; };
    record(op, {&v, &g}, {&w}, Saved{v.detach(), g.detach(), norm}, [rows, n](Node& nd, const Saved& s) {
      Tensor dv = nd.new_grad(0), dg = nd.new_grad(1);
      dispatch_float("weight_norm", s.v.dtype(), [&](auto z) {
        using T = decltype(z);
        fast::weight_norm_backward(s.v.data<T>(), s.g.data<T>(), s.norm.data<T>(), nd.grad_out().data<T>(),
                                   grad_ptr<T>(dv), grad_ptr<T>(dg), rows, n);
      });
      nd.pass_grad(0, std::move(dv));
      nd.pass_grad(1, std::move(dg));
    });
  }
  return w;
}

}  // namespace tg
