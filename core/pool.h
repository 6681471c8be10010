#pragma once
// Per-thread pools of fixed-size blocks for the small objects behind every Tensor (internal).
#include <cstddef>
#include <new>
#include <utility>

#include "per_thread.h"

namespace tg::detail {

// Blocks of the objects behind a Tensor (a Storage, an AutogradMeta, a gradient's Tensor) are
// recycled through a per-thread free list per block size. A training step makes and drops a few
// hundred of each; a chain of 10^5 small ops, 10^5. Through malloc, the freed tail of the heap is
// trimmed back to the system and faulted in again on the next step, which costs more than the ops.
// A block freed on another thread joins that thread's list (any block fits any list of its size);
// each list keeps at most kPoolMax blocks and frees the rest. A thread's list is freed when the
// thread ends; a block dropped after that (a tensor held in a static, or by another thread_local)
// goes straight to the heap, as every block does under AddressSanitizer (so use-after-free stays
// detectable).
// The free blocks are an intrusive list (each free block holds the next one's address): a push or a
// pop is two moves and a count, with nothing to grow.
template <std::size_t Size, std::size_t Align>
struct BlockPool {
  static_assert(Size >= sizeof(void*));
  static constexpr std::size_t kPoolMax = std::size_t(1) << 18;
  void* head = nullptr;
  std::size_t count = 0;
  ~BlockPool() {
    while (head) {
      void* p = head;
      head = *static_cast<void**>(p);
      release(p);
    }
  }
  static void* get() {
    if constexpr (Align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return ::operator new(Size, std::align_val_t(Align));
    else return ::operator new(Size);
  }
  static void release(void* p) {
    if constexpr (Align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) ::operator delete(p, std::align_val_t(Align));
    else ::operator delete(p);
  }
  static BlockPool* mine() { return per_thread<BlockPool>(); }
};
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kPoolOn = false;
#else
constexpr bool kPoolOn = true;
#endif

// Raw memory for one T, and its return.
template <class T>
T* pool_allocate() {
  using Pool = BlockPool<sizeof(T), alignof(T)>;
  auto* pool = kPoolOn ? Pool::mine() : nullptr;
  if (!pool || !pool->head) return static_cast<T*>(Pool::get());
  void* p = pool->head;
  pool->head = *static_cast<void**>(p);
  --pool->count;
  return static_cast<T*>(p);
}
template <class T>
void pool_deallocate(T* p) noexcept {
  using Pool = BlockPool<sizeof(T), alignof(T)>;
  auto* pool = kPoolOn ? Pool::mine() : nullptr;
  if (!pool || pool->count >= Pool::kPoolMax) return Pool::release(p);
  *reinterpret_cast<void**>(p) = pool->head;
  pool->head = p;
  ++pool->count;
}

// A T built in pooled memory, the memory given back if its constructor throws.
template <class T, class... Args>
T* pool_new(Args&&... args) {
  T* mem = pool_allocate<T>();
  try {
    return ::new (mem) T(std::forward<Args>(args)...);
  } catch (...) {
    pool_deallocate(mem);
    throw;
  }
}
template <class T>
void pool_delete(T* p) noexcept {
  p->~T();
  pool_deallocate(p);
}

}  // namespace tg::detail
