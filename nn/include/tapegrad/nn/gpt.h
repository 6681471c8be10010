#pragma once
// A character-level decoder-only transformer in two architectures, each matching the PyTorch
// reference model of the benchmarks (torch_gpt.py --arch gpt|llama), parameter names included:
//   gpt    GPT-2 at toy size: token + learned position embeddings; pre-norm blocks
//          x += proj(attn(ln1(x))), x += fc_out(gelu(fc(ln2(x)))); ln_f; head tied to wte.
//   llama  LLaMA-style (Hugging Face LlamaModel): token embedding only, rotary position embedding
//          on q and k; x += proj(attn(ln1(x))), x += down(silu(gate) * up), [gate | up] =
//          gate_up(ln2(x)); ln_f; an untied head.
// Both: no biases by default, a fused qkv Linear (rows q, k, v), causal softmax attention scaled
// 1/sqrt(hs), any norm (NormKind) in every norm's place.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/nn/norms.h"
#include "tapegrad/random.h"

namespace tg::nn {

enum class Arch { gpt, llama };
Arch parse_arch(const std::string& s);  // "gpt" or "llama"; throws tg::Error naming both
std::string to_string(Arch a);

struct GPTConfig {
  Arch arch = Arch::gpt;
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
  // Throws tg::Error naming the bad field, or the combination: llama needs an even head size
  // (RoPE pairs dimension j with j + hs/2) and has no biases.
  void validate() const;
  std::int64_t head_size() const { return n_embd / n_head; }
  // The MLP's hidden width: 4 n_embd for gpt; for llama 16 ceil(8 n_embd / 3 / 16), the
  // reference's (and LLaMA's) rounding of 2/3 of 4 n_embd to a multiple of 16 (352 at 128).
  std::int64_t ffn_hidden() const;
};

// Multi-head causal self-attention: qkv projection, per-head softmax(q k^T / sqrt(hs)) with future
// positions masked (one fused scaled causal softmax), weighted sum of v, output projection.
class CausalSelfAttention : public UnaryModule {
 public:
  CausalSelfAttention(std::int64_t n_embd, std::int64_t n_head, bool bias = false, double dropout = 0.0,
                      DType dtype = float32);
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  std::string type_name() const override { return "CausalSelfAttention"; }
  std::string extra_repr() const override;
  std::int64_t n_embd, n_head;
  std::shared_ptr<Linear> qkv, proj;
  std::shared_ptr<Dropout> attn_drop, resid_drop;
};

// Keys and values of the positions seen so far, per block, for generation: each new token then
// costs one position's work. k and v are (capacity, C); rows [0, len) hold positions
// [start, start + len) (k already rotated, for llama).
struct KVCache {
  std::vector<Tensor> k, v;  // one per block
  std::int64_t len = 0, start = 0, capacity = 0;
  // Slides the window by one: drops the oldest position's keys and values (rows move up one),
  // so rows [0, len - 1) hold positions [start + 1, start + len).
  void drop_oldest();
};

// Pre-norm block: x + proj(attn(ln1(x))), then x + mlp(ln2(x)), mlp = fc_out(gelu(fc(.))) for gpt
// and down(swiglu(gate_up(.))) for llama. Its Linears sit directly under the block (blocks.i.qkv,
// blocks.i.fc, ...), as in the reference's state dict.
class Block : public UnaryModule {
 public:
  // rope_cos/rope_sin: the model's RoPE tables (llama), shared, not registered (the reference's are
  // non-persistent buffers).
  Block(const GPTConfig& cfg, DType dtype = float32, Tensor rope_cos = Tensor(), Tensor rope_sin = Tensor());
  Tensor forward(const Tensor& x) override;
  // The same on T new positions of one sequence (x (1, T, C)), attending to the cached keys and
  // values of the positions before them as well: k_cache and v_cache are this block's (capacity,
  // C) tables, of which rows [0, len) are filled; the new rows are written at [len, len + T).
  // pos0 is the first new position (RoPE's angle). Generation's step: not recorded.
  Tensor forward_cached(const Tensor& x, Tensor& k_cache, Tensor& v_cache, std::int64_t len, std::int64_t pos0);
  void set_rope_tables(Tensor cos, Tensor sin) { rope_cos_ = std::move(cos); rope_sin_ = std::move(sin); }
  // Activation checkpointing (tg::checkpoint): a recorded forward keeps the block's input only,
  // and the backward recomputes the block's activations when it reaches it. Off by default.
  void set_gradient_checkpointing(bool on = true) { checkpoint_ = on; }
  bool gradient_checkpointing() const { return checkpoint_; }
  std::string type_name() const override { return "Block"; }
  std::shared_ptr<UnaryModule> ln1, ln2;
  std::shared_ptr<Linear> qkv, proj;
  std::shared_ptr<Linear> fc, fc_out;   // gpt
  std::shared_ptr<Linear> gate_up, down;  // llama: gate_up rows [0, ffn) gate, [ffn, 2 ffn) up
  std::shared_ptr<Dropout> attn_drop, resid_drop, mlp_drop;

