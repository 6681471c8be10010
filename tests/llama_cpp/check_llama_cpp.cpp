// tapegrad against real llama.cpp (npm node-llama-cpp's prebuilt CPU build): a llama-arch
// RMSNorm model with a character vocabulary is trained by train_lm, exported with
// --export-gguf (F32 and BF16) and run in llama.cpp, which must
//   - tokenize a prompt to exactly tapegrad's ids, and turn them back into the prompt;
//   - F32: give next-token probabilities within 1e-4 of tapegrad's for every vocabulary entry, at
//     every one of 64 greedy steps, and choose the same 64 tokens;
//   - BF16: give probabilities within 2 R of tapegrad's float32 ones, where R is how far bf16
//     rounding moves tapegrad's own: R = max |twin - float32|, the twin being tapegrad with the
//     file's rounded weights and products of bfloat16 operands with float32 sums
//     (tg::AutocastGuard) for the Linears, which is what ggml's BF16 matrix product computes,
//     and float32 attention (generation's KV-cache path; ggml's reads f16 keys and values, and
//     autocast would round causal_attention's operands to bf16); and lie within R of the twin,
//     so that the difference from float32 is the rounding, not a mapping error (which moves
//     probabilities by orders of magnitude more). The twin is not ggml's arithmetic exactly:
//     autocast's mlp rounds the gate/up product's output to bf16 before SwiGLU, as PyTorch's
//     autocast does and ggml does not, a rounding of the size of R's own; and an activation whose
//     float32 value sits near a bfloat16 rounding boundary can round one bfloat16 step (2^-8
//     relative) apart after sums taken in another order.
// Then the same model trained on byte-level BPE tokens (train_lm --tokenizer bpe --vocab-size 300),
// exported in F32 as llama.cpp's gpt2 tokenizer: the prompt must tokenize to tapegrad's BPE ids
// (the encode of tapegrad::text), and the F32 probabilities and 64 greedy tokens must agree as
// above.
// Exit 77 with a one-line reason when node (>= 20) or the package is absent.
//   check_llama_cpp TRAIN_LM NPM_DIR SCRIPT CORPUS WORK_DIR
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <tapegrad/nn/gguf_export.h>

#include "lm/checkpoint.h"
#include "tapegrad/autocast.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kSteps = 64;
constexpr double kTol = 1e-4;
const char* const kPrompt = "ROMEO:\nI will";  // + 64 tokens within the context of 96
// Words, punctuation, a contraction and new lines, so that GPT-2's pre-tokenizer cuts it in
// several ways and many of the merges apply: 30 tokens with a BPE of 300, + 64 within the context of 96.
const char* const kBpePrompt = "ROMEO:\nI will not, and thou shalt be the king's.";

struct Paths {
  std::string train_lm, npm, script, corpus;
  fs::path work;
};

std::string run(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    *rc = -1;
    return out;
  }
  char buf[65536];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The reason the reference cannot run, or "" when it can.
std::string missing_reference(const Paths& p) {
  int rc = 0;
  const std::string v = run("node --version 2>/dev/null", &rc);
  if (rc != 0 || v.size() < 2 || v[0] != 'v') return "node is not installed";
  if (std::atoi(v.c_str() + 1) < 20) return "node " + v.substr(0, v.size() - 1) + " is older than 20";
  for (const char* pkg : {"node-llama-cpp", "@node-llama-cpp/linux-x64"})
    if (!fs::exists(fs::path(p.npm) / "node_modules" / pkg / "package.json"))
      return std::string("npm package ") + pkg + " is not installed in " + p.npm;
  if (!fs::exists(p.corpus)) return "the corpus " + p.corpus + " is absent";
  return "";
}

// Softmax of the last position's logits of `ids`, in double.
// The next token's probabilities after ids. cached: through generation's KV-cache path, whose
// attention keeps float32 operands under autocast (only the Linears' products take bf16 ones, as
// in ggml's BF16 model, whose attention reads f16 keys and values); else the model's forward.
std::vector<double> next_probs(tg::nn::GPT& model, const std::vector<std::int32_t>& ids, bool cached = false) {
  tg::NoGradGuard ng;
  tg::Tensor x = tg::Tensor::empty({1, static_cast<std::int64_t>(ids.size())}, tg::int32);
  std::copy(ids.begin(), ids.end(), x.data<std::int32_t>());
  tg::nn::KVCache cache = model.start_cache();
  const tg::Tensor logits = cached ? model.forward_cached(ids, cache) : model.forward(x);
  const std::int64_t V = logits.size(2), last = static_cast<std::int64_t>(ids.size()) - 1;
  const float* l = logits.data<float>() + last * V;
  const double m = *std::max_element(l, l + V);
  std::vector<double> p(static_cast<std::size_t>(V));
  double s = 0;
  for (std::int64_t v = 0; v < V; ++v) s += p[static_cast<std::size_t>(v)] = std::exp(l[v] - m);
  for (double& q : p) q /= s;
  return p;
}

