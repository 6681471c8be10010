#pragma once
// This thread's instance of a cache, for the allocators' per-thread free lists.
//
// The instance is made on first use and destroyed when the thread ends, freeing what it holds.
// After that (a tensor held by a static, or by another thread_local destroyed later, is dropped
// at the very end of the thread) per_thread returns nullptr and the caller takes its shared path.

namespace tg::detail {

template <class T>
T* per_thread() {
  thread_local bool gone = false;  // trivially destructible: readable until the thread is gone
  struct Holder {
    T value;
    ~Holder() { gone = true; }     // set before value's destructor runs: its frees see it
  };
  if (gone) return nullptr;
  thread_local Holder h{};
  return &h.value;
}

}  // namespace tg::detail
