#include "invariance/invariance.h"

#include <cmath>

namespace inv {

using namespace tg;

const std::vector<Norm>& all_norms() {
  static const std::vector<Norm> v = {Norm::batchnorm, Norm::weightnorm, Norm::layernorm, Norm::rmsnorm, Norm::prmsnorm};
  return v;
}
const std::vector<Transform>& all_transforms() {
  static const std::vector<Transform> v = {Transform::weight_rescale,   Transform::weight_recenter,
                                           Transform::weight_vector_rescale, Transform::data_rescale,
                                           Transform::data_recenter,   Transform::single_case_rescale};
  return v;
}

std::string name(Norm n) {
  switch (n) {
    case Norm::batchnorm: return "BatchNorm";
    case Norm::weightnorm: return "WeightNorm";
    case Norm::layernorm: return "LayerNorm";
    case Norm::rmsnorm: return "RMSNorm";
    default: return "pRMSNorm";
  }
}
std::string name(Transform t) {
  switch (t) {
    case Transform::weight_rescale: return "weight matrix re-scaling";
    case Transform::weight_recenter: return "weight matrix re-centering";
    case Transform::weight_vector_rescale: return "weight vector re-scaling";
    case Transform::data_rescale: return "dataset re-scaling";
    case Transform::data_recenter: return "dataset re-centering";
    default: return "single training case re-scaling";
  }
}

bool paper_says_invariant(Norm n, Transform t) {
  // rows: BatchNorm, WeightNorm, LayerNorm, RMSNorm, pRMSNorm; columns in all_transforms() order
  static const bool table[5][6] = {{true, false, true, true, true, false},
                                   {true, false, true, false, false, false},
                                   {true, true, false, true, false, true},
                                   {true, false, false, true, false, true},
                                   {true, false, false, true, false, true}};
  return table[static_cast<int>(n)][static_cast<int>(t)];
}

Tensor normalised(Norm norm, const Tensor& W, const Tensor& x, const Setup& s) {
  switch (norm) {
    case Norm::weightnorm: {
      // w_i = g_i v_i / |v_i| with g = 1: only W's row directions matter; no data statistics.
      return matmul(x, weight_norm(W, ones({W.size(0)}, float64)), false, true);
    }
    case Norm::batchnorm:  // per output feature, statistics over the N cases of the batch
      return batch_norm(matmul(x, W, false, true), Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, s.eps);
    case Norm::layernorm:  // per case, over the n features
      return layer_norm(matmul(x, W, false, true), Tensor(), Tensor(), s.eps);
    case Norm::rmsnorm:
      return rms_norm(matmul(x, W, false, true), Tensor(), Tensor(), s.eps, 1.0);
    default:
      return rms_norm(matmul(x, W, false, true), Tensor(), Tensor(), s.eps, s.p);
  }
}

namespace {

struct Data {
  Tensor W, x;
};

Data make(const Setup& s) {
  Generator g(s.seed);
  Data d{randn({s.n, s.m}, float64, &g), randn({s.N, s.m}, float64, &g)};
  // shift the data off-centre so that centring matters
  d.x = add(d.x, 0.5);
  return d;
}

Data transformed(const Data& d, Transform t, const Setup& s) {
  Generator g(s.seed + 1000);
  switch (t) {
    case Transform::weight_rescale: return {mul(d.W, s.delta), d.x};
    case Transform::weight_recenter: {
      // W + 1 gamma^T: the same vector gamma added to every row, so every a_i shifts by gamma^T x
      Tensor gamma = randn({1, s.m}, float64, &g);
      return {add(d.W, gamma), d.x};
    }
    case Transform::weight_vector_rescale: {
      // one scale per row: w_i -> delta_i w_i, delta_i in [0.5, 4.5)
      Tensor deltas = add(mul(rand({s.n, 1}, float64, &g), 4.0), 0.5);
      return {mul(d.W, deltas), d.x};
    }
    case Transform::data_rescale: return {d.W, mul(d.x, s.delta)};
    case Transform::data_recenter: {
      Tensor gamma = randn({1, s.m}, float64, &g);
      return {d.W, add(d.x, gamma)};
    }
    default: {
      // one case alone: x_0 -> delta x_0
      Tensor scale = ones({s.N, 1}, float64);
      scale.set({0, 0}, s.delta);
      return {d.W, mul(d.x, scale)};
    }
  }
}

double max_abs(const Tensor& t) { return max(abs(t)).item(); }

}  // namespace

Cell measure(Norm norm, Transform t, const Setup& s) {
  NoGradGuard ng;
  const Data d = make(s), d2 = transformed(d, t, s);
  const Tensor y = normalised(norm, d.W, d.x, s), y2 = normalised(norm, d2.W, d2.x, s);
  const double change = max_abs(sub(y2, y)) / max_abs(y);
  return {change, change <= kInvariantTol};
}

std::vector<Claim> measure_gradients(const Setup& s, bool partial) {
  // L = sum(tanh(y) * R) for a fixed random R: any smooth function of y would do.
  const Data d = make(s);
  Generator g(s.seed + 7);
  const Tensor R = randn({s.N, s.n}, float64, &g);
  const Tensor gain = add(rand({s.n}, float64, &g), 0.5);
  const Tensor bias = randn({s.n}, float64, &g);
  const double p = partial ? s.p : 1.0;
  struct Grads {
    Tensor dg, db, dW;
  };
  auto grads = [&](const Tensor& W0, const Tensor& x) {
    Tensor W = W0.detach().clone().requires_grad_();
    Tensor gg = gain.clone().requires_grad_(), bb = bias.clone().requires_grad_();
    Tensor y = rms_norm(matmul(x, W, false, true), gg, bb, s.eps, p);
    sum(mul(tanh(y), R)).backward();
    return Grads{gg.grad(), bb.grad(), W.grad()};
  };
  auto l2 = [](const Tensor& t) { return std::sqrt(sum(mul(t, t)).item()); };
  auto claim = [&](std::string what, double expected, const Tensor& now, const Tensor& ref) {
    return Claim{std::move(what), expected, l2(now) / l2(ref), max_abs(sub(now, mul(ref, expected))) / max_abs(ref)};
  };
  const Grads base = grads(d.W, d.x);
  const Grads xs = grads(d.W, mul(d.x, s.delta));
  const Grads ws = grads(mul(d.W, s.delta), d.x);
  std::vector<Claim> out;
  out.push_back(claim("dL/dg unchanged when x -> delta x", 1.0, xs.dg, base.dg));
  out.push_back(claim("dL/db unchanged when x -> delta x", 1.0, xs.db, base.db));
  out.push_back(claim("dL/dg unchanged when W -> delta W", 1.0, ws.dg, base.dg));
  out.push_back(claim("dL/db unchanged when W -> delta W", 1.0, ws.db, base.db));
  out.push_back(claim("dL/dW unchanged when x -> delta x", 1.0, xs.dW, base.dW));
  out.push_back(claim("dL/dW' = dL/dW / delta when W' = delta W", 1.0 / s.delta, ws.dW, base.dW));
  // RMS(alpha a) = alpha RMS(a), row by row
  NoGradGuard ng;
  const Tensor a = matmul(d.x, d.W, false, true);
  auto rms = [](const Tensor& t) { return sqrt(mean(mul(t, t), {-1})); };
  out.push_back(claim("RMS(delta a) = delta RMS(a)", s.delta, rms(mul(a, s.delta)), rms(a)));
  // |RMSNorm(a)|_2 = sqrt(n) with unit gain: compare every row's norm with sqrt(n)
  const Tensor y = rms_norm(a, Tensor(), Tensor(), s.eps, 1.0);
  const Tensor row_norms = sqrt(sum(mul(y, y), {-1}));
  out.push_back(claim("|RMSNorm(a)|_2 = sqrt(n) (gain 1)", std::sqrt(static_cast<double>(s.n)), row_norms,
                      ones({s.N}, float64)));
  return out;
}

}  // namespace inv
