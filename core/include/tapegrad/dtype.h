#pragma once
#include <cstddef>
#include <cstdint>
#include <ostream>

namespace tg {

// float32 for training, float64 for exact checks (gradcheck, invariance), int32 for token ids and
// masks. bfloat16 (the upper half of a float32: 8 exponent bits, 8 significant bits) is a storage
// dtype: tensors of it are created, converted with to(), copied, printed, read element by element
// and saved or loaded as safetensors "BF16", but no arithmetic op takes one (convert with
// to(float32) first).
// One spelling, PyTorch's: tg::float32 (torch.float32), tg::float64, tg::int32, tg::bfloat16.
enum class DType : std::uint8_t { float32, float64, int32, bfloat16 };
inline constexpr DType float32 = DType::float32;
inline constexpr DType float64 = DType::float64;
inline constexpr DType int32 = DType::int32;
inline constexpr DType bfloat16 = DType::bfloat16;

constexpr std::size_t itemsize(DType d) {
  switch (d) {
    case float32: return 4;
    case float64: return 8;
    case int32: return 4;
    case bfloat16: return 2;
  }
  return 0;
}
// The dtypes ops compute and differentiate in: float32 and float64. (Not PyTorch's
// is_floating_point, which also holds for bfloat16: here bfloat16 has no arithmetic.)
constexpr bool is_floating(DType d) { return d == float32 || d == float64; }
// A dtype that only holds values: ops refuse it and name to(float32) as the way in.
constexpr bool is_storage_only(DType d) { return d == bfloat16; }
constexpr const char* dtype_name(DType d) {
  switch (d) {
    case float32: return "float32";
    case float64: return "float64";
    case int32: return "int32";
    case bfloat16: return "bfloat16";
  }
  return "?";
}
inline std::ostream& operator<<(std::ostream& os, DType d) { return os << dtype_name(d); }

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = float32; };
template <> struct dtype_of<double> { static constexpr DType value = float64; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = int32; };
// (dtype_of<kernels::bf16>, the internal storage type of bfloat16, is in core/dispatch.h.)

}  // namespace tg
