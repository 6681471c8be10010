// BPE training with pair counts kept up to date merge by merge (as Hugging Face's BpeTrainer and
// minbpe's "fast" variants do): the corpus is cut into chunks and counted once; each merge then
// visits only the distinct chunks that hold its pair and adjusts the counts of the pairs around
// each occurrence, so a merge costs its occurrences, not a pass over the corpus.
#include <algorithm>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "model.h"
#include "pretokenize.h"
#include "tapegrad/error.h"

namespace tg::text {

namespace {

using Pair = std::uint64_t;  // left << 32 | right
Pair pair_of(std::int32_t l, std::int32_t r) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(l)) << 32) | static_cast<std::uint32_t>(r);
}
std::int32_t left_of(Pair p) { return static_cast<std::int32_t>(p >> 32); }
std::int32_t right_of(Pair p) { return static_cast<std::int32_t>(p & 0xFFFFFFFFu); }

// A distinct chunk of the corpus as its current tokens, and how often it occurs.
struct Word {
  std::vector<std::int32_t> sym;
  std::int64_t count = 0;
};

// The distinct chunks of the corpus, in order of first occurrence, with the special tokens cut
// out so that they take no part in the merges.
std::vector<Word> count_words(std::string_view corpus, const std::vector<std::string>& specials) {
  std::unordered_map<std::string_view, std::size_t> index;
  std::vector<Word> words;
  auto add_chunks = [&](std::string_view text) {
    detail::PreTokenizer chunks(text);
    std::string_view chunk;
    while (chunks.next(chunk)) {
      const auto [it, fresh] = index.emplace(chunk, words.size());
      if (fresh) {
        Word w;
        w.sym.assign(chunk.begin(), chunk.end());
        for (std::int32_t& s : w.sym) s = static_cast<unsigned char>(s);
        words.push_back(std::move(w));
      }
      words[it->second].count += 1;
    }
  };
  std::size_t from = 0;
  while (from < corpus.size()) {
    std::size_t at = corpus.size(), len = 0;
    for (const std::string& s : specials) {
      const std::size_t p = corpus.find(s, from);
      if (p < at || (p == at && p != corpus.size() && s.size() > len)) at = p, len = s.size();
    }
    add_chunks(corpus.substr(from, at - from));
    from = at + len;
  }
  return words;
}

