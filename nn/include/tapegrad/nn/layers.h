#pragma once
// Basic layers. Constructor arguments and defaults follow torch.nn; every constructor also takes
// the dtype of its parameters (float32 by default; float64 for exact checks).
#include <cstdint>
#include <string>

#include "tapegrad/nn/module.h"

namespace tg::nn {

// y = x W^T + b, W (out, in). Initialised as PyTorch: U(-1/sqrt(in), 1/sqrt(in)) for W and b.
class Linear : public UnaryModule {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true, DType dtype = float32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Linear"; }
  std::string extra_repr() const override;
  std::int64_t in_features, out_features;
  Tensor weight;  // (out, in)
  Tensor bias;    // (out,) or undefined
};

// Rows of weight (num, dim) picked by int32 ids. Initialised N(0, 1) as PyTorch.
class Embedding : public UnaryModule {
 public:
  Embedding(std::int64_t num_embeddings, std::int64_t embedding_dim, DType dtype = float32);
  Tensor forward(const Tensor& ids) override;
  std::string type_name() const override { return "Embedding"; }
  std::string extra_repr() const override;
  std::int64_t num_embeddings, embedding_dim;
  Tensor weight;
};

class Dropout : public UnaryModule {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Dropout"; }
  std::string extra_repr() const override;
  double p;
};

class GELU : public UnaryModule {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "GELU"; }
  std::string extra_repr() const override { return "approximate='" + approximate + "'"; }
  std::string approximate;
};

class Identity : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override { return x; }
  std::string type_name() const override { return "Identity"; }
};

// The transformer's feed-forward block: fc (C -> hidden), GELU, fc_out (hidden -> C), dropout.
class MLP : public UnaryModule {
 public:
  MLP(std::int64_t n_embd, std::int64_t hidden, bool bias = false, double dropout = 0.0, DType dtype = float32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "MLP"; }
  std::shared_ptr<Linear> fc, fc_out;
  std::shared_ptr<GELU> gelu;
  std::shared_ptr<Dropout> drop;
};

}  // namespace tg::nn
