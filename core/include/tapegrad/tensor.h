#pragma once
// Tensor: a cheap handle (shared storage + shape + dtype + autograd slot). Copying a Tensor shares
// both the data and the autograd slot, like a Python reference to a torch.Tensor; clone() copies
// the data, detach() drops the autograd slot. Storage is always contiguous and row-major:
// reshape/view share it, transpose/permute/slice/cat copy (documented difference from PyTorch,
// whose transpose is a strided view).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "tapegrad/dtype.h"
#include "tapegrad/error.h"
#include "tapegrad/ref.h"
#include "tapegrad/shape.h"

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
  alignas(64) unsigned char inline_data[kInlineBytes];
};

// The caching allocator keeps freed blocks for reuse (small ones by exact size, large ones in
// segments it splits and merges: core/block_arena.h), so a training step that allocates the same
// activations every iteration stops page-faulting fresh memory after the first one or two.
// cached_bytes: bytes the cache holds from the system and does not use: the small-block lists
// (shared, and this thread's) and the segments' free space, touched or not (a segment's untouched
// tail costs no resident memory). empty_cache returns the small blocks and the segments with
// nothing in use to the system; a segment holding a live tensor stays, free space and all.
std::size_t cached_bytes();
void empty_cache();
// Bytes of tensor memory in use (all threads; the few bytes kept inside a Storage excepted), and
// the most in use at once since the program started or reset_peak_memory_stats() (PyTorch's
// torch.cuda.memory_allocated, max_memory_allocated and reset_peak_memory_stats, for this CPU
// allocator). The process's resident memory also counts the cache, the code and everything else.
std::size_t memory_allocated();
std::size_t max_memory_allocated();
void reset_peak_memory_stats();

struct AutogradMeta;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  // Uninitialised memory of the given shape. Prefer the factories below.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.ndim(); }
  std::int64_t size(int d) const;  // d may be negative, as in PyTorch
  std::int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * itemsize(dtype_); }

  // Typed access to the contiguous data; throws tg::Error when T does not match dtype().
  template <class T> T* data();
  template <class T> const T* data() const;
  void* raw_data() { return storage_ ? storage_->data : nullptr; }
  const void* raw_data() const { return storage_ ? storage_->data : nullptr; }
  bool shares_storage(const Tensor& o) const { return storage_ && storage_ == o.storage_; }

  // Element access for tests and small programs (values go through double).
  double item() const;                                        // the one element of a 1-element tensor
  double at(std::initializer_list<std::int64_t> idx) const;   // negative indices count from the end
  void set(std::initializer_list<std::int64_t> idx, double v);
  template <class T> std::vector<T> to_vector() const;        // copies, converting to T

  // ---- autograd ----
  bool requires_grad() const;
  // Marks a floating-point leaf as a parameter whose gradient backward() accumulates. Returns *this.
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const;          // not produced by a recorded op
  Tensor grad() const;           // undefined until a backward reaches this tensor
  void zero_grad();              // drops the gradient (PyTorch's set_to_none=True)
  // Keep this non-leaf tensor's gradient after backward (PyTorch's retain_grad()).
  void retain_grad();
  // Reverse-mode pass from this tensor: a scalar, or any shape with an explicit upstream gradient.
  // keep_tape=true keeps the recorded graph for another backward (PyTorch's retain_graph).
  void backward() const;
  void backward(const Tensor& grad, bool keep_tape = false) const;
  Tensor detach() const;         // same data, no autograd history
  Tensor clone() const;          // a copy of the data; differentiable
  // A label shown when the tape is printed or drawn (modules name their parameters).
  Tensor& set_name(std::string name);
  std::string name() const;

  // ---- common ops as methods (see ops.h for the rest) ----
  Tensor reshape(const Shape& shape) const;  // one dimension may be -1; shares storage
  Tensor view(const Shape& shape) const { return reshape(shape); }
  Tensor transpose(int d0, int d1) const;
  Tensor permute(const std::vector<int>& dims) const;
  Tensor slice(int dim, std::int64_t start, std::int64_t end, std::int64_t step = 1) const;
  Tensor to(DType dtype) const;
  Tensor sum(const std::vector<int>& axes = {}, bool keepdim = false) const;
  Tensor mean(const std::vector<int>& axes = {}, bool keepdim = false) const;

  // Internal: the autograd slot (may be null) and construction from parts.
  const detail::Ref<AutogradMeta>& meta() const { return meta_; }
  inline detail::Ref<AutogradMeta>& ensure_meta();
  // Internal: makes this tensor undefined, as Tensor() (without building one to move in).
  void reset() {
    storage_.reset();
    meta_.reset();
    shape_ = Shape();
    dtype_ = DType::f32;
  }
  // Internal: no other tensor shares this one's memory.
  bool sole_owner() const { return storage_.unique(); }
  // Internal: the number of tensors that share this one's memory, itself included.
  std::size_t storage_refs() const { return static_cast<std::size_t>(storage_.use_count()); }
  // Internal: a copy of the data, without autograd history.
  Tensor clone_data() const;
  // Internal: the same storage under another shape of equal numel, without autograd history.
  Tensor alias(const Shape& shape) const { return Tensor(storage_, shape, dtype_); }
  Tensor(detail::Ref<Storage> s, const Shape& shape, DType dtype)
      : storage_(std::move(s)), shape_(shape), dtype_(dtype) {}

 private:
  detail::Ref<Storage> storage_;
  Shape shape_;
  DType dtype_ = DType::f32;
  detail::Ref<AutogradMeta> meta_;
  void check_dtype(DType want) const;
  std::int64_t flat_index(std::initializer_list<std::int64_t> idx, const char* op) const;
};

