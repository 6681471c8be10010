// matmul: the BLAS path against the naive reference, every transpose and batch layout, gradients.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "helpers.h"
#include "isa_helpers.h"
#include "kernels/gemm.h"
#include "kernels/isa.h"
#include "kernels/sgemm_avx2.h"

using namespace tg;
using namespace tgtest;

namespace {
// Reference product through the naive kernel, one batch at a time (a and b already broadcast).
Tensor naive_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  const std::int64_t M = ta ? a.size(-1) : a.size(-2), K = ta ? a.size(-2) : a.size(-1);
  const std::int64_t N = tb ? b.size(-2) : b.size(-1);
  const std::int64_t batch = a.numel() / (M * K);
  Shape out;
  for (int d = 0; d + 2 < a.dim(); ++d) out.push_back(a.size(d));
  out.push_back(M);
  out.push_back(N);
  Tensor c = zeros(out, float64);
  Tensor a64 = a.to(float64), b64 = b.to(float64);
  for (std::int64_t i = 0; i < batch; ++i)
    kernels::gemm_naive<double>(ta, tb, M, N, K, 1.0, a64.data<double>() + i * M * K, a.size(-1),
                                b64.data<double>() + (b.dim() == 2 ? 0 : i * K * N), b.size(-1), 0.0,
                                c.data<double>() + i * M * N, N);
  return c;
}

// The float32 products' levels (kernels/isa.h): portable (OpenBLAS), avx2 (our 6 x 16 tile) and
// avx512 (our 14 x 32 and 8 x 48 tiles); each_isa (isa_helpers.h) runs a test under each the CPU
// has, and at avx512 under each tile.
const std::initializer_list<kernels::Isa> kProducts = {kernels::Isa::portable, kernels::Isa::avx2,
                                                       kernels::Isa::avx512};
}  // namespace

TEST_CASE("gemm (BLAS) agrees with the naive reference for every transpose, alpha and beta") {
  each_isa(kProducts, [&](kernels::Isa) {
    Generator g(3);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [M, N, K] : {std::tuple<int, int, int>{5, 7, 3}, {64, 96, 128}, {1, 1, 1}}) {
          Tensor A = randn(ta ? Shape{K, M} : Shape{M, K}, float64, &g);
          Tensor B = randn(tb ? Shape{N, K} : Shape{K, N}, float64, &g);
          Tensor C0 = randn({M, N}, float64, &g);
          Tensor C1 = C0.clone(), C2 = C0.clone();
          kernels::gemm<double>(ta, tb, M, N, K, 0.5, A.data<double>(), A.size(1), B.data<double>(), B.size(1), 2.0,
                                C1.data<double>(), N);
          kernels::gemm_naive<double>(ta, tb, M, N, K, 0.5, A.data<double>(), A.size(1), B.data<double>(), B.size(1),
                                      2.0, C2.data<double>(), N);
          INFO("ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K);
          CHECK(max_abs_diff(C1, C2) < 1e-11);
          // float32 path too
          Tensor A32 = A.to(float32), B32 = B.to(float32), C32 = C0.to(float32), R32 = C0.to(float32);
          kernels::gemm<float>(ta, tb, M, N, K, 0.5f, A32.data<float>(), A.size(1), B32.data<float>(), B.size(1), 2.0f,
                               C32.data<float>(), N);
          kernels::gemm_naive<float>(ta, tb, M, N, K, 0.5f, A32.data<float>(), A.size(1), B32.data<float>(), B.size(1),
                                     2.0f, R32.data<float>(), N);
          CHECK(max_abs_diff(C32, R32) < 1e-3);
        }
  });
}

TEST_CASE("gemm with beta = 0 ignores what C held, NaN included, and leaves the columns beyond N alone") {
  // BLAS's rule; gemm implements beta = 0 as a zero fill and beta = 1 (see kernels/gemm.cpp).
  each_isa(kProducts, [&](kernels::Isa) {
    Generator g(11);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (auto [M, N, K] : {std::tuple<int, int, int>{5, 7, 3}, {70, 33, 20}, {4, 3, 0}}) {
      const int ldc = N + 2;
      Tensor A = randn({M, K}, float64, &g), B = randn({K, N}, float64, &g);
      Tensor want = full({M, ldc}, 7.0, float64);
      kernels::gemm_naive<double>(false, false, M, N, K, 1.5, A.data<double>(), K, B.data<double>(), N, 0.0,
                                  want.data<double>(), ldc);
      Tensor C64 = full({M, ldc}, 7.0, float64);
      Tensor C32 = full({M, ldc}, 7.0, float32);
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) C64.set({m, n}, nan), C32.set({m, n}, nan);
      kernels::gemm<double>(false, false, M, N, K, 1.5, A.data<double>(), K, B.data<double>(), N, 0.0,
                            C64.data<double>(), ldc);
      Tensor A32 = A.to(float32), B32 = B.to(float32);
      kernels::gemm<float>(false, false, M, N, K, 1.5f, A32.data<float>(), K, B32.data<float>(), N, 0.0f,
                           C32.data<float>(), ldc);
      INFO("M=" << M << " N=" << N << " K=" << K);
      CHECK(max_abs_diff(C64, want) < 1e-12);  // NaN would make the difference NaN and fail
      CHECK(max_abs_diff(C32.to(float64), want) < 1e-4);
      CHECK(C64.at({M - 1, N}) == 7.0);  // padding columns untouched
      CHECK(C32.at({0, N + 1}) == 7.0);
    }
  });
}

