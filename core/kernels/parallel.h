#pragma once
// Parallel loops over OpenMP that cost nothing when the work is small, and the helpers every
// kernel shares: parallel_for(n, work, body(lo, hi)) and parallel_region(work, body(t, nt)),
// chunk_begin (a thread's share of a range), fill_zero(x, n) (x (n) = 0), with_bool (a run-time
// flag as a compile-time one), and TG_PRAGMA. n is the iterations split, `work` the elements the
// loop touches.
//
// OpenMP only pays off above a few tens of thousands of elements: below that, waking the team
// costs more than the loop. And the work test must sit outside the pragma: libgomp enters a
// `#pragma omp parallel if (false)` region through GOMP_parallel all the same (a team of one is
// made and torn down), a fixed cost per call that dominates an op on a few elements. So every
// parallel loop goes through parallel_for / parallel_region, which test the threshold first and
// call the body directly when it is not met.
//
// The split is static (thread t of nt gets [n t / nt, n (t + 1) / nt)), so a kernel that keeps
// per-thread partial sums gives the same bits on every run with the same thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// A pragma from a macro argument (e.g. TG_PRAGMA(omp simd reduction(+ : s)) inside a kernel).
#define TG_PRAGMA(x) _Pragma(#x)

namespace tg::kernels {

inline constexpr std::int64_t kParallelMin = 1 << 15;  // elements (or rows * cols) of work

// True when a loop with this much work should use the OpenMP team.
inline bool worth_parallel(std::int64_t work) {
  return work >= kParallelMin && omp_get_max_threads() > 1 && !omp_in_parallel();
}

// Thread t's share of [0, n) when split into nt contiguous ranges.
inline std::int64_t chunk_begin(std::int64_t n, int t, int nt) { return n * t / nt; }

// body(lo, hi) over contiguous ranges covering [0, n): one range per thread when `work` (elements
// touched) is large enough, else body(0, n) on the calling thread.
template <class F>
void parallel_for(std::int64_t n, std::int64_t work, F&& body) {
  if (n <= 0) return;
  if (n == 1 || !worth_parallel(work)) {
    body(std::int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const std::int64_t lo = chunk_begin(n, t, nt), hi = chunk_begin(n, t + 1, nt);
    if (lo < hi) body(lo, hi);
  }
}

// body(t, nt) on every thread of a team of nt (nt = 1 and no team when `work` is small).
template <class F>
void parallel_region(std::int64_t work, F&& body) {
  if (!worth_parallel(work)) {
    body(0, 1);
    return;
  }
#pragma omp parallel
  body(omp_get_thread_num(), omp_get_num_threads());
}

// x[0, n) = 0, in parallel when large.
template <class T>
void fill_zero(T* x, std::int64_t n) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    std::memset(x + lo, 0, static_cast<std::size_t>(hi - lo) * sizeof(T));
  });
}

// f(std::true_type) or f(std::false_type): a run-time flag as a compile-time one, so that each
// variant of a loop is its own plain, vectorisable loop (a flag tested inside a loop, above all
// one guarding a store, keeps GCC from vectorising it).
// Always inlined: called out of line, the caller stores a small kernel's captures and the callee
// reads them back at once with one wide load that store forwarding cannot serve, a stall on every
// call that is a visible part of a recorded op on four elements (docs/performance.md).
template <class F>
[[gnu::always_inline]] inline void with_bool(bool b, F&& f) {
  if (b) f(std::true_type{});
  else f(std::false_type{});
}

// ---- a team product's items ----
// A product cut into `base` items that the team takes from a shared counter (the float32 driver's
// and the bf16 product's plans), with its last `team` items each cut in two: the threads then end
// within about half an item of each other, not a whole one. Item i is base item base_of(i), whole
// or one of its halves (part()). Cut in four, or the last 2 x team items cut, the step is slower
// (docs/performance.md, "The team's last items cut in two"). With one thread nothing is cut.
struct TailCut {
  std::int64_t base = 0, whole = 0;  // items before the cut; items taken whole
  TailCut() = default;
  TailCut(std::int64_t base_items, int team)
      : base(base_items), whole(team > 1 ? base_items - std::min<std::int64_t>(base_items, team) : base_items) {}
  std::int64_t items() const { return whole + 2 * (base - whole); }
  // Items whole + 2j and whole + 2j + 1 are the halves of base item whole + j.
  std::int64_t base_of(std::int64_t i) const { return i < whole ? i : whole + (i - whole) / 2; }
  // [u0, u1): the base item's units (tiles or units of rows), narrowed to item i's half. The first
  // half is empty when the base item has one unit.
  void part(std::int64_t i, std::int64_t& u0, std::int64_t& u1) const {
    if (i < whole) return;
    const std::int64_t mid = u0 + (u1 - u0) / 2;
    if ((i - whole) % 2 == 0) u1 = mid;
    else u0 = mid;
  }
};

// ---- two products on one team ----
// Two independent products (a Linear's dx = dy w and dw = dy^T x) made by the float32 drivers
// (sgemm_driver.h) and the bf16 product (sgemm_bf16.cpp) alike. The team is cut in two in
// proportion to their work wp and wq (with two threads: one product each); each part packs its own
// product's op(B) and takes its items; a thread whose product has no items left then takes the
// other's, once that product's B is packed (a counter of packed units says so). Each thread so
// works from its own L2 for most of the call, and neither waits for the other at the end.
// (Both products' items from one counter, every thread packing both, is slower: each thread then
// reads the other's packed B from L3.) Plan has units(), pack(u), items and item(i, a), a being
// a_buffer(): the calling thread's packing buffer for A, or null (that thread then takes no items).
template <class Plan, class ABuffer>
void run_pair_on_team(Plan (&plan)[2], double wp, double wq, int team, ABuffer&& a_buffer) {
  const int np = std::clamp(static_cast<int>(std::lround(team * wp / (wp + wq))), 1, team - 1);
  std::atomic<std::int64_t> next[2] = {0, 0}, packed[2] = {0, 0};
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Thread t's own product and its rank in that product's part of the team. With a team of
    // one (the runtime gave fewer threads than asked) the thread packs both.
    const int split = std::min(np, nt - 1);
    const int own = nt < 2 || t < split ? 0 : 1;
    for (int j = 0; j < 2; ++j) {
      if (nt >= 2 && j != own) continue;
      const int rank = nt < 2 ? 0 : (j == 0 ? t : t - split), size = nt < 2 ? 1 : (j == 0 ? split : nt - split);
      for (std::int64_t u = rank; u < plan[j].units(); u += size) {
        plan[j].pack(u);
        packed[j].fetch_add(1, std::memory_order_release);
      }
    }
    auto* Ap = a_buffer();
    for (int k = 0; Ap && k < 2; ++k) {
      const int j = k == 0 ? own : 1 - own;
      if (next[j].load(std::memory_order_relaxed) >= plan[j].items) continue;
      while (packed[j].load(std::memory_order_acquire) < plan[j].units()) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();  // the spin-wait hint
#endif
      }
      for (std::int64_t i; (i = next[j].fetch_add(1, std::memory_order_relaxed)) < plan[j].items;) plan[j].item(i, Ap);
    }
  }
}

}  // namespace tg::kernels
