#pragma once
// The attention kernels' bf16 products on vdpbf16ps (AVX512_BF16), for kernels/attention.h inside
// an autocast scope where isa() >= avx512_bf16. Internal: never included by tapegrad.h.
//
// An operand is bf16 pairs in 32-bit words, as the bf16 product packs them (sgemm_bf16.h): the
// word (lo, hi) holds the elements 2p and 2p + 1 along the sum's index, and one vdpbf16ps adds a
// pair's two products to each of 16 sums. The word makers below round floats to bf16 (nearest,
// ties to even, kernels/bf16.h, with its array conversion) or take bf16 as they are, and pad a
// pair past an odd end with 0. They too run only where attention_dpbf16().
//
// What a product computes is gemm_bf16's arithmetic (sgemm_bf16.h) with alpha = 1 and one K
// block: each element summed from 0 over k in pairs, the pair's odd k first, each step a fused
// multiply-add flushed to zero when tiny, subnormal operands read as zero; then C = sum, or
// C = C + sum (one rounding) when accumulating. tests/core/test_attention.cpp holds it to
// gemm_bf16's emulated path bit for bit. The attention's other bf16 path (isa() below
// avx512_bf16: a CPU without AVX512_BF16, or the level capped) sums the same rounded operands in
// float32 in k order instead, so the two paths' bits differ in the last places, both within
// docs/attention.md's bound.
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/gemm.h"  // Tri, prefetch_rows

namespace tg::kernels {

// The word makers, for T = float or bf16.
//
// x (rows, cols, leading dimension ld) along its rows: out[r ldo + p] = (x(r, 2p), x(r, 2p + 1))
// for p < ceil(cols / 2). A row-major A operand (si = ldo, sk = 1).
template <class T>
void words_along_rows(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::uint32_t* out,
                      std::int64_t ldo);

// The same words transposed: out[p ldo + r] = (x(r, 2p), x(r, 2p + 1)). A B operand whose sum runs
// along x's rows (k^T for the scores, v^T for dP).
template <class T>
void words_along_rows_t(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::uint32_t* out,
                        std::int64_t ldo);

// x down its columns: out[p ldo + c] = (x(2p, c), x(2p + 1, c)) for p < ceil(rows / 2). A B
// operand whose sum runs down x's rows (v, dY, k, q), or a transposed A (P^T, dS^T: si = 1,
// sk = ldo).
template <class T>
void words_down_cols(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::uint32_t* out,
                     std::int64_t ldo);

// True where the attention's bf16 products take this path: isa() >= avx512_bf16 (kernels/isa.h).
bool attention_dpbf16();

// C (M, N, leading dimension ldc) = A B, or C += A B (acc), over K values of k: A's word (i, p)
// at A[i si + p sk], B's word (p, n) at B[p ldb + n], p < ceil(K / 2). tri as tile_product's
// (kernels/attention.h), in pairs: upper_a starts a row block's sum at the pair of its first row
// (blocks start at even rows), lower_a ends it at the pair of its last; the skipped words are
// zero. lower_c writes only columns up to each row block's last row. Only where
// attention_dpbf16().
void tile_product_dpbf16(Tri tri, std::int64_t M, std::int64_t N, std::int64_t K, const std::uint32_t* A,
                         std::int64_t si, std::int64_t sk, const std::uint32_t* B, std::int64_t ldb, float* C,
                         std::int64_t ldc, bool acc);

}  // namespace tg::kernels