TEST_CASE("gemm split across threads (by rows or by columns) matches the naive reference, padded strides and all") {
  // Large enough products are cut into blocks of rows (M >= N) or columns of C, one BLAS call per
  // thread (kernels/gemm.cpp). The shapes below put cuts off multiples of 16, give threads blocks
  // of different sizes, and read A, B and C through leading dimensions wider than the matrices.
  each_isa(kProducts, [&](kernels::Isa) {
    const int before = get_num_threads();
    Generator g(12);
    for (int threads : {2, 3}) {
      set_num_threads(threads);
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (auto [M, N, K] : {std::tuple<int, int, int>{133, 50, 120}, {40, 150, 100}, {300, 37, 64}}) {
            for (double beta : {0.0, 0.5}) {
              const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
              Tensor A = randn({ta ? K : M, lda}, float64, &g), B = randn({tb ? N : K, ldb}, float64, &g);
              Tensor C0 = randn({M, ldc}, float64, &g);
              Tensor want = C0.clone(), C64 = C0.clone(), C32 = C0.to(float32);
              kernels::gemm_naive<double>(ta, tb, M, N, K, 1.25, A.data<double>(), lda, B.data<double>(), ldb, beta,
                                          want.data<double>(), ldc);
              kernels::gemm<double>(ta, tb, M, N, K, 1.25, A.data<double>(), lda, B.data<double>(), ldb, beta,
                                    C64.data<double>(), ldc);
              Tensor A32 = A.to(float32), B32 = B.to(float32);
              kernels::gemm<float>(ta, tb, M, N, K, 1.25f, A32.data<float>(), lda, B32.data<float>(), ldb,
                                   static_cast<float>(beta), C32.data<float>(), ldc);
              INFO("threads=" << threads << " ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K
                              << " beta=" << beta);
              CHECK(max_abs_diff(C64, want) < 1e-11);  // padding columns included: they must keep C0's values
              CHECK(max_abs_diff(C32.to(float64), want) < 2e-3);
            }
          }
    }
    set_num_threads(before);
  });
}

TEST_CASE("float32 gemm on one thread matches the naive reference at every tile, block and panel edge") {
  // On AVX2 and AVX-512 CPUs this is our own product (kernels/sgemm_driver.h): tiles of C of 6 x 16
  // (avx2), 14 x 32 or 8 x 48 (avx512), K in blocks of at most 768, rows of C in blocks of at most
  // 144 (avx2, 8 x 48) or 140 (14 x 32), B packed 2048 (2016 for 8 x 48) columns at a time in panels
  // of 16, 32 or 48, B^T transposed 8 x 8 in registers, A^T packed in panels of 6, 14 or 8. The
  // sizes put a ragged tile, block or panel at every one of those edges (M = 151: two row blocks,
  // the second ending in a 1-row tile (avx2: 78 + 73), an 11-row one (14 x 32: 84 + 67) or a 7-row
  // one (8 x 48: 80 + 71); M = 295: three, the last ending in a ragged tile on all; N = 17 and 65: a
  // panel of 1 or 17 columns; K = 769: blocks of 388 and 381, not multiples of the 8-wide
  // transpose; N = 2100: two packs of B), and whole tiles only (12 x 32, 28 x 64, 16 x 96), with
  // padded leading dimensions whose extra columns must keep their values.
  each_isa(kProducts, [&](kernels::Isa) {
    const int before = get_num_threads();
    set_num_threads(1);
    Generator g(21);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    struct Size {
      int M, N, K;
    };
    std::vector<Size> sizes;
    for (int M : {1, 13, 151})
      for (int N : {1, 17, 65})
        for (int K : {1, 9, 257, 769}) sizes.push_back({M, N, K});
    sizes.push_back({7, 2100, 3});
    sizes.push_back({295, 65, 300});
    sizes.push_back({12, 32, 16});  // whole tiles only (avx2)
    sizes.push_back({28, 64, 16});  // whole tiles only (avx512, 14 x 32)
    sizes.push_back({16, 96, 16});  // whole tiles only (avx512, 8 x 48)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (const Size& z : sizes)
          for (float beta : {0.0f, 1.0f, -0.5f}) {
            const int M = z.M, N = z.N, K = z.K;
            const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
            Tensor A = randn({ta ? K : M, lda}, float32, &g), B = randn({tb ? N : K, ldb}, float32, &g);
            Tensor C = randn({M, ldc}, float32, &g);
            if (beta == 0.0f)  // BLAS's rule: beta = 0 ignores C, NaN included
              for (int m = 0; m < M; ++m)
                for (int n = 0; n < N; ++n) C.data<float>()[m * ldc + n] = nan;
            Tensor want = C.to(float64);
            Tensor A64 = A.to(float64), B64 = B.to(float64);
            kernels::gemm_naive<double>(ta, tb, M, N, K, 1.5, A64.data<double>(), lda, B64.data<double>(), ldb, beta,
                                        want.data<double>(), ldc);
            kernels::gemm<float>(ta, tb, M, N, K, 1.5f, A.data<float>(), lda, B.data<float>(), ldb, beta, C.data<float>(),
                                 ldc);
            INFO("ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K << " beta=" << beta);
            // float sums of K products of N(0, 1) numbers: a few float roundings of a sum ~ sqrt(K)
            CHECK(max_abs_diff(C.to(float64), want) < 1e-5 * (K + 1));
          }
    // A NaN in op(A)'s row 4 at k = 400 (second K block) turns that row of C to NaN and no other.
    for (bool ta : {false, true}) {
      const int M = 13, N = 20, K = 769;
      Tensor A = randn(ta ? Shape{K, M} : Shape{M, K}, float32, &g), B = randn({K, N}, float32, &g);
      A.data<float>()[ta ? 400 * M + 4 : 4 * K + 400] = nan;
      Tensor C = zeros({M, N}, float32);
      kernels::gemm<float>(ta, false, M, N, K, 1.0f, A.data<float>(), ta ? M : K, B.data<float>(), N, 0.0f,
                           C.data<float>(), N);
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) CHECK(std::isnan(C.data<float>()[m * N + n]) == (m == 4));
    }
    // alpha = 0 and K = 0: C = beta C.
    Tensor A = randn({5, 4}, float32, &g), B = randn({4, 6}, float32, &g), C = randn({5, 6}, float32, &g);
    Tensor C0 = C.clone();
    kernels::gemm<float>(false, false, 5, 6, 4, 0.0f, A.data<float>(), 4, B.data<float>(), 6, 0.5f, C.data<float>(), 6);
    CHECK(max_abs_diff(C, C0 * 0.5) == 0.0);
    kernels::gemm<float>(false, false, 5, 6, 0, 1.0f, A.data<float>(), 4, B.data<float>(), 6, 0.0f, C.data<float>(), 6);
    CHECK(max_abs_diff(C, zeros({5, 6})) == 0.0);
    set_num_threads(before);
  });
}

