#pragma once
// Which instruction set the kernels use, chosen once at run time from the CPU (cpuid), so one
// binary runs on any x86-64 CPU and takes the widest kernels the CPU has. Internal: never included
// by tapegrad.h.
//
// The levels are ordered, each implying the ones before it:
//   portable     loops any compiler vectorises for the build's target, float32 products through OpenBLAS;
//   avx2         AVX2 + FMA: our own float32 product, 6 x 16 register tile (sgemm_avx2.h);
//   avx512       AVX-512F: our own float32 product, 14 x 32 or 8 x 48 register tile (sgemm_avx512.h);
//   avx512_bf16  AVX-512F + AVX512_BF16: bf16 products (vdpbf16ps) as well;
//   amx_bf16     AVX512_BF16 + AMX-BF16 (Intel's tile unit, Sapphire Rapids on): bf16 products on
//                16 x 16 tiles (tdpbf16ps), about four times vdpbf16ps's rate. The operating system
//                must grant the tile state to the process (Linux 5.16 on, arch_prctl
//                ARCH_REQ_XCOMP_PERM); cpu_supports asks once, and a refusal means unsupported.
//
// The environment variable TAPEGRAD_ISA = portable | avx2 | avx512 | avx512_bf16 | amx_bf16 caps the level
// (read at the first call to isa()): a kernel above it is not used even where the CPU has it. A
// value the CPU cannot run, or an unknown name, makes isa() throw tg::Error naming the value and
// what the CPU supports; it never silently runs something else. TAPEGRAD_SGEMM_TILE = 14x32 | 8x48,
// the AVX-512 product's register tile (sgemm_avx512.h), is read and checked at the same call when
// the level is avx512 or above (below it, no product runs that tile). Tests set the level in-process
// with set_isa() to cover every path in one binary.
// Where the compiler can build the x86 kernels: each is compiled for its own instruction set by a
// target pragma (sgemm_driver.h), whatever the build's -march, and called only where the CPU has it.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define TG_KERNELS_X86 1
#endif

namespace tg::kernels {

enum class Isa { portable = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx_bf16 = 4 };

// What the CPU (and the operating system, which must save the wider registers) supports; false
// on every level above portable where the build cannot compile the kernels (not x86-64 GCC/Clang).
bool cpu_supports(Isa level);
inline bool cpu_has_avx2_fma() { return cpu_supports(Isa::avx2); }
inline bool cpu_has_avx512() { return cpu_supports(Isa::avx512); }
inline bool cpu_has_avx512_bf16() { return cpu_supports(Isa::avx512_bf16); }
inline bool cpu_has_amx_bf16() { return cpu_supports(Isa::amx_bf16); }

// The widest level the CPU supports.
Isa best_isa();

// The level in use: TAPEGRAD_ISA's if set (throws tg::Error for a bad value), else best_isa().
Isa isa();

// The level a value of TAPEGRAD_ISA names: best_isa() for null or empty; throws tg::Error for an
// unknown name or a level this CPU cannot run.
Isa parse_isa(const char* value);

// Sets the level in use for the whole process (throws tg::Error if the CPU cannot run it). Not
// to be called while another thread is inside a kernel.
void set_isa(Isa level);

// "portable", "avx2", "avx512", "avx512_bf16", "amx_bf16".
const char* isa_name(Isa level);

}  // namespace tg::kernels
