#include "tapegrad/tensor.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "per_thread.h"
#include "pool.h"
#include "tape_internal.h"
#include "tapegrad/ops.h"

namespace tg {

namespace {
std::atomic<std::uint32_t> next_meta_id{1};

// v as an element of type T. An int32 element takes v truncated toward zero, as static_cast and
// PyTorch do, when that fits int32: NaN and values outside (-2^31 - 1, 2^31) have no int32 (the
// cast is undefined behaviour), so they are refused with the op, the value and the shape.
template <class T>
T element(const char* op, double v, const Shape& shape) {
  if constexpr (std::is_same_v<T, std::int32_t>)
    if (!(v > -2147483649.0 && v < 2147483648.0))
      fail(op, "value ", v, " does not fit int32 (tensor of shape ", shape, ")");
  return detail::from_double<T>(v);
}


}  // namespace


std::int64_t Tensor::size(int d) const { return shape_[detail::norm_axis("size", d, dim(), shape_)]; }

void Tensor::check_dtype(DType want) const {
  if (!defined()) fail("data", "tensor is undefined");
  if (want != dtype_) fail("data", "tensor has dtype ", dtype_, ", requested ", want);
}

std::int64_t Tensor::flat_index(std::initializer_list<std::int64_t> idx, const char* op) const {
  if (!defined()) fail(op, "tensor is undefined");
  if (static_cast<int>(idx.size()) != dim())
    fail(op, idx.size(), " indices for a ", dim(), "-d tensor of shape ", shape_);
  std::int64_t flat = 0;
  int d = 0;
  for (std::int64_t i : idx) {
    const std::int64_t n = shape_[d];
    if (i < -n || i >= n) fail(op, "index ", i, " is out of range for dim ", d, " of shape ", shape_);
    flat = flat * n + (i < 0 ? i + n : i);
    ++d;
  }
  return flat;
}

double Tensor::item() const {
  if (!defined()) fail("item", "tensor is undefined");
  if (numel() != 1) fail("item", "needs a tensor with one element, got shape ", shape_);
  return to_vector<double>()[0];
}

double Tensor::at(std::initializer_list<std::int64_t> idx) const {
  const std::int64_t i = flat_index(idx, "at");
  return detail::dispatch_all(dtype_, [&](auto t) {
    using T = decltype(t);
    return detail::to_double(static_cast<const T*>(storage_->data)[i]);
  });
}

void Tensor::set(std::initializer_list<std::int64_t> idx, double v) {
  const std::int64_t i = flat_index(idx, "set");
  detail::check_no_history("set", *this);
  detail::dispatch_all(dtype_, [&](auto t) {
    using T = decltype(t);
    static_cast<T*>(storage_->data)[i] = element<T>("set", v, shape_);
  });
  bump_version();
}

Tensor& Tensor::copy_(const Tensor& src) {
  detail::check_defined("copy_", *this, "destination");
  detail::check_defined("copy_", src, "source");
  if (!(src.shape() == shape_)) fail("copy_", "source shape ", src.shape(), " differs from destination ", shape_);
  detail::check_no_history("copy_", *this);
  if (src.dtype() == dtype_) {
    if (nbytes()) std::memmove(raw_data(), src.raw_data(), nbytes());
  } else {
    const Tensor c = src.detach().to(dtype_);
    if (nbytes()) std::memcpy(raw_data(), c.raw_data(), nbytes());
  }
  bump_version();
  return *this;
}

// ---- autograd slot ----

// Storage::make / destroy are in storage.cpp, beside Tensor::empty, which inlines make;
// AutogradMeta::make / destroy in autograd.cpp, beside Node::release, which inlines destroy.

Tensor& Tensor::requires_grad_(bool on) {
  if (!defined()) fail("requires_grad_", "tensor is undefined");
  if (on && is_storage_only(dtype_))
    fail("requires_grad_", "a ", dtype_, " tensor ", shape_, " cannot require grad (", dtype_,
         " is a storage dtype; make the float32 tensor the parameter and convert it with to())");
  if (on && !is_floating(dtype_)) fail("requires_grad_", "only float tensors can require grad, got ", dtype_, " ", shape_);
  if (!is_leaf()) fail("requires_grad_", "can only be set on a leaf tensor; use detach() first");
  if (on || meta_) ensure_meta()->requires_grad = on;
  return *this;
}

bool Tensor::is_leaf() const { return !meta_ || meta_->node < 0; }

Tensor Tensor::grad() const { return meta_ ? meta_->grad.get() : Tensor(); }

void Tensor::zero_grad() {
  if (meta_) meta_->grad.reset();
}

void Tensor::retain_grad() {
  if (!requires_grad()) fail("retain_grad", "tensor does not require grad");
  meta_->retains_grad = true;
  detail::note_retain_grad();
}

void Tensor::backward() const { tg::backward(*this); }
void Tensor::backward(const Tensor& grad, bool keep_tape) const { tg::backward(*this, grad, keep_tape); }

Tensor Tensor::detach() const { return Tensor(storage_, shape_, dtype_); }

Tensor& Tensor::set_name(std::string name) {
  ensure_meta()->name = std::make_unique<std::string>(std::move(name));
  return *this;
}

std::string Tensor::name() const { return meta_ ? meta_->label() : std::string(); }

std::uint32_t AutogradMeta::dot_id() {
  while (id == 0) id = next_meta_id++;  // (0 means none yet: skipped when the counter wraps)
  return id;
}

Tensor& AutogradMeta::grad_accumulator() {
  if (!grad.defined()) return grad.set(zeros(shape, dtype));
  return *grad.ptr();
}

// ---- gradient slot ----

namespace detail {

// Constant-initialised (Tensor's default constructor is constexpr): valid before any dynamic
// initialisation, so a slot read from another static's constructor sees it too.
constinit const Tensor g_undefined_tensor{};

Tensor& GradSlot::set(Tensor t) {
  if (!t.defined()) fail("autograd", "internal error: an undefined tensor stored as a gradient (use reset())");
  if (p_) {
    *p_ = std::move(t);
    return *p_;
  }
  p_ = detail::pool_new<Tensor>(std::move(t));  // a move: cannot throw after the allocation
  return *p_;
}

void GradSlot::release() {
  Tensor* p = p_;
  p_ = nullptr;
  detail::pool_delete(p);
}

}  // namespace detail

// ---- methods that forward to ops ----
Tensor Tensor::reshape(const Shape& s) const { return tg::reshape(*this, s); }
Tensor Tensor::transpose(int d0, int d1) const { return tg::transpose(*this, d0, d1); }
Tensor Tensor::permute(const std::vector<int>& dims) const { return tg::permute(*this, dims); }
Tensor Tensor::slice(int d, std::int64_t start, std::int64_t end, std::int64_t step) const {
  return tg::slice(*this, d, start, end, step);
}
Tensor Tensor::clone() const { return tg::clone(*this); }
Tensor Tensor::clone_data() const {
  Tensor t = Tensor::empty(shape_, dtype_);
  if (nbytes()) std::memcpy(t.raw_data(), raw_data(), nbytes());
  return t;
}
Tensor Tensor::to(DType d) const { return tg::to(*this, d); }
Tensor Tensor::sum(const std::vector<int>& axes, bool keepdim) const { return tg::sum(*this, axes, keepdim); }
Tensor Tensor::mean(const std::vector<int>& axes, bool keepdim) const { return tg::mean(*this, axes, keepdim); }

// ---- factories ----

Tensor zeros(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor full(const Shape& shape, double value, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    const T v = element<T>("full", value, shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = v;
  });
  return t;
}

Tensor ones(const Shape& shape, DType dtype) { return full(shape, 1.0, dtype); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype()); }

