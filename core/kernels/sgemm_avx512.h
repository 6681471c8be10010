#pragma once
// The float32 product for AVX-512 CPUs: the AVX2 product's layering (sgemm_avx2.h), run by the
// same driver (sgemm_driver.h), with a register tile sized for 32 zmm registers. Behind
// kernels::gemm<float>, gemm_pair and gemm_tri (gemm.cpp) when kernels::isa() is avx512 or above
// (isa.h); docs/matmul.md walks through it.
//
// - The tile is 14 x 32: 28 zmm accumulators (two 16-float registers per row), two for the row of
//   B, one for the broadcast of a(i, k): 31 of 32 registers. Each k step does 28 FMAs (14 cycles on
//   two 512-bit FMA pipes) for 2 loads of B and 14 broadcasts, so the loop is bound by the FMAs,
//   not by the loads, and 28 independent accumulators cover the FMA latency (4 cycles x 2 pipes
//   needs 8) several times over. (12 x 32 and 8 x 32 fit too; with fewer rows, each k step's loads
//   of B serve fewer FMAs.)
// - A 32-column panel of B is kc x 128 bytes: 96 KB at kc = 768, streamed from L2 in order.
// - K blocks are as the AVX2 product's (kc <= 768, the same cut of K), and every element of C is
//   one chain of FMAs over k in order in each, so the two products give the same bits.
//
// Compiled for AVX-512F whatever the build's -march (sgemm_driver.h says how), on compilers that
// can (TG_KERNELS_X86, isa.h); called only where the CPU has it.
#include <cstdint>

#include "kernels/gemm.h"
#include "kernels/isa.h"

#ifdef TG_KERNELS_X86
#define TG_SGEMM_AVX512 1

namespace tg::kernels::sgemm_avx512 {

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

}  // namespace tg::kernels::sgemm_avx512
#endif
