#pragma once
// GPT-2's pre-tokenization: the text is cut into chunks by the pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (contractions; a word, a number or a run of punctuation with at most one leading space; runs of
// white space, leaving the last space of a run to the word after it), and merges never cross a
// chunk. The pattern runs on PCRE2 in UTF mode with Unicode properties (\s, \p{L}, \p{N} by the
// Unicode tables) and its JIT. PCRE2 matches only valid UTF-8, so the text is first cut into
// maximal valid runs: each run is split by the pattern, and each maximal run of bytes that are not
// valid UTF-8 is one chunk of its own. The chunks cover the text in order, byte for byte.
#include <cstddef>
#include <string_view>

struct pcre2_real_match_data_8;
struct pcre2_real_match_context_8;
struct pcre2_real_jit_stack_8;

namespace tg::text::detail {

class PreTokenizer {
 public:
  explicit PreTokenizer(std::string_view text);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // The next chunk, or false at the end of the text.
  bool next(std::string_view& chunk);

 private:
  std::size_t valid_run_end(std::size_t from) const;
  std::size_t invalid_run_end(std::size_t from) const;
  std::size_t match_end(std::size_t from);
  void release();

  std::string_view text_;
  std::size_t pos_ = 0, run_end_ = 0;  // the valid UTF-8 run being split is [pos_, run_end_)
  pcre2_real_match_data_8* match_ = nullptr;
  pcre2_real_match_context_8* context_ = nullptr;
  pcre2_real_jit_stack_8* stack_ = nullptr;
};

}  // namespace tg::text::detail
