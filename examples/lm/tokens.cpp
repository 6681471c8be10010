#include "lm/tokens.h"

#include <filesystem>

#include "lm/run_dir.h"

namespace lm {

namespace fs = std::filesystem;

namespace {

tg::text::BpeTokenizer make_tokenizer(const TokenizerChoice& choice, const std::string& train_text) {
  if (choice.spec != "bpe") return tg::text::BpeTokenizer::load(choice.spec);
  tg::text::BpeTrainOptions o;
  o.vocab_size = choice.vocab_size;
  return tg::text::BpeTokenizer::train(train_text, o);
}

}  // namespace

Corpus load_corpus(const std::string& path, std::int64_t block_size, const TokenizerChoice& choice) {
  Corpus c = load_corpus(path, block_size);
  if (choice.spec == "char") return c;
  if (choice.spec.empty()) tg::fail("tokenizer", "give char, bpe or the path of a tokenizer.json");
  const std::string train_text = c.decode(c.train), val_text = c.decode(c.val);
  c.bpe = std::make_shared<const tg::text::BpeTokenizer>(make_tokenizer(choice, train_text));
  c.train = c.bpe->encode(train_text);
  c.val = c.bpe->encode(val_text);
  if (static_cast<std::int64_t>(c.val.size()) <= block_size + 1 || static_cast<std::int64_t>(c.train.size()) <= block_size + 1)
    tg::fail("data", "'", path, "' is ", c.train.size(), " + ", c.val.size(), " BPE tokens; each split needs more than ",
             block_size + 1, " for the block size ", block_size);
  return c;
}

TokenizerChoice run_tokenizer(const std::string& kind, const std::string& dir) {
  if (kind == "char") return {};
  if (kind != "bpe") tg::fail("resume", "unknown tokenizer '", kind, "' in the checkpoint's configuration");
  const fs::path file = fs::path(dir) / "tokenizer.json";
  if (!fs::exists(file)) tg::fail("resume", "the run '", dir, "' uses BPE tokens but has no tokenizer.json");
  return {file.string(), 0};
}

void save_tokenizer(const Corpus& corpus, const std::string& dir) {
  if (corpus.bpe && !dir.empty()) tg::write_file_atomic((fs::path(dir) / "tokenizer.json").string(), corpus.bpe->to_tokenizer_json());
}

double bits_per_byte(double loss, const Corpus& corpus, bool val) {
  const double tokens = static_cast<double>(val ? corpus.val.size() : corpus.train.size());
  const double bytes = static_cast<double>(val ? corpus.val_bytes : corpus.train_bytes);
  return bytes > 0 ? loss * tokens / bytes / std::log(2.0) : NAN;
}

}  // namespace lm
