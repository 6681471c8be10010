// The fused normalisation ops: argument checks, forward kernel, one tape node with the
// hand-derived backward (core/kernels/norms.h).
#include <cmath>

#include "dispatch.h"
#include "kernels/isa.h"
#include "kernels/norms.h"
#include "tapegrad/autograd.h"
#include "tapegrad/checkpoint.h"
#include "tapegrad/ops.h"

namespace tg {

using namespace kernels;
using detail::detached;
using detail::dispatch_float;
using detail::opt_ptr;

namespace {

// A per-feature parameter (gain, bias, running statistic) must be undefined or (C,) of x's dtype.
void check_param(const char* op, const char* what, const Tensor& p, const Tensor& x, std::int64_t C) {
  if (!p.defined()) return;
  if (!(p.shape() == Shape{C}))
    fail(op, what, " has shape ", p.shape(), " but the input ", x.shape(), " has ", C, " features");
  if (p.dtype() != x.dtype()) fail(op, what, " is ", p.dtype(), " but the input is ", x.dtype());
}

void check_eps(const char* op, double eps) {
  if (!(eps >= 0) || !std::isfinite(eps)) fail(op, "eps must be finite and >= 0, got ", eps);
}

// The checks shared by the row norms (over the last axis); returns the number of features C.
std::int64_t check_row_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_float(op, x);
  if (x.dim() < 1) fail(op, "needs at least 1 dim, got a 0-d tensor");
  const std::int64_t C = x.size(-1);
  if (C == 0) fail(op, "normalising over 0 features, input ", x.shape());
  check_param(op, "weight", weight, x, C);
  check_param(op, "bias", bias, x, C);
  check_eps(op, eps);
  return C;
}

// RMSNorm's kernels: the AVX2 variant where the build itself targets AVX2 + FMA (TG_RMS_AVX2,
// defined by kernels/rms_avx2.h under -march=native, the TAPEGRAD_NATIVE option), the row fits it
// (rms_avx2::fits: C and k multiples of 8) and kernels::isa() is at least avx2 (TAPEGRAD_ISA can
// cap it); the portable loops otherwise.
template <class T>
void rms_forward(const T* x, const T* g, const T* b, T* y, T* rrms, std::int64_t rows, std::int64_t C, std::int64_t k,
                 double eps) {
#ifdef TG_RMS_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (rms_avx2::fits(C, k) && isa() >= Isa::avx2) return rms_norm_forward_avx2(x, g, b, y, rrms, rows, C, k, eps);
#endif
  rms_norm_forward(x, g, b, y, rrms, rows, C, k, eps);
}
template <class T>
void rms_backward(const T* x, const T* g, const T* rrms, const T* dy, T* dx, T* dg, T* db, std::int64_t rows,
                  std::int64_t C, std::int64_t k, bool acc_dx) {
#ifdef TG_RMS_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (rms_avx2::fits(C, k) && isa() >= Isa::avx2) return rms_norm_backward_avx2(x, g, rrms, dy, dx, dg, db, rows, C, k, acc_dx);
#endif
  rms_norm_backward(x, g, rrms, dy, dx, dg, db, rows, C, k, acc_dx);
}

}  // namespace

