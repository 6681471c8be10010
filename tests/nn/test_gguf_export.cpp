// A GPT as a llama.cpp GGUF: names, shapes and metadata; the RoPE row permutation, checked by
// computing attention scores both ways (tapegrad's rotate_half on the original rows, llama.cpp's
// adjacent pairs on the written rows); the round trip to the same logits bit for bit; BF16;
// refusals of what llama.cpp cannot run, with nothing written; damaged model files on import;
// and a gpt model's model.safetensors (tied head as head.weight) loading through load_state_dict.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "helpers.h"
#include "tapegrad/nn/gguf_export.h"

using namespace tg;
using namespace tgtest;
namespace fs = std::filesystem;

namespace {

nn::GPTConfig tiny_llama() {
  nn::GPTConfig c;
  c.arch = nn::Arch::llama;
  c.norm = nn::NormKind::rmsnorm;
  c.vocab_size = 6;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

const std::vector<std::string> kVocab = {"\n", " ", "a", "\xc3\xa9", "\xe2\x82\xac", "z"};  // \n, space, a, é, €, z

Tensor ids_of(const std::vector<std::int32_t>& v) {
  Tensor t = Tensor::empty({1, static_cast<std::int64_t>(v.size())}, int32);
  std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(std::int32_t));
  return t;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

Tensor logits_of(nn::GPT& m) {
  NoGradGuard ng;
  return m.forward(ids_of({1, 2, 3, 0, 5, 4, 2, 1})).detach();
}

// Scores q_t . k_s of one head with llama.cpp's rotation: pairs (2i, 2i + 1) turned by
// p theta^(-2i / hs), in double.
double llama_score(const std::vector<double>& q, const std::vector<double>& k, int pq, int pk) {
  const std::size_t hs = q.size();
  auto turn = [&](std::vector<double> v, int p) {
    for (std::size_t i = 0; i < hs / 2; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(hs));
      const double x = v[2 * i], y = v[2 * i + 1];
      v[2 * i] = x * std::cos(a) - y * std::sin(a);
      v[2 * i + 1] = x * std::sin(a) + y * std::cos(a);
    }
    return v;
  };
  const auto rq = turn(q, pq), rk = turn(k, pk);
  double s = 0;
  for (std::size_t j = 0; j < hs; ++j) s += rq[j] * rk[j];
  return s;
}

// Rows [r0, r0 + n) of a (rows, cols) float32 matrix times x, in double.
std::vector<double> project(const Tensor& w, std::int64_t r0, std::int64_t n, const std::vector<double>& x) {
  std::vector<double> out;
  const float* p = w.data<float>();
  for (std::int64_t r = r0; r < r0 + n; ++r) {
    double s = 0;
    for (std::size_t j = 0; j < x.size(); ++j) s += p[r * w.size(1) + static_cast<std::int64_t>(j)] * x[j];
    out.push_back(s);
  }
  return out;
}

}  // namespace

