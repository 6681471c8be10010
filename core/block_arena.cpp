// First-fit segments with splitting and merging: see block_arena.h.
#include "block_arena.h"

#include <sys/mman.h>

#include <cassert>
#include <functional>
#include <memory>
#include <new>

namespace tg::detail {

// Addresses of different mappings are ordered through std::less, which gives pointers a total order
// (the built-in < does not promise one across objects).
bool BlockArena::BySizeThenAddress::operator()(const Block* a, const Block* b) const {
  return a->size != b->size ? a->size < b->size : std::less<const char*>()(a->addr, b->addr);
}

BlockArena::BlockArena(std::size_t segment_bytes, std::size_t min_split, std::size_t max_cached)
    : segment_bytes_(segment_bytes), min_split_(min_split), max_cached_(max_cached) {}

BlockArena::~BlockArena() {
  // A segment's first block (no prev) finds its length by walking to the last one.
  const auto unmap_segment_of = [](const Block* first) {
    std::size_t bytes = 0;
    for (const Block* x = first; x; x = x->next) bytes += x->size;
    munmap(first->addr, bytes);
  };
  for (Block* b : free_)
    if (!b->prev) unmap_segment_of(b);
  for (auto& [addr, b] : used_)
    if (!b->prev) unmap_segment_of(b);
  for (auto& [addr, b] : used_) delete b;
  for (Block* b : free_) delete b;  // the set frees its nodes after, without comparing them
}

BlockArena::Block* BlockArena::new_block(char* addr, std::size_t size) {
  auto b = std::make_unique<Block>();
  b->addr = addr;
  b->size = size;
  FreeSet holder;
  holder.insert(b.get());  // allocates the node this block keeps for its life
  b->node = holder.extract(holder.begin());
  return b.release();
}

BlockArena::Block* BlockArena::map_segment(std::size_t size) {
  constexpr std::size_t k2MiB = std::size_t(2) << 20;
  if (size > (std::size_t(1) << 62)) throw std::bad_alloc();  // no system maps this; the rounding below stays exact
  const std::size_t bytes = size <= segment_bytes_ ? segment_bytes_ : (size + k2MiB - 1) / k2MiB * k2MiB;
  // Counted against the system's commit limit as malloc's large blocks are (no MAP_NORESERVE), so a
  // request beyond the memory there is is refused here, not met by the OOM killer at first touch.
  // Refused, the segments with nothing in use go back and the mapping is tried once more.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED && segments_ > 0) {
    const std::size_t before = reserved_;
    release_free_segments_locked();
    if (reserved_ < before) p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) throw std::bad_alloc();
  Block* b = nullptr;
  try {
    b = new_block(static_cast<char*>(p), bytes);
  } catch (...) {
    munmap(p, bytes);
    throw;
  }
  b->free = true;
  // Tensors are at most 1 TiB (2^40 bytes), so offsets stay below the next segment's number; past
  // that, or once 2^24 segments have been mapped (mapped_ << 40 wraps), the order blurs, which
  // changes where blocks go but never whether they overlap.
  b->place = mapped_++ << 40;
  free_.insert(std::move(b->node));
  reserved_ += bytes;
  ++segments_;
  return b;
}

void* BlockArena::allocate(std::size_t size) {
  assert(size > 0 && size % kAlign == 0);
  std::lock_guard<std::mutex> lock(mu_);
  // Of the free blocks of at least `size` bytes (the set's tail from lower_bound), the first placed.
  Block probe;
  probe.size = size;
  Block* b = nullptr;
  for (auto it = free_.lower_bound(&probe); it != free_.end(); ++it)
    if (!b || (*it)->place < b->place) b = *it;
  if (!b) b = map_segment(size);
  // Everything that can fail comes first: the split-off block and its node, the entry in used_.
  std::unique_ptr<Block> rest;
  if (b->size - size >= min_split_) rest.reset(new_block(b->addr + size, b->size - size));
  used_.emplace(b->addr, b);
  b->node = free_.extract(b);
  b->free = false;
  if (rest) {
    Block* r = rest.release();
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    r->free = true;
    r->place = b->place + size;
    free_.insert(std::move(r->node));
  }
  in_use_ += b->size;
  return b->addr;
}

void BlockArena::absorb_next(Block* b) noexcept {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  delete n;  // with its node
}

void BlockArena::deallocate(void* p) noexcept {
  [[maybe_unused]] const bool owned = deallocate_if_owned(p);
  assert(owned && "BlockArena::deallocate: a pointer not from allocate(), or freed twice");
}

bool BlockArena::deallocate_if_owned(void* p) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.find(p);
  if (it == used_.end()) return false;
  Block* b = it->second;
  used_.erase(it);
  in_use_ -= b->size;
  b->free = true;
  // Merge with a free neighbour on either side: the neighbour leaves the free set (its node moves
  // into the neighbour's `node` member), and the two become one block.
  if (Block* a = b->prev; a && a->free) {
    a->node = free_.extract(a);
    absorb_next(a);
    b = a;
  }
  if (Block* c = b->next; c && c->free) {
    c->node = free_.extract(c);
    absorb_next(b);
  }
  free_.insert(std::move(b->node));
  if (reserved_ - in_use_ > max_cached_) release_free_segments_locked();
  return true;
}

void BlockArena::release_free_segments_locked() noexcept {
  for (auto it = free_.begin(); it != free_.end();) {
    Block* b = *it;
    if (b->prev || b->next) {
      ++it;
      continue;
    }
    it = free_.erase(it);  // frees the node; the block is the whole segment
    munmap(b->addr, b->size);
    reserved_ -= b->size;
    --segments_;
    delete b;
  }
}

void BlockArena::release_free_segments() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  release_free_segments_locked();
}

std::size_t BlockArena::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}
std::size_t BlockArena::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}
std::size_t BlockArena::free_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_ - in_use_;
}
std::size_t BlockArena::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.empty() ? 0 : (*free_.rbegin())->size;
}
std::size_t BlockArena::segment_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return segments_;
}

}  // namespace tg::detail
