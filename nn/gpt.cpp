#include "tapegrad/nn/gpt.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>

#include "tapegrad/autograd.h"
#include "tapegrad/checkpoint.h"

#include "tapegrad/ops.h"
#include "tapegrad/random.h"

namespace tg::nn {

Arch parse_arch(const std::string& s) {
  if (s == "gpt") return Arch::gpt;
  if (s == "llama") return Arch::llama;
  fail("GPTConfig", "unknown arch '", s, "' (expected gpt or llama)");
}

std::string to_string(Arch a) { return a == Arch::llama ? "llama" : "gpt"; }

std::int64_t GPTConfig::ffn_hidden() const {
  if (arch == Arch::gpt) return 4 * n_embd;
  return 16 * ((8 * n_embd + 47) / 48);  // 16 * ceil(8 n_embd / 3 / 16), in integers
}

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
  if (arch == Arch::llama) {
    if (head_size() % 2 != 0)
      fail("GPTConfig", "llama needs an even head size for RoPE: n_embd ", n_embd, " / n_head ", n_head, " = ",
           head_size());
    if (bias) fail("GPTConfig", "llama has no biases (bias must be false)");
  }
}

CausalSelfAttention::CausalSelfAttention(std::int64_t C, std::int64_t H, bool bias, double dropout, DType dtype)
    : n_embd(C), n_head(H) {
  if (C <= 0 || H <= 0 || C % H != 0) fail("CausalSelfAttention", "n_embd ", C, " must be a positive multiple of n_head ", H);
  qkv = register_module("qkv", std::make_shared<Linear>(C, 3 * C, bias, dtype));
  proj = register_module("proj", std::make_shared<Linear>(C, C, bias, dtype));
  attn_drop = register_module("attn_drop", std::make_shared<Dropout>(dropout));
  resid_drop = register_module("resid_drop", std::make_shared<Dropout>(dropout));
}

namespace {

// Multi-head causal attention over a packed qkv (B, T, 3C) -> (B, T, C): softmax(q k^T / sqrt(hs))
// over keys j <= i, the weighted sum of v, heads merged. Without attention dropout one fused op;
// with it, the textbook path: (B, T, 3, H, hs) -> (3, B, H, T, hs), the scores, dropout, then v.
Tensor attend(const Tensor& packed, std::int64_t H, Dropout& attn_drop) {
  if (attn_drop.p == 0 || !attn_drop.is_training()) return causal_attention(packed, H);  // no copies, one node
  const std::int64_t B = packed.size(0), T = packed.size(1), C = packed.size(2) / 3, hs = C / H;
  std::vector<Tensor> parts = split(permute(packed.reshape({B, T, 3, H, hs}), {2, 0, 3, 1, 4}), 1, 0);
  Tensor q = parts[0].reshape({B, H, T, hs}), k = parts[1].reshape({B, H, T, hs}), v = parts[2].reshape({B, H, T, hs});
  Tensor att = scaled_causal_softmax(matmul(q, k, false, true), 1.0 / std::sqrt(static_cast<double>(hs)));
  return permute(matmul(attn_drop.forward(att), v), {0, 2, 1, 3}).reshape({B, T, C});
}

}  // namespace

Tensor CausalSelfAttention::forward(const Tensor& x) {
  if (!x.defined() || x.dim() != 3 || x.size(2) != n_embd)
    fail("CausalSelfAttention", "expects input (B, T, ", n_embd, "), got ", x.defined() ? x.shape().str() : "undefined");
  Tensor packed = qkv->forward(x);  // (B, T, 3C): q, k, v side by side
  return resid_drop->forward(proj->forward(attend(packed, n_head, *attn_drop)));
}

std::string CausalSelfAttention::extra_repr() const {
  return "n_embd=" + std::to_string(n_embd) + ", n_head=" + std::to_string(n_head);
}