TEST_CASE("a llama RMSNorm GPT maps to llama.cpp's llama arch: names, shapes, metadata, tokenizer", "[gguf]") {
  manual_seed(1);
  nn::GPT m(tiny_llama());
  const GGUFFile f = nn::to_gguf(m, kVocab);
  const std::int64_t F = tiny_llama().ffn_hidden();
  const std::vector<std::pair<std::string, Shape>> want = {
      {"token_embd.weight", {6, 8}},        {"output_norm.weight", {8}},          {"output.weight", {6, 8}},
      {"blk.0.attn_norm.weight", {8}},      {"blk.0.attn_q.weight", {8, 8}},      {"blk.0.attn_k.weight", {8, 8}},
      {"blk.0.attn_v.weight", {8, 8}},      {"blk.0.attn_output.weight", {8, 8}}, {"blk.0.ffn_norm.weight", {8}},
      {"blk.0.ffn_gate.weight", {F, 8}},    {"blk.0.ffn_up.weight", {F, 8}},      {"blk.0.ffn_down.weight", {8, F}}};
  for (const auto& [name, shape] : want) {
    INFO(name);
    REQUIRE(f.tensors.contains(name));
    CHECK(f.tensors.at(name).shape() == shape);
    CHECK(f.tensors.at(name).dtype() == float32);
  }
  CHECK(f.tensors.size() == 3 + 9 * 2);
  const GGUFMetadata& md = f.metadata;
  CHECK(md.at("general.architecture").as_string("") == "llama");
  CHECK(md.at("llama.context_length").as_uint("") == 8);
  CHECK(md.at("llama.embedding_length").as_uint("") == 8);
  CHECK(md.at("llama.block_count").as_uint("") == 2);
  CHECK(md.at("llama.feed_forward_length").as_uint("") == static_cast<std::uint64_t>(F));
  CHECK(md.at("llama.attention.head_count").as_uint("") == 2);
  CHECK(md.at("llama.attention.head_count_kv").as_uint("") == 2);
  CHECK(md.at("llama.attention.layer_norm_rms_epsilon").as_double("") == static_cast<double>(1e-5f));
  CHECK(md.at("llama.rope.dimension_count").as_uint("") == 4);
  CHECK(md.at("llama.rope.freq_base").as_double("") == 10000.0);
  CHECK(md.at("tokenizer.ggml.model").as_string("") == "llama");
  CHECK(md.at("tokenizer.ggml.tokens").as_strings("") ==
        std::vector<std::string>{"\n", "\xe2\x96\x81", "a", "\xc3\xa9", "\xe2\x82\xac", "z"});
  CHECK(md.at("tokenizer.ggml.scores").size() == 6);
  CHECK(md.at("tokenizer.ggml.scores").item(3, "").as_double("") == 0.0);
  CHECK(md.at("tokenizer.ggml.token_type").item(5, "").as_int("") == 1);
  for (const char* k : {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"})
    CHECK_FALSE(md.at(k).as_bool(k));
  CHECK_FALSE(md.contains("tokenizer.ggml.bos_token_id"));
  CHECK_FALSE(md.contains("tokenizer.ggml.eos_token_id"));
  // v and the MLP halves are row ranges of the fused matrices; q and k rows are permuted (next test).
  const Tensor qkv = m.state_dict().at("blocks.1.qkv.weight");
  CHECK(std::memcmp(f.tensors.at("blk.1.attn_v.weight").raw_data(), qkv.data<float>() + 16 * 8, 64 * sizeof(float)) == 0);
  const Tensor gu = m.state_dict().at("blocks.0.gate_up.weight");
  CHECK(std::memcmp(f.tensors.at("blk.0.ffn_up.weight").raw_data(), gu.data<float>() + F * 8, F * 8 * sizeof(float)) == 0);
}

TEST_CASE("the q and k rows are permuted so that llama.cpp's adjacent-pair RoPE gives tapegrad's scores", "[gguf]") {
  manual_seed(2);
  nn::GPT m(tiny_llama());
  const GGUFFile f = nn::to_gguf(m, kVocab);
  const Tensor qkv = m.state_dict().at("blocks.0.qkv.weight");
  const Tensor wq = f.tensors.at("blk.0.attn_q.weight"), wk = f.tensors.at("blk.0.attn_k.weight");
  const std::int64_t C = 8, hs = 4;
  // Row i of a head's first half -> 2i, row i of its second half -> 2i + 1.
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < hs / 2; ++i)
      for (std::int64_t col = 0; col < C; ++col) {
        CHECK(wq.at({h * hs + 2 * i, col}) == qkv.at({h * hs + i, col}));
        CHECK(wq.at({h * hs + 2 * i + 1, col}) == qkv.at({h * hs + hs / 2 + i, col}));
        CHECK(wk.at({h * hs + 2 * i + 1, col}) == qkv.at({C + h * hs + hs / 2 + i, col}));
      }
  // The score of a query at position 3 against a key at position 2: tapegrad's rope (rotate_half)
  // on the original rows against llama.cpp's rotation on the written rows.
  const std::vector<double> x = {0.3, -1.2, 0.5, 2.0, -0.7, 0.1, 0.9, -0.4};
  Tensor packed = Tensor::empty({1, 2, 3 * C}, float64);  // the same token at positions 2 and 3
  const std::vector<double> qkv_x = project(qkv, 0, 3 * C, x);
  for (std::int64_t t = 0; t < 2; ++t)
    for (std::int64_t j = 0; j < 3 * C; ++j) packed.set({0, t, j}, qkv_x[static_cast<std::size_t>(j)]);
  const auto [cos, sin] = rope_tables(8, hs, 10000.0, float64);
  const Tensor turned_a = rope(packed, cos, sin, hs, 2 * C, 2);
  for (std::int64_t h = 0; h < 2; ++h) {
    double hf = 0;
    for (std::int64_t j = 0; j < hs; ++j) hf += turned_a.at({0, 1, h * hs + j}) * turned_a.at({0, 0, C + h * hs + j});
    const double ll = llama_score(project(wq, h * hs, hs, x), project(wk, h * hs, hs, x), 3, 2);
    INFO("head " << h << ": tapegrad " << hf << ", llama.cpp order " << ll);
    CHECK(std::fabs(hf - ll) <= 1e-9 * (1 + std::fabs(hf)));
  }
}

TEST_CASE("a GGUF written by tapegrad loads back to the same logits bit for bit (F32)", "[gguf]") {
  manual_seed(3);
  nn::GPT a(tiny_llama());
  const fs::path path = fs::temp_directory_path() / ("tapegrad_gguf_rt_" + std::to_string(::getpid()) + ".gguf");
  nn::save_gguf_model(path.string(), a, kVocab);
  const nn::GGUFModel back = nn::load_gguf_model(path.string());
  fs::remove(path);
  CHECK(back.vocab == nn::GGUFVocab::characters(kVocab));
  CHECK(back.config.n_layer == 2);
  CHECK(back.config.eps == 1e-5);  // the exact double, from tapegrad.norm_eps
  manual_seed(99);
  nn::GPT b(back.config);
  b.load_state_dict(back.state_dict);
  for (const auto& [k, t] : a.state_dict()) CHECK(bit_equal(t, b.state_dict().at(k)));
  CHECK(bit_equal(logits_of(a), logits_of(b)));
}

// A byte-level BPE: the bytes a, b and space (U+0120 in GPT-2's byte-level text), two merges and
// one added token.
nn::GGUFVocab tiny_bpe() {
  return nn::GGUFVocab::bpe({"a", "b", "\xc4\xa0", "ab", "\xc4\xa0" "ab", "<|end|>"}, {"a b", "\xc4\xa0 ab"}, {5});
}

TEST_CASE("a BPE vocabulary is written as llama.cpp's gpt2 tokenizer: tokens, merges, types, no special tokens", "[gguf]") {
  manual_seed(5);
  nn::GPT m(tiny_llama());
  const GGUFFile f = nn::to_gguf(m, tiny_bpe());
  const GGUFMetadata& md = f.metadata;
  CHECK(md.at("tokenizer.ggml.model").as_string("") == "gpt2");
  CHECK(md.at("tokenizer.ggml.pre").as_string("") == "gpt-2");
  CHECK(md.at("tokenizer.ggml.tokens").as_strings("") == tiny_bpe().tokens);
  CHECK(md.at("tokenizer.ggml.merges").as_strings("") == std::vector<std::string>{"a b", "\xc4\xa0 ab"});
  const GGUFValue& types = md.at("tokenizer.ggml.token_type");
  REQUIRE(types.size() == 6);
  for (std::size_t i = 0; i < 6; ++i) CHECK(types.item(i, "").as_int("") == (i == 5 ? 4 : 1));
  for (const char* k : {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"})
    CHECK_FALSE(md.at(k).as_bool(k));
  for (const char* k : {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.scores"})
    CHECK_FALSE(md.contains(k));
  const nn::GGUFModel back = nn::from_gguf(from_gguf_bytes(to_gguf_bytes(f.tensors, f.metadata)));
  CHECK(back.vocab == tiny_bpe());
  CHECK(back.config.vocab_size == 6);
}

TEST_CASE("a BPE vocabulary that llama.cpp would read otherwise is refused, on export and import", "[gguf]") {
  nn::GPT m(tiny_llama());
  nn::GGUFVocab v = tiny_bpe();
  v.merges[1] = "a \xc4\xa0";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "to_gguf: ", "BPE merge 1 ('a \xc4\xa0') is not two tokens");
  v = tiny_bpe();
  v.merges[0] = "ab";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "BPE merge 0 ('ab')");
  v = tiny_bpe();
  v.merges[0] = "a <|end|>";  // an added token is matched whole, never merged
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "BPE merge 0");
  v = tiny_bpe();
  v.added = {6};
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "added token id 6 is outside [0, 6)");
  v = tiny_bpe();
  v.tokens[2] = "";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "BPE token 2 is empty");
  v = tiny_bpe();
  v.model = "bert";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "\"bert\"");
  const GGUFFile good = nn::to_gguf(m, tiny_bpe());
  auto with = [&](const std::string& key, GGUFValue val) {
    GGUFFile f = good;
    f.metadata.set(key, std::move(val));
    return f;
  };
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.pre", GGUFValue::of_string("llama3"))), "pre is \"llama3\"");
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.model", GGUFValue::of_string("bert"))), "tokenizer.ggml.model");
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.token_type", GGUFValue::i32s({1, 1, 1, 1, 1, 3}))),
                   "token 5 has type 3");
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.token_type", GGUFValue::i32s({1, 1}))), "2 entries for 6 tokens");
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.merges", GGUFValue::strings({"b a"}))), "BPE merge 0 ('b a')");
  GGUFFile no_merges;
  for (const auto& [k, val] : good.metadata)
    if (k != "tokenizer.ggml.merges") no_merges.metadata.set(k, val);
  no_merges.tensors = good.tensors;
  REQUIRE_TG_ERROR(nn::from_gguf(no_merges), "no metadata 'tokenizer.ggml.merges'");
}

