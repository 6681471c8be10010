#pragma once
// The float32 product for AVX-512 CPUs: the AVX2 product's layering (sgemm_avx2.h), run by the
// same driver (sgemm_driver.h), with a register tile sized for 32 zmm registers. Behind
// kernels::gemm<float>, gemm_pair and gemm_tri (gemm.cpp) when kernels::isa() is avx512 or above
// (isa.h); docs/matmul.md walks through it.
//
// - Two register tiles, using 31 and 28 of the 32 zmm registers:
//   - 14 x 32: 28 accumulators (two 16-float registers per row), two for the row of B, one for
//     the broadcast of a(i, k). Each k step does 28 FMAs for 2 loads of B and 14 broadcasts.
//   - 8 x 48: 24 accumulators (three per row), three for the row of B, one for the broadcast.
//     Each k step does 24 FMAs for 3 loads of B and 8 broadcasts: 11 loads where the tall tile
//     has 16, for 4 FMAs fewer.
//   Either way the loop is bound by the FMAs (14 or 12 cycles on two 512-bit FMA pipes), not by
//   the loads, and 24 or more independent accumulators cover the FMA latency (4 cycles x 2 pipes
//   needs 8) several times over.
// - Which tile runs is chosen at run time from the CPU, as the instruction set is: 8 x 48 on
//   Intel, 14 x 32 on the others; TAPEGRAD_SGEMM_TILE=14x32|8x48 chooses instead. On an Intel Xeon
//   (family 6, model 207) the wide tile runs each of the GPT's twelve weight products, at the
//   medium and the GPT-2-small size, 1-17% faster (geometric mean 4%) and the training step 1-2%
//   faster (measured in docs/performance.md). AMD's CPUs keep the 14 x 32 tile, the one measured
//   on Zen 4 (whose AVX-512 FMA runs on two 256-bit halves); the wide tile is not measured there.
// - A panel of B is kc x 128 or kc x 192 bytes: 96 or 144 KB at kc = 768, streamed from L2 in order.
// - K blocks are as the AVX2 product's (kc <= 768, the same cut of K), and every element of C is
//   one chain of FMAs over k in order in each, so the two tiles and the AVX2 product give the same
//   bits wherever the caller reads C (gemm.h: a triangle's skipped tiles are the caller's to
//   ignore), and the choice of tile does not change a result.
//
// Compiled for AVX-512F whatever the build's -march (sgemm_driver.h says how), on compilers that
// can (TG_KERNELS_X86, isa.h); called only where the CPU has it.
#include <cstdint>
#include <optional>

#include "kernels/gemm.h"
#include "kernels/isa.h"

#ifdef TG_KERNELS_X86
#define TG_SGEMM_AVX512 1

namespace tg::kernels::sgemm_avx512 {

enum class TileShape { tall_14x32, wide_8x48 };
// The CPU's tile: wide_8x48 on Intel, tall_14x32 on the others (above).
TileShape default_tile();
// The tile a value of TAPEGRAD_SGEMM_TILE names: "14x32" or "8x48"; default_tile() for null or
// empty; throws tg::Error naming the value for anything else.
TileShape parse_tile(const char* value);
// The tile in use: set_tile's if set, else TAPEGRAD_SGEMM_TILE's (read at the first call; a bad
// value makes every call throw tg::Error, never silently run another tile), else default_tile().
TileShape tile();
// Sets the tile for the whole process (every tile runs on every AVX-512 CPU), or with nullopt
// goes back to the environment's or the CPU's. For tests and benches: not to be called while
// another thread is inside a product.
void set_tile(std::optional<TileShape> shape);
// What set_tile set: nullopt when the tile is the environment's or the CPU's.
std::optional<TileShape> tile_set();
int tile_rows(TileShape shape);  // 14 or 8
int tile_cols(TileShape shape);  // 32 or 48
const char* tile_name(TileShape shape);  // "14x32" or "8x48", as TAPEGRAD_SGEMM_TILE names it

// tri (gemm.h): a triangle of C the caller does not need, or of op(A) that is zero, which the
// tiles then skip (causal attention's products).
void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
           std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc,
           Tri tri = Tri::none);

// The same product by the whole OpenMP team (call it outside a parallel region): op(B) packed once
// by the team, then blocks of C taken from a shared counter (sgemm_driver.h).
void sgemm_parallel(const Gemm<float>& product);

// Two independent products by the team, each part of it on its own product first and then on
// what is left of the other's (sgemm_driver.h).
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q);

// The 8 x 48 register tile alone, for the bf16 product's fused multiply-add path (sgemm_bf16.cpp),
// whatever tile() is: acc (8 x 48, row stride 48) = sum over k < kc of a(i, k) b(k, j), A eight
// rows lda floats apart (a(i, k) = A[i * lda + k]) when rows, else a packed panel of 8 rows
// (a(i, k) = A[k * 8 + i]), and B a panel of 48 columns (b(k, j) = B[k * 48 + j]); each element
// one chain of fused multiply-adds over k in order from zero, stored as it is. Asks for ahead's
// slice of the next panel as the driver's tiles do. Never inlined: the caller's setting of the
// MXCSR around the call is what the sums run under.
void tile_8x48(std::int64_t kc, const float* A, bool rows, std::int64_t lda, const float* B, float* acc,
               const Ahead& ahead);

}  // namespace tg::kernels::sgemm_avx512
#endif
