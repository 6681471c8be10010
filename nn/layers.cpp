#include "tapegrad/nn/layers.h"

#include <cmath>
#include <sstream>

#include "tapegrad/ops.h"
#include "tapegrad/random.h"

namespace tg::nn {

namespace {
void check_positive(const char* op, const char* what, std::int64_t v) {
  if (v <= 0) fail(op, what, " must be positive, got ", v);
}
void check_float_dtype(const char* op, DType d) {
  if (!is_floating(d)) fail(op, "parameters must be float32 or float64, got ", d);
}
std::string fmt(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
}  // namespace

Linear::Linear(std::int64_t in, std::int64_t out, bool use_bias, DType dtype) : in_features(in), out_features(out) {
  check_positive("Linear", "in_features", in);
  check_positive("Linear", "out_features", out);
  check_float_dtype("Linear", dtype);
  // PyTorch: kaiming_uniform_(a = sqrt(5)) works out to U(-1/sqrt(in), 1/sqrt(in)), bias likewise.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  Tensor w = Tensor::empty({out, in}, dtype);
  uniform_(w, -bound, bound);
  weight = register_parameter("weight", w);
  if (use_bias) {
    Tensor b = Tensor::empty({out}, dtype);
    uniform_(b, -bound, bound);
    bias = register_parameter("bias", b);
  }
}

Tensor Linear::forward(const Tensor& x) {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != in_features)
    fail("Linear", "expects input (..., ", in_features, "), got ", x.defined() ? x.shape().str() : "undefined");
  return linear(x, weight, bias);  // (..., in) @ (out, in)^T + bias: one gemm over all rows
}

std::string Linear::extra_repr() const {
  return "in_features=" + std::to_string(in_features) + ", out_features=" + std::to_string(out_features) +
         ", bias=" + (bias.defined() ? "true" : "false");
}

Embedding::Embedding(std::int64_t num, std::int64_t dim, DType dtype) : num_embeddings(num), embedding_dim(dim) {
  check_positive("Embedding", "num_embeddings", num);
  check_positive("Embedding", "embedding_dim", dim);
  check_float_dtype("Embedding", dtype);
  weight = register_parameter("weight", randn({num, dim}, dtype));
}

Tensor Embedding::forward(const Tensor& ids) { return embedding(weight, ids); }

std::string Embedding::extra_repr() const {
  return std::to_string(num_embeddings) + ", " + std::to_string(embedding_dim);
}

Dropout::Dropout(double p_) : p(p_) {
  if (!(p >= 0 && p <= 1)) fail("Dropout", "probability must be in [0, 1], got ", p);
}
Tensor Dropout::forward(const Tensor& x) { return dropout(x, p, is_training()); }
std::string Dropout::extra_repr() const { return "p=" + fmt(p); }

GELU::GELU(std::string a) : approximate(std::move(a)) {
  if (approximate != "none" && approximate != "tanh")
    fail("GELU", "approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
}
Tensor GELU::forward(const Tensor& x) { return gelu(x, approximate.c_str()); }

MLP::MLP(std::int64_t n_embd, std::int64_t hidden, bool bias, double p, DType dtype) {
  fc = register_module("fc", std::make_shared<Linear>(n_embd, hidden, bias, dtype));
  gelu = register_module("gelu", std::make_shared<GELU>());
  fc_out = register_module("fc_out", std::make_shared<Linear>(hidden, n_embd, bias, dtype));
  drop = register_module("drop", std::make_shared<Dropout>(p));
}

Tensor MLP::forward(const Tensor& x) { return drop->forward(fc_out->forward(gelu->forward(fc->forward(x)))); }

}  // namespace tg::nn
