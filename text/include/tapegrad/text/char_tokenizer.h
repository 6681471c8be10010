#pragma once
// CharTokenizer: one token per Unicode character. The vocabulary is the sorted set of distinct code
// points of a UTF-8 text, and a token's id is its index in that set (the character-level GPT's
// vocabulary, as in the PyTorch reference of the baby GPT).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tg::text {

class CharTokenizer {
 public:
  CharTokenizer() = default;
  // The distinct characters of a UTF-8 text; tg::Error when the text is not valid UTF-8.
  static CharTokenizer from_text(std::string_view utf8);
  // The vocabulary as one UTF-8 string (vocab_utf8()); tg::Error unless it is sorted and distinct.
  static CharTokenizer from_vocab_utf8(std::string_view vocab);

  // Token ids of a UTF-8 text; a character outside the vocabulary is a tg::Error naming it.
  std::vector<std::int32_t> encode(std::string_view utf8) const;
  // The UTF-8 text of ids; an id outside [0, vocab_size) is a tg::Error.
  std::string decode(std::span<const std::int32_t> ids) const;

  std::string vocab_utf8() const;
  const std::vector<char32_t>& vocab() const { return vocab_; }
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(vocab_.size()); }

 private:
  std::vector<char32_t> vocab_;  // sorted code points; token id = index
};

}  // namespace tg::text
