#include "tapegrad/text/bpe.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "model.h"
#include "pretokenize.h"
#include "tapegrad/error.h"
#include "tapegrad/text/byte_level.h"

namespace tg::text {

namespace detail {

namespace {

std::string printable(std::string_view bytes) { return to_byte_level(bytes); }

// The token of each single byte, from the ordinary (not added) tokens.
void index_bytes(const ModelSource& source, BpeModel& m, const std::vector<bool>& is_added) {
  m.byte_ids.fill(-1);
  for (std::int32_t id = 0; id < m.size(); ++id) {
    const std::string_view t = m.token(id);
    if (is_added[static_cast<std::size_t>(id)] || t.size() != 1) continue;
    std::int32_t& slot = m.byte_ids[static_cast<unsigned char>(t[0])];
    if (slot >= 0) fail(source.function, source.vocab_field, ": ids ", slot, " and ", id, " are both the byte '", printable(t), "'");
    slot = id;
  }
  for (int b = 0; b < 256; ++b)
    if (m.byte_ids[static_cast<std::size_t>(b)] < 0)
      fail(source.function, source.vocab_field, ": no token for the byte ", b, " ('",
           printable(std::string(1, static_cast<char>(b))), "'); a byte-level vocabulary has all 256");
}

void index_merges(const ModelSource& source, BpeModel& m, const std::vector<std::pair<std::int32_t, std::int32_t>>& merges,
                  const std::vector<bool>& is_added) {
  std::unordered_map<std::string_view, std::int32_t> ids;
  ids.reserve(static_cast<std::size_t>(m.size()));
  for (std::int32_t id = 0; id < m.size(); ++id)
    if (!is_added[static_cast<std::size_t>(id)] && !ids.emplace(m.token(id), id).second)
      fail(source.function, source.vocab_field, ": ids ", ids[m.token(id)], " and ", id, " are both '", printable(m.token(id)), "'");
  m.table.reserve(merges.size());
  std::string joined;
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const auto [left, right] = merges[r];
    if (left < 0 || left >= m.size() || right < 0 || right >= m.size())
      fail(source.function, source.merges_field, "[", r, "]: id ", left < 0 || left >= m.size() ? left : right,
           " is outside the vocabulary [0, ", m.size(), ")");
    joined.assign(m.token(left));
    joined += m.token(right);
    const auto it = ids.find(joined);
    if (it == ids.end())
      fail(source.function, source.merges_field, "[", r, "]: '", printable(m.token(left)), "' + '", printable(m.token(right)),
           "' makes '", printable(joined), "', which is not in ", source.vocab_field);
    if (!m.table.insert(left, right, static_cast<std::int32_t>(r), it->second))
      fail(source.function, source.merges_field, "[", r, "]: the pair '", printable(m.token(left)), "' '",
           printable(m.token(right)), "' is merged twice (rank ", m.table.rank(left, right), " and ", r, ")");
  }
  m.merges = merges;
}

}  // namespace

std::shared_ptr<const BpeModel> make_model(const ModelSource& source, const std::vector<std::string>& tokens,
                                           const std::vector<std::pair<std::int32_t, std::int32_t>>& merges,
                                           std::vector<AddedToken> added) {
  if (tokens.size() >= static_cast<std::size_t>(INT32_MAX))
    fail(source.function, source.vocab_field, ": ", tokens.size(), " tokens do not fit 32-bit ids");
  auto m = std::make_shared<BpeModel>();
  m->offsets.reserve(tokens.size() + 1);
  m->offsets.push_back(0);
  for (const std::string& t : tokens) {
    m->bytes += t;
    m->offsets.push_back(m->bytes.size());
  }
  std::vector<bool> is_added(tokens.size(), false);
  for (const AddedToken& a : added) {
    if (a.id < 0 || a.id >= m->size() || a.content.empty() || tokens[static_cast<std::size_t>(a.id)] != a.content)
      fail(source.function, "added token '", a.content, "' (id ", a.id, ") does not match the vocabulary");
    is_added[static_cast<std::size_t>(a.id)] = true;
  }
  index_bytes(source, *m, is_added);
  index_merges(source, *m, merges, is_added);
  std::stable_sort(added.begin(), added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  m->added = std::move(added);
  return m;
}

namespace {

// Chunk bytes -> their token ids, for one encode call: repeated words (most of a text) merge once.
// Keys point into the text being encoded; ids live in one arena. Open addressing, load <= 1/2.
class WordCache {
 public:
  WordCache() : slots_(1024) {}
  // The cached ids of chunk, or nullptr.
  const std::int32_t* find(std::string_view chunk, std::uint64_t h, std::size_t& n) const {
    for (std::size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (!s.key) return nullptr;
      if (s.hash == h && s.len == chunk.size() && std::memcmp(s.key, chunk.data(), chunk.size()) == 0) {
        n = s.count;
        return ids_.data() + s.offset;
      }
    }
  }
  void insert(std::string_view chunk, std::uint64_t h, const std::int32_t* ids, std::size_t n) {
    if (2 * (used_ + 1) > slots_.size()) grow();
    place(Slot{chunk.data(), chunk.size(), h, ids_.size(), n});
    ids_.insert(ids_.end(), ids, ids + n);
    ++used_;
  }
  static std::uint64_t hash(std::string_view s) {
    std::uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
    std::size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
      std::uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    }
    std::uint64_t tail = 0;
    std::memcpy(&tail, s.data() + i, s.size() - i);
    h = (h ^ tail) * 0x94D049BB133111EBull;
    return h ^ (h >> 29);
  }

 private:
  struct Slot {
    const char* key = nullptr;
    std::size_t len = 0;
    std::uint64_t hash = 0;
    std::size_t offset = 0, count = 0;
  };
  void place(const Slot& s) {
    std::size_t i = s.hash & (slots_.size() - 1);
    while (slots_[i].key) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = s;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key) place(s);
  }
  std::vector<Slot> slots_;
  std::vector<std::int32_t> ids_;
  std::size_t used_ = 0;
};

}  // namespace

}  // namespace detail

