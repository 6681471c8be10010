#pragma once
// The four normalisations compared by Zhang & Sennrich (2019), as modules over the fused ops of
// core (tg::layer_norm, tg::rms_norm, tg::batch_norm, tg::weight_norm).
#include <cstdint>
#include <memory>
#include <string>

#include "tapegrad/nn/layers.h"

namespace tg::nn {

// torch.nn.LayerNorm over the last dimension (normalized_shape = (n,)). bias = false as PyTorch >= 2.1.
class LayerNorm : public UnaryModule {
 public:
  explicit LayerNorm(std::int64_t n, double eps = 1e-5, bool elementwise_affine = true, bool bias = true,
                     DType dtype = float32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LayerNorm"; }
  std::string extra_repr() const override;
  std::int64_t n;
  double eps;
  Tensor weight, bias;  // (n,), either may be undefined
};

// RMSNorm: x / sqrt(mean(x[..., :k]^2) + eps) * weight (+ bias), k = ceil(n p).
// p = 1: RMSNorm; p < 1: partial RMSNorm (the paper uses p = 6.25%). eps defaults to 1e-5 here
// (torch.nn.RMSNorm's default is float32 machine epsilon; LLaMA uses 1e-6): it sits inside the
// square root, so it only matters for rows whose mean square is near eps.
class RMSNorm : public UnaryModule {
 public:
  explicit RMSNorm(std::int64_t n, double eps = 1e-5, bool weight = true, bool bias = false, double p = 1.0,
                   DType dtype = float32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return p < 1 ? "pRMSNorm" : "RMSNorm"; }
  std::string extra_repr() const override;
  std::int64_t n;
  double eps, p;
  Tensor weight, bias;
};

// torch.nn.BatchNorm1d over (N, C) or (N, C, L), or with channels_last over (..., C) (a (B, T, C)
// activation normalised over B*T rows, which PyTorch needs a reshape for). Buffers running_mean,
// running_var and num_batches_tracked (int32 here, int64 in PyTorch). momentum = None (the
// cumulative average) is not supported.
class BatchNorm1d : public UnaryModule {
 public:
  explicit BatchNorm1d(std::int64_t n, double eps = 1e-5, double momentum = 0.1, bool affine = true,
                       bool track_running_stats = true, bool channels_last = false, DType dtype = float32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "BatchNorm1d"; }
  std::string extra_repr() const override;
  std::int64_t n;
  double eps, momentum;
  bool channels_last;
  Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};

// A Linear whose weight is reparameterised as w = g v / |v| per output row (Salimans & Kingma 2016;
// torch.nn.utils.weight_norm(Linear, dim=0), whose weight_g has shape (out, 1) where ours is (out,)).
class WeightNorm : public UnaryModule {
 public:
  WeightNorm(std::int64_t in_features, std::int64_t out_features, bool bias = true, DType dtype = float32);
  // Takes over a Linear: v = its weight, g = its rows' norms (so the function is unchanged), same bias.
  explicit WeightNorm(const Linear& linear);
  Tensor forward(const Tensor& x) override;
  Tensor weight() const;  // g v / |v|, recorded on the tape
  std::string type_name() const override { return "WeightNorm"; }
  std::string extra_repr() const override;
  std::int64_t in_features, out_features;
  Tensor weight_g, weight_v, bias;
};

enum class NormKind { layernorm, rmsnorm, prmsnorm, batchnorm, none };
NormKind parse_norm_kind(const std::string& s);  // throws tg::Error listing the valid names
std::string to_string(NormKind k);

// The norm a transformer uses for width n: batchnorm is channels-last; prmsnorm uses p.
std::shared_ptr<UnaryModule> make_norm(NormKind kind, std::int64_t n, double eps = 1e-5, double p = 0.0625,
                                       DType dtype = float32);

}  // namespace tg::nn
