#include "tapegrad/shape.h"

#include <sstream>

#include "tapegrad/error.h"

namespace tg {

Shape::Shape(std::initializer_list<std::int64_t> dims) {
  if (dims.size() > static_cast<std::size_t>(kMaxDims)) fail("Shape", "at most ", kMaxDims, " dims, got ", dims.size());
  for (auto v : dims) d_[static_cast<std::size_t>(n_++)] = v;
}

Shape::Shape(const std::vector<std::int64_t>& dims) {
  if (dims.size() > static_cast<std::size_t>(kMaxDims)) fail("Shape", "at most ", kMaxDims, " dims, got ", dims.size());
  for (auto v : dims) d_[static_cast<std::size_t>(n_++)] = v;
}

void Shape::push_back(std::int64_t v) {
  if (n_ == kMaxDims) fail("Shape", "at most ", kMaxDims, " dims");
  d_[static_cast<std::size_t>(n_++)] = v;
}

std::string Shape::str() const {
  std::ostringstream s;
  s << '(';
  for (int i = 0; i < n_; ++i) s << (i ? ", " : "") << d_[static_cast<std::size_t>(i)];
  if (n_ == 1) s << ',';
  s << ')';
  return s.str();
}

}  // namespace tg
