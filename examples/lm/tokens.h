#pragma once
// Subword tokens for train_lm (--tokenizer, --vocab-size): the corpus's 90/10 split (the same
// characters as the character-level run), each split encoded by a byte-level BPE
// (tapegrad::text, docs/tokenizer.md) trained on the training split only, so the validation text
// does not shape it; or by an existing tokenizer.json / GPT-2 encoder.json. Losses in nats per
// token do not compare across tokenizers; bits per byte do.
#include <cmath>
#include <string>

#include "lm/corpus.h"

namespace lm {

struct TokenizerChoice {
  std::string spec = "char";      // "char", "bpe" (trained), or the path of a tokenizer file
  std::int64_t vocab_size = 512;  // of a trained BPE
};

// The corpus in the chosen tokens; tg::Error for a bad choice, or splits too short for a block.
Corpus load_corpus(const std::string& path, std::int64_t block_size, const TokenizerChoice& choice);

// A run's tokenizer on resume: the kind its configuration records, from its directory.
TokenizerChoice run_tokenizer(const std::string& kind, const std::string& dir);

// The run directory's tokenizer.json, for a BPE corpus; nothing for characters.
void save_tokenizer(const Corpus& corpus, const std::string& dir);

// "char" or "bpe": the kind recorded in the configuration.
inline std::string tokenizer_kind(const Corpus& corpus) { return corpus.bpe ? "bpe" : "char"; }

// Bits per byte of a mean loss in nats per token on a split: loss x tokens / bytes / ln 2, with
// the split's own tokens-per-byte ratio (evaluation windows are uniform over the split).
double bits_per_byte(double loss, const Corpus& corpus, bool val);

}  // namespace lm
