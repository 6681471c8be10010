#pragma once
// A character-level GPT: the pre-norm transformer of GPT-2 at toy size, matching the PyTorch
// reference model used by the benchmarks (no biases, tied input and output embeddings, GELU MLP).
#include <cstdint>
#include <memory>
#include <string>

#include <vector>

#include "tapegrad/nn/norms.h"
#include "tapegrad/random.h"

namespace tg::nn {

struct GPTConfig {
  std::int64_t vocab_size = 65;
  std::int64_t block_size = 64;  // context length
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;
  bool bias = false;             // biases in Linear layers
  NormKind norm = NormKind::rmsnorm;
  double p = 0.0625;             // pRMSNorm's fraction of features
  double eps = 1e-5;
  void validate() const;         // throws tg::Error naming the bad field
};

// Multi-head causal self-attention: qkv projection, per-head softmax(q k^T / sqrt(hs)) with future
// positions masked (one fused scaled causal softmax), weighted sum of v, output projection.
class CausalSelfAttention : public UnaryModule {
 public:
  CausalSelfAttention(std::int64_t n_embd, std::int64_t n_head, bool bias = false, double dropout = 0.0,
                      DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  std::string type_name() const override { return "CausalSelfAttention"; }
  std::string extra_repr() const override;
  std::int64_t n_embd, n_head;
  std::shared_ptr<Linear> qkv, proj;
  std::shared_ptr<Dropout> attn_drop, resid_drop;
};

// Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)).
class Block : public UnaryModule {
 public:
  Block(const GPTConfig& cfg, DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Block"; }
  std::shared_ptr<UnaryModule> ln1, ln2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
};

class GPT : public Module {
 public:
  // Initialised as GPT-2 from the default generator (seed it with tg::manual_seed first):
  // Linear and Embedding weights N(0, 0.02), residual projections (attn.proj, mlp.fc_out)
  // N(0, 0.02 / sqrt(2 n_layer)), biases 0, norm gains 1.
  explicit GPT(const GPTConfig& cfg, DType dtype = DType::f32);
  Tensor forward(const Tensor& ids);                           // int32 (B, T) -> logits (B, T, V)
  Tensor loss(const Tensor& ids, const Tensor& targets);       // mean cross-entropy
  // Samples n tokens after `prompt` (the context is cropped to block_size), from
  // softmax(logits / temperature) restricted to the top_k most likely tokens (top_k <= 0: all).
  // Runs without recording; returns the new tokens only.
  std::vector<std::int32_t> generate(const std::vector<std::int32_t>& prompt, std::int64_t n, double temperature = 1.0,
                                     std::int64_t top_k = 0, Generator* gen = nullptr);
  std::string type_name() const override { return "GPT"; }
  const GPTConfig& config() const { return cfg_; }

  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<Block>> blocks;
  std::shared_ptr<UnaryModule> ln_f;
  // The output head is tied to wte: logits = x wte.weight^T (no separate parameter).

 private:
  GPTConfig cfg_;
};

}  // namespace tg::nn