TEST_CASE("a BF16 export rounds the matrices to bfloat16 and keeps the norm gains float32", "[gguf]") {
  manual_seed(4);
  nn::GPT a(tiny_llama());
  const GGUFFile f = nn::to_gguf(a, kVocab, {bfloat16, "t"});
  CHECK(f.tensors.at("blk.0.attn_q.weight").dtype() == bfloat16);
  CHECK(f.tensors.at("token_embd.weight").dtype() == bfloat16);
  CHECK(f.tensors.at("blk.0.attn_norm.weight").dtype() == float32);
  CHECK(f.metadata.at("general.file_type").as_uint("") == 32);
  const nn::GGUFModel back = nn::from_gguf(from_gguf_bytes(to_gguf_bytes(f.tensors, f.metadata)));
  for (const auto& [k, t] : a.state_dict()) {
    INFO(k);
    const Tensor want = t.dim() == 2 ? t.to(bfloat16).to(float32) : t;
    CHECK(bit_equal(back.state_dict.at(k), want));
  }
}

TEST_CASE("norms and archs llama.cpp has no equivalent for are refused with one line, nothing written", "[gguf]") {
  const fs::path path = fs::temp_directory_path() / ("tapegrad_gguf_refuse_" + std::to_string(::getpid()) + ".gguf");
  const std::vector<std::pair<nn::NormKind, const char*>> norms = {{nn::NormKind::prmsnorm, "partial RMSNorm"},
                                                                   {nn::NormKind::batchnorm, "no BatchNorm"},
                                                                   {nn::NormKind::none, "always normalises"},
                                                                   {nn::NormKind::layernorm, "LayerNorm llama"}};
  for (const auto& [norm, why] : norms) {
    nn::GPTConfig c = tiny_llama();
    c.norm = norm;
    nn::GPT m(c);
    INFO(nn::to_string(norm));
    REQUIRE_TG_ERROR(nn::save_gguf_model(path.string(), m, kVocab), "to_gguf: ", why);
    CHECK(nn::gguf_unsupported_reason(c).find('\n') == std::string::npos);
    CHECK_FALSE(fs::exists(path));
  }
  nn::GPTConfig g = tiny_llama();
  g.arch = nn::Arch::gpt;
  nn::GPT gm(g);
  REQUIRE_TG_ERROR(nn::save_gguf_model(path.string(), gm, kVocab), "to_gguf: ", "gpt arch", "GELU");
  CHECK_FALSE(fs::exists(path));
  nn::GPT m(tiny_llama());
  REQUIRE_TG_ERROR(nn::to_gguf(m, {"a", "b"}), "2 tokens but the model 6");
  std::vector<std::string> v = kVocab;
  v[2] = "ab";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "token 2 ('ab') is not one UTF-8 character");
  v[2] = "\xe2\x96\x81";
  REQUIRE_TG_ERROR(nn::to_gguf(m, v), "token 2 is U+2581");
  REQUIRE_TG_ERROR(nn::to_gguf(m, kVocab, {float64, "x"}), "float32 or bfloat16");
}

