#include "tapegrad/nn/norms.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "tapegrad/autograd.h"
#include "tapegrad/checkpoint.h"
#include "tapegrad/ops.h"

namespace tg::nn {

namespace {
void check_features(const char* op, std::int64_t n, double eps, DType dtype) {
  if (n <= 0) fail(op, "number of features must be positive, got ", n);
  if (!(eps >= 0) || !std::isfinite(eps)) fail(op, "eps must be finite and >= 0, got ", eps);
  if (!is_floating(dtype)) fail(op, "parameters must be float32 or float64, got ", dtype);
}
void check_input(const char* op, const Tensor& x, std::int64_t n) {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != n)
    fail(op, "expects input (..., ", n, "), got ", x.defined() ? x.shape().str() : "undefined");
}
}  // namespace

LayerNorm::LayerNorm(std::int64_t n_, double eps_, bool affine, bool use_bias, DType dtype) : n(n_), eps(eps_) {
  check_features("LayerNorm", n, eps, dtype);
  if (affine) weight = register_parameter("weight", ones({n}, dtype));
  if (affine && use_bias) bias = register_parameter("bias", zeros({n}, dtype));
}
Tensor LayerNorm::forward(const Tensor& x) {
  check_input("LayerNorm", x, n);
  return layer_norm(x, weight, bias, eps);
}
std::string LayerNorm::extra_repr() const {
  std::ostringstream s;
  s << '(' << n << ",), eps=" << eps << ", elementwise_affine=" << (weight.defined() ? "true" : "false")
    << ", bias=" << (bias.defined() ? "true" : "false");
  return s.str();
}

RMSNorm::RMSNorm(std::int64_t n_, double eps_, bool use_weight, bool use_bias, double p_, DType dtype)
    : n(n_), eps(eps_), p(p_) {
  check_features("RMSNorm", n, eps, dtype);
  if (!(p > 0 && p <= 1)) fail("RMSNorm", "p must be in (0, 1], got ", p);
  if (use_weight) weight = register_parameter("weight", ones({n}, dtype));
  if (use_bias) bias = register_parameter("bias", zeros({n}, dtype));
}
Tensor RMSNorm::forward(const Tensor& x) {
  check_input(p < 1 ? "pRMSNorm" : "RMSNorm", x, n);
  return rms_norm(x, weight, bias, eps, p);
}
std::string RMSNorm::extra_repr() const {
  std::ostringstream s;
  s << '(' << n << ",), eps=" << eps;
  if (p < 1) s << ", p=" << p << " (k=" << prms_k(n, p) << ')';
  return s.str();
}

BatchNorm1d::BatchNorm1d(std::int64_t n_, double eps_, double momentum_, bool affine, bool track, bool cl, DType dtype)
    : n(n_), eps(eps_), momentum(momentum_), channels_last(cl) {
  check_features("BatchNorm1d", n, eps, dtype);
  if (!(momentum >= 0 && momentum <= 1)) fail("BatchNorm1d", "momentum must be in [0, 1], got ", momentum);
  if (affine) {
    weight = register_parameter("weight", ones({n}, dtype));
    bias = register_parameter("bias", zeros({n}, dtype));
  }
  if (track) {
    running_mean = register_buffer("running_mean", zeros({n}, dtype));
    running_var = register_buffer("running_var", ones({n}, dtype));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, int32));
  }
}
Tensor BatchNorm1d::forward(const Tensor& x) {
  if (!x.defined()) fail("BatchNorm1d", "input is undefined");
  const int cdim = channels_last || x.dim() < 2 ? x.dim() - 1 : 1;
  if (x.dim() < 1 || x.size(cdim) != n)
    fail("BatchNorm1d", "expects ", channels_last ? "(..., C)" : "(N, C) or (N, C, L)", " with C = ", n, ", got ", x.shape());
  Tensor y = batch_norm(x, running_mean, running_var, weight, bias, is_training(), momentum, eps, channels_last);
  if (is_training() && num_batches_tracked.defined() && !in_checkpoint_recompute())  // counted once per forward
    num_batches_tracked.data<std::int32_t>()[0] += 1;
  return y;
}
std::string BatchNorm1d::extra_repr() const {
  std::ostringstream s;
  s << n << ", eps=" << eps << ", momentum=" << momentum << ", affine=" << (weight.defined() ? "true" : "false")
    << ", track_running_stats=" << (running_mean.defined() ? "true" : "false") << (channels_last ? ", channels_last=true" : "");
  return s.str();
}

WeightNorm::WeightNorm(std::int64_t in, std::int64_t out, bool use_bias, DType dtype)
    : WeightNorm(Linear(in, out, use_bias, dtype)) {}

WeightNorm::WeightNorm(const Linear& lin) : in_features(lin.in_features), out_features(lin.out_features) {
  Tensor v = lin.weight.detach().clone();
  Tensor g;
  {
    NoGradGuard ng;
    g = sqrt(sum(v * v, {1}));  // |v_i|, so w = v at the start
  }
  weight_g = register_parameter("weight_g", g);
  weight_v = register_parameter("weight_v", v);
  if (lin.bias.defined()) bias = register_parameter("bias", lin.bias.detach().clone());
}
Tensor WeightNorm::weight() const { return weight_norm(weight_v, weight_g); }
Tensor WeightNorm::forward(const Tensor& x) {
  check_input("WeightNorm", x, in_features);
  return linear(x, weight(), bias);  // as Linear, with w = g v / |v| (1-D inputs included)
}
std::string WeightNorm::extra_repr() const {
  return "in_features=" + std::to_string(in_features) + ", out_features=" + std::to_string(out_features) +
         ", bias=" + (bias.defined() ? "true" : "false");
}

NormKind parse_norm_kind(const std::string& s) {
  if (s == "layernorm") return NormKind::layernorm;
  if (s == "rmsnorm") return NormKind::rmsnorm;
  if (s == "prmsnorm") return NormKind::prmsnorm;
  if (s == "batchnorm") return NormKind::batchnorm;
  if (s == "none") return NormKind::none;
  fail("norm", "unknown norm '", s, "' (choose layernorm, rmsnorm, prmsnorm, batchnorm or none)");
}

std::string to_string(NormKind k) {
  switch (k) {
    case NormKind::layernorm: return "layernorm";
    case NormKind::rmsnorm: return "rmsnorm";
    case NormKind::prmsnorm: return "prmsnorm";
    case NormKind::batchnorm: return "batchnorm";
    default: return "none";
  }
}

std::shared_ptr<UnaryModule> make_norm(NormKind kind, std::int64_t n, double eps, double p, DType dtype) {
  switch (kind) {
    case NormKind::layernorm: return std::make_shared<LayerNorm>(n, eps, true, true, dtype);
    case NormKind::rmsnorm: return std::make_shared<RMSNorm>(n, eps, true, false, 1.0, dtype);
    case NormKind::prmsnorm: return std::make_shared<RMSNorm>(n, eps, true, false, p, dtype);
    case NormKind::batchnorm: return std::make_shared<BatchNorm1d>(n, eps, 0.1, true, true, true, dtype);
    default: return std::make_shared<Identity>();
  }
}

}  // namespace tg::nn
