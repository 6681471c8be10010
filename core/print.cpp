// operator<< for Tensor, in the layout of PyTorch's printout:
//   tensor([[ 0.1000, -2.0000],
//           [ 3.0000,  4.0000]], shape=(2, 2), dtype=float32)
// Four decimals, one width for all elements, scientific notation when magnitudes span more than
// three decades or leave [1e-4, 1e8) (PyTorch's rule), and "..." past 3 items at each end of a
// dimension when the tensor has more than 1000 elements.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {
namespace {

struct Formatter {
  bool integer = false;  // every value integral: print "3." (floats) or "3" (int32)
  bool sci = false;
  bool is_int_dtype = false;
  std::size_t width = 0;

  std::string fmt(double v) const {
    char buf[64];
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    if (is_int_dtype) std::snprintf(buf, sizeof buf, "%.0f", v);
    else if (sci) std::snprintf(buf, sizeof buf, "%.4e", v);
    else if (integer) std::snprintf(buf, sizeof buf, "%.0f.", v);
    else std::snprintf(buf, sizeof buf, "%.4f", v);
    return buf;
  }
};

struct Printer {
  const std::vector<double>& v;
  const Shape& shape;
  const Formatter& f;
  bool summarize;
  std::ostream& os;

  void rec(int d, std::int64_t offset, int indent) {
    const std::int64_t n = shape[d];
    std::int64_t stride = 1;
    for (int k = d + 1; k < shape.ndim(); ++k) stride *= shape[k];
    os << '[';
    for (std::int64_t i = 0; i < n; ++i) {
      if (summarize && n > 6 && i == 3) {
        os << (d + 1 == shape.ndim() ? "..., " : "...,\n" + std::string(static_cast<std::size_t>(indent + 1), ' '));
        i = n - 3;
      }
      if (d + 1 == shape.ndim()) {
        std::string s = f.fmt(v[static_cast<std::size_t>(offset + i)]);
        os << std::string(f.width - std::min(f.width, s.size()), ' ') << s;
      } else {
        rec(d + 1, offset + i * stride, indent + 1);
      }
      if (i + 1 < n) {
        if (d + 1 == shape.ndim()) os << ", ";
        else os << ',' << std::string(static_cast<std::size_t>(shape.ndim() - d - 1), '\n')
                << std::string(static_cast<std::size_t>(indent + 1), ' ');
      }
    }
    os << ']';
  }
};

}  // namespace

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "tensor(undefined)";
  const std::vector<double> v = t.to_vector<double>();
  Formatter f;
  f.is_int_dtype = t.dtype() == int32;
  double mx = 0, mn = INFINITY;
  f.integer = true;
  for (double x : v) {
    if (!std::isfinite(x)) continue;
    const double a = std::fabs(x);
    if (a != 0) { mx = std::max(mx, a); mn = std::min(mn, a); }
    if (x != std::round(x)) f.integer = false;
  }
  if (!f.is_int_dtype && !f.integer && mx > 0) f.sci = mx >= 1e8 || mn < 1e-4 || mx / mn > 1e3;
  if (!f.is_int_dtype && f.integer && mx >= 1e8) f.sci = true;
  for (double x : v) f.width = std::max(f.width, f.fmt(x).size());

  os << "tensor(";
  if (t.dim() == 0) os << f.fmt(v[0]);
  else if (t.numel() == 0) os << "[]";
  else Printer{v, t.shape(), f, t.numel() > 1000, os}.rec(0, 0, 7);
  os << ", shape=" << t.shape() << ", dtype=" << t.dtype();
  if (t.requires_grad()) os << (t.is_leaf() ? ", requires_grad=true" : ", grad_fn=yes");
  return os << ')';
}

}  // namespace tg
