#include "tapegrad/text/char_tokenizer.h"

#include <algorithm>
#include <cstdio>

#include "tapegrad/error.h"
#include "tapegrad/text/utf8.h"

namespace tg::text {

CharTokenizer CharTokenizer::from_text(std::string_view utf8) {
  // Decoded 64 KiB at a time (at a character boundary), so that a corpus is never held twice
  // as code points: only the distinct ones are kept.
  std::vector<char32_t> chars, piece;
  for (std::size_t i = 0; i < utf8.size();) {
    std::size_t end = std::min(utf8.size(), i + (std::size_t(1) << 16));
    while (end < utf8.size() && (static_cast<unsigned char>(utf8[end]) & 0xC0) == 0x80) ++end;  // a continuation byte
    piece.clear();
    if (!decode_utf8(utf8.substr(i, end - i), piece)) fail("CharTokenizer::from_text", "the text is not valid UTF-8");
    chars.insert(chars.end(), piece.begin(), piece.end());
    std::sort(chars.begin(), chars.end());
    chars.erase(std::unique(chars.begin(), chars.end()), chars.end());
    i = end;
  }
  CharTokenizer t;
  t.vocab_ = std::move(chars);
  return t;
}

CharTokenizer CharTokenizer::from_vocab_utf8(std::string_view vocab) {
  CharTokenizer t;
  if (!decode_utf8(vocab, t.vocab_)) fail("CharTokenizer::from_vocab_utf8", "the vocabulary is not valid UTF-8");
  if (std::adjacent_find(t.vocab_.begin(), t.vocab_.end(), std::greater_equal<char32_t>()) != t.vocab_.end())
    fail("CharTokenizer::from_vocab_utf8", "the vocabulary of ", t.vocab_.size(), " characters is not sorted and distinct");
  return t;
}

std::vector<std::int32_t> CharTokenizer::encode(std::string_view utf8) const {
  std::vector<char32_t> chars;
  if (!decode_utf8(utf8, chars)) fail("CharTokenizer::encode", "the text is not valid UTF-8");
  std::vector<std::int32_t> ids;
  ids.reserve(chars.size());
  for (char32_t c : chars) {
    const auto it = std::lower_bound(vocab_.begin(), vocab_.end(), c);
    if (it == vocab_.end() || *it != c) {
      char code[16];
      std::snprintf(code, sizeof code, "U+%04X", static_cast<unsigned>(c));
      fail("CharTokenizer::encode", "the character '", encode_utf8(c), "' (", code,
           ") is not in the vocabulary of ", vocab_.size(), " characters");
    }
    ids.push_back(static_cast<std::int32_t>(it - vocab_.begin()));
  }
  return ids;
}

std::string CharTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string s;
  for (std::int32_t i : ids) {
    if (i < 0 || i >= static_cast<std::int32_t>(vocab_.size()))
      fail("CharTokenizer::decode", "id ", i, " is outside the vocabulary [0, ", vocab_.size(), ")");
    s += encode_utf8(vocab_[static_cast<std::size_t>(i)]);
  }
  return s;
}

std::string CharTokenizer::vocab_utf8() const {
  std::string s;
  for (char32_t c : vocab_) s += encode_utf8(c);
  return s;
}

}  // namespace tg::text
