// The AVX-512 float32 product: its register tile, run by the shared driver (sgemm_driver.h);
// sgemm_avx512.h says why this tile.
#include "kernels/sgemm_avx512.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "tapegrad/error.h"

#ifdef TG_SGEMM_AVX512
namespace tg::kernels::sgemm_avx512 {

namespace {
// The tile set_tile chose, or -1 for none. These few functions are compiled outside the AVX-512
// target below: tests and benches ask for the tile on any CPU.
std::atomic<int> g_tile{-1};

// TAPEGRAD_SGEMM_TILE's tile, or nullopt when it is unset or empty: read once (a value that throws
// is read again at the next call, and throws again).
std::optional<TileShape> env_tile() {
  static const std::optional<TileShape> t = []() -> std::optional<TileShape> {
    const char* v = std::getenv("TAPEGRAD_SGEMM_TILE");
    if (!v || !*v) return std::nullopt;
    return parse_tile(v);
  }();
  return t;
}
}  // namespace

TileShape default_tile() {
  return __builtin_cpu_is("intel") ? TileShape::wide_8x48 : TileShape::tall_14x32;  // sgemm_avx512.h says why
}
TileShape parse_tile(const char* v) {
  if (!v || !*v) return default_tile();
  for (TileShape shape : {TileShape::tall_14x32, TileShape::wide_8x48})
    if (std::strcmp(v, tile_name(shape)) == 0) return shape;
  fail("TAPEGRAD_SGEMM_TILE", "unknown AVX-512 tile '", v, "' (expected 14x32 or 8x48)");
}
TileShape tile() {
  if (const std::optional<TileShape> t = tile_set()) return *t;
  if (const std::optional<TileShape> e = env_tile()) return *e;
  return default_tile();
}
void set_tile(std::optional<TileShape> shape) {
  g_tile.store(shape ? static_cast<int>(*shape) : -1, std::memory_order_relaxed);
}
std::optional<TileShape> tile_set() {
  const int t = g_tile.load(std::memory_order_relaxed);
  if (t < 0) return std::nullopt;
  return static_cast<TileShape>(t);
}
int tile_rows(TileShape shape) { return shape == TileShape::wide_8x48 ? 8 : 14; }
int tile_cols(TileShape shape) { return shape == TileShape::wide_8x48 ? 48 : 32; }
const char* tile_name(TileShape shape) { return shape == TileShape::wide_8x48 ? "8x48" : "14x32"; }

}  // namespace tg::kernels::sgemm_avx512

#define TG_SGEMM_TARGET "avx512f,avx2,fma"
#include "kernels/sgemm_driver.h"

TG_SGEMM_BEGIN_TARGET(TG_SGEMM_TARGET)

namespace tg::kernels::sgemm_avx512 {

namespace {

using i64 = std::int64_t;

// The MR x (16 NV) tile C[0..mv) x [0..nv) = alpha * sum_k a(i, k) b(k, j) + beta * C, over k < kc
// (sgemm_driver.h gives the operands' layout). Each row's NV accumulators take a(i, k) as a
// broadcast and b(k, 16 v .. 16 v + 16) from the packed panel. sgemm_avx512.h says which tile runs
// where, and why.
template <int MR_, int NV, i64 MC_, i64 NC_, bool AHEAD>
struct Tile {
  static constexpr int MR = MR_;       // rows of C per kernel call
  static constexpr int NR = 16 * NV;   // columns of C per kernel call (NV zmm)
  static constexpr i64 KC = 768;       // K per block, as the AVX2 tile's: a panel of B is kc x 4 NR bytes
  static constexpr i64 MC = MC_;       // rows of C per block: MC x 768 floats of A, under half a 1 MB L2
  static constexpr i64 NC = NC_;       // columns of B packed at once: about 6 MB at kc = 768
  static constexpr bool kAhead = AHEAD;  // the driver hands the tile a slice of the next panel (gemm.h's Ahead)
  static_assert(MR * NV + NV + 1 <= 32, "accumulators, the row of B and the broadcast fit in 32 zmm");

