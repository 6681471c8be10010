#pragma once
// The caching allocator's home for large blocks (internal): segments split and merged again, and
// filled first fit in the order the memory was mapped.
//
// An exact-size cache (a freed block serves the next request of its size only) keeps, for every
// size, the most blocks of that size ever alive at once, and the sum of those maxima is more than
// is ever in use at one moment: at the medium GPT size with activation checkpointing such a cache
// holds 35-90 MiB beyond the tensors' peak. Here a request takes a free block it fits, and what it
// does not need is split off as a free block of its own; a freed block merges with free
// neighbours, so the same memory serves different sizes from one phase of a step to the next (the
// scheme of PyTorch's CUDA caching allocator, c10/cuda/CUDACachingAllocator.cpp, and of dlmalloc's
// large bins before it).
//
// Which free block: the first that fits, in the order of the segments' mapping and of addresses
// within a segment (a variant of address-ordered first fit, which Wilson, Johnstone, Neely and
// Boles, "Dynamic Storage Allocation: A Survey and Critical Review", 1995, find among the least
// fragmenting policies). Finding it scans the free blocks large enough, under the lock: a training
// step makes a few hundred large requests, each one product's or one activation's worth of work.
// What counts here is resident memory, and a page is resident from its first touch: first fit keeps
// the blocks at the front of the oldest segments, so the ends of the segments and the newest ones
// are touched only when the blocks in use really need them. Best fit (the smallest block that fits)
// spreads a training step's blocks over every hole, and over a few steps touches nearly every page
// mapped (docs/performance.md, "Memory, and the targets again on Zen 4").
//
// Segments are mapped from the system (anonymous mmap) and kept: a page costs resident memory from
// its first touch, so a segment's untouched tail costs nothing, and after the first step or two a
// training loop's requests land on pages already touched, without a system call or a page fault.
// Segments with nothing in use go back to the system on release_free_segments(), when a free
// leaves more than max_cached bytes free, and when the system refuses a new segment (then the
// mapping is tried once more).
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <unordered_map>

namespace tg::detail {

class BlockArena {
 public:
  // Segments are segment_bytes, or the request rounded up to a multiple of 2 MiB if larger (a
  // round size, so that a freed large segment serves a slightly larger request later); requests
  // and splits are multiples of kAlign, and a split leaves at least min_split bytes in the free part
  // (the caching allocator sends only requests above min_split here, so less would serve none).
  BlockArena(std::size_t segment_bytes, std::size_t min_split, std::size_t max_cached);
  ~BlockArena();  // unmaps every segment; blocks still in use become invalid
  BlockArena(const BlockArena&) = delete;
  BlockArena& operator=(const BlockArena&) = delete;

  static constexpr std::size_t kAlign = 64;

  void* allocate(std::size_t size);      // size > 0, a multiple of kAlign; throws std::bad_alloc
  void deallocate(void* p) noexcept;     // p from allocate(), once; allocates nothing, so it cannot fail
  bool deallocate_if_owned(void* p) noexcept;  // as deallocate for a block of this arena; else false
  void release_free_segments() noexcept;  // unmaps the segments with no block in use

  std::size_t reserved_bytes() const;  // mapped from the system
  std::size_t in_use_bytes() const;    // handed out (whole blocks, so at least what was asked)
  std::size_t free_bytes() const;      // reserved and not in use (touched or not), read under one lock
  std::size_t largest_free_block() const;
  std::size_t segment_count() const;

 private:
  struct Block;
  struct BySizeThenAddress {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BySizeThenAddress>;

  // A block: a run of bytes of one segment, free or in use, with its address neighbours. Each block
  // owns one node of the free set for its whole life: inside the set while the block is free, in
  // `node` while it is in use, so freeing and merging move nodes and never allocate.
  struct Block {
    char* addr = nullptr;
    std::size_t size = 0;
    Block* prev = nullptr;  // neighbours in the segment; both null: the block is the whole segment
    Block* next = nullptr;
    bool free = false;
    std::uint64_t place = 0;  // the segment's mapping number << 40, plus the offset in it: first fit's order
    FreeSet::node_type node;
  };

  Block* new_block(char* addr, std::size_t size);  // with its node; throws std::bad_alloc
  Block* map_segment(std::size_t size);            // a free block that is a whole new segment
  void release_free_segments_locked() noexcept;
  void absorb_next(Block* b) noexcept;  // b takes in its next neighbour (out of the free set), which is deleted

  const std::size_t segment_bytes_, min_split_, max_cached_;
  mutable std::mutex mu_;
  FreeSet free_;
  std::unordered_map<void*, Block*> used_;
  std::size_t reserved_ = 0, in_use_ = 0, segments_ = 0;
  std::uint64_t mapped_ = 0;  // segments ever mapped: the next one's number
};

}  // namespace tg::detail
