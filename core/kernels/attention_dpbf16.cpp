// The attention kernels' tile products on vdpbf16ps (attention_dpbf16.h has what they compute).
#include "kernels/attention_dpbf16.h"

#include <algorithm>
#include <cassert>
#include <cstring>

#include "kernels/isa.h"

#ifdef TG_KERNELS_X86
#include <immintrin.h>
#endif

namespace tg::kernels {

using i64 = std::int64_t;
using u32 = std::uint32_t;

bool attention_dpbf16() {
#ifdef TG_KERNELS_X86
  return isa() >= Isa::avx512_bf16;
#else
  return false;
#endif
}

// ---- Words ----

using bf16_impl::row_bf16;
constexpr i64 kChunk = 512;  // values of a row converted at a time (1 KB of stack a row)

// A row's bf16 values are its words in memory order (element 2p the low half of word p): one
// conversion per row, and a zero high half after an odd end (memset: the row is u32 storage).
template <class T>
void words_along_rows(const T* x, i64 ld, i64 rows, i64 cols, u32* out, i64 ldo) {
  assert(attention_dpbf16());
  for (i64 r = 0; r < rows; ++r) {
    prefetch_rows(x, ld, r + 8, 1, rows, cols);
    row_bf16(x + r * ld, reinterpret_cast<bf16*>(out + r * ldo), cols);
    if (cols % 2) std::memset(reinterpret_cast<char*>(out + r * ldo) + 2 * cols, 0, 2);
  }
}

// Each row converted a chunk at a time, its words then stored down a column of out.
template <class T>
void words_along_rows_t(const T* x, i64 ld, i64 rows, i64 cols, u32* out, i64 ldo) {
  assert(attention_dpbf16());
  alignas(64) std::uint16_t h[kChunk + 1];
  for (i64 r = 0; r < rows; ++r) {
    prefetch_rows(x, ld, r + 8, 1, rows, cols);
    for (i64 c0 = 0; c0 < cols; c0 += kChunk) {
      const i64 n = std::min(kChunk, cols - c0), words = (n + 1) / 2;
      row_bf16(x + r * ld + c0, reinterpret_cast<bf16*>(h), n);
      h[n] = 0;  // the pad of an odd n
      for (i64 p = 0; p < words; ++p) out[(c0 / 2 + p) * ldo + r] = u32{h[2 * p]} | u32{h[2 * p + 1]} << 16;
    }
  }
}

// Two rows converted a chunk at a time, then interleaved: the first row's values the low halves.
template <class T>
void words_down_cols(const T* x, i64 ld, i64 rows, i64 cols, u32* out, i64 ldo) {
  assert(attention_dpbf16());
  alignas(64) std::uint16_t h0[kChunk], h1[kChunk];
  for (i64 p = 0; 2 * p < rows; ++p) {
    prefetch_rows(x, ld, 2 * p + 8, 2, rows, cols);
    const bool pair = 2 * p + 1 < rows;
    for (i64 c0 = 0; c0 < cols; c0 += kChunk) {
      const i64 n = std::min(kChunk, cols - c0);
      row_bf16(x + 2 * p * ld + c0, reinterpret_cast<bf16*>(h0), n);
      if (pair) row_bf16(x + (2 * p + 1) * ld + c0, reinterpret_cast<bf16*>(h1), n);
      else std::fill(h1, h1 + n, std::uint16_t{0});
      u32* d = out + p * ldo + c0;
      for (i64 c = 0; c < n; ++c) d[c] = u32{h0[c]} | u32{h1[c]} << 16;
    }
  }
}

template void words_along_rows(const float*, i64, i64, i64, u32*, i64);
template void words_along_rows(const bf16*, i64, i64, i64, u32*, i64);
template void words_along_rows_t(const float*, i64, i64, i64, u32*, i64);
template void words_along_rows_t(const bf16*, i64, i64, i64, u32*, i64);
template void words_down_cols(const float*, i64, i64, i64, u32*, i64);
template void words_down_cols(const bf16*, i64, i64, i64, u32*, i64);

// ---- The product ----

#ifdef TG_KERNELS_X86
namespace {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

constexpr int kRows = 6, kVecs = 4, kLanes = 16;  // 6 x 4 zmm accumulators, as the bf16 product's tile
static_assert(kRows % 2 == 0, "row blocks start at even rows, so the masks cut in whole pairs");

// Rows [i0, i0 + R) and columns [n0, n0 + 16 NV) of C (lanes past m[v] neither read nor written),
// over pairs [p0, p1): per pair NV loads of B, R broadcasts of A's word, R NV vdpbf16ps.
template <int R, int NV>
void dp_block(const u32* A, i64 si, i64 sk, i64 i0, const u32* B, i64 ldb, i64 n0, const __mmask16* m, float* C,
              i64 ldc, i64 p0, i64 p1, bool acc) {
  __m512 c[R][NV];  // in registers: the loops over r and v unrolled whole
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
  const u32* a = A + i0 * si;
  for (i64 p = p0; p < p1; ++p) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(m[v], B + p * ldb + n0 + kLanes * v));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r * si + p * sk])));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], ar, b[v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* dst = C + (i0 + r) * ldc + n0 + kLanes * v;
      __m512 x = c[r][v];
      if (acc) x = _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], dst), x);  // C + sum, as gemm_bf16's beta = 1
      _mm512_mask_storeu_ps(dst, m[v], x);
    }
}

