#pragma once
// Tensor: a cheap handle (shared storage + shape + dtype + autograd slot). Copying a Tensor shares
// both the data and the autograd slot, like a Python reference to a torch.Tensor; clone() copies
// the data, detach() drops the autograd slot. Storage is always contiguous and row-major:
// reshape/view share it, transpose/permute/slice/cat copy (documented difference from PyTorch,
// whose transpose is a strided view).
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "tapegrad/dtype.h"
#include "tapegrad/error.h"
#include "tapegrad/ref.h"
#include "tapegrad/shape.h"

namespace tg {

struct Storage;       // tapegrad/detail/tensor_parts.h: the memory, shared by tensors
struct AutogradMeta;  // tapegrad/detail/tensor_parts.h: the autograd slot

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  // Uninitialised memory of the given shape. Prefer the factories below.
  static Tensor empty(const Shape& shape, DType dtype = float32);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.ndim(); }
  std::int64_t size(int d) const;  // d may be negative, as in PyTorch
  std::int64_t numel() const { return storage_ ? shape_.numel() : 0; }  // 0 when undefined (its shape () gives 1)
  DType dtype() const { return dtype_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * itemsize(dtype_); }  // 0 when undefined

  // Typed access to the contiguous data; throws tg::Error when T does not match dtype(). A write
  // through the pointer is not counted by version() (PyTorch's data_ptr() writes are not either):
  // after one, call bump_version(), as set() and copy_() do. Otherwise a recorded op that saved
  // the tensor does not notice the write, and inside an autocast scope the next op may be handed
  // the bf16 copy of the old values that the op before it made (ops/product.h, activation_bf16).
  template <class T> T* data();
  template <class T> const T* data() const;
  void* raw_data();
  const void* raw_data() const;
  bool shares_storage(const Tensor& o) const { return storage_ && storage_ == o.storage_; }

  // Element access for tests and small programs (values go through double).
  double item() const;                                        // the one element of a 1-element tensor
  double at(std::initializer_list<std::int64_t> idx) const;   // negative indices count from the end
  // An in-place write: see version(). An int32 element takes v truncated toward zero; a v that
  // does not fit int32 (NaN included) throws, as in full, arange and tensor.
  void set(std::initializer_list<std::int64_t> idx, double v);
  // Copies src's values into this tensor in place (same shape; any dtypes, converted). An in-place
  // write, as set() is: a recorded op that saved this tensor then refuses its backward. Neither
  // write is recorded (PyTorch records copy_), so both throw, while recording is on, for a
  // tensor made by a recorded op (a backward would send the new values' gradient to the old ones'
  // inputs); a leaf, a detach()ed tensor, or any tensor under NoGradGuard takes them.
  Tensor& copy_(const Tensor& src);
  // Copies, converting to T; a float that has no value of an integer T (NaN, out of range) throws.
  template <class T> std::vector<T> to_vector() const;

  // ---- autograd ----
  bool requires_grad() const;
  // Marks a floating-point leaf as a parameter whose gradient backward() accumulates. Returns *this.
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const;          // not produced by a recorded op
  // dL/d(this tensor): a leaf's accumulates over backward() calls; a tensor made by an op keeps
  // its gradient only with retain_grad(). Undefined until a backward reaches the tensor.
  Tensor grad() const;
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

  // ---- internal: what the tape and the ops use (tapegrad/detail/tensor_parts.h) ----
  const detail::Ref<AutogradMeta>& meta() const { return meta_; }  // the autograd slot, or null
  inline detail::Ref<AutogradMeta>& ensure_meta();
  void reset();                             // makes this tensor undefined, as Tensor()
  std::uint32_t version() const;            // the count of in-place writes to this memory
  void bump_version();                      // what each such write (set, copy_, an optimizer) does
  bool sole_owner() const;                  // no other tensor shares this one's memory
  std::size_t storage_refs() const;         // the tensors sharing this memory, itself included
  Tensor clone_data() const;                // a copy of the data, without autograd history
  Tensor alias(const Shape& shape) const;   // the same memory under another shape of equal numel
  Tensor(detail::Ref<Storage> s, const Shape& shape, DType dtype)
      : storage_(std::move(s)), shape_(shape), dtype_(dtype) {}

 private:
  detail::Ref<Storage> storage_;
  Shape shape_;
  DType dtype_ = float32;
  detail::Ref<AutogradMeta> meta_;
  void check_dtype(DType want) const;
  std::int64_t flat_index(std::initializer_list<std::int64_t> idx, const char* op) const;
};

// ---- factories (dtype defaults to float32, as in PyTorch). An int32 tensor takes values truncated
// toward zero; one outside int32's range, or NaN, throws (it has no int32). ----
Tensor zeros(const Shape& shape, DType dtype = float32);
Tensor ones(const Shape& shape, DType dtype = float32);
Tensor full(const Shape& shape, double value, DType dtype = float32);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor arange(std::int64_t end, DType dtype = float32);
Tensor arange(double start, double end, double step = 1.0, DType dtype = float32);
// From values: tensor({1, 2, 3, 4}, {2, 2}); the shape defaults to 1-D.
Tensor tensor(const std::vector<double>& values, const Shape& shape = Shape(), DType dtype = float32);
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape);

std::ostream& operator<<(std::ostream& os, const Tensor& t);

}  // namespace tg

#include "tapegrad/detail/tensor_parts.h"
