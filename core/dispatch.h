#pragma once
// Internal helpers shared by the op implementations: dtype dispatch and argument checks.
#include <cstdint>
#include <vector>

#include "tapegrad/error.h"
#include "tapegrad/tensor.h"

namespace tg::detail {

// Calls f(T{}) with T = float or double according to the dtype; int32 is an error naming the op.
template <class F>
decltype(auto) dispatch_float(const char* op, DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    default: fail(op, "expected a float32 or float64 tensor, got ", d);
  }
}

// Calls f(T{}) for any dtype (shape ops, copies).
template <class F>
decltype(auto) dispatch_all(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    default: return f(std::int32_t{});
  }
}

inline void check_defined(const char* op, const Tensor& t, const char* what = "input") {
  if (!t.defined()) fail(op, what, " is an undefined tensor");
}

inline void check_float(const char* op, const Tensor& t) {
  check_defined(op, t);
  if (!is_floating(t.dtype())) fail(op, "expected a float32 or float64 tensor, got ", t.dtype(), " ", t.shape());
}

inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    fail(op, "dtypes differ: ", a.dtype(), " ", a.shape(), " and ", b.dtype(), " ", b.shape(),
         " (convert one with to())");
}

// Normalises a possibly negative axis; error names the op, the axis and the shape.
inline int norm_axis(const char* op, int axis, int ndim, const Shape& shape) {
  if (axis < -ndim || axis >= ndim || ndim == 0)
    fail(op, "axis ", axis, " is out of range for a ", ndim, "-d tensor of shape ", shape);
  return axis < 0 ? axis + ndim : axis;
}

// An optional tensor (a norm's weight, a Linear's bias) as saved for backward: detached, or
// undefined when absent; and its data, or null.
inline Tensor detached(const Tensor& t) { return t.defined() ? t.detach() : Tensor(); }
template <class T>
const T* opt_ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

// Row-major strides of a shape, in elements.
inline std::vector<std::int64_t> strides_of(const Shape& s) {
  std::vector<std::int64_t> st(static_cast<std::size_t>(s.ndim()));
  std::int64_t acc = 1;
  for (int i = s.ndim() - 1; i >= 0; --i) {
    st[static_cast<std::size_t>(i)] = acc;
    acc *= s[i];
  }
  return st;
}

}  // namespace tg::detail