TEST_CASE("float32 gemm and gemm_pair give the same bits for any team size") {
  // With our own product (avx2, avx512) each element of C is summed in the same order (K blocks of a
  // size that does not depend on the team, k in order inside each) whichever thread computes it and
  // however C is cut (kernels/sgemm_driver.h), so the products, unlike OpenBLAS's, do not change
  // with the thread count. The portable level goes through OpenBLAS, whose blocking depends on the
  // team: checked there to the tolerance instead.
  each_isa(kProducts, [&](kernels::Isa level) {
    const int before = get_num_threads();
    Generator g(44);
    struct P {
      bool ta, tb;
      int M, N, K;
    };
    const P shapes[] = {{false, true, 768, 384, 128}, {false, false, 301, 130, 384}, {true, false, 200, 129, 770}};
    for (const P& s : shapes)
      for (float beta : {0.0f, 1.0f, 0.3f}) {
        Tensor A = randn({s.ta ? s.K : s.M, s.ta ? s.M : s.K}, float32, &g);
        Tensor B = randn({s.tb ? s.N : s.K, s.tb ? s.K : s.N}, float32, &g);
        Tensor C0 = randn({s.M, s.N}, float32, &g);
        std::vector<Tensor> out;
        for (int threads : {1, 2, 3}) {
          set_num_threads(threads);
          Tensor C = C0.clone(), D = C0.clone(), E = C0.clone();
          auto product = [&](Tensor& c) {
            return kernels::Gemm<float>{s.ta,      s.tb, s.M, s.N, s.K, 1.0f, A.data<float>(), A.size(1), B.data<float>(),
                                        B.size(1), beta, c.data<float>(), s.N};
          };
          kernels::gemm(product(C));
          kernels::gemm_pair(product(D), product(E));  // the same product twice, side by side
          out.insert(out.end(), {C, D, E});
        }
        INFO("M=" << s.M << " N=" << s.N << " K=" << s.K << " beta=" << beta);
        for (std::size_t i = 1; i < out.size(); ++i) {
          if (level != kernels::Isa::portable) CHECK(max_abs_diff(out[i], out[0]) == 0.0);
          else CHECK(max_abs_diff(out[i], out[0]) < 1e-5 * (s.K + 1));
        }
      }
    set_num_threads(before);
  });
}

TEST_CASE("A's rows read in place or packed because their stride crowds L1's sets give the same bits") {
  // kernels/sgemm_driver.h reads MR rows of A in place unless their stride would put more than
  // eight of them in one set of L1 (rows_crowd_l1); then it packs them. The same values, once at
  // lda = K and once at lda = 1024 floats (4 KB: every row in one set, so the AVX-512 14 x 32
  // tile's 14 rows are packed; 8 rows never crowd a set, and 8 x 48 reads them in place both
  // times), with gemm and gemm_tri, at 1 and 2 threads: the same bits, and the naive reference's
  // values.
  each_isa(kProducts, [&](kernels::Isa level) {
    if (level == kernels::Isa::portable) return;  // OpenBLAS's own packing
    const int before = get_num_threads();
    Generator g(48);
    for (int threads : {1, 2})
      for (auto [M, N, K] : {std::tuple<int, int, int>{151, 65, 300}, {29, 33, 257}, {200, 70, 200}, {30, 40, 800}})
        for (bool tb : {false, true}) {
          set_num_threads(threads);
          const int wide = 1024;
          Tensor A = randn({M, K}, float32, &g), Aw = zeros({M, wide}, float32);
          if (M == K)  // lower triangular, for gemm_tri
            for (int i = 0; i < M; ++i)
              for (int k = i + 1; k < K; ++k) A.data<float>()[i * K + k] = 0.0f;
          for (int i = 0; i < M; ++i)
            std::copy_n(A.data<float>() + i * K, K, Aw.data<float>() + i * wide);
          Tensor B = randn(tb ? Shape{N, K} : Shape{K, N}, float32, &g);
          Tensor C0 = randn({M, N}, float32, &g);
          Tensor C = C0.clone(), Cw = C0.clone(), T = C0.clone(), Tw = C0.clone();
          auto run = [&](const Tensor& a, int lda, Tensor& c, bool tri) {
            if (tri)
              kernels::gemm_tri<float>(kernels::Tri::lower_a, false, tb, M, N, K, 1.5f, a.data<float>(), lda,
                                       B.data<float>(), B.size(1), 0.5f, c.data<float>(), N);
            else
              kernels::gemm<float>(false, tb, M, N, K, 1.5f, a.data<float>(), lda, B.data<float>(), B.size(1), 0.5f,
                                   c.data<float>(), N);
          };
          run(A, K, C, false);
          run(Aw, wide, Cw, false);
          INFO("threads=" << threads << " M=" << M << " N=" << N << " K=" << K << " tb=" << tb);
          CHECK(max_abs_diff(C, Cw) == 0.0);
          Tensor want = naive_matmul(A, B, false, tb) * 1.5 + C0.to(float64) * 0.5;
          CHECK(max_abs_diff(C.to(float64), want) < 1e-4 * (K + 1));
          if (M == K) {
            run(A, K, T, true);
            run(Aw, wide, Tw, true);
            CHECK(max_abs_diff(T, Tw) == 0.0);
            CHECK(max_abs_diff(T, C) == 0.0);
          }
        }
    set_num_threads(before);
  });
}