double max_diff(const std::vector<double>& a, const json& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b.at(i).get<double>()));
  return b.size() == a.size() ? m : INFINITY;
}

json llama_cpp(const Paths& p, const std::string& model, const std::string& prompt_file = "prompt.txt") {
  int rc = 0;
  const std::string out = run("node " + quote(p.script) + " " + quote(p.npm) + " " + quote(model) + " " +
                                  quote((p.work / prompt_file).string()) + " " + std::to_string(kSteps),
                              &rc);
  if (rc != 0) throw std::runtime_error("node-llama-cpp failed on " + model + " (exit " + std::to_string(rc) + ")");
  return json::parse(out);
}

struct Model {
  std::unique_ptr<tg::nn::GPT> gpt;
  lm::Corpus vocab;
};

// The run's final weights from model.safetensors, with its configuration and vocabulary.
Model load_run(const fs::path& dir) {
  tg::Metadata meta;
  const tg::StateDict sd = tg::load_safetensors((dir / "model.safetensors").string(), &meta);
  Model m;
  m.gpt = std::make_unique<tg::nn::GPT>(lm::parse_config_json(meta.at("config"), "model.safetensors").model);
  m.gpt->load_state_dict(sd);
  m.gpt->eval();
  m.vocab = lm::vocabulary_only(meta.at("vocab"));
  return m;
}

// Text on one line, quoted: newlines as \n.
std::string escaped(const std::string& text) {
  std::string out = "\"";
  for (char c : text) out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out + "\"";
}

bool check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok    " : "FAIL  ") << what << "\n";
  return ok;
}

// The continuation llama.cpp chose, after the prompt: ids[0, n) + the first s chosen tokens.
std::vector<std::int32_t> context_at(const std::vector<std::int32_t>& prompt, const json& steps, int s) {
  std::vector<std::int32_t> ids = prompt;
  for (int i = 0; i < s; ++i) ids.push_back(steps.at(i).at("token").get<std::int32_t>());
  return ids;
}

bool check_f32(Model& m, const std::vector<std::int32_t>& prompt, const json& r) {
  double worst = 0;
  int same = 0;
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<double> p = next_probs(*m.gpt, context_at(prompt, r.at("steps"), s));
    worst = std::max(worst, max_diff(p, r.at("steps").at(s).at("probs")));
    const auto argmax = static_cast<std::int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
    same += argmax == r.at("steps").at(s).at("token").get<std::int32_t>();
  }
  std::ostringstream w;
  w << (m.vocab.bpe ? "BPE " : "") << "F32: max |p_llama.cpp - p_tapegrad| over " << kSteps << " steps x " << m.vocab.vocab_size()
    << " tokens = " << worst << " (tolerance " << kTol << ")";
  bool ok = check(worst <= kTol, w.str());
  const std::string text = escaped(m.vocab.decode(context_at({}, r.at("steps"), kSteps)));
  const std::string kind = m.vocab.bpe ? "BPE " : "";
  ok &= check(same == kSteps, kind + "F32: greedy continuation identical for " + std::to_string(same) + " of " +
                                  std::to_string(kSteps) + " tokens: " + text);
  return ok;
}

bool check_bf16(Model& m, const fs::path& gguf, const std::vector<std::int32_t>& prompt, const json& r) {
  const tg::nn::GGUFModel f = tg::nn::load_gguf_model(gguf.string());
  tg::nn::GPT twin(f.config);
  twin.load_state_dict(f.state_dict);
  double vs_twin = 0, vs_f32 = 0, rounding = 0;
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<std::int32_t> ids = context_at(prompt, r.at("steps"), s);
    const std::vector<double> p32 = next_probs(*m.gpt, ids);
    tg::AutocastGuard bf16;
    const std::vector<double> pbf = next_probs(twin, ids, /*cached=*/true);
    const json& got = r.at("steps").at(s).at("probs");
    vs_twin = std::max(vs_twin, max_diff(pbf, got));
    vs_f32 = std::max(vs_f32, max_diff(p32, got));
    for (std::size_t i = 0; i < p32.size(); ++i) rounding = std::max(rounding, std::fabs(pbf[i] - p32[i]));
  }
  std::ostringstream a, b;
  a << "BF16: max |p_llama.cpp - p_tapegrad float32| = " << vs_f32 << " (tolerance 2 R = " << 2 * rounding
    << ", R = " << rounding << ": how far bf16 rounding moves tapegrad's own)";
  b << "BF16: max |p_llama.cpp - p_tapegrad bf16 twin| = " << vs_twin << " (tolerance R = " << rounding << ")";
  const bool ok = check(vs_f32 <= 2 * rounding, a.str());
  return check(vs_twin <= rounding, b.str()) && ok;
}

