#include "lm/gguf_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <sstream>
#include <tapegrad/nn/gguf_export.h>
#include <tapegrad/text/byte_level.h>

#include "lm/checkpoint.h"

namespace lm {

using namespace tg;

namespace {

// The corpus's tokenizer as the GGUF writes it: its characters, or its BPE tokens and merges in
// GPT-2's byte-level text (as tokenizer.json spells them), added tokens as they are.
nn::GGUFVocab gguf_vocab(const Corpus& corpus) {
  if (!corpus.bpe) {
    std::vector<std::string> chars;
    for (char32_t c : corpus.chars.vocab()) chars.push_back(encode_utf8(c));
    return nn::GGUFVocab::characters(std::move(chars));
  }
  const text::BpeTokenizer& bpe = *corpus.bpe;
  std::vector<bool> is_added(static_cast<std::size_t>(bpe.vocab_size()), false);
  std::vector<std::int32_t> added;
  for (const text::AddedToken& a : bpe.added_tokens()) added.push_back(a.id);
  std::sort(added.begin(), added.end());
  for (std::int32_t id : added) is_added[static_cast<std::size_t>(id)] = true;
  std::vector<std::string> tokens, merges;
  for (std::int32_t id = 0; id < bpe.vocab_size(); ++id) {
    const std::string_view t = bpe.token(id);
    tokens.emplace_back(is_added[static_cast<std::size_t>(id)] ? std::string(t) : text::to_byte_level(t));
  }
  for (const auto& [l, r] : bpe.merges())
    merges.push_back(tokens[static_cast<std::size_t>(l)] + " " + tokens[static_cast<std::size_t>(r)]);
  return nn::GGUFVocab::bpe(std::move(tokens), std::move(merges), std::move(added));
}

std::string describe(const nn::GGUFVocab& v) {
  const std::string n = std::to_string(v.tokens.size());
  return v.is_bpe() ? "a BPE of " + n + " tokens and " + std::to_string(v.merges.size()) + " merges" : n + " characters";
}

// The flags that define the model, each with its value in a configuration (as --help spells it).
// (--p is not among them: a GGUF model's norm is RMSNorm, which --p does not shape.)
struct ModelFlag {
  const char* flag;
  std::string (*value)(const nn::GPTConfig&);
};
const ModelFlag kModelFlags[] = {
    {"--arch", [](const nn::GPTConfig& c) { return nn::to_string(c.arch); }},
    {"--norm", [](const nn::GPTConfig& c) { return nn::to_string(c.norm); }},
    {"--n-layer", [](const nn::GPTConfig& c) { return std::to_string(c.n_layer); }},
    {"--n-head", [](const nn::GPTConfig& c) { return std::to_string(c.n_head); }},
    {"--n-embd", [](const nn::GPTConfig& c) { return std::to_string(c.n_embd); }},
    {"--block-size", [](const nn::GPTConfig& c) { return std::to_string(c.block_size); }},
};

// The file's configuration defines the run: a model flag given with another value is refused,
// every difference listed, rather than quietly replaced by the file's.
void check_model_flags(const CLI::App& app, const nn::GPTConfig& given, const nn::GPTConfig& file,
                       const std::string& path) {
  std::string diffs;
  for (const ModelFlag& f : kModelFlags)
    if (app.count(f.flag) && f.value(given) != f.value(file))
      diffs += (diffs.empty() ? "" : ", ") + std::string(f.flag) + " " + f.value(given) + " (the file's: " + f.value(file) + ")";
  if (!diffs.empty())
    fail("--init-from", "the model is the one in '", path, "'; these flags differ from it: ", diffs,
         ". Leave them out to start from the file");
}

}  // namespace

void add_gguf_options(CLI::App& app, GGUFOptions& o) {
  app.add_option("--export-gguf", o.export_file,
                 "with --resume DIR: write the run's weights and vocabulary as a llama.cpp GGUF model file "
                 "(llama arch with RMSNorm; docs/gguf.md), then exit");
  app.add_option("--gguf-dtype", o.dtype, "the GGUF's matrices: f32 (exact) or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--init-from", o.init_from,
                 "start a new run from a GGUF model file tapegrad wrote: its configuration and weights");
}

void settle_gguf_options(const GGUFOptions& o, const CLI::App& app, bool resuming, TrainConfig& c) {
  if (!o.export_file.empty() && !resuming) fail("--export-gguf", "needs --resume DIR (the run to export)");
  if (app.count("--gguf-dtype") && o.export_file.empty()) fail("--gguf-dtype", "applies to --export-gguf only");
  if (o.init_from.empty()) return;
  if (resuming) fail("--init-from", "starts a new run; not with --resume");
  if (app.count("--compare")) fail("--init-from", "starts one run from the file's model; not with --compare");
  const nn::GGUFModel m = nn::load_gguf_model(o.init_from);
  check_model_flags(app, c.model, m.config, o.init_from);
  const double dropout = c.model.dropout;
  c.model = m.config;
  c.model.dropout = dropout;
  c.init_from = o.init_from;
}

std::string export_run_gguf(const std::string& run_dir, const GGUFOptions& o) {
  if (job_size() > 1) fail("--export-gguf", "writes one file: run it without mpirun");
  const TrainConfig r = read_checkpoint_config(run_dir);
  if (const std::string why = nn::gguf_unsupported_reason(r.model); !why.empty()) fail("--export-gguf", why);
  Checkpoint ck = read_checkpoint(run_dir, r.model);
  StateDict weights;
  for (const auto& [k, t] : ck.tensors)
    if (k.rfind("model.", 0) == 0) weights.insert(k.substr(6), t);
  nn::GPT model(r.model);
  model.load_state_dict(weights);
  const DType dtype = o.dtype == "bf16" ? bfloat16 : float32;
  const nn::GGUFVocab vocab = gguf_vocab(vocabulary_only(ck.meta["vocab"]));
  nn::save_gguf_model(o.export_file, model, vocab, {dtype, "tapegrad " + run_dir});
  return "wrote " + o.export_file + " (llama.cpp llama arch, " + o.dtype + ", step " + ck.meta["step"] + " of " +
         run_dir + ")";
}

void init_from_gguf(nn::GPT& model, const std::string& file, const Corpus& corpus) {
  const nn::GGUFModel m = nn::load_gguf_model(file);
  const nn::GGUFVocab mine = gguf_vocab(corpus);
  if (mine != m.vocab)
    fail("--init-from", "the corpus '", corpus.path, "' (in the run's tokenizer) has a different vocabulary from '", file,
         "' (", describe(mine), " against ", describe(m.vocab),
         m.vocab.is_bpe() ? "; give the run the file's tokenizer: --tokenizer RUN/tokenizer.json)" : ")");
  model.load_state_dict(m.state_dict);  // refuses a configuration that differs, naming the tensors
}

}  // namespace lm
