#pragma once
// A float32's bits and back, for tests of rounding.
#include <cstdint>
#include <cstring>

namespace tgtest {

inline float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

}  // namespace tgtest
