#pragma once
// Running a test at each instruction-set level the kernels have (kernels/isa.h), for unit tests
// (which see the library's internal headers).
#include <catch2/catch.hpp>
#include <initializer_list>
#include <optional>
#include <utility>

#include "kernels/isa.h"
#include "kernels/sgemm_avx512.h"

namespace tgtest {

// Sets the kernels' instruction set for a scope (kernels/isa.h) and restores the one in use.
struct IsaScope {
  tg::kernels::Isa saved = tg::kernels::isa();
  explicit IsaScope(tg::kernels::Isa level) { tg::kernels::set_isa(level); }
  ~IsaScope() { tg::kernels::set_isa(saved); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

#ifdef TG_SGEMM_AVX512
// Sets the AVX-512 product's register tile for a scope (kernels/sgemm_avx512.h), then goes back to
// what was set before (nothing, usually: the environment's or the CPU's tile).
struct TileScope {
  std::optional<tg::kernels::sgemm_avx512::TileShape> saved = tg::kernels::sgemm_avx512::tile_set();
  explicit TileScope(tg::kernels::sgemm_avx512::TileShape shape) { tg::kernels::sgemm_avx512::set_tile(shape); }
  ~TileScope() { tg::kernels::sgemm_avx512::set_tile(saved); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
constexpr tg::kernels::sgemm_avx512::TileShape kTiles[] = {tg::kernels::sgemm_avx512::TileShape::tall_14x32,
                                                            tg::kernels::sgemm_avx512::TileShape::wide_8x48};
#endif

// Rows and columns of C in a register tile of the float32 product at this level: avx2's 6 x 16,
// or the AVX-512 tile in use; 0 x 0 at portable (OpenBLAS).
inline std::pair<int, int> product_tile(tg::kernels::Isa level) {
#ifdef TG_SGEMM_AVX512
  using namespace tg::kernels::sgemm_avx512;
  if (level >= tg::kernels::Isa::avx512) return {tile_rows(tile()), tile_cols(tile())};
#endif
  if (level >= tg::kernels::Isa::avx2) return {6, 16};
  return {0, 0};
}

// Runs body(level) once for each of the levels this CPU can run, each set in-process in turn; at
// avx512, once for each of the AVX-512 product's register tiles (the CPU picks one; both run on
// every AVX-512 CPU).
template <class F>
void each_isa(std::initializer_list<tg::kernels::Isa> levels, F&& body) {
  for (tg::kernels::Isa level : levels) {
    if (!tg::kernels::cpu_supports(level)) continue;
    IsaScope scope(level);
    INFO("isa=" << tg::kernels::isa_name(level));
#ifdef TG_SGEMM_AVX512
    if (level == tg::kernels::Isa::avx512) {
      for (auto shape : kTiles) {
        TileScope tile(shape);
        INFO("tile=" << tg::kernels::sgemm_avx512::tile_name(shape));
        body(level);
      }
      continue;
    }
#endif
    body(level);
  }
}

}  // namespace tgtest