TEST_CASE("importing a GGUF refuses what tapegrad's llama cannot hold, naming the key or tensor", "[gguf]") {
  nn::GPT m(tiny_llama());
  const GGUFFile good = nn::to_gguf(m, kVocab);
  REQUIRE_NOTHROW(nn::from_gguf(good));
  auto with = [&](const std::string& key, GGUFValue v) {
    GGUFFile f = good;
    f.metadata.set(key, std::move(v));
    return f;
  };
  REQUIRE_TG_ERROR(nn::from_gguf(with("general.architecture", GGUFValue::of_string("gpt2"))), "not \"llama\"");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.attention.head_count_kv", GGUFValue::of_u32(1))), "grouped-query");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.feed_forward_length", GGUFValue::of_u32(64))), "feed_forward_length 64");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.rope.freq_base", GGUFValue::of_f32(500000.f))), "rope.freq_base");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.rope.dimension_count", GGUFValue::of_u32(2))), "RoPE turns 2");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.block_count", GGUFValue::of_string("2"))), "llama.block_count", "STRING");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.block_count", GGUFValue::of_u32(3))), "no tensor 'blk.2.attn_norm.weight'");
  REQUIRE_TG_ERROR(nn::from_gguf(with("llama.embedding_length", GGUFValue::of_u32(0))), "out of range");
  REQUIRE_TG_ERROR(nn::from_gguf(with("tokenizer.ggml.model", GGUFValue::of_string("gpt2"))), "no metadata 'tokenizer.ggml.merges'");
  GGUFFile wrong = good;
  wrong.tensors.insert("blk.0.attn_q.weight", zeros({8, 4}));
  REQUIRE_TG_ERROR(nn::from_gguf(wrong), "tensor 'blk.0.attn_q.weight' is (8, 4), the model needs (8, 8)");
  // Without output, the head is token_embd (llama.cpp's fallback).
  GGUFFile tied;
  tied.metadata = good.metadata;
  for (const auto& [k, t] : good.tensors)
    if (k != "output.weight") tied.tensors.insert(k, t);
  const nn::GGUFModel back = nn::from_gguf(tied);
  CHECK(bit_equal(back.state_dict.at("head.weight"), back.state_dict.at("wte.weight")));
}