#ifdef TG_SGEMM_AVX512
TEST_CASE("the AVX2 and AVX-512 products give the same bits, with either AVX-512 tile") {
  // All cut K into the same blocks and sum each element of C as one chain of FMAs over k in order
  // (kernels/sgemm_avx512.h), so neither the instruction set nor the tile changes a result: every
  // transpose, beta, a triangle, one thread and two, the shapes ragged for all three tiles.
  if (!kernels::cpu_has_avx512()) return;
  const int before = get_num_threads();
  Generator g(47);
  for (int threads : {1, 2})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [M, N, K] : {std::tuple<int, int, int>{151, 65, 1600}, {300, 200, 130}, {29, 33, 257}, {300, 64, 300}})
          for (float beta : {0.0f, 0.5f}) {
            set_num_threads(threads);
            Tensor A = randn(ta ? Shape{K, M} : Shape{M, K}, float32, &g);
            if (M == K)  // op(A) lower triangular, as causal attention's P in P v
              for (int i = 0; i < M; ++i)
                for (int k = i + 1; k < K; ++k) A.data<float>()[ta ? k * M + i : i * K + k] = 0.0f;
            Tensor B = randn(tb ? Shape{N, K} : Shape{K, N}, float32, &g);
            Tensor C0 = randn({M, N}, float32, &g);
            std::vector<Tensor> out;
            for (int run = 0; run < 3; ++run) {  // avx2, then avx512 with each tile
              IsaScope scope(run == 0 ? kernels::Isa::avx2 : kernels::Isa::avx512);
              TileScope tile(kTiles[run == 2 ? 1 : 0]);
              Tensor C = C0.clone(), T = C0.clone();
              kernels::gemm<float>(ta, tb, M, N, K, 1.25f, A.data<float>(), A.size(1), B.data<float>(), B.size(1), beta,
                                   C.data<float>(), N);
              if (M == K)
                kernels::gemm_tri<float>(kernels::Tri::lower_a, ta, tb, M, N, K, 1.25f, A.data<float>(), A.size(1),
                                         B.data<float>(), B.size(1), beta, T.data<float>(), N);
              out.insert(out.end(), {C, T});
            }
            INFO("threads=" << threads << " ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K
                            << " beta=" << beta);
            for (int run = 1; run < 3; ++run) {
              INFO("avx512 tile " << run);
              CHECK(max_abs_diff(out[0], out[2 * run]) == 0.0);
              CHECK(max_abs_diff(out[1], out[2 * run + 1]) == 0.0);
            }
          }
  set_num_threads(before);
}

TEST_CASE("the AVX-512 tile is the CPU's own unless set or named, and an unknown name is refused") {
  namespace s5 = kernels::sgemm_avx512;
  CHECK_FALSE(s5::tile_set().has_value());  // each_isa's scopes leave nothing set
  CHECK(s5::parse_tile("14x32") == s5::TileShape::tall_14x32);
  CHECK(s5::parse_tile("8x48") == s5::TileShape::wide_8x48);
  CHECK(s5::parse_tile(nullptr) == s5::default_tile());
  CHECK(s5::parse_tile("") == s5::default_tile());
  for (const char* bad : {"8x32", "14X32", " 8x48", "wide"}) {
    INFO("value=" << bad);
    REQUIRE_TG_ERROR(s5::parse_tile(bad), "TAPEGRAD_SGEMM_TILE", bad);
  }
  // The tile in use is the environment's when it names one: ctest runs this binary without it, and
  // this test also with 8x48, 14x32 and a bad name (tests/CMakeLists.txt). A bad name makes every
  // product at avx512 throw, naming it, and never run a tile.
  const char* env = std::getenv("TAPEGRAD_SGEMM_TILE");
  bool env_ok = true;
  try {
    s5::parse_tile(env);
  } catch (const Error&) {
    env_ok = false;
  }
  if (!env_ok) {  // this test alone runs, so isa() reads the environment here (kernels/isa.h)
    REQUIRE_TG_ERROR(s5::tile(), "TAPEGRAD_SGEMM_TILE", env);
    if (kernels::cpu_has_avx512()) {
      REQUIRE_TG_ERROR(kernels::isa(), "TAPEGRAD_SGEMM_TILE", env);
      std::vector<float> a(64, 1.0f), c(64, 7.0f);
      REQUIRE_TG_ERROR(kernels::gemm<float>(false, false, 8, 8, 8, 1.0f, a.data(), 8, a.data(), 8, 0.0f, c.data(), 8),
                       "TAPEGRAD_SGEMM_TILE", env);
      CHECK(c == std::vector<float>(64, 7.0f));  // C untouched
    }
    return;
  }
  CHECK(s5::tile() == s5::parse_tile(env));
  for (s5::TileShape shape : kTiles) {
    {
      TileScope scope(shape);
      CHECK(s5::tile() == shape);
      CHECK(s5::tile_set() == shape);
    }
    CHECK_FALSE(s5::tile_set().has_value());
    CHECK(s5::tile() == s5::parse_tile(env));
  }
}
#endif

