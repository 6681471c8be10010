#include "pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tapegrad/error.h"
#include "tapegrad/text/utf8.h"

namespace tg::text::detail {

namespace {

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The compiled pattern, shared by every thread (PCRE2's compiled code is read-only while matching).
struct Pattern {
  pcre2_code* code = nullptr;
  bool jit = false;
  Pattern() {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                         &err, &offset, nullptr);
    if (code) jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Pattern() { pcre2_code_free(code); }
};

const Pattern& gpt2_pattern() {
  static const Pattern p;
  if (!p.code) fail("PreTokenizer", "PCRE2 cannot compile GPT-2's pattern (PCRE2 without Unicode support?)");
  return p;
}

// The JIT's own stack grows to this size; the pattern's single-character repeats need a few
// hundred bytes whatever the length of a run.
constexpr std::size_t kJitStackStart = 32 * 1024, kJitStackMax = 4 * 1024 * 1024;

}  // namespace

PreTokenizer::PreTokenizer(std::string_view text) : text_(text) {
  const Pattern& p = gpt2_pattern();
  match_ = pcre2_match_data_create_from_pattern(p.code, nullptr);
  if (p.jit) {
    context_ = pcre2_match_context_create(nullptr);
    stack_ = pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr);
    if (context_ && stack_) pcre2_jit_stack_assign(context_, nullptr, stack_);
  }
  if (!match_ || (p.jit && (!context_ || !stack_))) {
    release();
    fail("PreTokenizer", "out of memory for PCRE2's match data");
  }
}

PreTokenizer::~PreTokenizer() { release(); }

void PreTokenizer::release() {
  pcre2_jit_stack_free(stack_);
  pcre2_match_context_free(context_);
  pcre2_match_data_free(match_);
  stack_ = nullptr;
  context_ = nullptr;
  match_ = nullptr;
}

std::size_t PreTokenizer::valid_run_end(std::size_t from) const {
  std::size_t i = from;
  while (i < text_.size()) {
    const std::size_t n = utf8_sequence_length(text_, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

std::size_t PreTokenizer::invalid_run_end(std::size_t from) const {
  std::size_t i = from;
  while (i < text_.size() && utf8_sequence_length(text_, i) == 0) ++i;
  return i;
}

// The end of the pattern's match at `from` within the valid run [from, run_end_). Every character
// is a letter, a number, white space or none of these, so a match always starts at `from`; the
// checks below only keep the chunks covering the text should that ever fail.
std::size_t PreTokenizer::match_end(std::size_t from) {
  const Pattern& p = gpt2_pattern();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text_.data());
  const int rc = p.jit ? pcre2_jit_match(p.code, subject, run_end_, from, 0, match_, context_)
                       : pcre2_match(p.code, subject, run_end_, from, PCRE2_NO_UTF_CHECK, match_, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return run_end_;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    fail("PreTokenizer", "PCRE2 match error at byte ", from, ": ", reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_);
  if (ovector[0] != from) return ovector[0] > from ? ovector[0] : run_end_;  // a gap: a chunk of its own
  return ovector[1] > from ? ovector[1] : from + utf8_sequence_length(text_, from);
}

bool PreTokenizer::next(std::string_view& chunk) {
  if (pos_ >= text_.size()) return false;
  std::size_t end = 0;
  if (pos_ >= run_end_) {
    run_end_ = valid_run_end(pos_);
    if (run_end_ == pos_) {  // bytes that are not UTF-8: one chunk up to the next valid character
      end = invalid_run_end(pos_);
      chunk = text_.substr(pos_, end - pos_);
      pos_ = end;
      return true;
    }
  }
  end = match_end(pos_);
  chunk = text_.substr(pos_, end - pos_);
  pos_ = end;
  return true;
}

}  // namespace tg::text::detail