 private:
  Tensor attention(const Tensor& h, const Tensor& residual);  // (B, T, C) -> (B, T, C) (+ residual)
  Tensor mlp(const Tensor& h, const Tensor& residual);        // the same, mlp_drop not applied
  Tensor attention_half(const Tensor& x);  // x + resid_drop(attention(ln1(x)))
  Tensor mlp_half(const Tensor& h);        // h + mlp_drop(mlp(ln2(h)))
  Arch arch_;
  bool checkpoint_ = false;
  std::int64_t n_head_;
  Tensor rope_cos_, rope_sin_;
};

class GPT : public Module {
 public:
  // Initialised as GPT-2 from the default generator (seed it with tg::manual_seed first), as the
  // reference does for both archs: Linear and Embedding weights N(0, 0.02), the residual
  // projections (proj, and fc_out or down) N(0, 0.02 / sqrt(2 n_layer)), biases 0, norm gains 1.
  explicit GPT(const GPTConfig& cfg, DType dtype = float32);
  Tensor forward(const Tensor& ids);                           // int32 (B, T) -> logits (B, T, V)
  Tensor loss(const Tensor& ids, const Tensor& targets);       // mean cross-entropy
  // Samples n tokens after `prompt` from softmax(logits / temperature) restricted to the top_k
  // most likely tokens (top_k <= 0: all). Runs without recording; returns the new tokens only.
  // With use_cache (the default) every block keeps its keys and values (KVCache), so a new token
  // costs one position's work. Past block_size tokens: gpt (learned positions) crops the context
  // to the last block_size tokens and recomputes it for every token, as without the cache; llama
  // slides its cache (RoPE encodes only relative positions, so the kept keys stay valid; as in
  // sliding-window attention, a kept position's deeper keys still carry what it attended to before
  // the window moved, so this is not the cropped window recomputed, which use_cache = false does).
  std::vector<std::int32_t> generate(const std::vector<std::int32_t>& prompt, std::int64_t n, double temperature = 1.0,
                                     std::int64_t top_k = 0, Generator* gen = nullptr, bool use_cache = true);
  // The logits (1, T, V) of new tokens at positions [cache.start + cache.len, ...), extending the
  // cache (generation's step; no recording). An empty cache is sized by start_cache; a cache that
  // start_cache of another configuration made is refused.
  Tensor forward_cached(const std::vector<std::int32_t>& ids, KVCache& cache);
  KVCache start_cache() const;
  // Activation checkpointing of every block (Block::set_gradient_checkpointing; Hugging Face's
  // gradient_checkpointing_enable()): the backward recomputes the activations one block at a
  // time instead of keeping them from the forward. Same results to the bit; the blocks' forward
  // runs twice, so a step takes 25-40% longer at the medium size (docs/performance.md), for a
  // fraction of the activations' memory.
  // Off by default.
  void set_gradient_checkpointing(bool on = true);
  bool gradient_checkpointing() const;  // every block checkpoints
  std::string type_name() const override { return "GPT"; }
  const GPTConfig& config() const { return cfg_; }
  // Module::load_state_dict, taking the names of earlier versions and of PyTorch's save_model as
  // well (upgrade_state_dict, on a copy): a gpt model's model.safetensors, whose tied head is
  // stored as head.weight, loads as it is.
  void load_state_dict(const StateDict& sd, bool strict = true) override;

  std::shared_ptr<Embedding> wte, wpe;  // wpe: gpt only
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<Block>> blocks;
  std::shared_ptr<UnaryModule> ln_f;
  // llama: the untied output head (V, C). gpt: none, the head is tied to wte: logits = x
  // wte.weight^T (PyTorch's safetensors save_model stores that one tensor as head.weight).
  std::shared_ptr<Linear> head;

 private:
  Tensor logits(const Tensor& x);  // ln_f, then the head
  GPTConfig cfg_;
  Tensor rope_cos_, rope_sin_;  // llama: (block_size, hs)
};

// Renames the state-dict keys of earlier tapegrad versions and of PyTorch's safetensors
// save_model to this version's, in place: blocks.i.attn.{qkv,proj} -> blocks.i.{qkv,proj},
// blocks.i.mlp.{fc,fc_out} -> blocks.i.{fc,fc_out}, and for a tied (gpt) model head.weight ->
// wte.weight when wte.weight is absent. `prefix` is put before every key looked for ("model." in a
// train_lm checkpoint). Returns the number of keys renamed.
std::size_t upgrade_state_dict(StateDict& sd, Arch arch, const std::string& prefix = "");

}  // namespace tg::nn
