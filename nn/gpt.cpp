#include "tapegrad/nn/gpt.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <functional>

#include "tapegrad/autograd.h"

#include "tapegrad/ops.h"
#include "tapegrad/random.h"

namespace tg::nn {

void GPTConfig::validate() const {
  auto pos = [](const char* what, std::int64_t v) {
    if (v <= 0) fail("GPTConfig", what, " must be positive, got ", v);
  };
  pos("vocab_size", vocab_size);
  pos("block_size", block_size);
  pos("n_layer", n_layer);
  pos("n_head", n_head);
  pos("n_embd", n_embd);
  if (n_embd % n_head != 0) fail("GPTConfig", "n_embd ", n_embd, " is not divisible by n_head ", n_head);
  if (!(dropout >= 0 && dropout < 1)) fail("GPTConfig", "dropout must be in [0, 1), got ", dropout);
  if (!(p > 0 && p <= 1)) fail("GPTConfig", "p must be in (0, 1], got ", p);
  if (!(eps >= 0) || !std::isfinite(eps)) fail("GPTConfig", "eps must be finite and >= 0, got ", eps);
}

CausalSelfAttention::CausalSelfAttention(std::int64_t C, std::int64_t H, bool bias, double dropout, DType dtype)
    : n_embd(C), n_head(H) {
  if (C <= 0 || H <= 0 || C % H != 0) fail("CausalSelfAttention", "n_embd ", C, " must be a positive multiple of n_head ", H);
  qkv = register_module("qkv", std::make_shared<Linear>(C, 3 * C, bias, dtype));
  proj = register_module("proj", std::make_shared<Linear>(C, C, bias, dtype));
  attn_drop = register_module("attn_drop", std::make_shared<Dropout>(dropout));
  resid_drop = register_module("resid_drop", std::make_shared<Dropout>(dropout));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  if (!x.defined() || x.dim() != 3 || x.size(2) != n_embd)
    fail("CausalSelfAttention", "expects input (B, T, ", n_embd, "), got ", x.defined() ? x.shape().str() : "undefined");
  const std::int64_t B = x.size(0), T = x.size(1), C = n_embd, H = n_head, hs = C / H;
  Tensor packed = qkv->forward(x);  // (B, T, 3C): q, k, v side by side
  Tensor y;
  if (attn_drop->p == 0 || !attn_drop->is_training()) {
    y = causal_attention(packed, H);  // fused: no copies, one node
  } else {
    // With attention dropout, the textbook path: (B, T, 3, H, hs) -> (3, B, H, T, hs), then
    // softmax(q k^T / sqrt(hs)) over keys j <= i, dropout, weighted sum of v, heads merged.
    std::vector<Tensor> parts = split(permute(packed.reshape({B, T, 3, H, hs}), {2, 0, 3, 1, 4}), 1, 0);
    Tensor q = parts[0].reshape({B, H, T, hs}), k = parts[1].reshape({B, H, T, hs}), v = parts[2].reshape({B, H, T, hs});
    Tensor att = scaled_causal_softmax(matmul(q, k, false, true), 1.0 / std::sqrt(static_cast<double>(hs)));
    y = permute(matmul(attn_drop->forward(att), v), {0, 2, 1, 3}).reshape({B, T, C});
  }
  return resid_drop->forward(proj->forward(y));
}

std::string CausalSelfAttention::extra_repr() const {
  return "n_embd=" + std::to_string(n_embd) + ", n_head=" + std::to_string(n_head);
}

Block::Block(const GPTConfig& cfg, DType dtype) {
  ln1 = register_module("ln1", make_norm(cfg.norm, cfg.n_embd, cfg.eps, cfg.p, dtype));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(cfg.n_embd, cfg.n_head, cfg.bias, cfg.dropout, dtype));
  ln2 = register_module("ln2", make_norm(cfg.norm, cfg.n_embd, cfg.eps, cfg.p, dtype));
  mlp = register_module("mlp", std::make_shared<MLP>(cfg.n_embd, 4 * cfg.n_embd, cfg.bias, cfg.dropout, dtype));
}

Tensor Block::forward(const Tensor& x) {
  Tensor h = x + attn->forward(ln1->forward(x));
  return h + mlp->forward(ln2->forward(h));
}

