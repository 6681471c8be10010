#include "merge.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace tg::text::detail {

void MergeTable::reserve(std::size_t n) {
  const std::size_t capacity = std::bit_ceil(std::max<std::size_t>(16, 2 * n));
  if (capacity <= slots_.size()) return;
  std::vector<Entry> old = std::move(slots_);
  slots_.assign(capacity, Entry{});
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
  size_ = 0;
  for (const Entry& e : old)
    if (e.key != kEmpty)
      insert(static_cast<std::int32_t>(e.key >> 32), static_cast<std::int32_t>(e.key & 0xFFFFFFFFu), e.rank, e.merged);
}

bool MergeTable::insert(std::int32_t left, std::int32_t right, std::int32_t rank, std::int32_t merged) {
  if (2 * (size_ + 1) > slots_.size()) reserve(size_ + 1);
  const std::uint64_t key = pack(left, right);
  std::size_t i = slot(key);
  for (; slots_[i].key != kEmpty; i = (i + 1) & mask_)
    if (slots_[i].key == key) return false;
  slots_[i] = Entry{key, rank, merged};
  ++size_;
  return true;
}

// Ranks of the adjacent pairs are kept in ranks[], so a merge looks up only the two pairs it
// changes; each step scans for the minimum and closes the gap (tiktoken's byte_pair_merge does
// the same). O(n^2) in the worst case, the fastest for the short chunks that words make.
std::size_t apply_merges_scan(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch) {
  if (n < 2) return n;
  std::vector<std::int32_t>& ranks = scratch.ranks;
  ranks.resize(n);
  for (std::size_t i = 0; i + 1 < n; ++i) ranks[i] = table.rank(sym[i], sym[i + 1]);
  ranks[n - 1] = kNoRank;
  for (;;) {
    std::int32_t best = kNoRank;
    std::size_t at = 0;
    for (std::size_t i = 0; i + 1 < n; ++i)
      if (ranks[i] < best) best = ranks[i], at = i;
    if (best == kNoRank) return n;
    sym[at] = table.find(sym[at], sym[at + 1])->merged;
    std::memmove(sym + at + 1, sym + at + 2, (n - at - 2) * sizeof(std::int32_t));
    std::memmove(ranks.data() + at + 1, ranks.data() + at + 2, (n - at - 2) * sizeof(std::int32_t));
    --n;
    ranks[at] = at + 1 < n ? table.rank(sym[at], sym[at + 1]) : kNoRank;
    if (at > 0) ranks[at - 1] = table.rank(sym[at - 1], sym[at]);
  }
}

namespace {

// Min-heap order on (rank, position): the lowest rank first, the leftmost among equals.
bool later(const MergeScratch::Candidate& a, const MergeScratch::Candidate& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
}

void push(std::vector<MergeScratch::Candidate>& heap, const MergeTable& table, std::int32_t left, std::int32_t right,
          std::size_t pos) {
  const std::int32_t r = table.rank(left, right);
  if (r == kNoRank) return;
  heap.push_back({r, left, right, pos});
  std::push_heap(heap.begin(), heap.end(), later);
}

}  // namespace

// The symbols form a linked list (prev/next, dead ones hold -1) and the candidate merges a heap.
// A popped candidate still applies when its left symbol and that symbol's right neighbour hold
// the ids it recorded: a symbol changes only by absorbing its right neighbour, which makes its
// token longer, so equal ids mean an unchanged pair (Hugging Face's BPE model works the same way).
std::size_t apply_merges_heap(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch) {
  if (n < 2) return n;
  auto& prev = scratch.prev;
  auto& next = scratch.next;
  auto& heap = scratch.heap;
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = i - 1;  // wraps to SIZE_MAX for the first: no left neighbour
    next[i] = i + 1;  // n for the last: no right neighbour
    if (i + 1 < n) push(heap, table, sym[i], sym[i + 1], i);
  }
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const MergeScratch::Candidate c = heap.back();
    heap.pop_back();
    const std::size_t i = c.pos, j = next[i];
    if (sym[i] != c.left || j >= n || sym[j] != c.right) continue;
    sym[i] = table.find(c.left, c.right)->merged;
    sym[j] = -1;
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    if (prev[i] < n) push(heap, table, sym[prev[i]], sym[i], prev[i]);
    if (next[i] < n) push(heap, table, sym[i], sym[next[i]], i);
  }
  std::size_t k = 0;
  for (std::size_t i = 0; i < n; i = next[i]) sym[k++] = sym[i];
  return k;
}

std::size_t apply_merges(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch) {
  return n <= kScanLimit ? apply_merges_scan(table, sym, n, scratch) : apply_merges_heap(table, sym, n, scratch);
}

}  // namespace tg::text::detail
