#pragma once
// The parts behind tapegrad/tensor.h's Tensor handle: Storage (the memory), the gradient slot and
// AutogradMeta (what autograd knows of a tensor), and Tensor's inline definitions. A learner can
// skip this file: a Tensor is shared memory, a shape, a dtype and an autograd slot.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

// A 64-byte aligned block of memory, recycled through a caching allocator (see core/storage.cpp).
// Up to kInlineBytes (a scalar, a loss, a few elements) live inside the Storage object itself: one
// allocation per tensor instead of two, and no trip through the cache's lists.
// Storage objects themselves come from a per-thread pool (Storage::make; Ref<Storage> gives them
// back through destroy).
struct Storage {
  static constexpr std::size_t kInlineBytes = 64;
  explicit Storage(std::size_t nbytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  static Storage* make(std::size_t nbytes);  // throws std::bad_alloc
  static void destroy(Storage* s) noexcept;
  void* data = nullptr;
  std::size_t nbytes = 0;
  std::atomic<std::uint32_t> refs{1};  // see detail::Ref
  // Bumped by every in-place write through the public API (Tensor::set, copy_, an optimizer's
  // step): a node that saved this memory refuses to run its backward when it changed (PyTorch's
  // version counter, shared by the tensors that share the memory).
  std::uint32_t version = 0;
  alignas(64) unsigned char inline_data[kInlineBytes];
};

namespace detail {
// A gradient held out of line by its autograd slot: a pointer to a Tensor (from a per-thread pool
// of Tensor-sized blocks, see core/pool.h), null when there is no gradient. A recorded op's slot
// lives until its node is freed, and most never hold a gradient outside a backward pass, so keeping
// the 96-byte Tensor out of the slot keeps it at 128 bytes, and the memory a long graph walks with
// it. Moving a GradSlot moves the pointer.
class GradSlot {
 public:
  GradSlot() = default;
  GradSlot(const GradSlot&) = delete;
  GradSlot& operator=(const GradSlot&) = delete;
  GradSlot(GradSlot&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  GradSlot& operator=(GradSlot&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  ~GradSlot() { reset(); }
  bool defined() const { return p_ != nullptr; }
  // The gradient, or an undefined Tensor.
  inline const Tensor& get() const;
  // Stores t, which must be defined (reset() empties the slot); returns the stored tensor.
  Tensor& set(Tensor t);
  Tensor* ptr() { return p_; }
  void reset() {
    if (p_) release();
  }

 private:
  void release();
  Tensor* p_ = nullptr;  // never an undefined Tensor
};
extern const Tensor g_undefined_tensor;  // what GradSlot::get() returns for an empty slot
}  // namespace detail

// The autograd slot of a tensor. Tape nodes hold these (not the data) for the inputs whose gradient
// they accumulate into, so an input's activations are freed as soon as nothing else needs them.
struct AutogradMeta {
  AutogradMeta(const Shape& s, DType d) : shape(s), dtype(d) {}
  AutogradMeta(const AutogradMeta&) = delete;
  AutogradMeta& operator=(const AutogradMeta&) = delete;
  // A new slot with one reference, from a per-thread pool (throws std::bad_alloc); see detail::Ref.
  static AutogradMeta* make(const Shape& s, DType d);
  static void destroy(AutogradMeta* m) noexcept;
  Shape shape;
  detail::GradSlot grad;           // the gradient accumulated here (undefined until a backward reaches it)
  std::int64_t node = -1;          // index of the creating node on the tape; -1 for a leaf
  std::uint64_t generation = 0;    // the tape generation that node belongs to
  std::uint64_t visit = 0;         // marks the tensors a backward pass will reach
  std::unique_ptr<std::string> name;  // set_name's label; null for the (many) unnamed tensors
  std::uint32_t id = 0;            // names the tensor in DOT output (0 until asked: see dot_id)
  std::atomic<std::uint32_t> refs{1};  // the Refs to this slot (Tensors and tape nodes)
  DType dtype = float32;
  bool requires_grad = false;
  bool retains_grad = false;
  // The gradient buffer to accumulate (+=) into, allocated as zeros on first use.
  Tensor& grad_accumulator();
  // The id, drawn from a global counter on first use (an atomic increment per recorded op
  // otherwise, for a number only the DOT output reads); unique among the first 2^32 drawn.
  std::uint32_t dot_id();
  std::string label() const { return name ? *name : std::string(); }
};

// ---- Tensor's inline and template definitions ----
inline const Tensor& detail::GradSlot::get() const { return p_ ? *p_ : g_undefined_tensor; }
template <class T> T* Tensor::data() {
  if (!storage_ || dtype_ != dtype_of<T>::value) check_dtype(dtype_of<T>::value);  // throws
  return static_cast<T*>(storage_->data);
}
template <class T> const T* Tensor::data() const {
  if (!storage_ || dtype_ != dtype_of<T>::value) check_dtype(dtype_of<T>::value);  // throws
  return static_cast<const T*>(storage_->data);
}
inline bool Tensor::requires_grad() const { return meta_ && meta_->requires_grad; }
inline detail::Ref<AutogradMeta>& Tensor::ensure_meta() {
  if (!meta_) meta_ = detail::Ref<AutogradMeta>(AutogradMeta::make(shape_, dtype_));
  return meta_;
}
namespace detail {
// The float32 whose upper half are the bits of a bfloat16 (exact: every bfloat16 is a float32).
inline float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
}  // namespace detail
template <class T> std::vector<T> Tensor::to_vector() const {
  if (!defined()) fail("to_vector", "tensor is undefined");
  std::vector<T> out(static_cast<std::size_t>(numel()));
  const void* p = raw_data();
  // A float converts to an integer T by truncation toward zero when the result fits T; NaN and
  // values outside T's range have none (static_cast would be undefined behaviour): refused.
  auto convert = [&](auto v, std::size_t i) {
    if constexpr (std::is_integral_v<T> && std::is_floating_point_v<decltype(v)>) {
      // T's range is [min, 2^digits), both ends exact in double (min + 1.0 would round for 64 bits).
      const double d = v, t = std::trunc(d);
      if (!(t >= static_cast<double>(std::numeric_limits<T>::min()) &&
            t < std::ldexp(1.0, std::numeric_limits<T>::digits)))
        fail("to_vector", "value ", d, " at position ", i, " of ", dtype_, ' ', shape_, " does not fit the integer type");
    }
    return static_cast<T>(v);
  };
  for (std::size_t i = 0; i < out.size(); ++i) {
    switch (dtype_) {
      case float32: out[i] = convert(static_cast<const float*>(p)[i], i); break;
      case float64: out[i] = convert(static_cast<const double*>(p)[i], i); break;
      case int32: out[i] = convert(static_cast<const std::int32_t*>(p)[i], i); break;
      case bfloat16: out[i] = convert(detail::bf16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]), i); break;
    }
  }
  return out;
}
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel())
    fail("from_vector", values.size(), " values do not fill shape ", shape);
  Tensor t = Tensor::empty(shape, dtype_of<T>::value);
  T* p = t.data<T>();
  for (std::size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}

inline void Tensor::reset() {
  storage_.reset();
  meta_.reset();
  shape_ = Shape();
  dtype_ = float32;
}
inline bool Tensor::sole_owner() const { return storage_.unique(); }
inline std::size_t Tensor::storage_refs() const { return static_cast<std::size_t>(storage_.use_count()); }
inline Tensor Tensor::alias(const Shape& shape) const { return Tensor(storage_, shape, dtype_); }
inline std::uint32_t Tensor::version() const { return storage_ ? storage_->version : 0; }
inline void Tensor::bump_version() {
  if (storage_) ++storage_->version;
}
inline void* Tensor::raw_data() { return storage_ ? storage_->data : nullptr; }
inline const void* Tensor::raw_data() const { return storage_ ? storage_->data : nullptr; }

}  // namespace tg