TEST_CASE("TAPEGRAD_ISA names an instruction set, and an unknown name or one the CPU lacks is refused") {
  using kernels::Isa;
  CHECK(kernels::parse_isa(nullptr) == kernels::best_isa());
  CHECK(kernels::parse_isa("") == kernels::best_isa());
  CHECK(kernels::parse_isa("portable") == Isa::portable);
  for (Isa level : {Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}) {
    INFO("level=" << kernels::isa_name(level));
    if (kernels::cpu_supports(level)) {
      CHECK(kernels::parse_isa(kernels::isa_name(level)) == level);
      CHECK(kernels::cpu_supports(static_cast<Isa>(static_cast<int>(level) - 1)));  // levels are nested
    } else {
      REQUIRE_TG_ERROR(kernels::parse_isa(kernels::isa_name(level)), "TAPEGRAD_ISA", "cannot run",
                       kernels::isa_name(level));
      REQUIRE_TG_ERROR(kernels::set_isa(level), "set_isa", "cannot run", kernels::isa_name(level));
    }
  }
  REQUIRE_TG_ERROR(kernels::parse_isa("avx1024"), "TAPEGRAD_ISA", "unknown", "'avx1024'", "portable, avx2");
  REQUIRE_TG_ERROR(kernels::parse_isa("AVX2"), "TAPEGRAD_ISA", "unknown", "'AVX2'");
  CHECK(kernels::cpu_supports(kernels::best_isa()));
  CHECK(std::string(kernels::isa_name(Isa::avx512_bf16)) == "avx512_bf16");
  CHECK(std::string(kernels::isa_name(Isa::amx_bf16)) == "amx_bf16");
}

#ifdef TG_SGEMM_AVX2
TEST_CASE("the float32 product's fallback without packing buffers matches the naive reference") {
  // Our own product computes without packing when its buffers cannot be allocated (it may run
  // inside a parallel region and must not throw); that path is otherwise never taken.
  if (!kernels::cpu_has_avx2_fma()) return;
  Generator g(46);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.0f, 1.0f, -0.5f}) {
        const int M = 13, N = 21, K = 30, lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 3, ldc = N + 1;
        Tensor A = randn({ta ? K : M, lda}, float32, &g), B = randn({tb ? N : K, ldb}, float32, &g);
        Tensor C = randn({M, ldc}, float32, &g);
        if (beta == 0.0f) C.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();  // ignored
        Tensor want = C.to(float64), A64 = A.to(float64), B64 = B.to(float64);
        kernels::gemm_naive<double>(ta, tb, M, N, K, 0.5, A64.data<double>(), lda, B64.data<double>(), ldb, beta,
                                    want.data<double>(), ldc);
        kernels::sgemm_avx2::sgemm_unpacked(ta, tb, M, N, K, 0.5f, A.data<float>(), lda, B.data<float>(), ldb, beta,
                                            C.data<float>(), ldc);
        INFO("ta=" << ta << " tb=" << tb << " beta=" << beta);
        CHECK(max_abs_diff(C.to(float64), want) < 1e-5 * (K + 1));
      }
}
#endif

TEST_CASE("gemm_tri skips a zero triangle of op(A) or an unneeded triangle of C and matches gemm where it counts") {
  // Causal attention's products (kernels/attention.h): S = q k^T and dP = dY v^T need only C's lower
  // triangle (lower_c); P v and dS k have op(A) zero above the diagonal (lower_a); P^T dY and
  // dS^T q have it zero below (upper_a). T = 800 takes K past one 768-deep block (two of 400),
  // so a tile's triangle ends inside the second block; 13 and 70 leave ragged tiles on the diagonal. (Builds
  // without the AVX2 kernel make the whole product, so there the two calls agree trivially.)
  each_isa(kProducts, [&](kernels::Isa) {
    using kernels::Tri;
    const int before = get_num_threads();
    set_num_threads(1);
    Generator g(45);
    for (int Tn : {1, 13, 64, 70, 300, 800})
      for (int hs : {8, 32})
        for (float beta : {0.0f, 1.0f}) {
          INFO("T=" << Tn << " hs=" << hs << " beta=" << beta);
          // lower_c: C (T, T) = q k^T, only j <= i compared; the rest must not be read.
          {
            Tensor q = randn({Tn, hs}, float32, &g), k = randn({Tn, hs}, float32, &g);
            Tensor C0 = randn({Tn, Tn}, float32, &g), C = C0.clone(), R = C0.clone();
            kernels::gemm_tri<float>(Tri::lower_c, false, true, Tn, Tn, hs, 1.0f, q.data<float>(), hs, k.data<float>(),
                                     hs, beta, C.data<float>(), Tn);
            kernels::gemm<float>(false, true, Tn, Tn, hs, 1.0f, q.data<float>(), hs, k.data<float>(), hs, beta,
                                 R.data<float>(), Tn);
            double worst = 0;
            for (int i = 0; i < Tn; ++i)
              for (int j = 0; j <= i; ++j)
                worst = std::max(worst, std::fabs(double(C.data<float>()[i * Tn + j]) - R.data<float>()[i * Tn + j]));
            CHECK(worst == 0.0);
          }
          // lower_a / upper_a: op(A) (T, T) triangular, B (T, hs); the whole C compared.
          for (Tri tri : {Tri::lower_a, Tri::upper_a})
            for (bool ta : {false, true}) {
              Tensor P = randn({Tn, Tn}, float32, &g);
              float* pd = P.data<float>();
              for (int i = 0; i < Tn; ++i)  // op(A)(i, k) = ta ? P(k, i) : P(i, k)
                for (int k = 0; k < Tn; ++k) {
                  const bool zero = tri == Tri::lower_a ? k > i : k < i;
                  if (zero) pd[ta ? k * Tn + i : i * Tn + k] = 0.0f;
                }
              Tensor B = randn({Tn, hs}, float32, &g), C0 = randn({Tn, hs}, float32, &g);
              Tensor C = C0.clone(), R = C0.clone();
              kernels::gemm_tri<float>(tri, ta, false, Tn, hs, Tn, 1.0f, pd, Tn, B.data<float>(), hs, beta,
                                       C.data<float>(), hs);
              kernels::gemm<float>(ta, false, Tn, hs, Tn, 1.0f, pd, Tn, B.data<float>(), hs, beta, R.data<float>(), hs);
              CHECK(max_abs_diff(C, R) == 0.0);
            }
        }
    set_num_threads(before);
  });
}