Block::Block(const GPTConfig& cfg, DType dtype, Tensor rope_cos, Tensor rope_sin)
    : arch_(cfg.arch), n_head_(cfg.n_head), rope_cos_(std::move(rope_cos)), rope_sin_(std::move(rope_sin)) {
  const std::int64_t C = cfg.n_embd, F = cfg.ffn_hidden();
  ln1 = register_module("ln1", make_norm(cfg.norm, C, cfg.eps, cfg.p, dtype));
  qkv = register_module("qkv", std::make_shared<Linear>(C, 3 * C, cfg.bias, dtype));
  proj = register_module("proj", std::make_shared<Linear>(C, C, cfg.bias, dtype));
  ln2 = register_module("ln2", make_norm(cfg.norm, C, cfg.eps, cfg.p, dtype));
  if (arch_ == Arch::gpt) {
    fc = register_module("fc", std::make_shared<Linear>(C, F, cfg.bias, dtype));
    fc_out = register_module("fc_out", std::make_shared<Linear>(F, C, cfg.bias, dtype));
  } else {
    gate_up = register_module("gate_up", std::make_shared<Linear>(C, 2 * F, cfg.bias, dtype));
    down = register_module("down", std::make_shared<Linear>(F, C, cfg.bias, dtype));
  }
  attn_drop = register_module("attn_drop", std::make_shared<Dropout>(cfg.dropout));
  resid_drop = register_module("resid_drop", std::make_shared<Dropout>(cfg.dropout));
  mlp_drop = register_module("mlp_drop", std::make_shared<Dropout>(cfg.dropout));
}

namespace {
// A dropout that passes its input through unchanged (p = 0, or evaluation).
bool passes_through(const Dropout& d) { return d.p == 0 || !d.is_training(); }
}  // namespace

// qkv, RoPE on q and k (llama), causal attention, proj; a defined residual is added in proj's
// epilogue (tg::linear's residual).
Tensor Block::attention(const Tensor& h, const Tensor& residual) {
  const std::int64_t C = h.size(2);
  Tensor packed = qkv->forward(h);  // (B, T, 3C): q, k, v side by side
  if (arch_ == Arch::llama) packed = rope(packed, rope_cos_, rope_sin_, C / n_head_, 2 * C);  // q and k; v as it is
  const Tensor y = attend(packed, n_head_, *attn_drop);
  return residual.defined() ? linear(y, proj->weight, proj->bias, residual) : proj->forward(y);
}

// fc, GELU, fc_out (gpt) or gate_up, SwiGLU, down (llama) as one op (tg::mlp: the activation in
// the products' epilogues, and x w1^T + b1 kept instead of the activation and its derivative);
// the same bits as the three modules called in turn, except under autocast, where the op rounds
// x w1^T + b1 to bf16 before the activation as PyTorch's autocast does (composite::mlp spells it
// out; nn::MLP's modules do not round). A defined residual is added as fc_out
// finishes. The op reads the Linears' parameters directly: their forward() is not called (as
// attention's proj with a residual), so a subclass of Linear would not be seen here.
Tensor Block::mlp(const Tensor& h, const Tensor& residual) {
  if (arch_ == Arch::gpt) return tg::mlp(h, fc->weight, fc->bias, fc_out->weight, fc_out->bias, "gelu", residual);
  return tg::mlp(h, gate_up->weight, gate_up->bias, down->weight, down->bias, "swiglu", residual);
}

// x + dropout(branch): with the dropout passing through, the residual add happens inside the
// branch's last product (the same bits as the add).
Tensor Block::attention_half(const Tensor& x) {
  if (passes_through(*resid_drop)) return attention(ln1->forward(x), x);
  return x + resid_drop->forward(attention(ln1->forward(x), Tensor()));
}
Tensor Block::mlp_half(const Tensor& h) {
  if (passes_through(*mlp_drop)) return mlp(ln2->forward(h), h);
  return h + mlp_drop->forward(mlp(ln2->forward(h), Tensor()));
}

Tensor Block::forward(const Tensor& x) {
  if (!x.defined() || x.dim() != 3 || x.size(2) != qkv->in_features)
    fail("Block", "expects input (B, T, ", qkv->in_features, "), got ", x.defined() ? x.shape().str() : "undefined");
  if (!checkpoint_ || !grad_enabled()) return mlp_half(attention_half(x));
  // One node that keeps x; the parameters are named so that their gradients reach them.
  return checkpoint([this](const Tensor& in) { return mlp_half(attention_half(in)); }, x, parameters());
}

void GPT::set_gradient_checkpointing(bool on) {
  for (auto& b : *blocks) b->set_gradient_checkpointing(on);
}

bool GPT::gradient_checkpointing() const {
  return std::all_of(blocks->begin(), blocks->end(), [](const auto& b) { return b->gradient_checkpointing(); });
}

