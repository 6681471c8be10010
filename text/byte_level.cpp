#include "tapegrad/text/byte_level.h"

#include <array>

#include "tapegrad/text/utf8.h"

namespace tg::text {

namespace {

// chars[b] is the character of byte b; bytes[c] the byte of character c < 0x144 (or -1).
struct ByteLevelMap {
  std::array<char32_t, 256> chars{};
  std::array<std::string, 256> utf8;
  std::array<int, 0x144> bytes{};
  ByteLevelMap() {
    bytes.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      chars[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
      utf8[static_cast<std::size_t>(b)] = encode_utf8(chars[static_cast<std::size_t>(b)]);
      bytes[chars[static_cast<std::size_t>(b)]] = b;
    }
  }
};

const ByteLevelMap& byte_level_map() {
  static const ByteLevelMap map;
  return map;
}

}  // namespace

char32_t byte_to_unicode(std::uint8_t b) { return byte_level_map().chars[b]; }

std::string to_byte_level(std::string_view bytes) {
  const ByteLevelMap& map = byte_level_map();
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) s += map.utf8[static_cast<unsigned char>(c)];
  return s;
}

bool from_byte_level(std::string_view text, std::string& out) {
  const ByteLevelMap& map = byte_level_map();
  out.clear();
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = utf8_sequence_length(text, i);
    if (n == 0 || n > 2) return false;  // the map's characters are all below U+0800
    const auto b0 = static_cast<unsigned char>(text[i]);
    const char32_t c = n == 1 ? b0 : ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
    if (c >= map.bytes.size() || map.bytes[c] < 0) return false;
    out += static_cast<char>(map.bytes[c]);
    i += n;
  }
  return true;
}

}  // namespace tg::text