TEST_CASE("a crafted model file's context_length past the limit is refused before anything is sized by it",
          "[gguf]") {
  // No tensor bounds the context length, yet GPT(config) builds RoPE tables of 2 x context_length
  // x head_size values from it: 2^31 would be gigabytes, UINT64's largest far past any memory.
  nn::GPT m(tiny_llama());
  const GGUFFile good = nn::to_gguf(m, kVocab);
  const fs::path path = fs::temp_directory_path() / ("tapegrad_gguf_ctx_" + std::to_string(::getpid()) + ".gguf");
  auto write_with = [&](const std::string& key, GGUFValue v) {
    GGUFMetadata md = good.metadata;
    md.set(key, std::move(v));
    save_gguf(path.string(), good.tensors, md);
  };
  const std::string limit = "out of range (1 to " + std::to_string(nn::kGGUFMaxContext) + ")";
  for (const std::uint64_t n : {std::uint64_t{1} << 31, std::uint64_t(nn::kGGUFMaxContext) + 1}) {
    INFO("context_length " << n);
    write_with("llama.context_length", GGUFValue::of_u32(static_cast<std::uint32_t>(n)));
    const std::string where = "load_gguf_model: '" + path.string() + "'",
                      what = "llama.context_length is " + std::to_string(n) + ", " + limit;
    REQUIRE_TG_ERROR(nn::load_gguf_model(path.string()), where.c_str(), what.c_str());
  }
  write_with("llama.context_length", GGUFValue::of_u64(~std::uint64_t{0}));
  const std::string widest = "llama.context_length is 18446744073709551615, " + limit;
  REQUIRE_TG_ERROR(nn::load_gguf_model(path.string()), widest.c_str());
  // The limit itself is taken.
  write_with("llama.context_length", GGUFValue::of_u32(static_cast<std::uint32_t>(nn::kGGUFMaxContext)));
  CHECK(nn::load_gguf_model(path.string()).config.block_size == nn::kGGUFMaxContext);
  // The other widths name their limit too, and must match the tensors the file holds.
  write_with("llama.embedding_length", GGUFValue::of_u64(std::uint64_t{1} << 40));
  REQUIRE_TG_ERROR(nn::load_gguf_model(path.string()),
                   "llama.embedding_length is 1099511627776, out of range (1 to 2147483648)");
  write_with("llama.block_count", GGUFValue::of_u32(std::uint32_t{1} << 31));  // stops at the first block it lacks
  REQUIRE_TG_ERROR(nn::load_gguf_model(path.string()), "no tensor 'blk.2.attn_norm.weight'");
  fs::remove(path);
}

