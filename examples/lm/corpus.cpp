#include "lm/corpus.h"

#include <tapegrad/text/utf8.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace lm {

std::string encode_utf8(char32_t c) { return tg::text::encode_utf8(c); }

namespace {
constexpr const char* kBpeVocabPrefix = "tokenizer.json\n";
bool decode_utf8(const std::string& s, std::vector<char32_t>& out) { return tg::text::decode_utf8(s, out); }
}  // namespace

std::uint64_t fnv1a64(const std::string& bytes) {
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::string absolute_corpus_path(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec) return path;
  const std::filesystem::path canonical = std::filesystem::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal().string() : canonical.string();
}

std::string shown_path(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.is_absolute()) return "'" + path + "'";
  const std::filesystem::path abs = std::filesystem::absolute(p, ec);
  return ec ? "'" + path + "'" : "'" + path + "' (" + abs.lexically_normal().string() + ")";
}

namespace {
// The bytes of a regular file of at most kMaxCorpusBytes; what stat(2) reports is what is read,
// so a device or a growing file never makes the reader allocate without bound.
std::string read_corpus_bytes(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) tg::fail("data", "cannot open ", shown_path(path), ": no such file");
  if (std::filesystem::is_directory(st)) tg::fail("data", "'", path, "' is a directory; give a text file");
  if (!std::filesystem::is_regular_file(st))
    tg::fail("data", "'", path, "' is not a regular file (a device, pipe or socket); give a text file");
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) tg::fail("data", "cannot read the size of '", path, "': ", ec.message());
  if (size > kMaxCorpusBytes)
    tg::fail("data", "'", path, "' is ", size, " bytes; the character-level reader takes at most ", kMaxCorpusBytes);
  std::ifstream f(path, std::ios::binary);
  if (!f) tg::fail("data", "cannot open ", shown_path(path));
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
  c.chars = tg::text::CharTokenizer::from_text(bytes);
  const std::vector<char32_t>& vocab = c.chars.vocab();
  const auto n = static_cast<std::int64_t>(text.size());
  const std::int64_t n_train = static_cast<std::int64_t>(0.9 * static_cast<double>(n));
  if (n_train <= block_size + 1 || n - n_train <= block_size + 1)
    tg::fail("data", "'", path, "' has ", n, " characters; a 90/10 split with block size ", block_size,
             " needs at least ", (block_size + 2) * 10, "");
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < text.size(); ++i)
    ids[i] = static_cast<std::int32_t>(std::lower_bound(vocab.begin(), vocab.end(), text[i]) - vocab.begin());
  c.train.assign(ids.begin(), ids.begin() + n_train);
  c.val.assign(ids.begin() + n_train, ids.end());
  for (std::size_t i = 0; i < text.size(); ++i)
    (static_cast<std::int64_t>(i) < n_train ? c.train_bytes : c.val_bytes) += static_cast<std::int64_t>(encode_utf8(text[i]).size());
  return c;
}

std::string Corpus::decode(const std::vector<std::int32_t>& ids) const {
  return bpe ? bpe->decode(ids) : chars.decode(ids);
}

std::vector<std::int32_t> Corpus::encode(const std::string& text) const {
  return bpe ? bpe->encode(text) : chars.encode(text);
}

Corpus vocabulary_only(const std::string& vocab_utf8) {
  Corpus c;
  const std::string prefix = kBpeVocabPrefix;
  if (vocab_utf8.rfind(prefix, 0) == 0)
    c.bpe = std::make_shared<const tg::text::BpeTokenizer>(
        tg::text::BpeTokenizer::from_tokenizer_json(std::string_view(vocab_utf8).substr(prefix.size())));
  else
    c.chars = tg::text::CharTokenizer::from_vocab_utf8(vocab_utf8);
  return c;
}

std::string Corpus::vocab_utf8() const {
  return bpe ? kBpeVocabPrefix + bpe->to_tokenizer_json() : chars.vocab_utf8();
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