std::int64_t prms_k(std::int64_t n, double p) {
  if (!(p > 0 && p <= 1)) fail("prms_k", "p must be in (0, 1], got ", p);
  if (n < 0) fail("prms_k", "n must be >= 0, got ", n);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(static_cast<double>(n) * p - 1e-9)));
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "layer_norm";
  const std::int64_t C = check_row_norm(op, x, weight, bias, eps), rows = x.numel() / C;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor mean = Tensor::empty(Shape{rows}, DType::f64), rstd = Tensor::empty(Shape{rows}, x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    layer_norm_forward(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), mean.data<double>(), rstd.data<T>(),
                       rows, C, eps);
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, mean, rstd; };  // weight undefined when absent
    record(op, {&x, &weight, &bias}, {&y}, Saved{x.detach(), detached(weight), mean, rstd},
           [rows, C](Node& n, const Saved& s) {  // writes dx; adds dweight, dbias
             dispatch_float("layer_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               GradDest dx = n.write_grad(0);
               layer_norm_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.mean.data<double>(), s.rstd.data<T>(),
                                   n.grad_out().data<T>(), dx.ptr<T>(), n.add_grad(1).ptr<T>(), n.add_grad(2).ptr<T>(),
                                   rows, C, dx.acc);
             });
           });
  }
  return y;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, double p) {
  const char* op = "rms_norm";
  const std::int64_t C = check_row_norm(op, x, weight, bias, eps), rows = x.numel() / C;
  if (!(p > 0 && p <= 1)) fail(op, "p must be in (0, 1], got ", p);
  const std::int64_t k = prms_k(C, p);
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor rrms = Tensor::empty(Shape{rows}, x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    rms_forward(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), rrms.data<T>(), rows, C, k, eps);
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, rrms; };  // weight undefined when absent
    record(p < 1 ? "prms_norm" : "rms_norm", {&x, &weight, &bias}, {&y}, Saved{x.detach(), detached(weight), rrms},
           [rows, C, k](Node& n, const Saved& s) {  // writes dx; adds dweight, dbias
             dispatch_float("rms_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               GradDest dx = n.write_grad(0);
               rms_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.rrms.data<T>(), n.grad_out().data<T>(),
                            dx.ptr<T>(), n.add_grad(1).ptr<T>(), n.add_grad(2).ptr<T>(), rows, C, k, dx.acc);
             });
           });
  }
  return y;
}

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps, bool channels_last) {
  const char* op = "batch_norm";
  detail::check_float(op, x);
  if (!channels_last && x.dim() == 3) {
    // (N, C, L): normalise the channels-last view (N, L, C) and come back (two copies, on the tape).
    Tensor y = batch_norm(transpose(x, 1, 2), running_mean, running_var, weight, bias, training, momentum, eps, true);
    return transpose(y, 1, 2);
  }
  if (!channels_last && x.dim() != 2)
    fail(op, "expects (N, C) or (N, C, L) input (or channels_last), got ", x.shape());
  if (x.dim() < 1) fail(op, "needs at least 1 dim, got a 0-d tensor");
  const std::int64_t C = x.size(-1), R = C ? x.numel() / C : 0;
  check_param(op, "weight", weight, x, C);
  check_param(op, "bias", bias, x, C);
  check_param(op, "running_mean", running_mean, x, C);
  check_param(op, "running_var", running_var, x, C);
  check_eps(op, eps);
  if (running_mean.defined() != running_var.defined()) fail(op, "running_mean and running_var must be given together");
  if (!(momentum >= 0 && momentum <= 1)) fail(op, "momentum must be in [0, 1], got ", momentum);
  const bool batch_stats = training || !running_mean.defined();
  if (batch_stats && R <= 1)
    fail(op, "expected more than 1 value per channel when training, got input ", x.shape());

  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor mean = Tensor::empty(Shape{C}, DType::f64);  // per-channel mean used, in double
  Tensor rstd = Tensor::empty(Shape{C}, x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    double* mu = mean.data<double>();
    T* rs = rstd.data<T>();
    if (batch_stats) {
      std::vector<double> var(static_cast<std::size_t>(C));
      batch_norm_forward_train(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), mu, rs, var.data(), R, C, eps);
      if (training && running_mean.defined() && !in_checkpoint_recompute()) {  // updated once per forward
        // PyTorch's rule: the running variance tracks the unbiased batch variance.
        T* rm = Tensor(running_mean).data<T>();
        T* rv = Tensor(running_var).data<T>();
        const double unbias = static_cast<double>(R) / static_cast<double>(R - 1);
        for (std::int64_t c = 0; c < C; ++c) {
          rm[c] = static_cast<T>((1 - momentum) * rm[c] + momentum * mu[c]);
          rv[c] = static_cast<T>((1 - momentum) * rv[c] + momentum * var[static_cast<std::size_t>(c)] * unbias);
        }
      }
    } else {
      const T* rm = running_mean.data<T>();
      const T* rv = running_var.data<T>();
      for (std::int64_t c = 0; c < C; ++c) {
        mu[c] = rm[c];
        rs[c] = static_cast<T>(1.0 / std::sqrt(static_cast<double>(rv[c]) + eps));
      }
      batch_norm_apply(x.data<T>(), opt_ptr<T>(weight), opt_ptr<T>(bias), y.data<T>(), mu, rs, R, C);
    }
  });
  if (should_record({&x, &weight, &bias})) {
    struct Saved { Tensor x, weight, mean, rstd; };  // weight undefined when absent
    record(batch_stats ? "batch_norm" : "batch_norm_eval", {&x, &weight, &bias}, {&y},
           Saved{x.detach(), detached(weight), mean, rstd},
           [R, C, batch_stats](Node& n, const Saved& s) {  // writes dx; adds dweight, dbias
             dispatch_float("batch_norm", s.x.dtype(), [&](auto z) {
               using T = decltype(z);
               GradDest dx = n.write_grad(0);
               batch_norm_backward(s.x.data<T>(), opt_ptr<T>(s.weight), s.mean.data<double>(), s.rstd.data<T>(),
                                   n.grad_out().data<T>(), dx.ptr<T>(), n.add_grad(1).ptr<T>(), n.add_grad(2).ptr<T>(),
                                   R, C, batch_stats, dx.acc);
             });
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
  Tensor w = Tensor::empty(v.shape(), v.dtype());
  Tensor norm = Tensor::empty(Shape{rows}, v.dtype());
  dispatch_float(op, v.dtype(), [&](auto z) {
    using T = decltype(z);
    weight_norm_forward(v.data<T>(), g.data<T>(), w.data<T>(), norm.data<T>(), rows, n);
  });
  if (should_record({&v, &g})) {
    struct Saved { Tensor v, g, norm; };
    record(op, {&v, &g}, {&w}, Saved{v.detach(), g.detach(), norm},
           [rows, n](Node& nd, const Saved& s) {  // writes dv; adds dg
             dispatch_float("weight_norm", s.v.dtype(), [&](auto z) {
               using T = decltype(z);
               GradDest dv = nd.write_grad(0);
               weight_norm_backward(s.v.data<T>(), s.g.data<T>(), s.norm.data<T>(), nd.grad_out().data<T>(), dv.ptr<T>(),
                                    nd.add_grad(1).ptr<T>(), rows, n, dv.acc);
             });
           });
  }
  return w;
}

Tensor scaled_causal_softmax(const Tensor& x, double scale) {
  const char* op = "scaled_causal_softmax";
  detail::check_float(op, x);
  if (x.dim() < 2 || x.size(-1) != x.size(-2)) fail(op, "expects (..., T, T) scores, got ", x.shape());
  if (!std::isfinite(scale)) fail(op, "scale must be finite, got ", scale);
  const std::int64_t Tn = x.size(-1), rows = Tn ? x.numel() / Tn : 0;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    causal_softmax_forward(x.data<T>(), y.data<T>(), rows, Tn, scale);
  });
  if (should_record({&x})) {
    struct Saved { Tensor y; };  // the softmax's output: dx = scale * y * (dy - sum(dy * y))
    record(op, {&x}, {&y}, Saved{y.detach()}, [rows, Tn, scale](Node& n, const Saved& s) {  // writes dx
      dispatch_float("scaled_causal_softmax", s.y.dtype(), [&](auto z) {
        using T = decltype(z);
        GradDest dx = n.write_grad(0);
        causal_softmax_backward(s.y.data<T>(), n.grad_out().data<T>(), dx.ptr<T>(), rows, Tn, scale, dx.acc);
      });
    });
  }
  return y;
}

}  // namespace tg
