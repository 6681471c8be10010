#pragma once
// A matrix product of bfloat16 operands accumulated in float32, for products inside an autocast
// scope (bf16.h has the format):
//
//   C = alpha op(A) op(B) + beta C,  row-major, op(A) M x K, op(B) K x N, C float32; beta = 0 ignores C.
//
// A and B may each be float32, rounded to bf16 while they are packed (a weight cast once per step
// and an activation consumed as it is), or already bf16. C is float32.
//
// What it computes, exactly. Each operand is rounded to bf16 (bf16.h), and a bf16 operand that is
// subnormal reads as a zero of its sign. Then, for each K block of kc <= 1536 (sizes fixed by K
// alone), every element is summed from 0 over k in pairs, as the AVX512_BF16 instruction
// vdpbf16ps does (Intel SDM, VDPBF16PS):
//
//   acc = ftz(acc + a(i, k+1) b(k+1, j))     then     acc = ftz(acc + a(i, k) b(k, j))
//
// each step one fused multiply-add rounded to nearest even (a product of two bf16 is exact in
// float32 anyway); ftz gives a zero of the same sign when the result is tiny, tininess detected
// after rounding (the rounded result at unbounded exponent is below 2^-126), as x86 does. An odd
// kc is padded with a zero pair half. The block's sum then goes to C as C = alpha acc + beta C
// (the caller's beta for the first block, 1 after; beta = 0 a plain store of alpha acc).
//
// Three paths give those bits: vdpbf16ps where the CPU has AVX512_BF16 and isa() allows it
// (kernels/isa.h); elsewhere, on AVX-512F or AVX2 + FMA, float32 fused multiply-adds on operands
// split into float32 with the MXCSR's flush-to-zero on (each step of the sum is exactly one such
// multiply-add: sgemm_bf16.cpp says why), at about the float32 product's rate; and a scalar
// emulation (the flushes done by hand), several times slower, the reference for tests and the
// path of CPUs without AVX2. Every element is computed by one thread in that fixed order, so the
// bits do not depend on the number of threads either. NaN payloads may differ between the paths
// (NaN stays NaN). The sums of vdpbf16ps and of the fused multiply-add path round to nearest even
// whatever the caller's MXCSR holds, which they leave as it was; the scalar emulation's round in
// the caller's mode, so it gives the same bits under the default mode, round to nearest even. The
// stores C = alpha acc + beta C round in the caller's mode on every path.
//
// A fourth path, AMX's tiles (isa amx_bf16: Intel's tile unit, with tdpbf16ps), gives the same
// operands and blocks but sums in the tile unit's own order: per element, 16 pairs of a chunk of
// 32 k at a time, as the hardware orders them within an instruction (Intel SDM, TDPBF16PS: inputs
// read as zero when subnormal, results flushed, round to nearest even). Its bits may differ from
// the other paths' in the last places, within the bound below; they too are the same for any
// number of threads. There K blocks are whole chunks of 32 (fixed by K alone), rows go in blocks
// of 32 (two tiles of 16), and op(A) is packed as bf16 rows (A^T's rows made from pairs of A's rows), while op(B)'s
// 64-column panels of pairs are what a B tile loads, 16 columns at a time.
//
// Accuracy against the exact product of the float32 operands: rounding each operand to bf16 moves
// it by at most 2^-8 of itself (the unit roundoff of 8 significant bits), so a product a b by at
// most (2 * 2^-8 + 2^-16) |a b|; the float32 sum of K exact products adds at most about K 2^-24
// sum |a b|. So |C - C_exact| <= |alpha| (2^-7 + 2^-16 + (K + 1) 2^-24) sum_k |a(i, k) b(k, j)|
// plus the rounding of the final alpha acc + beta C: the operands' rounding dominates while K is
// below 2^17.
//
// Layering (as sgemm_avx2.h; Goto and van de Geijn, ACM TOMS 2008): op(B) packed into panels of
// 64 columns with k in pairs (the 32-bit pair (b(k, j), b(k+1, j)) is what vdpbf16ps multiplies
// per lane), op(A) packed per block of rows (A as bf16 rows, A^T as 6-row panels of pairs), and a
// 6 x 64 register tile: 24 zmm accumulators, 4 for B, 1 for the broadcast pair of A. The fused
// multiply-add path splits each pair into two float32: with AVX-512F as it packs the operands,
// into rows of A (8-row panels of A^T) and 48-column panels of B, run by the float32 product's
// 8 x 48 tile (sgemm_avx512.h's tile_8x48); with AVX2 into 64-column panels of B as it packs them
// and 6-row panels of A from A's packed pairs, run by a 6 x 64 tile in 12 ymm, 16 columns at a
// time.
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/gemm.h"

namespace tg::kernels {

// One operand: float32 or bf16 (exactly one of f, h non-null), leading dimension ld.
struct Bf16Operand {
  const float* f = nullptr;
  const bf16* h = nullptr;
  std::int64_t ld = 0;
  Bf16Operand() = default;
  Bf16Operand(const float* p, std::int64_t l) : f(p), ld(l) {}
  Bf16Operand(const bf16* p, std::int64_t l) : h(p), ld(l) {}
};

// One product's arguments.
struct GemmBf16 {
  bool ta = false, tb = false;
  std::int64_t M = 0, N = 0, K = 0;
  float alpha = 1;
  Bf16Operand A, B;
  float beta = 0;
  float* C = nullptr;
  std::int64_t ldc = 0;
  Epilogue ep{};  // run on C's blocks as they are finished (kernels/gemm.h)
};

// The product; shared by the OpenMP team when it is large and the call is outside a parallel
// region. Same bits for any number of threads.
void gemm_bf16(const GemmBf16& g);

// A and B each float or bf16.
template <class TA, class TB>
void gemm_bf16(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const TA* A,
               std::int64_t lda, const TB* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  gemm_bf16(GemmBf16{ta, tb, M, N, K, alpha, Bf16Operand(A, lda), Bf16Operand(B, ldb), beta, C, ldc});
}

// gemm_bf16(p); gemm_bf16(q) for two products neither of which reads the other's output (a
// Linear's dx = dy w and dw = dy^T x), one per half of the team. Same bits as the two calls.
void gemm_bf16_pair(const GemmBf16& p, const GemmBf16& q);

// The reference: operands rounded to bf16 (subnormal bf16 read as zero, as above), each sum in
// double, C = alpha sum + beta C rounded once to float (beta = 0 ignores C).
void gemm_bf16_naive(const GemmBf16& g);

namespace bf16_impl {
// The kernels a product can run on: vdpbf16ps's arithmetic emulated in scalar code, the same on
// float32 fused multiply-adds (AVX-512F, or AVX2 + FMA where isa() is avx2), vdpbf16ps itself, or
// AMX's tiles. gemm_bf16 takes the fastest that isa() allows.
enum class Path { emulated, fma, dpbf16, amx };
// Whether isa() allows the path (and the build has it).
bool path_allowed(Path path);
// The path gemm_bf16 takes: the fastest isa() allows. The fused multiply-add path is taken only
// where a check at its first use finds that this CPU's flush-to-zero gives vdpbf16ps's bits (a
// CPU, hypervisor or emulator that ignores the MXCSR's flush-to-zero gets the scalar emulation).
Path path_in_use();
// The product on the calling thread by the given path, for the tests; throws std::logic_error
// for a path isa() does not allow.
void gemm_bf16_single(const GemmBf16& g, Path path);
}  // namespace bf16_impl

}  // namespace tg::kernels
