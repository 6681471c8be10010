#pragma once
// Byte-pair merges applied to one chunk: the merge table ((left, right) -> rank, merged id) and
// the loop that merges the adjacent pair of lowest rank, the leftmost among equals, until no
// adjacent pair has a merge. This is the order of GPT-2's encoder.py and of Hugging Face's BPE
// model, so the same merges give the same ids.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tg::text::detail {

constexpr std::int32_t kNoRank = INT32_MAX;

// An open-addressing hash table keyed by the pair (left << 32 | right).
class MergeTable {
 public:
  struct Entry {
    std::uint64_t key = kEmpty;
    std::int32_t rank = kNoRank, merged = -1;
  };
  // Room for n merges at a load factor of at most 1/2.
  void reserve(std::size_t n);
  // False (and nothing changes) when the pair already has a merge.
  bool insert(std::int32_t left, std::int32_t right, std::int32_t rank, std::int32_t merged);
  const Entry* find(std::int32_t left, std::int32_t right) const {
    if (slots_.empty()) return nullptr;
    const std::uint64_t key = pack(left, right);
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  std::int32_t rank(std::int32_t left, std::int32_t right) const {
    const Entry* e = find(left, right);
    return e ? e->rank : kNoRank;
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};  // ids are >= 0, so no pair packs to this
  static std::uint64_t pack(std::int32_t l, std::int32_t r) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(l)) << 32) | static_cast<std::uint32_t>(r);
  }
  std::size_t slot(std::uint64_t key) const { return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t size_ = 0;
};

// Buffers reused from chunk to chunk, so merging allocates nothing once they have grown.
struct MergeScratch {
  std::vector<std::int32_t> ranks;                 // ranks[i]: rank of the pair (sym[i], sym[i+1])
  std::vector<std::size_t> prev, next;             // the linked list of the heap path
  struct Candidate {
    std::int32_t rank, left, right;
    std::size_t pos;
  };
  std::vector<Candidate> heap;
};

// Chunks of up to this many symbols take the quadratic scan (fastest for words); longer ones, a
// priority queue over a linked list (n log n).
constexpr std::size_t kScanLimit = 48;

// Merges sym[0, n) in place; returns the new length. Chooses the path by n.
std::size_t apply_merges(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch);
// The two paths, exposed so that tests hold them equal.
std::size_t apply_merges_scan(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch);
std::size_t apply_merges_heap(const MergeTable& table, std::int32_t* sym, std::size_t n, MergeScratch& scratch);

}  // namespace tg::text::detail
