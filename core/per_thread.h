#pragma once
// This thread's instance of a cache, for the allocators' per-thread free lists.
//
// The instance is made on first use and destroyed when the thread ends, freeing what it holds.
// After that (a tensor held by a static, or by another thread_local destroyed later, is dropped
// at the very end of the thread) per_thread returns nullptr and the caller takes its shared path.

namespace tg::detail {

template <class T>
T* per_thread() {
  // Trivially destructible thread_locals are plain loads, readable until the thread is gone; the
  // guarded instance is reached only on first use (the allocators call this per tensor).
  thread_local T* cached = nullptr;
  thread_local bool gone = false;
  if (cached) [[likely]] return cached;
  if (gone) return nullptr;
  struct Holder {
    T value;
    ~Holder() {  // set before value's destructor runs: its frees see them
      gone = true;
      cached = nullptr;
    }
  };
  thread_local Holder h{};
  cached = &h.value;
  return cached;
}

}  // namespace tg::detail
