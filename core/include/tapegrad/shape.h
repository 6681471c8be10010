#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

namespace tg {

// A tensor's dimensions, at most kMaxDims of them, stored inline (no heap). Printed as "(2, 3, 4)".
class Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(const std::vector<std::int64_t>& dims);

  int ndim() const { return n_; }
  std::int64_t operator[](int i) const { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < n_; ++i) n *= d_[static_cast<std::size_t>(i)];
    return n;
  }
  void push_back(std::int64_t v);
  const std::int64_t* begin() const { return d_.data(); }
  const std::int64_t* end() const { return d_.data() + n_; }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.n_ != b.n_) return false;
    for (int i = 0; i < a.n_; ++i)
      if (a.d_[static_cast<std::size_t>(i)] != b.d_[static_cast<std::size_t>(i)]) return false;
    return true;
  }

 private:
  std::array<std::int64_t, kMaxDims> d_{};
  int n_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

}  // namespace tg
