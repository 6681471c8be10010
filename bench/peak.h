#pragma once
// The cores' multiply-add peaks (peak.cpp).
namespace bench {

enum class PeakKind { fma_avx2, fma_avx512, dpbf16, amx_bf16 };

// Flops one iteration of run_peak's loop makes on one thread.
double peak_flops_per_iteration(PeakKind k);

// iters iterations on every thread of the OpenMP team; returns a value that depends on the
// arithmetic (so it is not optimised away). Call only where the CPU has the instructions (for
// amx_bf16, after tg::kernels::cpu_supports(Isa::amx_bf16) has returned true: it asks Linux for the
// tile state).
float run_peak(PeakKind k, long iters);

}  // namespace bench