// The pair to merge next: the highest count, then the smaller left id, then the smaller right id.
struct Candidate {
  std::int64_t count;
  Pair pair;
  bool operator<(const Candidate& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

class Trainer {
 public:
  explicit Trainer(std::vector<Word> words) : words_(std::move(words)) {
    for (std::size_t w = 0; w < words_.size(); ++w)
      for (std::size_t i = 0; i + 1 < words_[w].sym.size(); ++i) {
        const Pair p = pair_of(words_[w].sym[i], words_[w].sym[i + 1]);
        counts_[p] += words_[w].count;
        where_[p].push_back(static_cast<std::int32_t>(w));
      }
    for (const auto& [p, c] : counts_) queue_.push({c, p});
  }

  // The next pair to merge and its count; false when no pair is left.
  bool best(Pair& pair, std::int64_t& count) {
    while (!queue_.empty()) {
      const Candidate c = queue_.top();
      queue_.pop();
      const auto it = counts_.find(c.pair);
      const std::int64_t now = it == counts_.end() ? 0 : it->second;
      if (now == c.count && now > 0) {
        pair = c.pair, count = now;
        return true;
      }
      if (now > 0) queue_.push({now, c.pair});  // stale: counts only fall, so re-queue lower
    }
    return false;
  }

  // Replaces every occurrence of pair by the token `merged` and updates the counts.
  void merge(Pair pair, std::int32_t merged) {
    std::vector<std::int32_t> list = std::move(where_[pair]);
    where_.erase(pair);
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
    touched_.clear();
    for (std::int32_t w : list) merge_word(static_cast<std::size_t>(w), left_of(pair), right_of(pair), merged);
    counts_.erase(pair);
    for (Pair p : touched_) {
      const auto it = counts_.find(p);
      if (it != counts_.end() && it->second > 0) queue_.push({it->second, p});
    }
  }

 private:
  void add(Pair p, std::int64_t c) { counts_[p] += c; }
  void add_new(Pair p, std::int64_t c, std::size_t w) {
    counts_[p] += c;
    where_[p].push_back(static_cast<std::int32_t>(w));
    touched_.insert(p);
  }

  // Left to right, non-overlapping: at each occurrence (a, b) -> z with left neighbour x and right
  // neighbour y, the pairs (x, a), (a, b), (b, y) lose the word's count and (x, z), (z, y) gain it.
  // x is read after the merges before it, so "a b a b" ends with one (z, z).
  void merge_word(std::size_t w, std::int32_t a, std::int32_t b, std::int32_t z) {
    std::vector<std::int32_t>& s = words_[w].sym;
    const std::int64_t c = words_[w].count;
    const std::size_t n = s.size();
    std::size_t out = 0;
    for (std::size_t i = 0; i < n;) {
      if (i + 1 < n && s[i] == a && s[i + 1] == b) {
        if (out > 0) add(pair_of(s[out - 1], a), -c), add_new(pair_of(s[out - 1], z), c, w);
        add(pair_of(a, b), -c);
        if (i + 2 < n) add(pair_of(b, s[i + 2]), -c), add_new(pair_of(z, s[i + 2]), c, w);
        s[out++] = z;
        i += 2;
      } else {
        s[out++] = s[i++];
      }
    }
    s.resize(out);
  }

  std::vector<Word> words_;
  std::unordered_map<Pair, std::int64_t> counts_;
  std::unordered_map<Pair, std::vector<std::int32_t>> where_;  // words that may hold the pair
  std::priority_queue<Candidate> queue_;
  std::unordered_set<Pair> touched_;  // pairs made by the current merge
};

void check_options(const BpeTrainOptions& o) {
  const auto n_special = static_cast<std::int64_t>(o.special_tokens.size());
  if (o.vocab_size < 256 + n_special || o.vocab_size > (std::int64_t{1} << 30))
    fail("BpeTokenizer::train", "vocab_size ", o.vocab_size, " must be in [256 + ", n_special, " special tokens, 2^30]");
  for (std::size_t i = 0; i < o.special_tokens.size(); ++i) {
    if (o.special_tokens[i].empty()) fail("BpeTokenizer::train", "special token ", i, " is empty");
    for (std::size_t j = 0; j < i; ++j)
      if (o.special_tokens[j] == o.special_tokens[i])
        fail("BpeTokenizer::train", "special token '", o.special_tokens[i], "' is given twice");
  }
}

}  // namespace

BpeTokenizer BpeTokenizer::train(std::string_view corpus, const BpeTrainOptions& options) {
  check_options(options);
  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b) tokens[static_cast<std::size_t>(b)] = std::string(1, static_cast<char>(b));
  const std::int64_t n_merges = options.vocab_size - 256 - static_cast<std::int64_t>(options.special_tokens.size());
  Trainer trainer(count_words(corpus, options.special_tokens));
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  // Two merges can spell the same bytes ((ab, c) and (a, bc)); the second reuses the first's id,
  // as Hugging Face's trainer does, so a merge adds at most one token.
  std::unordered_map<std::string, std::int32_t> ids;
  const std::size_t target = static_cast<std::size_t>(256 + n_merges);
  Pair pair = 0;
  std::int64_t count = 0;
  while (tokens.size() < target && trainer.best(pair, count)) {
    std::string joined = tokens[static_cast<std::size_t>(left_of(pair))] + tokens[static_cast<std::size_t>(right_of(pair))];
    const auto [it, fresh] = ids.emplace(std::move(joined), static_cast<std::int32_t>(tokens.size()));
    if (fresh) tokens.push_back(it->first);
    merges.emplace_back(left_of(pair), right_of(pair));
    trainer.merge(pair, it->second);
    if (options.progress)
      options.progress({static_cast<std::int64_t>(tokens.size()) - 256, n_merges, count, it->first});
  }
  std::vector<AddedToken> added;
  for (const std::string& s : options.special_tokens) {
    added.push_back({static_cast<std::int32_t>(tokens.size()), s});
    tokens.push_back(s);
  }
  return BpeTokenizer(detail::make_model({"BpeTokenizer::train", "vocab", "merges"}, tokens, merges, std::move(added)));
}

}  // namespace tg::text
