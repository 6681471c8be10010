#include "lm/corpus.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

namespace lm {

std::string encode_utf8(char32_t c) {
  std::string s;
  if (c < 0x80) s += static_cast<char>(c);
  else if (c < 0x800) { s += static_cast<char>(0xC0 | (c >> 6)); s += static_cast<char>(0x80 | (c & 0x3F)); }
  else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

namespace {
// Strict UTF-8 decoding (no overlong forms, no surrogates); false on any invalid sequence.
bool decode_utf8(const std::string& s, std::vector<char32_t>& out) {
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80 ? 0 : (b >> 5) == 6 ? 1 : (b >> 4) == 14 ? 2 : (b >> 3) == 30 ? 3 : -1;
    if (n < 0 || i + static_cast<std::size_t>(n) >= s.size() + (n == 0 ? 1 : 0)) return false;
    char32_t c = n == 0 ? b : n == 1 ? (b & 0x1F) : n == 2 ? (b & 0x0F) : (b & 0x07);
    for (int k = 1; k <= n; ++k) {
      const auto cb = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      if ((cb >> 6) != 2) return false;
      c = (c << 6) | (cb & 0x3F);
    }
    const char32_t min[] = {0, 0x80, 0x800, 0x10000};
    if (c < min[n] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return false;
    out.push_back(c);
    i += static_cast<std::size_t>(n) + 1;
  }
  return true;
}
}  // namespace

std::uint64_t fnv1a64(const std::string& bytes) {
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

namespace {
// The bytes of a regular file of at most kMaxCorpusBytes; what stat(2) reports is what is read,
// so a device or a growing file never makes the reader allocate without bound.
std::string read_corpus_bytes(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) tg::fail("data", "cannot open '", path, "': no such file");
  if (std::filesystem::is_directory(st)) tg::fail("data", "'", path, "' is a directory; give a text file");
  if (!std::filesystem::is_regular_file(st))
    tg::fail("data", "'", path, "' is not a regular file (a device, pipe or socket); give a text file");
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) tg::fail("data", "cannot read the size of '", path, "': ", ec.message());
  if (size > kMaxCorpusBytes)
    tg::fail("data", "'", path, "' is ", size, " bytes; the character-level reader takes at most ", kMaxCorpusBytes);
  std::ifstream f(path, std::ios::binary);
  if (!f) tg::fail("data", "cannot open '", path, "'");
  std::string bytes(static_cast<std::size_t>(size), '\0');
  f.read(bytes.data(), static_cast<std::streamsize>(size));
  bytes.resize(static_cast<std::size_t>(f.gcount()));  // a file that shrank meanwhile
  return bytes;
}
}  // namespace

Corpus load_corpus(const std::string& path, std::int64_t block_size) {
  const std::string bytes = read_corpus_bytes(path);
  if (bytes.empty()) tg::fail("data", "'", path, "' is empty");
  if (bytes.find('\0') != std::string::npos) tg::fail("data", "'", path, "' looks binary (contains NUL bytes); need UTF-8 text");
  std::vector<char32_t> text;
  if (!decode_utf8(bytes, text)) tg::fail("data", "'", path, "' is not valid UTF-8 text");
  Corpus c;
  c.path = path;
  c.content_hash = fnv1a64(bytes);
  std::set<char32_t> chars(text.begin(), text.end());
  c.vocab.assign(chars.begin(), chars.end());
  const auto n = static_cast<std::int64_t>(text.size());
  const std::int64_t n_train = static_cast<std::int64_t>(0.9 * static_cast<double>(n));
  if (n_train <= block_size + 1 || n - n_train <= block_size + 1)
    tg::fail("data", "'", path, "' has ", n, " characters; a 90/10 split with block size ", block_size,
             " needs at least ", (block_size + 2) * 10, "");
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < text.size(); ++i)
    ids[i] = static_cast<std::int32_t>(std::lower_bound(c.vocab.begin(), c.vocab.end(), text[i]) - c.vocab.begin());
  c.train.assign(ids.begin(), ids.begin() + n_train);
  c.val.assign(ids.begin() + n_train, ids.end());
  return c;
}

std::string Corpus::decode(const std::vector<std::int32_t>& ids) const {
  std::string s;
  for (std::int32_t i : ids) s += encode_utf8(vocab[static_cast<std::size_t>(i)]);
  return s;
}

std::vector<std::int32_t> Corpus::encode(const std::string& text) const {
  std::vector<char32_t> chars;
  if (!decode_utf8(text, chars)) tg::fail("prompt", "is not valid UTF-8");
  std::vector<std::int32_t> ids;
  for (char32_t c : chars) {
    const auto it = std::lower_bound(vocab.begin(), vocab.end(), c);
    if (it == vocab.end() || *it != c) {
      char code[16];
      std::snprintf(code, sizeof code, "U+%04X", static_cast<unsigned>(c));
      tg::fail("prompt", "the character '", encode_utf8(c), "' (", code, ") is not in the model's vocabulary of ",
               vocab.size(), " characters");
    }
    ids.push_back(static_cast<std::int32_t>(it - vocab.begin()));
  }
  return ids;
}

Corpus vocabulary_only(const std::string& vocab_utf8) {
  Corpus c;
  if (!decode_utf8(vocab_utf8, c.vocab) || !std::is_sorted(c.vocab.begin(), c.vocab.end()))
    tg::fail("vocab", "is not a sorted UTF-8 vocabulary");
  return c;
}

std::string Corpus::vocab_utf8() const {
  std::string s;
  for (char32_t c : vocab) s += encode_utf8(c);
  return s;
}

void sample_batch(const std::vector<std::int32_t>& split, std::int64_t B, std::int64_t T, tg::Generator& gen,
                  tg::Tensor& x, tg::Tensor& y) {
  x = tg::Tensor::empty({B, T}, tg::int32);
  y = tg::Tensor::empty({B, T}, tg::int32);
  std::int32_t* xp = x.data<std::int32_t>();
  std::int32_t* yp = y.data<std::int32_t>();
  const std::int64_t hi = static_cast<std::int64_t>(split.size()) - T;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto start = static_cast<std::size_t>(gen.next_int(0, hi));
    std::copy_n(split.begin() + static_cast<std::ptrdiff_t>(start), T, xp + b * T);
    std::copy_n(split.begin() + static_cast<std::ptrdiff_t>(start) + 1, T, yp + b * T);
  }
}

}  // namespace lm