TEST_CASE("a model whose context is past the GGUF limit is refused at export, not written to fail its load", "[gguf]") {
  nn::GPTConfig c = tiny_llama();
  c.block_size = nn::kGGUFMaxContext + 1;  // head size 4: RoPE tables of 2 x 2^20 x 4 floats, 32 MiB
  nn::GPT m(c);
  REQUIRE_TG_ERROR(nn::to_gguf(m, kVocab), "to_gguf", "block_size 1048577", "1048576");
}

TEST_CASE("a gpt model's model.safetensors (tied head stored as head.weight) loads through load_state_dict", "[gguf]") {
  manual_seed(5);
  nn::GPTConfig c = tiny_llama();
  c.arch = nn::Arch::gpt;
  nn::GPT a(c);
  StateDict saved;  // as PyTorch's save_model and train_lm's model.safetensors store it
  for (const auto& [k, t] : a.state_dict()) saved.insert(k == "wte.weight" ? "head.weight" : k, t.clone());
  const StateDict file = from_safetensors_bytes(to_safetensors_bytes(saved));
  manual_seed(6);
  nn::GPT b(c);
  b.load_state_dict(file);  // strict, without upgrade_state_dict
  CHECK(bit_equal(logits_of(a), logits_of(b)));
  manual_seed(7);
  nn::GPT d(c);
  static_cast<nn::Module&>(d).load_state_dict(file);  // the same through the base class
  CHECK(bit_equal(logits_of(a), logits_of(d)));
  REQUIRE_TG_ERROR(b.load_state_dict(StateDict{}), "missing keys");
}