// R rows of C, columns [0, n) in blocks of up to kVecs vectors.
template <int R>
void dp_rows(const u32* A, i64 si, i64 sk, i64 i0, const u32* B, i64 ldb, i64 n, float* C, i64 ldc, i64 p0, i64 p1,
             bool acc) {
  for (i64 n0 = 0; n0 < n; n0 += kVecs * kLanes) {
    __mmask16 m[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      const i64 left = n - n0 - kLanes * v;
      m[v] = left >= kLanes ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    switch (std::min<i64>(kVecs, (n - n0 + kLanes - 1) / kLanes)) {
      case 4: dp_block<R, 4>(A, si, sk, i0, B, ldb, n0, m, C, ldc, p0, p1, acc); break;
      case 3: dp_block<R, 3>(A, si, sk, i0, B, ldb, n0, m, C, ldc, p0, p1, acc); break;
      case 2: dp_block<R, 2>(A, si, sk, i0, B, ldb, n0, m, C, ldc, p0, p1, acc); break;
      default: dp_block<R, 1>(A, si, sk, i0, B, ldb, n0, m, C, ldc, p0, p1, acc); break;
    }
  }
}

#pragma GCC pop_options
}  // namespace
#endif

void tile_product_dpbf16(Tri tri, i64 M, i64 N, i64 K, const u32* A, i64 si, i64 sk, const u32* B, i64 ldb, float* C,
                         i64 ldc, bool acc) {
#ifdef TG_KERNELS_X86
  assert(attention_dpbf16());
  for (i64 i0 = 0; i0 < M; i0 += kRows) {
    const i64 rows = std::min<i64>(kRows, M - i0), last = i0 + rows;
    // In pairs: k0 is even (blocks start at multiples of 6), k1 rounds up to its pair.
    const i64 k0 = tri == Tri::upper_a ? std::min(i0, K) : 0, k1 = tri == Tri::lower_a ? std::min(last, K) : K;
    const i64 p0 = k0 / 2, p1 = (k1 + 1) / 2;
    // lower_c: columns up to the block's last row (the stores are masked; the rest is not written)
    const i64 n = tri == Tri::lower_c ? std::min(last, N) : N;
    switch (rows) {
      case 6: dp_rows<6>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
      case 5: dp_rows<5>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
      case 4: dp_rows<4>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
      case 3: dp_rows<3>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
      case 2: dp_rows<2>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
      default: dp_rows<1>(A, si, sk, i0, B, ldb, n, C, ldc, p0, p1, acc); break;
    }
  }
#else
  (void)tri, (void)M, (void)N, (void)K, (void)A, (void)si, (void)sk, (void)B, (void)ldb, (void)C, (void)ldc, (void)acc;
  assert(false && "tile_product_dpbf16 needs AVX512_BF16");
#endif
}

}  // namespace tg::kernels