GPT::GPT(const GPTConfig& cfg, DType dtype) : cfg_(cfg) {
  cfg.validate();
  wte = register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.n_embd, dtype));
  if (cfg.arch == Arch::gpt) wpe = register_module("wpe", std::make_shared<Embedding>(cfg.block_size, cfg.n_embd, dtype));
  else std::tie(rope_cos_, rope_sin_) = rope_tables(cfg.block_size, cfg.head_size(), 10000.0, dtype);
  drop = register_module("drop", std::make_shared<Dropout>(cfg.dropout));
  blocks = register_module("blocks", std::make_shared<ModuleList<Block>>());
  for (std::int64_t i = 0; i < cfg.n_layer; ++i) blocks->push_back(std::make_shared<Block>(cfg, dtype, rope_cos_, rope_sin_));
  ln_f = register_module("ln_f", make_norm(cfg.norm, cfg.n_embd, cfg.eps, cfg.p, dtype));
  if (cfg.arch == Arch::llama) head = register_module("head", std::make_shared<Linear>(cfg.n_embd, cfg.vocab_size, false, dtype));

  // GPT-2 initialisation, in named_parameters order so a seed fixes every weight.
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (auto& [name, t] : named_parameters()) {
    const bool is_norm = name.find(".ln") != std::string::npos || name.rfind("ln_f.", 0) == 0;
    if (is_norm) continue;
    Tensor p = t;
    const bool resid = ends_with(name, ".proj.weight") || ends_with(name, ".fc_out.weight") || ends_with(name, ".down.weight");
    if (ends_with(name, ".bias")) std::memset(p.raw_data(), 0, p.nbytes());
    else normal_(p, 0.0, resid ? resid_std : 0.02);
  }
  name_tensors();
}

Tensor GPT::logits(const Tensor& x) {
  Tensor h = ln_f->forward(x);
  if (head) return head->forward(h);             // llama: untied (B, T, C) -> (B, T, V)
  return matmul(h, wte->weight, false, true);  // tied head: (B, T, C) @ (V, C)^T -> (B, T, V)
}

Tensor GPT::forward(const Tensor& ids) {
  if (!ids.defined() || ids.dim() != 2 || ids.dtype() != int32)
    fail("GPT", "expects int32 token ids (B, T), got ", ids.defined() ? ids.shape().str() : "undefined",
         ids.defined() ? std::string(" ") + dtype_name(ids.dtype()) : "");
  const std::int64_t T = ids.size(1);
  if (T > cfg_.block_size) fail("GPT", "sequence length ", T, " exceeds block_size ", cfg_.block_size);
  Tensor x = wte->forward(ids);
  if (wpe) x = x + wpe->forward(arange(0.0, static_cast<double>(T), 1.0, int32));  // (B, T, C) + (T, C)
  x = drop->forward(x);
  for (auto& b : *blocks) x = b->forward(x);
  return logits(x);
}

Tensor GPT::loss(const Tensor& ids, const Tensor& targets) {
  Tensor logits = forward(ids);
  if (!targets.defined() || !(targets.shape() == ids.shape()))
    fail("GPT", "targets ", targets.defined() ? targets.shape().str() : "undefined", " must match ids ", ids.shape());
  return cross_entropy(logits.reshape({-1, cfg_.vocab_size}), targets.reshape({-1}));
}

void GPT::load_state_dict(const StateDict& sd, bool strict) {
  StateDict named = sd;  // shares the tensors; only the names change
  upgrade_state_dict(named, cfg_.arch);
  Module::load_state_dict(named, strict);
}

std::size_t upgrade_state_dict(StateDict& sd, Arch arch, const std::string& prefix) {
  const std::pair<std::string, std::string> legacy[] = {
      {".attn.qkv.", ".qkv."}, {".attn.proj.", ".proj."}, {".mlp.fc.", ".fc."}, {".mlp.fc_out.", ".fc_out."}};
  const bool tied_as_head =
      arch == Arch::gpt && sd.contains(prefix + "head.weight") && !sd.contains(prefix + "wte.weight");
  StateDict out;
  std::size_t renamed = 0;
  for (const auto& [key, t] : sd) {
    std::string name = key;
    if (key.rfind(prefix + "blocks.", 0) == 0)
      for (const auto& [from, to] : legacy)
        if (const auto at = name.find(from); at != std::string::npos) name.replace(at, from.size(), to);
    if (tied_as_head && key == prefix + "head.weight") name = prefix + "wte.weight";
    if (name != key && sd.contains(name)) fail("upgrade_state_dict", "both '", key, "' and '", name, "' are present");
    renamed += name != key;
    out.insert(name, t);
  }
  sd = std::move(out);
  return renamed;
}

}  // namespace tg::nn
