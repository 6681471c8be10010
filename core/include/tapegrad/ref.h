#pragma once
// Ref<T>: an owning pointer to an object that carries its own reference count (PyTorch's
// c10::intrusive_ptr, cut down). A Tensor holds two of these (its Storage and its autograd slot)
// and every recorded op copies and drops several, so their cost is the tape's cost per op.
//
// Against std::shared_ptr: one word instead of two; no separate control block with a weak count
// and a virtual destroy; the object and its count in one cache line. Copies and drops are atomic,
// as with shared_ptr, so tensors may be shared between threads. T provides
//   std::atomic<std::uint32_t> refs;   // starts at 1: Ref(T*) adopts that first reference
//   static void destroy(T*) noexcept;  // runs when the last Ref lets go (returns the block)
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace tg::detail {

template <class T>
class Ref {
 public:
  constexpr Ref() = default;
  explicit Ref(T* fresh) noexcept : p_(fresh) {}  // adopts the count of 1 a new T starts with
  Ref(const Ref& o) noexcept : p_(o.p_) {
    if (p_) p_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Ref(Ref&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Ref& operator=(const Ref& o) noexcept {
    Ref(o).swap(*this);
    return *this;
  }
  Ref& operator=(Ref&& o) noexcept {
    Ref(static_cast<Ref&&>(o)).swap(*this);
    return *this;
  }
  ~Ref() {
    if (p_) drop(p_);
  }
  void reset() noexcept {
    if (T* p = p_) {
      p_ = nullptr;
      drop(p);
    }
  }
  void swap(Ref& o) noexcept {
    T* t = p_;
    p_ = o.p_;
    o.p_ = t;
  }
  T* get() const { return p_; }
  T& operator*() const { return *p_; }
  T* operator->() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }
  // The number of Refs to the object (0 for a null Ref); exact only while no other thread copies
  // or drops one, as shared_ptr::use_count.
  long use_count() const { return p_ ? static_cast<long>(p_->refs.load(std::memory_order_relaxed)) : 0; }
  // This is the only Ref to the object: the caller may write to it. An acquire load, so that other
  // threads' uses before they dropped their Refs (release) happen before the caller's writes.
  bool unique() const { return p_ && p_->refs.load(std::memory_order_acquire) == 1; }
  friend bool operator==(const Ref& a, const Ref& b) { return a.p_ == b.p_; }
  friend bool operator==(const Ref& a, std::nullptr_t) { return a.p_ == nullptr; }

 private:
  static void drop(T* p) noexcept {
    // The last owner needs no read-modify-write: no other Ref exists that could copy it
    // concurrently (libstdc++'s shared_ptr takes the same shortcut). The acquire load (or the
    // acq_rel decrement) orders the destruction after every other owner's last use.
    if (p->refs.load(std::memory_order_acquire) == 1 || p->refs.fetch_sub(1, std::memory_order_acq_rel) == 1)
      T::destroy(p);
  }
  T* p_ = nullptr;
};

}  // namespace tg::detail
