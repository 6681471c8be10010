// Storage and the caching allocator.
//
// A training step allocates the same activation and gradient shapes every iteration, so after the
// first step or two every request is served from memory already touched, without a system call or
// a page fault. Blocks of up to kSmallMax bytes are cached by exact size (a list per size, no
// search); larger ones come from a BlockArena (block_arena.h), which splits and merges them so the
// same memory serves different sizes. Each of the two is bounded (kMaxCached free bytes); beyond it
// blocks (small) or whole free segments (large) go back to the system. Under AddressSanitizer the
// cache is off so that use-after-free stays detectable.
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include "block_arena.h"
#include "per_thread.h"
#include "pool.h"
#include "tapegrad/memory.h"
#include "tapegrad//tensor.h"

#if defined(__SANITIZE_ADDRESS__)
#define TG_CACHE_ENABLED 0
#else
#define TG_CACHE_ENABLED 1
#endif

namespace tg {
namespace {

constexpr std::size_t kAlign = 64;
constexpr std::size_t kMaxCached = std::size_t(2) << 30;  // 2 GiB

// Blocks up to kSmallMax bytes sit in an array of lists indexed by size / kAlign (no hashing);
// larger ones in the arena, in segments of kSegmentBytes (or one of their own if larger).
constexpr std::size_t kSmallMax = std::size_t(64) << 10;
constexpr std::size_t kSegmentBytes = std::size_t(64) << 20;
// Long-lived blocks (LongLivedAllocations) in segments of their own, smaller: they are seldom freed
// in a run (a loaded optimizer state replaces the old one), so a segment's untouched tail is most
// of the slack there is.
constexpr std::size_t kLongLivedSegmentBytes = std::size_t(16) << 20;

struct Cache {
  std::mutex mu;  // guards the small lists and `bytes`; the arena has its own lock
  std::vector<std::vector<void*>> small = std::vector<std::vector<void*>>(kSmallMax / kAlign + 1);
  std::size_t bytes = 0;  // in the small lists
  // A split leaves more than kSmallMax bytes free: less would serve no request the arena sees.
  detail::BlockArena large{kSegmentBytes, kSmallMax + kAlign, kMaxCached};
  detail::BlockArena long_lived{kLongLivedSegmentBytes, kSmallMax + kAlign, kMaxCached};
  ~Cache() { release(); }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& blocks : small) {
      for (void* p : blocks) std::free(p);
      blocks.clear();
    }
    bytes = 0;
    large.release_free_segments();
    long_lived.release_free_segments();
  }
};

// Inside a LongLivedAllocations scope on this thread (its depth).
thread_local int t_long_lived = 0;

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may outlive static destruction order
  return *c;
}

std::size_t rounded(std::size_t n) { return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign; }

// Bytes of blocks in use (allocated and not yet freed), and the most in use at once since the
// last reset_peak_memory_stats().
std::atomic<std::size_t> g_in_use{0}, g_peak{0};
void note_allocated(std::size_t size) noexcept {
  const std::size_t now = g_in_use.fetch_add(size, std::memory_order_relaxed) + size;
  std::size_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

// Blocks up to kLocalMax bytes also pass through a small per-thread list first, without the lock:
// the activations of a chain of tiny ops come and go by the hundred thousand.
namespace {
constexpr std::size_t kLocalMax = 4096;
constexpr std::size_t kLocalBytes = std::size_t(16) << 20;  // per thread; beyond it blocks go to the cache

// Freed with the thread; a block dropped after that goes to the shared cache.
struct LocalLists {
  std::vector<void*> lists[kLocalMax / kAlign + 1];
  std::size_t bytes = 0;
  ~LocalLists() {
    for (auto& blocks : lists)
      for (void* p : blocks) std::free(p);
  }
  static LocalLists* mine() { return detail::per_thread<LocalLists>(); }
};

// A block of n > kInlineBytes bytes: this thread's list, the shared cache, or the system.
[[gnu::noinline]] void* allocate_block(std::size_t n) {
  void* data = nullptr;
  const std::size_t size = rounded(n);
#if TG_CACHE_ENABLED
  if (LocalLists* local = size <= kLocalMax ? LocalLists::mine() : nullptr) {
    std::vector<void*>& mine = local->lists[size / kAlign];
    if (!mine.empty()) {
      data = mine.back();
      mine.pop_back();
      local->bytes -= size;
      note_allocated(size);
      return data;
    }
  }
  if (size > kSmallMax) {
    data = (t_long_lived > 0 ? cache().long_lived : cache().large).allocate(size);
    note_allocated(size);
    return data;
  }
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    std::vector<void*>& blocks = c.small[size / kAlign];
    if (!blocks.empty()) {
      data = blocks.back();
      blocks.pop_back();
      c.bytes -= size;
      note_allocated(size);
      return data;
    }
  }
#endif
  data = std::aligned_alloc(kAlign, size);
  if (!data) throw std::bad_alloc();
  note_allocated(size);
  return data;
}

// Gives a block from allocate_block back (to this thread's list, the shared cache or the system).
[[gnu::noinline]] void free_block(void* data, std::size_t nbytes) noexcept {
  const std::size_t size = rounded(nbytes);
  g_in_use.fetch_sub(size, std::memory_order_relaxed);
#if TG_CACHE_ENABLED
  if (LocalLists* local = size <= kLocalMax ? LocalLists::mine() : nullptr) {
    if (local->bytes + size <= kLocalBytes) {
      try {
        local->lists[size / kAlign].push_back(data);
        local->bytes += size;
        return;
      } catch (const std::bad_alloc&) {
        // no room to note it: hand it to the shared cache below
      }
    }
  }
  Cache& c = cache();
  if (size > kSmallMax) {
    if (!c.long_lived.deallocate_if_owned(data)) c.large.deallocate(data);
    return;
  }
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.bytes + size <= kMaxCached) {
    try {  // noting the block may allocate; out of memory, the block simply goes back to the system
      c.small[size / kAlign].push_back(data);
      c.bytes += size;
      return;
    } catch (const std::bad_alloc&) {
    }
  }
#endif
  std::free(data);
}

}  // namespace