Tensor arange(std::int64_t end, DType dtype) { return arange(0.0, static_cast<double>(end), 1.0, dtype); }

Tensor arange(double start, double end, double step, DType dtype) {
  if (step == 0 || !std::isfinite(step) || !std::isfinite(start) || !std::isfinite(end))
    fail("arange", "invalid range start=", start, " end=", end, " step=", step);
  const double n = std::ceil((end - start) / step);
  // (2^62 elements are past any allocation; the bound keeps the cast to int64 defined.)
  if (n > 0x1p62) fail("arange", "range start=", start, " end=", end, " step=", step, " has ", n, " elements");
  const std::int64_t count = n > 0 ? static_cast<std::int64_t>(n) : 0;
  Tensor t = Tensor::empty(Shape{count}, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    for (std::int64_t i = 0; i < count; ++i) p[i] = element<T>("arange", start + static_cast<double>(i) * step, t.shape());
  });
  return t;
}

Tensor tensor(const std::vector<double>& values, const Shape& shape, DType dtype) {
  const Shape s = shape.ndim() == 0 && values.size() != 1 ? Shape{static_cast<std::int64_t>(values.size())} : shape;
  if (s.numel() != static_cast<std::int64_t>(values.size()))
    fail("tensor", values.size(), " values do not fill shape ", s);
  Tensor t = Tensor::empty(s, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = element<T>("tensor", values[i], s);
  });
  return t;
}

}  // namespace tg
