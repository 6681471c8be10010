#pragma once
// OpenMP only pays off above a few tens of thousands of elements: below that, waking the team
// costs more than the loop. Every parallel loop in the kernels goes through this threshold.
#include <cstdint>

namespace tg::kernels {
inline constexpr std::int64_t kParallelMin = 1 << 15;  // elements (or row * cols) of work
}  // namespace tg::kernels

#define TG_PRAGMA(x) _Pragma(#x)
// Parallel for over a loop whose total work is `work` elements; serial when it is small.
#define TG_PARALLEL_FOR(work) TG_PRAGMA(omp parallel for schedule(static) if ((work) >= ::tg::kernels::kParallelMin))
