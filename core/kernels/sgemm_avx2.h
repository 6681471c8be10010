#pragma once
// A float32 matrix product of our own for AVX2 + FMA CPUs, behind kernels::gemm<float>, gemm_pair
// and gemm_tri (gemm.cpp) when kernels::isa() is avx2 (isa.h; AVX-512 CPUs take sgemm_avx512.h's
// wider tile through the same driver, sgemm_driver.h): sgemm on one thread, sgemm_parallel and
// sgemm_pair_parallel on the team. Other CPUs, and every float64 product, call OpenBLAS instead;
// the reference both are tested against is gemm_naive (gemm.h). docs/matmul.md walks through it.
//
//   C = alpha op(A) op(B) + beta C,  row-major, op(A) M x K, op(B) K x N; beta = 0 ignores C.
//
// Why our own. A profile of the training step put 75% of its samples in OpenBLAS's sgemm, and a
// quarter of those outside its arithmetic kernel: packing both operands (11% of the step) and a
// scalar pass that applies beta = 0 (3.6%). The step's products are small (K = 128 to 768, M and N
// 65 to 768): packing matters in proportion. This product is the Goto / BLIS layering (Goto and
// van de Geijn, "Anatomy of high-performance matrix multiplication", ACM TOMS 2008; Van Zee and
// van de Geijn, "BLIS", ACM TOMS 2015), cut to what these shapes need:
//
//   for each block of kc <= 768 of K:        pack op(B)'s kc x N rows into panels of 16 columns
//     for each block of mc <= 144 rows of C:   (pack op(A) only when it is A^T, see below)
//       for each panel of 16 columns:          its kc x 16 panel of B (48 KB at kc = 768), from L2
//         for each 6 rows of C:                6 x 16 tile = kernel: kc steps of 2 loads of B,
//                                              6 broadcasts of A, 12 FMAs into 12 registers
//
// - The 6 x 16 tile keeps 12 ymm accumulators, 2 for B and 1 for the broadcast: 15 of 16
//   registers. Each k step does 12 FMAs (6 cycles on two FMA pipes) for 8 loads, so the loop is
//   bound by the FMAs, not by the loads: 70 GFLOP/s on one core here from L1, against 78 for two
//   FMA pipes at the 2.45 GHz base clock.
// - op(A) = A (activations, x in x w^T) is read in place: the kernel's six rows are six rows of A,
//   each read forward; only a last panel of fewer than six rows is copied, zero padded. That
//   leaves the forward pass with no packing of A at all.
// - op(A) = A^T (the weight gradient dy^T x) is packed: the kernel's six values per k are
//   contiguous in A, but successive k are a row of A apart, and the GPT's rows are 128, 384 or 512
//   floats long: power-of-two strides that would map every k to the same few L1 sets.
// - op(B) is always packed (once per kc block, used by every row of C): 16 contiguous floats a k
//   step, aligned. B^T (the weights in x w^T) is transposed 8 x 8 at a time in registers; B (w in
//   dy w, x in dy^T x) is read row by row, in its own order.
// - beta = 0 is a plain store of alpha * acc; C is read only when beta != 0, and only the first kc
//   block applies the caller's beta (the later ones add with beta = 1).
// - Tiles at the right and bottom edges compute a full 6 x 16 tile from zero-padded operands into
//   a buffer and copy the valid part, so no read or write goes past the operands.
//
// Accuracy: each element of C is a sum of K float products, accumulated in float (as OpenBLAS and
// PyTorch do), in kc-sized pieces; tests compare it with gemm_naive's double sum.
//
// Compiled for AVX2 + FMA whatever the build's -march (sgemm_driver.h says how), on compilers that
// can (TG_KERNELS_X86, isa.h); called only where the CPU has them.
#include <cstdint>

#include "kernels/gemm.h"
#include "kernels/isa.h"

#ifdef TG_KERNELS_X86
#define TG_SGEMM_AVX2 1

namespace tg::kernels::sgemm_avx2 {

// tri (gemm.h): a triangle of C the caller does not need, or of op(A) that is zero, which the
// tiles then skip (causal attention's products).
void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
           std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc,
           Tri tri = Tri::none);

// The product without packing buffers: what sgemm falls back to when they cannot be allocated
// (it may run inside a parallel region, which an exception must not leave). Slow, and its sums
// are rounded in another order; exposed for its test.
void sgemm_unpacked(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                    const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C,
                    std::int64_t ldc);

// The same product by the whole OpenMP team (call it outside a parallel region): op(B) packed once
// by the team, then blocks of C taken from a shared counter (sgemm_avx2.cpp).
void sgemm_parallel(const Gemm<float>& product);

// Two independent products by the team, each part of it on its own product first and then on
// what is left of the other's (sgemm_avx2.cpp).
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q);

}  // namespace tg::kernels::sgemm_avx2
#endif
