#pragma once
// BpeTokenizer: byte-level byte-pair encoding as GPT-2 defines it (Radford et al. 2019, section
// 2.2). A text is cut into chunks by GPT-2's pattern (words with their leading space, numbers,
// punctuation, white space); each chunk starts as its bytes, one token per byte, and the learned
// merges join adjacent tokens, the merge of lowest rank first, until none applies. Every byte is a
// token, so any bytes encode, and decode(encode(b)) == b for any b, UTF-8 or not.
//
// Trained from a corpus (BpeTokenizer::train), read and written as Hugging Face's tokenizer.json,
// read from GPT-2's released encoder.json + vocab.bpe. docs/tokenizer.md teaches the algorithm.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tg::text {

namespace detail {
struct BpeModel;
}

// A token matched as a whole in the input before pre-tokenization, e.g. "<|endoftext|>".
struct AddedToken {
  std::int32_t id = 0;
  std::string content;
  bool operator==(const AddedToken&) const = default;
};

struct BpeTrainProgress {
  std::int64_t merges_done = 0, merges_total = 0;  // tokens made so far, and to make
  std::int64_t pair_count = 0;  // occurrences of the pair just merged
  std::string_view token;       // the bytes of the token it made
};

struct BpeTrainOptions {
  std::int64_t vocab_size = 1024;           // the 256 bytes + merges + special tokens
  std::vector<std::string> special_tokens;  // given the last ids, in this order
  std::function<void(const BpeTrainProgress&)> progress;  // called after every merge when set
};

class BpeTokenizer {
 public:
  // The 256 single bytes (id = byte value) and no merges.
  BpeTokenizer();
  explicit BpeTokenizer(std::shared_ptr<const detail::BpeModel> model);

  // Learns merges from the corpus: starting from the 256 bytes, the most frequent adjacent pair
  // of tokens within a chunk becomes a new token, until vocab_size. Among pairs of equal count
  // the one with the smaller left id wins, then the smaller right id. Stops early when no pair
  // is left. Ids: 0..255 the bytes, then merges in order, then the special tokens.
  static BpeTokenizer train(std::string_view corpus, const BpeTrainOptions& options);

  // Hugging Face tokenizer.json with a BPE model, a ByteLevel pre-tokenizer and decoder.
  static BpeTokenizer from_tokenizer_json(std::string_view json);
  // GPT-2's encoder.json (token -> id) and vocab.bpe (merges, by rank).
  static BpeTokenizer from_gpt2(std::string_view encoder_json, std::string_view vocab_bpe);
  // A tokenizer.json, or an encoder.json with vocab.bpe in the same directory.
  static BpeTokenizer load(const std::string& path);
  std::string to_tokenizer_json() const;
  // As tokenizer.json, whole or not at all: a failed write leaves an earlier file at path as it was.
  void save(const std::string& path) const;

  std::vector<std::int32_t> encode(std::string_view bytes) const;
  void encode(std::string_view bytes, std::vector<std::int32_t>& out) const;  // appends to out
  // The bytes of the tokens; an id outside [0, vocab_size) is a tg::Error.
  std::string decode(std::span<const std::int32_t> ids) const;

  std::int64_t vocab_size() const;
  std::string_view token(std::int32_t id) const;                          // its bytes
  const std::vector<std::pair<std::int32_t, std::int32_t>>& merges() const;  // by rank
  const std::vector<AddedToken>& added_tokens() const;

 private:
  void encode_ordinary(std::string_view bytes, std::vector<std::int32_t>& out) const;
  std::shared_ptr<const detail::BpeModel> m_;
};

}  // namespace tg::text
