#pragma once
// bfloat16: the upper half of a float32 (1 sign bit, 8 exponent bits, 7 fraction bits), so the
// float32 range at 8 significant bits. The storage of products' operands inside an autocast scope
// (sgemm_bf16.h) and of tensors of dtype bfloat16 (a storage dtype: no arithmetic of its own).
//
// float -> bf16 rounds to nearest, ties to even, by integer addition on the bits (the rounding of
// PyTorch's c10::BFloat16, round_to_nearest_even):
//
//   u = bits(x);  bf16 = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
//
// Adding 0x7FFF carries into the upper half exactly when the lower half is above one half of a
// bf16 unit, and at exactly one half (0x8000) when the upper half is odd: ties go to even. The same
// addition is right for every finite float, subnormals included (their bits are a fixed-point
// number of the same scale), carries into the exponent when the fraction rounds up to the next
// power of two, and takes the largest finite values (from 0x7F7F8000 up) to infinity, as IEEE
// rounding does. Infinity stays infinity (its lower half is 0).
//
// NaN: the bits' upper half with the quiet bit (bit 6 of the bf16) set: a NaN stays a NaN (a
// signalling NaN whose payload lies only in the lower half would otherwise become infinity), keeps
// its sign and the top of its payload. This is what the AVX512_BF16 conversion instructions
// produce; PyTorch's scalar conversion returns 0x7FC0 for every NaN instead.
//
// The conversion instructions (vcvtneps2bf16, vcvtne2ps2bf16) differ from this definition in one
// place: they flush float32 subnormal inputs to a zero of the same sign (they ignore MXCSR). The
// array conversion here (to_bf16 on arrays) uses them where the CPU has them and recomputes any
// block holding a subnormal by the definition, so every path gives these bits.
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tg::kernels {

struct bf16 {
  std::uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);

// x's bits with the bf16 rounding applied to the upper half (the lower half is left over): the
// rounded bf16 is the result's upper 16 bits. Packing routines combine two of these into a pair.
inline std::uint32_t bf16_round_bits(std::uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? u | 0x00400000u : u + 0x7FFFu + ((u >> 16) & 1u);
}

inline bf16 to_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return bf16{static_cast<std::uint16_t>(bf16_round_bits(u) >> 16)};
}

// Exact: every bf16 is a float32.
inline float to_float(bf16 h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h.bits) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// y[i] = to_bf16(x[i]) and y[i] = to_float(x[i]) for i < n, vectorised for the CPU (isa.h).
void to_bf16(const float* x, bf16* y, std::int64_t n);
void to_float(const bf16* x, float* y, std::int64_t n);

namespace bf16_impl {
// The ways of the array conversion, for the tests: the scalar definition, the AVX512_BF16 one
// (call it only when cpu_has_avx512_bf16()), and the AVX-512F one, the definition's integer
// rounding in 16 lanes, for CPUs with AVX-512F but not AVX512_BF16 (only where AVX-512F is).
void to_bf16_portable(const float* x, bf16* y, std::int64_t n);
void to_bf16_avx512(const float* x, bf16* y, std::int64_t n);
void to_bf16_avx512f(const float* x, bf16* y, std::int64_t n);
void to_float_avx512f(const bf16* x, float* y, std::int64_t n);

// n values as bf16 for the AVX512_BF16 packers (the bf16 product's, the attention's words):
// floats through to_bf16_avx512, bf16 copied as they are. Only where cpu_has_avx512_bf16().
inline void row_bf16(const float* x, bf16* y, std::int64_t n) { to_bf16_avx512(x, y, n); }
inline void row_bf16(const bf16* x, bf16* y, std::int64_t n) {
  std::memcpy(y, x, static_cast<std::size_t>(n) * sizeof(bf16));
}
}  // namespace bf16_impl

}  // namespace tg::kernels