  template <bool ROWS>
  static void kernel(i64 kc, const float* __restrict A, i64 lda, const float* __restrict Bp, float* C, i64 ldc,
                     float alpha, float beta, int mv, int nv, const Ahead& next) {
    // By reference: passed by value, the 24-byte struct goes through the stack, where the caller's
    // field-by-field stores are read back as one 16-byte load, which waits for them (a failed
    // store forward) at every tile (docs/performance.md). Here its fields are read one by one.
    Ahead ahead = next;
    __m512 c[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] = _mm512_setzero_ps();
    const i64 row = ROWS ? lda : 1, step = ROWS ? 1 : lda;
    prefetch_tile(C, ldc, mv, nv);
#pragma GCC unroll 2
    for (i64 k = 0; k < kc; ++k) {
      __m512 b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(Bp + 16 * v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(A[i * row]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[i][v] = _mm512_fmadd_ps(a, b[v], c[i][v]);
      }
      A += step;
      Bp += NR;
      if constexpr (AHEAD) ahead.step(k);  // a line of the next panel every 1, 2 or 4 k
    }
    // A full tile goes straight to C; an edge tile to a buffer, then its valid part to C.
    alignas(64) float edge[MR * NR];
    const bool full = mv == MR && nv == NR;
    float* dst = full ? C : edge;
    const i64 ld = full ? ldc : NR;
    const bool read_c = full && beta != 0.0f;
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* r = dst + i * ld + 16 * v;
        __m512 x = _mm512_mul_ps(va, c[i][v]);
        if (read_c) x = _mm512_fmadd_ps(vb, _mm512_loadu_ps(r), x);
        _mm512_storeu_ps(r, x);
      }
    if (!full)
      for (int i = 0; i < mv; ++i)
        for (int j = 0; j < nv; ++j) {
          float& out = C[i * ldc + j];
          out = beta == 0.0f ? edge[i * NR + j] : std::fma(beta, out, edge[i * NR + j]);  // as the full tile
        }
  }
};

// 14 x 32: 140 x 768 floats of A = 420 KB a block; 2048 columns of B at once.
using Tall = sgemm_driver::Driver<Tile<14, 2, 140, 2048, false>>;
// 8 x 48: 144 x 768 floats of A = 432 KB a block; 2016 columns (42 panels) of B at once.
using WideTile = Tile<8, 3, 144, 2016, true>;
using Wide = sgemm_driver::Driver<WideTile>;
static_assert(Tall::MR == 14 && Tall::NR == 32 && Wide::MR == 8 && Wide::NR == 48, "as tile_rows and tile_cols say");

}  // namespace

void sgemm(bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B, i64 ldb,
           float beta, float* C, i64 ldc, Tri tri) {
  if (tile() == TileShape::wide_8x48) Wide::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, tri);
  else Tall::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, tri);
}
void sgemm_parallel(const Gemm<float>& p) {
  if (tile() == TileShape::wide_8x48) Wide::sgemm_parallel(p);
  else Tall::sgemm_parallel(p);
}
void sgemm_pair_parallel(const Gemm<float>& p, const Gemm<float>& q) {
  if (tile() == TileShape::wide_8x48) Wide::sgemm_pair_parallel(p, q);
  else Tall::sgemm_pair_parallel(p, q);
}
[[gnu::noinline]] void tile_8x48(i64 kc, const float* A, bool rows, i64 lda, const float* B, float* acc,
                                 const Ahead& ahead) {
  using T = WideTile;  // alpha 1, beta 0: acc = 1 c, the sums exactly
  if (rows) T::kernel<true>(kc, A, lda, B, acc, T::NR, 1.0f, 0.0f, T::MR, T::NR, ahead);
  else T::kernel<false>(kc, A, T::MR, B, acc, T::NR, 1.0f, 0.0f, T::MR, T::NR, ahead);
}

}  // namespace tg::kernels::sgemm_avx512

TG_SGEMM_END_TARGET
#endif