TEST_CASE("each instruction set runs its own tile: gemm_tri's lower_c leaves exactly the tiles above the diagonal") {
  // lower_c leaves the elements of C in tiles wholly above the diagonal as they were (kernels/gemm.h):
  // which elements those are shows the tile in use, 6 x 16 for avx2, 14 x 32 or 8 x 48 for avx512
  // (tiles start at multiples of their size); portable makes the whole product.
  const int before = get_num_threads();
  set_num_threads(1);
  Generator g(48);
  each_isa(kProducts, [&](kernels::Isa level) {
    const auto [MR, NR] = product_tile(level);
    const int T = 70, hs = 8;
    Tensor q = randn({T, hs}, float32, &g), k = randn({T, hs}, float32, &g), C = full({T, T}, 7.0, float32);
    kernels::gemm_tri<float>(kernels::Tri::lower_c, false, true, T, T, hs, 1.0f, q.data<float>(), hs, k.data<float>(),
                             hs, 0.0f, C.data<float>(), T);
    int wrong = 0;
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) {
        bool skipped = false;  // portable (MR = 0): OpenBLAS makes the whole product
        if (MR > 0) {
          const int r = i / MR * MR, last = std::min(r + MR, T) - 1;
          skipped = j / NR * NR > last;
        }
        wrong += (C.data<float>()[i * T + j] == 7.0f) != skipped;
      }
    CHECK(wrong == 0);
  });
  set_num_threads(before);
}

TEST_CASE("gemm_pair computes two products side by side as two gemm calls would, any team size") {
  // The team is cut in two in proportion to the products' work (kernels/gemm.cpp); each part
  // splits its product again when it has several threads. Products of equal and unequal work,
  // one too small to split (run after the other on the whole team), beta 0 and 1.
  each_isa(kProducts, [&](kernels::Isa) {
    const int before = get_num_threads();
    Generator g(31);
    struct P {
      bool ta, tb;
      int M, N, K;
    };
    const std::vector<std::pair<P, P>> pairs = {{{false, false, 200, 48, 96}, {true, false, 96, 48, 200}},
                                                {{false, true, 300, 64, 40}, {false, false, 20, 33, 64}},
                                                {{true, true, 64, 257, 50}, {false, false, 129, 129, 129}},
                                                {{false, false, 3, 5, 7}, {true, false, 160, 160, 160}}};
    for (int threads : {1, 2, 3, 4}) {
      set_num_threads(threads);
      for (const auto& [p, q] : pairs)
        for (double beta : {0.0, 1.0}) {
          auto make = [&](const P& s, std::vector<Tensor>& keep) {
            keep = {randn({s.ta ? s.K : s.M, s.ta ? s.M : s.K}, float64, &g),
                    randn({s.tb ? s.N : s.K, s.tb ? s.K : s.N}, float64, &g), randn({s.M, s.N}, float64, &g)};
            keep.push_back(keep[2].clone());  // the reference's C
            keep.push_back(keep[2].to(float32));  // C for the float32 pair
            keep.push_back(keep[0].to(float32));
            keep.push_back(keep[1].to(float32));
            kernels::gemm_naive<double>(s.ta, s.tb, s.M, s.N, s.K, 0.75, keep[0].data<double>(), keep[0].size(1),
                                        keep[1].data<double>(), keep[1].size(1), beta, keep[3].data<double>(), s.N);
            return kernels::Gemm<double>{s.ta, s.tb, s.M, s.N, s.K, 0.75, keep[0].data<double>(), keep[0].size(1),
                                         keep[1].data<double>(), keep[1].size(1), beta, keep[2].data<double>(), s.N};
          };
          std::vector<Tensor> kp, kq;
          const auto gp = make(p, kp);
          const auto gq = make(q, kq);
          kernels::gemm_pair(gp, gq);
          INFO("threads=" << threads << " p " << p.M << "x" << p.N << "x" << p.K << " q " << q.M << "x" << q.N << "x"
                          << q.K << " beta=" << beta);
          CHECK(max_abs_diff(kp[2], kp[3]) < 1e-11);
          CHECK(max_abs_diff(kq[2], kq[3]) < 1e-11);
          // float32: on AVX2 builds the team's own pair (kernels/sgemm_avx2.cpp: each part of the team
          // on its own product, then on what is left of the other's).
          auto f32 = [&](const P& s, std::vector<Tensor>& keep) {
            return kernels::Gemm<float>{s.ta, s.tb, s.M, s.N, s.K, 0.75f, keep[5].data<float>(), keep[5].size(1),
                                        keep[6].data<float>(), keep[6].size(1), static_cast<float>(beta),
                                        keep[4].data<float>(), s.N};
          };
          kernels::gemm_pair(f32(p, kp), f32(q, kq));
          CHECK(max_abs_diff(kp[4].to(float64), kp[3]) < 1e-5 * (p.K + 1));
          CHECK(max_abs_diff(kq[4].to(float64), kq[3]) < 1e-5 * (q.K + 1));
        }
    }
    // A Linear's backward pairs dx and dw: at a size that is split, against the composite matmul's
    // gradients; and linear(a, a), where both products write one gradient, in turn.
    set_num_threads(2);
    Tensor x = param64({256, 96}, 41), w = param64({80, 96}, 42);
    Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    Tensor dy = randn({256, 80}, float64, &g);
    linear(x, w).backward(dy);
    matmul(x2, w2, false, true).backward(dy);
    CHECK(max_abs_diff(x.grad(), x2.grad()) < 1e-11);
    CHECK(max_abs_diff(w.grad(), w2.grad()) < 1e-11);
    Tensor a = param64({128, 128}, 43), a2 = a.detach().clone().requires_grad_();
    Tensor da = randn({128, 128}, float64, &g);
    linear(a, a).backward(da);
    matmul(a2, a2, false, true).backward(da);
    CHECK(max_abs_diff(a.grad(), a2.grad()) < 1e-11);
    set_num_threads(before);
  });
}