BpeTokenizer::BpeTokenizer() {
  std::vector<std::string> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[static_cast<std::size_t>(b)] = std::string(1, static_cast<char>(b));
  m_ = detail::make_model({"BpeTokenizer", "vocab", "merges"}, bytes, {}, {});
}

BpeTokenizer::BpeTokenizer(std::shared_ptr<const detail::BpeModel> model) : m_(std::move(model)) {
  if (!m_) fail("BpeTokenizer", "no model");
}

std::int64_t BpeTokenizer::vocab_size() const { return m_->size(); }

std::string_view BpeTokenizer::token(std::int32_t id) const {
  if (id < 0 || id >= m_->size()) fail("BpeTokenizer::token", "id ", id, " is outside the vocabulary [0, ", m_->size(), ")");
  return m_->token(id);
}

const std::vector<std::pair<std::int32_t, std::int32_t>>& BpeTokenizer::merges() const { return m_->merges; }
const std::vector<AddedToken>& BpeTokenizer::added_tokens() const { return m_->added; }

std::vector<std::int32_t> BpeTokenizer::encode(std::string_view bytes) const {
  std::vector<std::int32_t> out;
  out.reserve(bytes.size() / 3 + 16);
  encode(bytes, out);
  return out;
}

// Added tokens are found first (the longest where several start at the same byte), as Hugging
// Face's tokenizers do; the text between them is pre-tokenized and merged. next[k] is the next
// occurrence of added token k at or after `from`, searched again only once passed.
void BpeTokenizer::encode(std::string_view bytes, std::vector<std::int32_t>& out) const {
  const std::vector<AddedToken>& added = m_->added;
  if (added.empty()) return encode_ordinary(bytes, out);
  std::vector<std::size_t> next(added.size(), 0);
  std::size_t from = 0;
  for (bool searched = false; from < bytes.size(); searched = true) {
    std::size_t at = bytes.size(), hit = added.size();
    for (std::size_t k = 0; k < added.size(); ++k) {
      if (!searched || (next[k] != std::string_view::npos && next[k] < from)) next[k] = bytes.find(added[k].content, from);
      if (next[k] < at) at = next[k], hit = k;
    }
    encode_ordinary(bytes.substr(from, at - from), out);
    if (hit == added.size()) break;
    out.push_back(added[hit].id);
    from = at + added[hit].content.size();
  }
}

void BpeTokenizer::encode_ordinary(std::string_view bytes, std::vector<std::int32_t>& out) const {
  const detail::BpeModel& m = *m_;
  detail::PreTokenizer chunks(bytes);
  detail::WordCache cache;
  detail::MergeScratch scratch;
  std::vector<std::int32_t> sym;
  std::string_view chunk;
  while (chunks.next(chunk)) {
    if (chunk.size() == 1) {
      out.push_back(m.byte_ids[static_cast<unsigned char>(chunk[0])]);
      continue;
    }
    const std::uint64_t h = detail::WordCache::hash(chunk);
    std::size_t n = 0;
    if (const std::int32_t* ids = cache.find(chunk, h, n)) {
      out.insert(out.end(), ids, ids + n);
      continue;
    }
    sym.resize(chunk.size());
    for (std::size_t i = 0; i < chunk.size(); ++i) sym[i] = m.byte_ids[static_cast<unsigned char>(chunk[i])];
    n = detail::apply_merges(m.table, sym.data(), chunk.size(), scratch);
    out.insert(out.end(), sym.data(), sym.data() + n);
    cache.insert(chunk, h, sym.data(), n);
  }
}

std::string BpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string s;
  for (std::int32_t id : ids) {
    if (id < 0 || id >= m_->size()) fail("BpeTokenizer::decode", "id ", id, " is outside the vocabulary [0, ", m_->size(), ")");
    s += m_->token(id);
  }
  return s;
}

}  // namespace tg::text