namespace detail {
// A gradient held out of line by its autograd slot: a pointer to a Tensor (from a per-thread pool
// of Tensor-sized blocks, see core/pool.h), null when there is no gradient. A recorded op's slot
// lives until its node is freed, and most never hold a gradient outside a backward pass, so keeping
// the 96-byte Tensor out of the slot keeps it at 128 bytes, and the memory a
// long graph walks with it. Moving a GradSlot moves the pointer: a gradient handed from an op's
// output to its input (Node::write_grad_over_output) copies nothing.
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
  DType dtype = DType::f32;
  bool requires_grad = false;
  bool retains_grad = false;
  // The gradient buffer to accumulate (+=) into, allocated as zeros on first use.
  Tensor& grad_accumulator();
  // The id, drawn from a global counter on first use (an atomic increment per recorded op
  // otherwise, for a number only the DOT output reads); unique among the first 2^32 drawn.
  std::uint32_t dot_id();
  std::string label() const { return name ? *name : std::string(); }
};

// ---- factories (dtype defaults to float32, as in PyTorch) ----
Tensor zeros(const Shape& shape, DType dtype = DType::f32);
Tensor ones(const Shape& shape, DType dtype = DType::f32);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor arange(std::int64_t end, DType dtype = DType::f32);
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::f32);
// From values: tensor({1, 2, 3, 4}, {2, 2}); the shape defaults to 1-D.
Tensor tensor(const std::vector<double>& values, const Shape& shape = Shape(), DType dtype = DType::f32);
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape);

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- template definitions ----
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
  std::vector<T> out(static_cast<std::size_t>(numel()));
  const void* p = raw_data();
  for (std::size_t i = 0; i < out.size(); ++i) {
    switch (dtype_) {
      case DType::f32: out[i] = static_cast<T>(static_cast<const float*>(p)[i]); break;
      case DType::f64: out[i] = static_cast<T>(static_cast<const double*>(p)[i]); break;
      case DType::i32: out[i] = static_cast<T>(static_cast<const std::int32_t*>(p)[i]); break;
      case DType::bf16:
        out[i] = static_cast<T>(detail::bf16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]));
        break;
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

}  // namespace tg
