#include "tapegrad/nn/gguf_export.h"

#include <cmath>
#include <cstring>
#include <map>

namespace tg::nn {

namespace {

constexpr const char* kSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's stand-in for a space
constexpr double kRopeBase = 10000.0;           // tapegrad's llama (GPT builds its tables with it)
constexpr std::uint32_t kFileTypeF32 = 0, kFileTypeBF16 = 32;  // llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_BF16
constexpr std::int32_t kTokenNormal = 1;                        // llama.cpp's LLAMA_TOKEN_TYPE_NORMAL
constexpr std::int32_t kTokenUserDefined = 4;                   // LLAMA_TOKEN_TYPE_USER_DEFINED

// Bytes of the UTF-8 sequence that starts with lead byte b, 0 when b cannot start one.
int utf8_length(unsigned char b) { return b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0; }

bool is_one_character(const std::string& s) {
  if (s.empty() || static_cast<std::size_t>(utf8_length(static_cast<unsigned char>(s[0]))) != s.size()) return false;
  for (std::size_t i = 1; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) >> 6) != 2) return false;
  return true;
}

// Rows [begin, end) of a matrix, as a new contiguous tensor.
Tensor rows(const Tensor& w, std::int64_t begin, std::int64_t end) {
  const std::int64_t cols = w.size(1);
  Tensor out = Tensor::empty({end - begin, cols}, w.dtype());
  const std::size_t skip = static_cast<std::size_t>(begin * cols) * itemsize(w.dtype());
  std::memcpy(out.raw_data(), static_cast<const char*>(w.raw_data()) + skip, out.nbytes());
  return out;
}

