// Run-time instruction-set selection; isa.h says what each level means.
#include "kernels/isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/sgemm_avx512.h"
#include "tapegrad/error.h"

#if defined(TG_KERNELS_X86)
#include <cpuid.h>
#endif
#if defined(TG_KERNELS_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tg::kernels {

namespace {

constexpr Isa kLevels[] = {Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16};

// -1 until the first isa() or set_isa(); then the level, as an int.
std::atomic<int> g_isa{-1};

#ifdef TG_KERNELS_X86
// AMX-BF16 and AMX-TILE in cpuid (leaf 7, sub-leaf 0, EDX bits 22 and 24), and the tile data
// state granted to this process by Linux (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA,
// Linux 5.16 on; the grant covers every thread of the process). Asked once.
bool amx_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
#ifdef __linux__
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return granted;
}
#endif

std::string supported_list() {
  std::string s;
  for (Isa l : kLevels)
    if (cpu_supports(l)) s += std::string(s.empty() ? "" : ", ") + isa_name(l);
  return s;
}

}  // namespace

Isa parse_isa(const char* v) {
  if (!v || !*v) return best_isa();
  for (Isa l : kLevels)
    if (std::strcmp(v, isa_name(l)) == 0) {
      if (!cpu_supports(l))
        fail("TAPEGRAD_ISA", "this CPU cannot run '", v, "' (it supports: ", supported_list(), ")");
      return l;
    }
  fail("TAPEGRAD_ISA", "unknown instruction set '", v, "' (expected portable, avx2, avx512, avx512_bf16 or amx_bf16)");
}

bool cpu_supports(Isa level) {
#ifdef TG_KERNELS_X86
  // __builtin_cpu_supports reads cpuid once at start-up and, for AVX and AVX-512, also checks
  // (XGETBV) that the operating system saves the ymm / zmm registers.
  switch (level) {
    case Isa::portable: return true;
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512: return cpu_supports(Isa::avx2) && __builtin_cpu_supports("avx512f");
    case Isa::avx512_bf16: return cpu_supports(Isa::avx512) && __builtin_cpu_supports("avx512bf16");
    case Isa::amx_bf16: return cpu_supports(Isa::avx512_bf16) && amx_granted();
  }
  return false;
#else
  return level == Isa::portable;
#endif
}

Isa best_isa() {
  Isa best = Isa::portable;
  for (Isa l : kLevels)
    if (cpu_supports(l)) best = l;
  return best;
}

Isa isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {  // first call: every thread that races here computes the same value
    v = static_cast<int>(parse_isa(std::getenv("TAPEGRAD_ISA")));
#ifdef TG_SGEMM_AVX512
    // TAPEGRAD_SGEMM_TILE is read here too, before any product, so that a bad value throws where
    // a bad TAPEGRAD_ISA does (and again at every call until it is fixed).
    if (v >= static_cast<int>(Isa::avx512)) sgemm_avx512::tile();
#endif
    g_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

void set_isa(Isa level) {
  if (!cpu_supports(level))
    fail("set_isa", "this CPU cannot run '", isa_name(level), "' (it supports: ", supported_list(), ")");
  g_isa.store(static_cast<int>(level), std::memory_order_relaxed);
}

const char* isa_name(Isa level) {
  switch (level) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx_bf16: return "amx_bf16";
  }
  return "?";
}

}  // namespace tg::kernels
