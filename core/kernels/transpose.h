// An 8 x 8 transpose in registers, for any build: attention's key and value tiles
// (attention.h) and the bf16 fused multiply-add path's B panels (sgemm_bf16.cpp).
#pragma once
#include <cstdint>
#include <cstring>

namespace tg::kernels {

// An 8 x 8 block: out[c * ldo + r] = x[r * ld + c], in registers (GCC's vector extension, eight
// values to a vector): three rounds of shuffles, each pairing vectors at a distance of 1, 2 and 4
// rows, as _mm256_unpack*_ps, _mm256_shuffle_ps and _mm256_permute2f128_ps do on AVX.
template <class T>
[[gnu::always_inline]] inline void transpose8x8(const T* x, std::int64_t ld, T* out, std::int64_t ldo) {
  typedef T V __attribute__((vector_size(8 * sizeof(T))));
  V r[8], t[8];
  // memcpy rather than vec_load / vec_store: an eight-value vector is wider than a register in a
  // build for baseline x86-64, where passing it to or from a function would change the ABI
  for (int i = 0; i < 8; ++i) std::memcpy(&r[i], x + i * ld, sizeof(V));
  for (int i = 0; i < 8; i += 2) {  // rows i, i+1 interleaved, per half
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {  // pairs of pairs: four rows' values of one column, per half
    r[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    r[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    r[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    r[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {  // the halves: column i from rows 0-3 and 4-7, and column i + 4
    const V lo = __builtin_shufflevector(r[i], r[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const V hi = __builtin_shufflevector(r[i], r[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(out + i * ldo, &lo, sizeof(V));
    std::memcpy(out + (i + 4) * ldo, &hi, sizeof(V));
  }
}

}  // namespace tg::kernels