// The parts' rows, stacked in order (all parts have the same columns).
Tensor stack_rows(const std::vector<Tensor>& parts) {
  std::int64_t r = 0;
  for (const Tensor& p : parts) r += p.size(0);
  Tensor out = Tensor::empty({r, parts[0].size(1)}, parts[0].dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (const Tensor& p : parts) {
    std::memcpy(dst, p.raw_data(), p.nbytes());
    dst += p.nbytes();
  }
  return out;
}

// The RoPE row order within each head of a (H hs, C) projection. to_llama: HF's rotate_half
// order -> llama.cpp's adjacent pairs (row i -> 2i, row hs/2 + i -> 2i + 1); else the inverse.
Tensor permute_heads(const Tensor& w, std::int64_t hs, bool to_llama) {
  Tensor out = Tensor::empty(w.shape(), w.dtype());
  const std::size_t row = static_cast<std::size_t>(w.size(1)) * itemsize(w.dtype());
  const char* src = static_cast<const char*>(w.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const std::int64_t half = hs / 2;
  for (std::int64_t h0 = 0; h0 < w.size(0); h0 += hs)
    for (std::int64_t i = 0; i < half; ++i)
      for (std::int64_t s = 0; s < 2; ++s) {
        const std::int64_t hf = h0 + s * half + i, ll = h0 + 2 * i + s;  // the same row in either order
        const std::int64_t from = to_llama ? hf : ll, to = to_llama ? ll : hf;
        std::memcpy(dst + static_cast<std::size_t>(to) * row, src + static_cast<std::size_t>(from) * row, row);
      }
  return out;
}

void set_u32(GGUFMetadata& md, const std::string& key, std::int64_t v) {
  md.set(key, GGUFValue::of_u32(static_cast<std::uint32_t>(v)));
}

GGUFMetadata model_metadata(const GPTConfig& c, const GGUFExportOptions& o) {
  GGUFMetadata md;
  md.set("general.architecture", GGUFValue::of_string("llama"));
  md.set("general.name", GGUFValue::of_string(o.name));
  set_u32(md, "general.file_type", o.dtype == bfloat16 ? kFileTypeBF16 : kFileTypeF32);
  set_u32(md, "general.alignment", static_cast<std::int64_t>(kGGUFDefaultAlignment));
  set_u32(md, "llama.vocab_size", c.vocab_size);
  set_u32(md, "llama.context_length", c.block_size);
  set_u32(md, "llama.embedding_length", c.n_embd);
  set_u32(md, "llama.block_count", c.n_layer);
  set_u32(md, "llama.feed_forward_length", c.ffn_hidden());
  set_u32(md, "llama.attention.head_count", c.n_head);
  set_u32(md, "llama.attention.head_count_kv", c.n_head);
  md.set("llama.attention.layer_norm_rms_epsilon", GGUFValue::of_f32(static_cast<float>(c.eps)));
  set_u32(md, "llama.rope.dimension_count", c.head_size());
  md.set("llama.rope.freq_base", GGUFValue::of_f32(static_cast<float>(kRopeBase)));
  // llama.cpp reads eps as float32; the exact value makes an import compute bit for bit alike.
  md.set("tapegrad.norm_eps", GGUFValue::of_f64(c.eps));
  return md;
}

void add_char_tokenizer(GGUFMetadata& md, const std::vector<std::string>& vocab) {
  std::vector<std::string> tokens;
  for (std::size_t i = 0; i < vocab.size(); ++i) {
    if (!is_one_character(vocab[i]))
      fail("to_gguf", "token ", i, " ('", vocab[i], "') is not one UTF-8 character; the vocabulary must be characters");
    if (vocab[i] == kSpace)
      fail("to_gguf", "token ", i, " is U+2581, which SentencePiece vocabularies reserve for the space");
    tokens.push_back(vocab[i] == " " ? kSpace : vocab[i]);
  }
  md.set("tokenizer.ggml.model", GGUFValue::of_string("llama"));
  md.set("tokenizer.ggml.tokens", GGUFValue::strings(std::move(tokens)));
  md.set("tokenizer.ggml.scores", GGUFValue::f32s(std::vector<float>(vocab.size(), 0.0f)));
  md.set("tokenizer.ggml.token_type", GGUFValue::i32s(std::vector<std::int32_t>(vocab.size(), kTokenNormal)));
  md.set("tokenizer.ggml.add_bos_token", GGUFValue::of_bool(false));
  md.set("tokenizer.ggml.add_eos_token", GGUFValue::of_bool(false));
  md.set("tokenizer.ggml.add_space_prefix", GGUFValue::of_bool(false));
}

// The token types of a BPE vocabulary: USER_DEFINED for the added ids, NORMAL for the rest.
std::vector<std::int32_t> bpe_token_types(const GGUFVocab& v, const char* op) {
  std::vector<std::int32_t> types(v.tokens.size(), kTokenNormal);
  for (std::size_t i = 0; i < v.added.size(); ++i) {
    const std::int32_t id = v.added[i];
    if (id < 0 || static_cast<std::size_t>(id) >= v.tokens.size() || (i > 0 && id <= v.added[i - 1]))
      fail(op, "added token id ", id, " is outside [0, ", v.tokens.size(), ") or not ascending");
    types[static_cast<std::size_t>(id)] = kTokenUserDefined;
  }
  return types;
}

// Every token non-empty; every merge "left right" (llama.cpp splits at the first space after the
// first byte) of two ordinary tokens whose concatenation is a token. Byte-level text has no
// space: the space byte is U+0120.
void check_bpe(const GGUFVocab& v, const std::vector<std::int32_t>& types, const char* op) {
  std::map<std::string, std::int32_t> type_of;
  for (std::size_t i = 0; i < v.tokens.size(); ++i) {
    if (v.tokens[i].empty()) fail(op, "BPE token ", i, " is empty");
    type_of.emplace(v.tokens[i], types[i]);
  }
  auto ordinary = [&](const std::string& t) {
    const auto it = type_of.find(t);
    return it != type_of.end() && it->second == kTokenNormal;
  };
  for (std::size_t r = 0; r < v.merges.size(); ++r) {
    const std::string& m = v.merges[r];
    const std::size_t sp = m.find(' ', 1);
    const std::string left = m.substr(0, sp), right = sp == std::string::npos ? "" : m.substr(sp + 1);
    if (sp == std::string::npos || !ordinary(left) || !ordinary(right) || !ordinary(left + right))
      fail(op, "BPE merge ", r, " ('", m, "') is not two tokens joined by a space that make a token");
  }
}

void add_bpe_tokenizer(GGUFMetadata& md, const GGUFVocab& v) {
  std::vector<std::int32_t> types = bpe_token_types(v, "to_gguf");
  check_bpe(v, types, "to_gguf");
  md.set("tokenizer.ggml.model", GGUFValue::of_string("gpt2"));
  md.set("tokenizer.ggml.pre", GGUFValue::of_string("gpt-2"));
  md.set("tokenizer.ggml.tokens", GGUFValue::strings(v.tokens));
  md.set("tokenizer.ggml.token_type", GGUFValue::i32s(types));
  md.set("tokenizer.ggml.merges", GGUFValue::strings(v.merges));
  md.set("tokenizer.ggml.add_bos_token", GGUFValue::of_bool(false));
  md.set("tokenizer.ggml.add_eos_token", GGUFValue::of_bool(false));
  md.set("tokenizer.ggml.add_space_prefix", GGUFValue::of_bool(false));
}

// tapegrad's names -> llama.cpp's, matrices in the export dtype.
StateDict model_tensors(const GPT& model, DType dtype) {
  const GPTConfig& c = model.config();
  const StateDict sd = model.state_dict();
  const std::int64_t C = c.n_embd, F = c.ffn_hidden(), hs = c.head_size();
  StateDict out;
  auto mat = [&](const std::string& name, const Tensor& t) { out.insert(name, t.to(dtype)); };
  auto vec = [&](const std::string& name, const Tensor& t) { out.insert(name, t.to(float32)); };
  mat("token_embd.weight", sd.at("wte.weight"));
  vec("output_norm.weight", sd.at("ln_f.weight"));
  mat("output.weight", sd.at("head.weight"));
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string t = "blocks." + std::to_string(i) + ".", g = "blk." + std::to_string(i) + ".";
    const Tensor qkv = sd.at(t + "qkv.weight"), gate_up = sd.at(t + "gate_up.weight");
    vec(g + "attn_norm.weight", sd.at(t + "ln1.weight"));
    mat(g + "attn_q.weight", permute_heads(rows(qkv, 0, C), hs, true));
    mat(g + "attn_k.weight", permute_heads(rows(qkv, C, 2 * C), hs, true));
    mat(g + "attn_v.weight", rows(qkv, 2 * C, 3 * C));
    mat(g + "attn_output.weight", sd.at(t + "proj.weight"));
    vec(g + "ffn_norm.weight", sd.at(t + "ln2.weight"));
    mat(g + "ffn_gate.weight", rows(gate_up, 0, F));
    mat(g + "ffn_up.weight", rows(gate_up, F, 2 * F));
    mat(g + "ffn_down.weight", sd.at(t + "down.weight"));
  }
  return out;
}

}  // namespace

