#pragma once
// UTF-8 as RFC 3629 defines it: one to four bytes per code point, no overlong forms, no surrogates
// (U+D800..U+DFFF), nothing above U+10FFFF.
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tg::text {

// The UTF-8 bytes of one code point; throws tg::Error for a surrogate or a value above U+10FFFF.
std::string encode_utf8(char32_t c);

// Strict decoding of the whole string; false (out holds what was decoded so far) on any invalid
// sequence.
bool decode_utf8(std::string_view s, std::vector<char32_t>& out);

// The length of the valid UTF-8 sequence that starts at s[i], or 0 when the bytes there are not one.
std::size_t utf8_sequence_length(std::string_view s, std::size_t i);

}  // namespace tg::text
