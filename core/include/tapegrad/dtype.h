#pragma once
#include <cstddef>
#include <cstdint>
#include <ostream>

namespace tg {

// float32 for training, float64 for exact checks (gradcheck, invariance), int32 for token ids and masks.
enum class DType : std::uint8_t { f32, f64, i32 };

inline constexpr DType float32 = DType::f32;
inline constexpr DType float64 = DType::f64;
inline constexpr DType int32 = DType::i32;

constexpr std::size_t itemsize(DType d) { return d == DType::f64 ? 8 : 4; }
constexpr bool is_floating(DType d) { return d != DType::i32; }
constexpr const char* dtype_name(DType d) {
  return d == DType::f32 ? "float32" : d == DType::f64 ? "float64" : "int32";
}
inline std::ostream& operator<<(std::ostream& os, DType d) { return os << dtype_name(d); }

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };

}  // namespace tg