// Small, so that Storage::make and Tensor::empty below inline them: the common small tensor is one
// pool pop and a few stores.
Storage::Storage(std::size_t n) : nbytes(n) {
#if TG_CACHE_ENABLED
  if (n <= kInlineBytes) {
    data = inline_data;
    return;
  }
#endif
  data = allocate_block(n);
}

Storage::~Storage() {
#if TG_CACHE_ENABLED
  if (data == inline_data) return;
#endif
  free_block(data, nbytes);
}

// Tensor::empty is here with the Storage constructor, which it inlines (one call per op saved).
Storage* Storage::make(std::size_t nbytes) { return detail::pool_new<Storage>(nbytes); }
void Storage::destroy(Storage* s) noexcept { detail::pool_delete(s); }

namespace {
// The shape's byte count, refusing negative dimensions and sizes beyond 1 TiB before anything is
// allocated (and before the count could overflow): no machine this runs on has that much memory,
// and the allocator's own failure is a less helpful message (or, under AddressSanitizer, an abort).
std::size_t checked_bytes(const char* op, const Shape& s, std::size_t itemsize) {
  constexpr std::uint64_t kMax = std::uint64_t(1) << 40;
  // Fast path: at most two dimensions, each in [1, 2^16]: at most 2^35 bytes, under the limit.
  if (s.ndim() <= 2) {
    const std::uint64_t d0 = s.ndim() > 0 ? static_cast<std::uint64_t>(s[0]) - 1 : 0;
    const std::uint64_t d1 = s.ndim() > 1 ? static_cast<std::uint64_t>(s[1]) - 1 : 0;
    if ((d0 | d1) < (std::uint64_t(1) << 16)) return itemsize * (d0 + 1) * (d1 + 1);
  }
  std::uint64_t n = itemsize;
  bool negative = false, zero = false, big = false;
  for (std::int64_t d : s) {
    negative = negative || d < 0;
    zero = zero || d == 0;
    if (d > 0 && !big) big = __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n) || n > kMax;
  }
  if (negative) fail(op, "negative dimension in shape ", s);
  if (zero) return 0;
  if (big) fail(op, "shape ", s, " is too large (over 1 TiB)");
  return static_cast<std::size_t>(n);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  const std::size_t bytes = checked_bytes("empty", shape, itemsize(dtype));
  detail::Ref<Storage> st;
  try {
    st = detail::Ref<Storage>(Storage::make(bytes));
  } catch (const std::bad_alloc&) {
    fail("empty", "out of memory allocating ", bytes, " bytes for ", dtype, " ", shape);
  }
  return Tensor(std::move(st), shape, dtype);
}


std::size_t memory_allocated() { return g_in_use.load(std::memory_order_relaxed); }
std::size_t max_memory_allocated() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak_memory_stats() { g_peak.store(g_in_use.load(std::memory_order_relaxed), std::memory_order_relaxed); }

std::size_t cached_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const LocalLists* local = LocalLists::mine();
  return c.bytes + c.large.free_bytes() + c.long_lived.free_bytes() + (local ? local->bytes : 0);
}

LongLivedAllocations::LongLivedAllocations() { ++t_long_lived; }
LongLivedAllocations::~LongLivedAllocations() { --t_long_lived; }

void empty_cache() {
  if (LocalLists* local = LocalLists::mine()) {
    for (auto& blocks : local->lists) {
      for (void* p : blocks) std::free(p);
      blocks.clear();
    }
    local->bytes = 0;
  }
  cache().release();
}

}  // namespace tg