std::string gguf_unsupported_reason(const GPTConfig& cfg) {
  if (cfg.arch == Arch::gpt)
    return "the gpt arch has no llama.cpp equivalent within 1e-4: llama.cpp's gpt2 computes GELU with the tanh "
           "approximation from a float16 table, tapegrad's gpt the exact erf GELU (export a llama-arch model)";
  switch (cfg.norm) {
    case NormKind::rmsnorm: return "";
    case NormKind::layernorm:
      return "llama.cpp's llama arch normalises with RMSNorm; a LayerNorm llama has no equivalent there";
    case NormKind::prmsnorm:
      return "llama.cpp has no partial RMSNorm (the RMS of a fraction p of the features)";
    case NormKind::batchnorm:
      return "llama.cpp has no BatchNorm (statistics over the batch and running averages)";
    case NormKind::none: return "llama.cpp's llama arch always normalises; a model without norms has no equivalent";
  }
  return "unknown norm";
}

GGUFVocab GGUFVocab::characters(std::vector<std::string> vocab) {
  GGUFVocab v;
  v.tokens = std::move(vocab);
  return v;
}

GGUFVocab GGUFVocab::bpe(std::vector<std::string> tokens, std::vector<std::string> merges, std::vector<std::int32_t> added) {
  GGUFVocab v;
  v.model = "gpt2";
  v.tokens = std::move(tokens);
  v.merges = std::move(merges);
  v.added = std::move(added);
  return v;
}

GGUFFile to_gguf(const GPT& model, const std::vector<std::string>& vocab, const GGUFExportOptions& options) {
  return to_gguf(model, GGUFVocab::characters(vocab), options);
}

GGUFFile to_gguf(const GPT& model, const GGUFVocab& vocab, const GGUFExportOptions& options) {
  const GPTConfig& c = model.config();
  if (const std::string why = gguf_unsupported_reason(c); !why.empty()) fail("to_gguf", why);
  if (options.dtype != float32 && options.dtype != bfloat16)
    fail("to_gguf", "dtype must be float32 or bfloat16, got ", options.dtype);
  if (vocab.model != "llama" && vocab.model != "gpt2")
    fail("to_gguf", "the tokenizer model must be \"llama\" (characters) or \"gpt2\" (BPE), got \"", vocab.model, "\"");
  if (static_cast<std::int64_t>(vocab.tokens.size()) != c.vocab_size)
    fail("to_gguf", "the vocabulary has ", vocab.tokens.size(), " tokens but the model ", c.vocab_size);
  if (c.block_size > kGGUFMaxContext)  // a file load_gguf_model would refuse
    fail("to_gguf", "block_size ", c.block_size, " is past the context length a GGUF model may hold here, ",
         kGGUFMaxContext);
  GGUFFile f;
  f.metadata = model_metadata(c, options);
  if (vocab.is_bpe())
    add_bpe_tokenizer(f.metadata, vocab);
  else
    add_char_tokenizer(f.metadata, vocab.tokens);
  f.tensors = model_tensors(model, options.dtype);
  return f;
}

