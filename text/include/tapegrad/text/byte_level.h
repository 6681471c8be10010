#pragma once
// GPT-2's byte-to-unicode map: the 256 byte values as 256 printable characters, so that a vocabulary
// of byte strings can be written as text (encoder.json, vocab.bpe, tokenizer.json's vocab and
// merges). The printable bytes '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF stand for themselves;
// the other 68 bytes (controls, space, U+00A0, U+00AD), in increasing order, take U+0100, U+0101,
// ...: space is U+0120 'Ġ', newline U+010A 'Ċ'.
#include <cstdint>
#include <string>
#include <string_view>

namespace tg::text {

// The character that stands for byte b.
char32_t byte_to_unicode(std::uint8_t b);

// The byte-level text of some bytes: each byte replaced by its character, UTF-8 encoded.
std::string to_byte_level(std::string_view bytes);

// The bytes of a byte-level text; false when it is not UTF-8 or holds a character outside the
// 256 of the map (out then holds what was decoded so far).
bool from_byte_level(std::string_view text, std::string& out);

}  // namespace tg::text
