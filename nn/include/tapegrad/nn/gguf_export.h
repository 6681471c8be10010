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
// The tokenizer is written as a character vocabulary in llama.cpp's SentencePiece form
// ("llama"): one token per character, in id order, the space as U+2581, scores 0, every token
// NORMAL, no BOS/EOS added and no space prefix, so that llama.cpp tokenizes a text character by
// character to tapegrad's ids.
#include <string>
#include <vector>

#include "tapegrad/gguf.h"
#include "tapegrad/nn/gpt.h"

namespace tg::nn {

// Why llama.cpp has no equivalent of this configuration, in one line; empty when it has one.
std::string gguf_unsupported_reason(const GPTConfig& cfg);

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
// to_gguf, written with tg::save_gguf (a temporary file renamed into place: nothing is left
// under path when anything fails).
void save_gguf_model(const std::string& path, const GPT& model, const std::vector<std::string>& vocab,
                     const GGUFExportOptions& options = {});

// A llama-arch GGUF read back as tapegrad's model: its configuration, vocabulary and float32
// state dict (q and k rows put back, qkv and gate_up joined; a missing output takes
// token_embd, llama.cpp's own fallback). Throws tg::Error naming the key or tensor when the file
// is not a model tapegrad's llama can hold (another arch, grouped-query attention, another
// feed-forward width, RoPE base or rotated width).
struct GGUFModel {
  GPTConfig config;
  std::vector<std::string> vocab;  // token i, UTF-8 (U+2581 back to a space)
  StateDict state_dict;            // loads into GPT(config)
};
GGUFModel from_gguf(const GGUFFile& file, const std::string& what = "gguf");
GGUFModel load_gguf_model(const std::string& path);

}  // namespace tg::nn