TEST_CASE("matmul forward matches the naive reference: 2-D, batched, folded, transposed") {
  Generator g(4);
  for (DType dt : {float32, float64}) {
    const double tol = dt == float32 ? 1e-4 : 1e-12;
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Tensor a = randn(ta ? Shape{3, 2, 4, 5} : Shape{3, 2, 5, 4}, dt, &g);  // op(a): (3, 2, 5, 4)
        Tensor b3 = randn(tb ? Shape{3, 2, 6, 4} : Shape{3, 2, 4, 6}, dt, &g);
        Tensor b2 = randn(tb ? Shape{6, 4} : Shape{4, 6}, dt, &g);
        INFO("dtype=" << dt << " ta=" << ta << " tb=" << tb);
        CHECK(max_abs_diff(matmul(a, b3, ta, tb).to(float64), naive_matmul(a, b3, ta, tb)) < tol);
        CHECK(max_abs_diff(matmul(a, b2, ta, tb).to(float64), naive_matmul(a, b2, ta, tb)) < tol);
      }
  }
  Tensor x = tensor({1, 2, 3, 4}, {2, 2}, float64);
  Tensor y = tensor({5, 6, 7, 8}, {2, 2}, float64);
  CHECK(matmul(x, y).to_vector<double>() == std::vector<double>{19, 22, 43, 50});
  CHECK(matmul(x, y, true, false).to_vector<double>() == std::vector<double>{26, 30, 38, 44});
}

TEST_CASE("matmul broadcasts batch dims") {
  Generator g(5);
  Tensor a = randn({2, 1, 3, 4}, float64, &g);
  Tensor b = randn({5, 4, 2}, float64, &g);
  Tensor c = matmul(a, b);
  REQUIRE(c.shape() == Shape{2, 5, 3, 2});
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 5; ++j) {
      Tensor ref = matmul(slice(a, 0, i, i + 1).reshape({3, 4}), slice(b, 0, j, j + 1).reshape({4, 2}));
      Tensor got = slice(slice(c, 0, i, i + 1), 1, j, j + 1).reshape({3, 2});
      CHECK(max_abs_diff(ref, got) < 1e-12);
    }
}

TEST_CASE("matmul gradients pass gradcheck in every layout") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("ta=" << ta << " tb=" << tb);
      auto f = [ta, tb](const std::vector<Tensor>& in) { return matmul(in[0], in[1], ta, tb); };
      // 2-D
      tgtest::require_gradcheck(f, {tgtest::param64(ta ? Shape{4, 3} : Shape{3, 4}, 1), tgtest::param64(tb ? Shape{5, 4} : Shape{4, 5}, 2)});
      // batched, same batch
      tgtest::require_gradcheck(f, {tgtest::param64(ta ? Shape{2, 4, 3} : Shape{2, 3, 4}, 3), tgtest::param64(tb ? Shape{2, 5, 4} : Shape{2, 4, 5}, 4)});
      // batched a with a shared 2-D b (the folded single-gemm path when !ta)
      tgtest::require_gradcheck(f, {tgtest::param64(ta ? Shape{2, 4, 3} : Shape{2, 3, 4}, 5), tgtest::param64(tb ? Shape{5, 4} : Shape{4, 5}, 6)});
      // broadcast on both sides: gradients summed over the broadcast batch entries
      tgtest::require_gradcheck(f, {tgtest::param64(ta ? Shape{2, 1, 4, 3} : Shape{2, 1, 3, 4}, 7), tgtest::param64(tb ? Shape{3, 5, 4} : Shape{3, 4, 5}, 8)});
    }
}