// train_lm on the corpus into dir (extra: the tokenizer options), then --export-gguf of each
// dtype into dir/<dtype>.gguf. Throws with the exit status when a command fails.
void train_and_export(const Paths& p, const fs::path& dir, const std::string& extra,
                      const std::vector<std::string>& dtypes) {
  int rc = 0;
  run(quote(p.train_lm) + " --data " + quote(p.corpus) + " --arch llama --norm rmsnorm --n-layer 2 --n-head 2 --n-embd 32" +
          " --block-size 96 --batch-size 8 --steps 800 --lr 1e-2 --min-lr 1e-3 --warmup 20 --eval-interval 800" +
          " --eval-iters 1 --threads 1 --quiet " + extra + " --out " + quote(dir.string()) + " >/dev/null 2>&1",
      &rc);
  if (rc != 0) throw std::runtime_error("train_lm " + extra + " failed (exit " + std::to_string(rc) + ")");
  for (const std::string& dtype : dtypes) {
    run(quote(p.train_lm) + " --resume " + quote(dir.string()) + " --export-gguf " +
            quote((dir / (dtype + ".gguf")).string()) + " --gguf-dtype " + dtype + " 2>&1", &rc);
    if (rc != 0) throw std::runtime_error("train_lm --export-gguf failed (exit " + std::to_string(rc) + ")");
  }
}

// The prompt in llama.cpp's tokens against tapegrad's, and back to text.
bool check_prompt(const std::string& text, const std::vector<std::int32_t>& prompt, const json& r, const std::string& kind) {
  const auto merged = std::count_if(prompt.begin(), prompt.end(), [](std::int32_t id) { return id >= 256; });
  bool ok = check(r.at("tokens").get<std::vector<std::int32_t>>() == prompt,
                  kind + ": the prompt tokenizes to tapegrad's " + std::to_string(prompt.size()) + " ids" +
                      (kind == "BPE" ? " (" + std::to_string(merged) + " of them made by merges)" : ""));
  std::string pieces;
  for (const auto& piece : r.at("pieces")) pieces += piece.get<std::string>();
  return check(pieces == text, kind + ": and its tokens detokenize to the prompt: " + escaped(pieces)) && ok;
}

int run_checks(const Paths& p) {
  fs::remove_all(p.work);
  fs::create_directories(p.work);
  std::ofstream(p.work / "prompt.txt") << kPrompt;
  std::ofstream(p.work / "bpe_prompt.txt") << kBpePrompt;
  const fs::path dir = p.work / "run", bpe_dir = p.work / "bpe";
  train_and_export(p, dir, "", {"f32", "bf16"});
  Model m = load_run(dir);
  const std::vector<std::int32_t> prompt = m.vocab.encode(kPrompt);
  const json f32 = llama_cpp(p, (dir / "f32.gguf").string());
  bool ok = check_prompt(kPrompt, prompt, f32, "characters");
  ok &= check_f32(m, prompt, f32);
  ok &= check_bf16(m, dir / "bf16.gguf", prompt, llama_cpp(p, (dir / "bf16.gguf").string()));
  train_and_export(p, bpe_dir, "--tokenizer bpe --vocab-size 300", {"f32"});
  Model b = load_run(bpe_dir);
  const std::vector<std::int32_t> bpe_prompt = b.vocab.encode(kBpePrompt);
  const json bpe = llama_cpp(p, (bpe_dir / "f32.gguf").string(), "bpe_prompt.txt");
  ok &= check_prompt(kBpePrompt, bpe_prompt, bpe, "BPE");
  ok &= check_f32(b, bpe_prompt, bpe);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return std::cerr << "usage: check_llama_cpp TRAIN_LM NPM_DIR SCRIPT CORPUS WORK_DIR\n", 2;
  const Paths p{argv[1], argv[2], argv[3], argv[4], argv[5]};
  if (const std::string why = missing_reference(p); !why.empty()) {
    std::cout << "skipped: " << why << "\n";
    return 77;
  }
  // One thread everywhere: the model is tiny, and on a shared machine idle threads spinning in
  // OpenMP's barriers cost far more than they save.
  tg::set_num_threads(1);
  try {
    return run_checks(p);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