GPT::GPT(const GPTConfig& cfg, DType dtype) : cfg_(cfg) {
  cfg.validate();
  wte = register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.n_embd, dtype));
  wpe = register_module("wpe", std::make_shared<Embedding>(cfg.block_size, cfg.n_embd, dtype));
  drop = register_module("drop", std::make_shared<Dropout>(cfg.dropout));
  blocks = register_module("blocks", std::make_shared<ModuleList<Block>>());
  for (std::int64_t i = 0; i < cfg.n_layer; ++i) blocks->push_back(std::make_shared<Block>(cfg, dtype));
  ln_f = register_module("ln_f", make_norm(cfg.norm, cfg.n_embd, cfg.eps, cfg.p, dtype));

  // GPT-2 initialisation, in named_parameters order so a seed fixes every weight.
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  for (auto& [name, t] : named_parameters()) {
    const bool is_norm = name.find(".ln") != std::string::npos || name.rfind("ln_f.", 0) == 0;
    if (is_norm) continue;
    Tensor p = t;
    const bool resid = name.find("attn.proj.weight") != std::string::npos || name.find("mlp.fc_out.weight") != std::string::npos;
    if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      std::memset(p.raw_data(), 0, p.nbytes());
    } else {
      normal_(p, 0.0, resid ? resid_std : 0.02);
    }
  }
  name_tensors();
}

Tensor GPT::forward(const Tensor& ids) {
  if (!ids.defined() || ids.dim() != 2 || ids.dtype() != DType::i32)
    fail("GPT", "expects int32 token ids (B, T), got ", ids.defined() ? ids.shape().str() : "undefined",
         ids.defined() ? std::string(" ") + dtype_name(ids.dtype()) : "");
  const std::int64_t T = ids.size(1);
  if (T > cfg_.block_size) fail("GPT", "sequence length ", T, " exceeds block_size ", cfg_.block_size);
  Tensor pos = arange(0.0, static_cast<double>(T), 1.0, DType::i32);
  Tensor x = drop->forward(wte->forward(ids) + wpe->forward(pos));  // (B, T, C) + (T, C)
  for (auto& b : *blocks) x = b->forward(x);
  x = ln_f->forward(x);
  return matmul(x, wte->weight, false, true);  // tied head: (B, T, C) @ (V, C)^T -> (B, T, V)
}

Tensor GPT::loss(const Tensor& ids, const Tensor& targets) {
  Tensor logits = forward(ids);
  if (!targets.defined() || !(targets.shape() == ids.shape()))
    fail("GPT", "targets ", targets.defined() ? targets.shape().str() : "undefined", " must match ids ", ids.shape());
  return cross_entropy(logits.reshape({-1, cfg_.vocab_size}), targets.reshape({-1}));
}

std::vector<std::int32_t> GPT::generate(const std::vector<std::int32_t>& prompt, std::int64_t n, double temperature,
                                        std::int64_t top_k, Generator* gen) {
  if (prompt.empty()) fail("generate", "needs a non-empty prompt");
  if (n < 0) fail("generate", "number of tokens must be >= 0, got ", n);
  if (!(temperature > 0) || !std::isfinite(temperature)) fail("generate", "temperature must be positive, got ", temperature);
  for (std::int32_t t : prompt)
    if (t < 0 || t >= cfg_.vocab_size) fail("generate", "prompt token ", t, " is out of range for vocab ", cfg_.vocab_size);
  Generator& g = gen ? *gen : default_generator();
  NoGradGuard ng;
  const bool was_training = is_training();
  eval();
  std::vector<std::int32_t> ctx = prompt, out;
  const std::int64_t V = cfg_.vocab_size;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t T = std::min<std::int64_t>(static_cast<std::int64_t>(ctx.size()), cfg_.block_size);
    std::vector<std::int32_t> window(ctx.end() - T, ctx.end());
    Tensor logits = forward(from_vector(window, {1, T})).to(DType::f64);  // (1, T, V)
    const double* last = logits.data<double>() + (T - 1) * V;
    std::vector<double> z(last, last + V);
    // keep the top_k largest logits
    if (top_k > 0 && top_k < V) {
      std::vector<double> sorted = z;
      std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<double>());
      const double kth = sorted[static_cast<std::size_t>(top_k - 1)];
      for (double& v : z)
        if (v < kth) v = -INFINITY;
    }
    const double mx = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (double& v : z) s += (v = std::exp((v - mx) / temperature));
    double u = g.next_uniform() * s;
    std::int32_t pick = 0;
    for (std::int64_t k = 0; k < V; ++k) {
      u -= z[static_cast<std::size_t>(k)];
      if (u < 0 || k == V - 1) { pick = static_cast<std::int32_t>(k); break; }
    }
    // a token of probability 0 is never picked, even at the end of the loop
    while (z[static_cast<std::size_t>(pick)] == 0 && pick > 0) --pick;
    ctx.push_back(pick);
    out.push_back(pick);
  }
  train(was_training);
  return out;
}

}  // namespace tg::nn
