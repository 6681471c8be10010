#pragma once
// A GPT as a llama.cpp model file (GGUF, tapegrad/gguf.h) and back. docs/gguf.md has the tables.
//
// The llama arch with RMSNorm maps to llama.cpp's "llama" arch: wte -> token_embd, ln_f ->
// output_norm, head -> output, and per block ln1 -> attn_norm, qkv -> attn_q | attn_k | attn_v,
// proj -> attn_output, ln2 -> ffn_norm, gate_up -> ffn_gate | ffn_up, down -> ffn_down. tapegrad's
// RoPE pairs dimension j of a head with j + hs/2 (Hugging Face's rotate_half); llama.cpp's llama
// arch pairs 2i with 2i + 1. So within every head of q and k, row i of the first half is written
// as row 2i and row i of the second half as row 2i + 1: the same rotations on renamed dimensions,
// and q . k is unchanged because both are renamed alike.
//
// A character vocabulary is written in llama.cpp's SentencePiece form ("llama"): one token per
// character, in id order, the space as U+2581, scores 0, every token NORMAL, no BOS/EOS added and
// no space prefix, so that llama.cpp tokenizes a text character by character to tapegrad's ids.
// A byte-level BPE is written in its GPT-2 form ("gpt2", pre-tokenizer "gpt-2"): the tokens as
// GPT-2's byte-level text in id order, the merges "left right" by rank, added tokens as
// USER_DEFINED (matched as a whole, as tapegrad's BPE matches them), no BOS/EOS added.
#include <cstdint>
#include <string>
#include <vector>

#include "tapegrad/gguf.h"
#include "tapegrad/nn/gpt.h"

namespace tg::nn {

// Why llama.cpp has no equivalent of this configuration, in one line; empty when it has one.
std::string gguf_unsupported_reason(const GPTConfig& cfg);

// The tokenizer of a model file. Not an aggregate, so that a braced list of tokens names a
// character vocabulary (the std::vector<std::string> overloads below).
struct GGUFVocab {
  GGUFVocab() = default;
  // vocab[i] is token i, one UTF-8 character (a space as ' ').
  static GGUFVocab characters(std::vector<std::string> vocab);
  // tokens[i] is token i as GPT-2 byte-level text (tokenizer.json's vocab) or, for the ids in
  // added, its text as it is; merges are "left right" in byte-level text, by rank.
  static GGUFVocab bpe(std::vector<std::string> tokens, std::vector<std::string> merges,
                       std::vector<std::int32_t> added = {});
  bool is_bpe() const { return model == "gpt2"; }
  bool operator==(const GGUFVocab&) const = default;

  std::string model = "llama";        // tokenizer.ggml.model: "llama" (characters) or "gpt2" (BPE)
  std::vector<std::string> tokens;    // in id order
  std::vector<std::string> merges;    // gpt2 only
  std::vector<std::int32_t> added;    // gpt2 only: ids of added tokens, ascending
};

struct GGUFExportOptions {
  DType dtype = float32;       // of the matrices: f32 or bf16 (round to nearest even);
                                  // norm gains stay f32, as llama.cpp's own converter keeps 1-D tensors
  std::string name = "tapegrad";  // general.name
};

// The file's tensors (llama.cpp's names, tapegrad's row-major shapes) and metadata for `model`
// and its character vocabulary (vocab[i] is token i, one UTF-8 character). Throws tg::Error
// naming the reason when the model has no llama.cpp equivalent (gguf_unsupported_reason), when
// the vocabulary does not fit the model, or when a token is not one character or collides with
// U+2581 (the space's stand-in).
GGUFFile to_gguf(const GPT& model, const std::vector<std::string>& vocab, const GGUFExportOptions& options = {});
// A BPE vocabulary is checked too: every token non-empty, every merge two tokens joined by one
// space whose concatenation is a token, added ids in range.
GGUFFile to_gguf(const GPT& model, const GGUFVocab& vocab, const GGUFExportOptions& options = {});
// to_gguf, written with tg::save_gguf (a temporary file renamed into place: nothing is left
// under path when anything fails).
void save_gguf_model(const std::string& path, const GPT& model, const std::vector<std::string>& vocab,
                     const GGUFExportOptions& options = {});
void save_gguf_model(const std::string& path, const GPT& model, const GGUFVocab& vocab,
                     const GGUFExportOptions& options = {});

// A llama-arch GGUF read back as tapegrad's model: its configuration, vocabulary and float32
// state dict (q and k rows put back, qkv and gate_up joined; a missing output takes
// token_embd, llama.cpp's own fallback). Throws tg::Error naming the key or tensor when the file
// is not a model tapegrad's llama can hold (another arch, grouped-query attention, another
// feed-forward width, RoPE base or rotated width, a tokenizer other than characters or GPT-2's
// byte-level BPE). Every width is held to the file: the vocabulary is its tokens, and the embedding,
// feed-forward and head widths and the block count must match tensors it holds. The context length
// is the one size no tensor bounds, yet GPT(config) builds RoPE tables of 2 x context_length x
// head_size values from it, so it is held to kGGUFMaxContext.
inline constexpr std::int64_t kGGUFMaxContext = std::int64_t{1} << 20;  // 1,048,576 positions
struct GGUFModel {
  GPTConfig config;
  GGUFVocab vocab;  // characters (U+2581 back to a space) or a byte-level BPE ("gpt-2" pre-tokenizer)
  StateDict state_dict;            // loads into GPT(config)
};
GGUFModel from_gguf(const GGUFFile& file, const std::string& what = "gguf");
GGUFModel load_gguf_model(const std::string& path);

}  // namespace tg::nn
