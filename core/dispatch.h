#pragma once
// Internal helpers shared by the op implementations: dtype dispatch and argument checks.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"
#include "tapegrad/autograd.h"
#include "tapegrad/error.h"
#include "tapegrad/tensor.h"

namespace tg {
// Typed access to a bfloat16 tensor's storage: t.data<kernels::bf16>().
template <> struct dtype_of<kernels::bf16> { static constexpr DType value = bfloat16; };
}  // namespace tg

namespace tg::detail {

// Refuses a storage-only dtype (bfloat16) in an op that computes: the message names the op and the
// way in, to(float32).
[[noreturn]] inline void fail_storage_only(const char* op, DType d, const Shape* shape = nullptr) {
  if (shape) fail(op, "got a ", d, " tensor ", *shape, ": ", d, " is a storage dtype with no arithmetic; convert it with to(float32) first");
  fail(op, "got a ", d, " tensor: ", d, " is a storage dtype with no arithmetic; convert it with to(float32) first");
}

// Calls f(T{}) with T = float or double according to the dtype; int32 and bfloat16 are errors
// naming the op.
template <class F>
decltype(auto) dispatch_float(const char* op, DType d, F&& f) {
  switch (d) {
    case float32: return f(float{});
    case float64: return f(double{});
    case bfloat16: fail_storage_only(op, d);
    case int32: break;
  }
  fail(op, "expected a float32 or float64 tensor, got ", d);
}

// Calls f(T{}) for every dtype: T = float, double, std::int32_t or kernels::bf16. A bf16 is two
// bytes of bits without arithmetic: a caller copies it, or converts through from_double/to_double.
template <class F>
decltype(auto) dispatch_all(DType d, F&& f) {
  switch (d) {
    case float32: return f(float{});
    case float64: return f(double{});
    case int32: return f(std::int32_t{});
    case bfloat16: return f(kernels::bf16{});
  }
  fail("dispatch", "unknown dtype ", static_cast<int>(d));
}

// A stored element as a double (exact for every dtype), and a double stored as T: a cast, or for
// bfloat16 a cast to float32 and then kernels::to_bf16's rounding (PyTorch's cast goes through
// float32 the same way, so a float64 can round twice). Beyond float32's largest value a bfloat16
// is infinite whichever way float32 rounds, so such a double becomes infinity without the cast
// (which C++ leaves undefined out of range).
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, kernels::bf16>) return static_cast<double>(kernels::to_float(v));
  else return static_cast<double>(v);
}
template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, kernels::bf16>) {
    constexpr double kFltMax = 3.4028234663852886e38;
    if (v > kFltMax) return kernels::bf16{0x7F80};
    if (v < -kFltMax) return kernels::bf16{0xFF80};
    return kernels::to_bf16(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

inline void check_defined(const char* op, const Tensor& t, const char* what = "input") {
  if (!t.defined()) fail(op, what, " is an undefined tensor");
}

inline void check_float(const char* op, const Tensor& t) {
  check_defined(op, t);
  if (is_storage_only(t.dtype())) fail_storage_only(op, t.dtype(), &t.shape());
  if (!is_floating(t.dtype())) fail(op, "expected a float32 or float64 tensor, got ", t.dtype(), " ", t.shape());
}

// An in-place write is not recorded on the tape. Into a tensor that a recorded op made, it would
// leave that op's node in place, and a backward through the tensor would pass the gradient of the
// new values on to the inputs that made the old ones: a wrong gradient, silently. Refused while
// recording is on (PyTorch records the write instead, which tapegrad's tape cannot do).
inline void check_no_history(const char* op, const Tensor& t) {
  if (grad_enabled() && !t.is_leaf() && t.requires_grad())
    fail(op, "cannot write in place into a ", t.dtype(), ' ', t.shape(),
         " tensor made by a recorded op: the write is not recorded, so a backward would send its gradient to the "
         "values it replaced; write into clone() of it, or into a leaf");
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
