#pragma once
// A character-level corpus: UTF-8 text decoded to code points, the sorted set of distinct
// characters as the vocabulary (tg::text::CharTokenizer), and a 90/10 train/validation split (as
// in the PyTorch reference). lm/tokens.h gives the same split in byte-level BPE tokens instead.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>
#include <tapegrad/text/bpe.h>
#include <tapegrad/text/char_tokenizer.h>

namespace lm {

struct Corpus {
  std::string path;
  std::uint64_t content_hash = 0;    // FNV-1a (64-bit) of the file's bytes: ranks compare it
  tg::text::CharTokenizer chars;     // sorted code points; token id = index
  std::shared_ptr<const tg::text::BpeTokenizer> bpe;  // set: the ids are BPE tokens (lm/tokens.h)
  std::vector<std::int32_t> train, val;
  std::int64_t train_bytes = 0, val_bytes = 0;  // UTF-8 bytes of each split, for bits per byte
  std::int64_t vocab_size() const { return bpe ? bpe->vocab_size() : chars.vocab_size(); }
  std::string decode(const std::vector<std::int32_t>& ids) const;
  // Token ids of a UTF-8 text; a character outside the vocabulary is a tg::Error naming it.
  std::vector<std::int32_t> encode(const std::string& text) const;
  // The vocabulary as one UTF-8 string (stored in checkpoints): the characters, or for BPE
  // "tokenizer.json" and a newline before the file's text (no sorted vocabulary starts so).
  std::string vocab_utf8() const;
};

// Throws tg::Error with a one-line reason for a missing file, a directory or any other file that is
// not a regular file (a device such as /dev/zero, a pipe), a file over kMaxCorpusBytes, an empty,
// binary (NUL bytes or invalid UTF-8) or too short file (each split needs more than
// block_size + 1 characters).
inline constexpr std::uint64_t kMaxCorpusBytes = std::uint64_t(1) << 30;
Corpus load_corpus(const std::string& path, std::int64_t block_size);

// FNV-1a, 64-bit (offset basis 14695981039346656037, prime 1099511628211) of bytes.
std::uint64_t fnv1a64(const std::string& bytes);

// The path a run records for its corpus: absolute and canonical (symbolic links, "." and ".."
// resolved), so that a resume from any working directory reads the same file. The path as given
// when the file system cannot resolve it.
std::string absolute_corpus_path(const std::string& path);

// A corpus path as messages name it: quoted, and when relative, followed by the file it names from
// this process's working directory ("'data.txt' (/home/me/data.txt)").
std::string shown_path(const std::string& path);

std::string encode_utf8(char32_t c);

// A Corpus with only the vocabulary (vocab_utf8() of a checkpoint), for encoding and decoding.
Corpus vocabulary_only(const std::string& vocab_utf8);

// A random batch (x, y) of shape (B, T): windows of the split starting at uniform positions,
// y shifted by one. Positions come from gen, so a saved generator state replays the same batches.
void sample_batch(const std::vector<std::int32_t>& split, std::int64_t B, std::int64_t T, tg::Generator& gen,
                  tg::Tensor& x, tg::Tensor& y);

}  // namespace lm