TEST_CASE("matmul with an empty inner dimension gives zeros") {
  Tensor a = zeros({3, 0}, float64), b = zeros({0, 2}, float64);
  Tensor c = matmul(a, b);
  CHECK(c.shape() == Shape{3, 2});
  for (double v : c.to_vector<double>()) CHECK(v == 0.0);
}

TEST_CASE("matmul argument errors name the op and both shapes") {
  REQUIRE_TG_ERROR(matmul(zeros({12, 64, 128}), zeros({96, 384})), "matmul: inner dimensions differ: (12, 64, 128) @ (96, 384)");
  REQUIRE_TG_ERROR(matmul(zeros({3}), zeros({3, 2})), "matmul", "at least 2 dims", "(3,)");
  REQUIRE_TG_ERROR(matmul(zeros({2, 3, 4}), zeros({3, 4, 5})), "matmul", "batch", "(2, 3, 4)", "(3, 4, 5)");
  REQUIRE_TG_ERROR(matmul(zeros({2, 2}), zeros({2, 2}, float64)), "matmul", "float32", "float64");
  REQUIRE_TG_ERROR(matmul(zeros({2, 2}, int32), zeros({2, 2}, int32)), "matmul", "int32");
}

TEST_CASE("linear = x w^T + b: values against matmul + add, gradients by gradcheck, bias optional") {
  Generator g(21);
  for (Shape xs : {Shape{5}, Shape{3, 5}, Shape{2, 3, 5}, Shape{70, 5}}) {
    INFO("x " << xs);
    Tensor x = randn(xs, float64, &g), w = randn({4, 5}, float64, &g), b = randn({4}, float64, &g);
    Tensor want = matmul(xs.ndim() == 1 ? x.reshape({1, 5}) : x, w, false, true) + b;
    Shape ys = xs;
    ys[ys.ndim() - 1] = 4;
    CHECK(linear(x, w, b).shape() == ys);
    CHECK(max_abs_diff(linear(x, w, b), want.reshape(ys)) < 1e-12);
    CHECK(max_abs_diff(linear(x, w), (want - b).reshape(ys)) < 1e-12);
  }
  auto with_bias = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  auto no_bias = [](const std::vector<Tensor>& in) { return linear(in[0], in[1]); };
  tgtest::require_gradcheck(with_bias, {param64({2, 3, 5}, 1), param64({4, 5}, 2), param64({4}, 3)});
  tgtest::require_gradcheck(with_bias, {param64({5}, 4), param64({4, 5}, 5), param64({4}, 6)});
  tgtest::require_gradcheck(no_bias, {param64({3, 5}, 7), param64({4, 5}, 8)});
  // float32 (the gemm's beta = 1 path over a bias-filled output) against float64
  Tensor x = randn({70, 33}, float64, &g), w = randn({40, 33}, float64, &g), b = randn({40}, float64, &g);
  CHECK(max_abs_diff(linear(x.to(float32), w.to(float32), b.to(float32)).to(float64), linear(x, w, b)) < 1e-4);
}

TEST_CASE("linear accumulates gradients into used-twice inputs, handles in = 0, and names the op in errors") {
  // x feeds linear twice: the second backward contribution is added (beta = 1), as is b's.
  Tensor x = param64({3, 5}, 1), w = param64({4, 5}, 2), b = param64({4}, 3);
  Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_(), b2 = b.detach().clone().requires_grad_();
  (linear(x, w, b) * 2.0 + linear(x, w, b)).sum().backward();
  (matmul(x2, w2, false, true) * 3.0 + b2 * 3.0).sum().backward();
  CHECK(max_abs_diff(x.grad(), x2.grad()) < 1e-12);
  CHECK(max_abs_diff(w.grad(), w2.grad()) < 1e-12);
  CHECK(max_abs_diff(b.grad(), b2.grad()) < 1e-12);
  // in = 0: the product is an empty sum, so y = b; x and w get empty gradients, b gets the rows' count
  Tensor xe = zeros({3, 0}).requires_grad_(), we = zeros({4, 0}).requires_grad_(), be = full({4}, 2.0, float32).requires_grad_();
  Tensor ye = linear(xe, we, be);
  CHECK(max_abs_diff(ye.to(float64), full({3, 4}, 2.0, float64)) == 0);
  CHECK(max_abs_diff(linear(xe, we).to(float64), zeros({3, 4}, float64)) == 0);
  ye.sum().backward();
  CHECK(max_abs_diff(be.grad().to(float64), full({4}, 3.0, float64)) == 0);
  CHECK(xe.grad().shape() == Shape{3, 0});
  // out = 0: an empty output, and x's gradient is zeros (nothing depends on x)
  Tensor xo = param64({3, 5}, 4), wo = zeros({0, 5}, float64).requires_grad_();
  Tensor yo = linear(xo, wo, zeros({0}, float64).requires_grad_());
  CHECK(yo.shape() == Shape{3, 0});
  (yo.sum() + xo.sum()).backward();
  CHECK(max_abs_diff(xo.grad(), full({3, 5}, 1.0, float64)) == 0);
  REQUIRE_TG_ERROR(linear(zeros({3, 5}), zeros({4, 6})), "linear", "(3, 5)");
  REQUIRE_TG_ERROR(linear(zeros({3, 5}), zeros({4, 5}), zeros({3})), "linear", "bias (4,)");
  REQUIRE_TG_ERROR(linear(zeros({3, 5}), zeros({4, 5}, float64)), "linear");
}