void save_gguf_model(const std::string& path, const GPT& model, const std::vector<std::string>& vocab,
                     const GGUFExportOptions& options) {
  save_gguf_model(path, model, GGUFVocab::characters(vocab), options);
}

void save_gguf_model(const std::string& path, const GPT& model, const GGUFVocab& vocab, const GGUFExportOptions& options) {
  const GGUFFile f = to_gguf(model, vocab, options);
  save_gguf(path, f.tensors, f.metadata);
}

// ---------------------------------------------------------------------------------------------
// Import

namespace {

// The positive integer `key`, at most max (2^31 unless the key has a limit of its own).
std::int64_t key_int(const GGUFMetadata& md, const std::string& key, const std::string& what,
                     std::int64_t max = std::int64_t{1} << 31) {
  const GGUFValue* v = md.find(key);
  if (!v) fail(what.c_str(), "no metadata '", key, "'");
  const std::uint64_t u = v->as_uint(what + ": " + key);
  if (u == 0 || u > static_cast<std::uint64_t>(max))
    fail(what.c_str(), key, " is ", u, ", out of range (1 to ", max, ")");
  return static_cast<std::int64_t>(u);
}

// The widths and RoPE of the file against what tapegrad's llama computes for c.
void check_shape_keys(const GGUFMetadata& md, const GPTConfig& c, const std::string& what) {
  const char* op = what.c_str();
  if (c.n_embd % c.n_head != 0) fail(op, "embedding_length ", c.n_embd, " is not a multiple of head_count ", c.n_head);
  if (const std::int64_t ff = key_int(md, "llama.feed_forward_length", what); ff != c.ffn_hidden())
    fail(op, "feed_forward_length ", ff, " is not tapegrad's ", c.ffn_hidden(), " for width ", c.n_embd);
  if (md.contains("llama.rope.dimension_count"))
    if (const std::int64_t rot = key_int(md, "llama.rope.dimension_count", what); rot != c.head_size())
      fail(op, "RoPE turns ", rot, " dims of each head; tapegrad all ", c.head_size());
  if (const GGUFValue* base = md.find("llama.rope.freq_base"))
    if (const double b = base->as_double(what + ": llama.rope.freq_base"); b != kRopeBase)
      fail(op, "rope.freq_base is ", b, "; tapegrad's llama uses ", kRopeBase);
}

// The configuration the metadata describes, checked against what tapegrad's llama computes.
GPTConfig read_config(const GGUFMetadata& md, const std::string& what) {
  const GGUFValue* arch = md.find("general.architecture");
  if (!arch || arch->as_string(what + ": general.architecture") != "llama")
    fail(what.c_str(), "general.architecture is not \"llama\" (tapegrad imports its llama arch)");
  GPTConfig c;
  c.arch = Arch::llama;
  c.norm = NormKind::rmsnorm;
  c.block_size = key_int(md, "llama.context_length", what, kGGUFMaxContext);  // sizes the RoPE tables
  c.n_embd = key_int(md, "llama.embedding_length", what);
  c.n_layer = key_int(md, "llama.block_count", what);
  c.n_head = key_int(md, "llama.attention.head_count", what);
  if (md.contains("llama.attention.head_count_kv") && key_int(md, "llama.attention.head_count_kv", what) != c.n_head)
    fail(what.c_str(), "grouped-query attention (head_count_kv != head_count) has no tapegrad equivalent");
  const GGUFValue* exact = md.find("tapegrad.norm_eps");
  c.eps = exact ? exact->as_double(what + ": tapegrad.norm_eps")
                : md.at("llama.attention.layer_norm_rms_epsilon").as_double(what + ": layer_norm_rms_epsilon");
  check_shape_keys(md, c, what);
  return c;
}

// A gpt2 tokenizer: GPT-2's pre-tokenizer, tokens, merges and the ids typed USER_DEFINED.
GGUFVocab read_bpe_vocab(const GGUFMetadata& md, const std::string& what) {
  if (const GGUFValue* pre = md.find("tokenizer.ggml.pre"); pre && pre->as_string(what + ": tokenizer.ggml.pre") != "gpt-2")
    fail(what.c_str(), "tokenizer.ggml.pre is \"", pre->as_string(""), "\"; tapegrad's BPE splits text as GPT-2 (\"gpt-2\")");
  const GGUFValue* merges = md.find("tokenizer.ggml.merges");
  if (!merges) fail(what.c_str(), "no metadata 'tokenizer.ggml.merges' (a gpt2 tokenizer needs its merges)");
  GGUFVocab v = GGUFVocab::bpe(md.at("tokenizer.ggml.tokens").as_strings(what + ": tokenizer.ggml.tokens"),
                               merges->as_strings(what + ": tokenizer.ggml.merges"));
  if (const GGUFValue* types = md.find("tokenizer.ggml.token_type")) {
    if (types->size() != v.tokens.size())
      fail(what.c_str(), "tokenizer.ggml.token_type has ", types->size(), " entries for ", v.tokens.size(), " tokens");
    for (std::size_t i = 0; i < v.tokens.size(); ++i) {
      const std::int64_t t = types->item(i, what + ": tokenizer.ggml.token_type").as_int(what + ": tokenizer.ggml.token_type");
      if (t != kTokenNormal && t != kTokenUserDefined)
        fail(what.c_str(), "token ", i, " has type ", t, "; tapegrad's BPE has normal (1) and added (4) tokens only");
      if (t == kTokenUserDefined) v.added.push_back(static_cast<std::int32_t>(i));
    }
  }
  check_bpe(v, bpe_token_types(v, what.c_str()), what.c_str());
  return v;
}

GGUFVocab read_vocab(const GGUFMetadata& md, const std::string& what) {
  const GGUFValue* model = md.find("tokenizer.ggml.model");
  const std::string name = model ? model->as_string(what + ": tokenizer.ggml.model") : "";
  if (name == "gpt2") return read_bpe_vocab(md, what);
  if (name != "llama")
    fail(what.c_str(), "tokenizer.ggml.model is not \"llama\" (a character vocabulary) or \"gpt2\" (a byte-level BPE)");
  std::vector<std::string> vocab = md.at("tokenizer.ggml.tokens").as_strings(what + ": tokenizer.ggml.tokens");
  for (std::string& t : vocab)
    if (t == kSpace) t = " ";
  return GGUFVocab::characters(std::move(vocab));
}

// The tensor `name`, as float32, with the shape tapegrad expects.
Tensor take(const StateDict& t, const std::string& name, const Shape& shape, const std::string& what) {
  const Tensor* p = t.find(name);
  if (!p) fail(what.c_str(), "no tensor '", name, "'");
  if (!(p->shape() == shape)) fail(what.c_str(), "tensor '", name, "' is ", p->shape(), ", the model needs ", shape);
  return p->to(float32);
}

StateDict read_tensors(const StateDict& t, const GPTConfig& c, const std::string& what) {
  const std::int64_t C = c.n_embd, F = c.ffn_hidden(), V = c.vocab_size, hs = c.head_size();
  StateDict sd;
  sd.insert("wte.weight", take(t, "token_embd.weight", {V, C}, what));
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".", g = "blk." + std::to_string(i) + ".";
    sd.insert(b + "ln1.weight", take(t, g + "attn_norm.weight", {C}, what));
    sd.insert(b + "qkv.weight", stack_rows({permute_heads(take(t, g + "attn_q.weight", {C, C}, what), hs, false),
                                            permute_heads(take(t, g + "attn_k.weight", {C, C}, what), hs, false),
                                            take(t, g + "attn_v.weight", {C, C}, what)}));
    sd.insert(b + "proj.weight", take(t, g + "attn_output.weight", {C, C}, what));
    sd.insert(b + "ln2.weight", take(t, g + "ffn_norm.weight", {C}, what));
    sd.insert(b + "gate_up.weight",
              stack_rows({take(t, g + "ffn_gate.weight", {F, C}, what), take(t, g + "ffn_up.weight", {F, C}, what)}));
    sd.insert(b + "down.weight", take(t, g + "ffn_down.weight", {C, F}, what));
  }
  sd.insert("ln_f.weight", take(t, "output_norm.weight", {C}, what));
  // Without output, llama.cpp computes the logits with token_embd: the same here.
  sd.insert("head.weight", take(t, t.contains("output.weight") ? "output.weight" : "token_embd.weight", {V, C}, what));
  return sd;
}

}  // namespace

GGUFModel from_gguf(const GGUFFile& file, const std::string& what) {
  GGUFModel m;
  m.config = read_config(file.metadata, what);
  m.vocab = read_vocab(file.metadata, what);
  m.config.vocab_size = static_cast<std::int64_t>(m.vocab.tokens.size());
  m.config.validate();
  m.state_dict = read_tensors(file.tensors, m.config, what);
  return m;
}

GGUFModel load_gguf_model(const std::string& path) { return from_gguf(load_gguf(path), "load_gguf_model: '" + path + "'"); }

}  // namespace tg::nn
