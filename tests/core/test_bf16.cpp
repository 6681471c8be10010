// bfloat16: the rounding against an independent reference, the array conversion's paths, and the
// bf16 product (sgemm_bf16.h) against float64 references, its two paths and any thread count.
#include <omp.h>

#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "float_bits.h"
#include "kernels/bf16.h"
#include "kernels/isa.h"
#include "kernels/sgemm_bf16.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

using namespace tg::kernels;
using i64 = std::int64_t;

namespace {

using tgtest::bits_of;
using tgtest::from_bits;

// The rounding by its definition rather than by bit tricks: of the two bf16 on either side of x
// (x truncated, and the next one away from zero), the nearer, the one with an even last bit on a
// tie; past the largest finite bf16 the next one is infinity, valued 2^128 as IEEE's overflow rule
// has it. The distances are exact in double.
std::uint16_t reference_round(float x) {
  const std::uint32_t u = bits_of(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16), hi = static_cast<std::uint16_t>(lo + 1);
  if ((u & 0xFFFFu) == 0) return lo;
  auto value = [](std::uint16_t h) {  // magnitude of a bf16, 2^128 for the pattern after the largest
    const std::uint16_t m = h & 0x7FFF;
    return m == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(from_bits(std::uint32_t{m} << 16)));
  };
  const double ax = std::fabs(static_cast<double>(x)), dl = ax - value(lo), dh = value(hi) - ax;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

bool same_bits_or_nan(float a, float b) { return bits_of(a) == bits_of(b) || (std::isnan(a) && std::isnan(b)); }

// Runs body for each path of the bf16 kernels this CPU has (fast: the fused multiply-adds on
// AVX2 or AVX-512F, AVX512_BF16's vdpbf16ps, or AMX's tiles; else the scalar emulation), the
// level set in-process in turn, then restored.
template <class F>
void each_path(F&& body) {
  struct Restore {
    Isa level;
    ~Restore() { set_isa(level); }
  } restore{isa()};
  for (Isa level : {Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}) {
    if (!cpu_supports(level)) continue;
    set_isa(level);
    INFO("isa=" << isa_name(level));
    body(level >= Isa::avx2);
  }
}

using bf16_impl::Path;

// The paths that give the scalar emulation's bits, each with the level it runs at: the fused
// multiply-adds at AVX2 and at AVX-512F, and vdpbf16ps.
std::vector<std::pair<Path, Isa>> exact_paths() {
  std::vector<std::pair<Path, Isa>> out;
  for (auto [path, level] : {std::pair{Path::fma, Isa::avx2}, {Path::fma, Isa::avx512}, {Path::dpbf16, Isa::avx512_bf16}})
    if (cpu_supports(level)) out.emplace_back(path, level);
  return out;
}

// Specials and random floats of every magnitude, subnormals included.
std::vector<float> conversion_inputs(std::mt19937& g, i64 n) {
  const std::uint32_t specials[] = {0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007FFF, 0x00008000,
                                    0x00008001, 0x00018000, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x3F808000,
                                    0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
                                    0x7F800000, 0xFF800000, 0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000,
                                    0x7FA12345, 0xFFFFFFFF, 0x7F80FFFF};
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) {
    const std::uint32_t r = g();
    if (r % 4 == 0) v = from_bits(specials[g() % std::size(specials)]);
    else if (r % 4 == 1) v = from_bits(g() & 0x807FFFFFu);  // a subnormal (or zero)
    else v = from_bits(g());
  }
  return x;
}

}  // namespace

TEST_CASE("bf16 rounding: nearest even, NaN stays NaN, Inf, subnormals and overflow as the reference", "[bf16]") {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000, 0x3F80}, {0x3F808000, 0x3F80},  // tie, even stays
      {0x3F818000, 0x3F82}, {0x3F808001, 0x3F81},  // tie, odd rounds up; just above a tie
      {0x3F807FFF, 0x3F80}, {0xBF818000, 0xBF82},  // just below a tie; negative tie, odd
      {0x3FFFFFFF, 0x4000},                         // carries into the exponent
      {0x7F7FFFFF, 0x7F80}, {0xFF7FFFFF, 0xFF80},  // the largest floats round to infinity
      {0x7F7F8000, 0x7F80}, {0x7F7F7FFF, 0x7F7F},  // the overflow boundary: its tie goes to Inf
      {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},  // infinities
      {0x00000000, 0x0000}, {0x80000000, 0x8000},  // zeros keep their sign
      {0x00000001, 0x0000}, {0x00008000, 0x0000},  // subnormals: below and at a tie (even)
      {0x00008001, 0x0001}, {0x00018000, 0x0002},  // above a tie; tie, odd up
      {0x007FFFFF, 0x0080}, {0x807FFFFF, 0x8080},  // the largest subnormals round to FLT_MIN
      {0x00C08000, 0x00C0},                         // a normal tie near the bottom
      {0x7FC00000, 0x7FC0}, {0xFFC00000, 0xFFC0},  // quiet NaNs keep sign and payload's top
      {0x7F800001, 0x7FC0}, {0xFF800001, 0xFFC0},  // signalling NaNs, payload only below: quieted
      {0x7FA12345, 0x7FE1}, {0xFF812345, 0xFFC1},  // signalling NaNs, payload above: kept, quieted
      {0xFFFFFFFF, 0xFFFF},
  };
  for (const Case& c : cases) {
    INFO("input 0x" << std::hex << c.in);
    CHECK(to_bf16(from_bits(c.in)).bits == c.out);
    if (!std::isnan(from_bits(c.in))) CHECK(reference_round(from_bits(c.in)) == c.out);
  }
  // Every NaN: a NaN of the same sign, quiet, the top of the payload kept.
  std::mt19937 g(11);
  for (int i = 0; i < 100000; ++i) {
    const std::uint32_t u = (g() & 0x807FFFFFu) | 0x7F800000u;
    if ((u & 0x7FFFFF) == 0) continue;
    const std::uint16_t h = to_bf16(from_bits(u)).bits;
    INFO("input 0x" << std::hex << u);
    REQUIRE(std::isnan(to_float(bf16{h})));
    REQUIRE((h & 0x8000) == (u >> 16 & 0x8000));
    REQUIRE((h & 0x0040) != 0);
    REQUIRE((h | 0x0040) == ((u >> 16) | 0x0040));
  }
  // Random bit patterns (every exponent, subnormals included) against the reference.
  for (int i = 0; i < 1000000; ++i) {
    const float x = from_bits(g());
    if (std::isnan(x)) continue;
    INFO("input 0x" << std::hex << bits_of(x));
    REQUIRE(to_bf16(x).bits == reference_round(x));
  }
  // bf16 -> float is exact: every bf16 but NaN comes back unchanged.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float x = to_float(bf16{static_cast<std::uint16_t>(h)});
    if (std::isnan(x)) continue;
    REQUIRE(bits_of(x) == h << 16);
    REQUIRE(to_bf16(x).bits == h);
  }
}

TEST_CASE("bf16 array conversion equals the scalar one bit for bit, every length to 100, every path", "[bf16]") {
  std::mt19937 g(5);
  for (i64 n = 0; n <= 100; ++n)
    for (i64 offset : {0, 1, 7}) {
      const std::vector<float> x = conversion_inputs(g, n + offset);
      std::vector<bf16> want(static_cast<std::size_t>(n));
      for (i64 i = 0; i < n; ++i) want[i] = to_bf16(x[offset + i]);
      auto check = [&](const char* path, auto convert) {
        std::vector<bf16> y(static_cast<std::size_t>(n + 40), bf16{0xABCD});  // the tail must stay untouched
        convert(x.data() + offset, y.data() + 3, n);
        INFO(path << " n=" << n << " offset=" << offset);
        for (i64 i = 0; i < 3; ++i) REQUIRE(y[i].bits == 0xABCD);
        for (i64 i = 0; i < n; ++i) {
          INFO("i=" << i << " input 0x" << std::hex << bits_of(x[offset + i]));
          REQUIRE(y[3 + i].bits == want[i].bits);
        }
        for (i64 i = n + 3; i < n + 40; ++i) REQUIRE(y[i].bits == 0xABCD);
      };
      check("portable", bf16_impl::to_bf16_portable);
      if (cpu_has_avx512_bf16()) check("avx512_bf16", bf16_impl::to_bf16_avx512);
      if (cpu_supports(Isa::avx512)) check("avx512f", bf16_impl::to_bf16_avx512f);
      // to_float at each level (AVX-512F's to_float_avx512f at avx512 and above): exact, NaN too
      each_path([&](bool) {
        check("to_bf16", [](const float* s, bf16* d, i64 m) { to_bf16(s, d, m); });
        std::vector<float> back(static_cast<std::size_t>(n + 1), 7.0f);
        to_float(want.data(), back.data(), n);
        for (i64 i = 0; i < n; ++i) REQUIRE(bits_of(back[i]) == bits_of(to_float(want[i])));
        REQUIRE(back[n] == 7.0f);
      });
    }
  // A block holding one subnormal among normals, at every position of a 32-float block: the
  // instruction's flush must be undone in that lane only.
  for (int pos = 0; pos < 32; ++pos) {
    std::vector<float> x(32, 1.2345f);
    x[pos] = from_bits(0x00018000);
    std::vector<bf16> y(32);
    each_path([&](bool) {
      to_bf16(x.data(), y.data(), 32);
      for (int i = 0; i < 32; ++i) REQUIRE(y[i].bits == to_bf16(x[i]).bits);
    });
  }
}

namespace {

// A product's operands and C, float32, and the same operands as bf16.
struct Problem {
  bool ta, tb;
  i64 M, N, K, lda, ldb, ldc;
  float alpha, beta;
  std::vector<float> A, B, C;
  std::vector<bf16> Ah, Bh;
  float& a(i64 m, i64 k) { return ta ? A[k * lda + m] : A[m * lda + k]; }
  float& b(i64 k, i64 n) { return tb ? B[n * ldb + k] : B[k * ldb + n]; }
  GemmBf16 args(bool a_bf16, bool b_bf16, float* out) const {
    GemmBf16 g;
    g.ta = ta;
    g.tb = tb;
    g.M = M;
    g.N = N;
    g.K = K;
    g.alpha = alpha;
    g.beta = beta;
    g.A = a_bf16 ? Bf16Operand(Ah.data(), lda) : Bf16Operand(A.data(), lda);
    g.B = b_bf16 ? Bf16Operand(Bh.data(), ldb) : Bf16Operand(B.data(), ldb);
    g.C = out;
    g.ldc = ldc;
    return g;
  }
};

// Normal random operands; leading dimensions a little longer than the rows; C random, or NaN when
// beta = 0 (which must ignore it).
Problem make_problem(std::mt19937& g, bool ta, bool tb, i64 M, i64 N, i64 K, float alpha, float beta) {
  Problem p{ta, tb, M, N, K, (ta ? M : K) + 3, (tb ? K : N) + 5, N + 2, alpha, beta, {}, {}, {}, {}, {}};
  std::normal_distribution<float> nd;
  p.A.resize(static_cast<std::size_t>((ta ? K : M) * p.lda));
  p.B.resize(static_cast<std::size_t>((tb ? N : K) * p.ldb));
  p.C.resize(static_cast<std::size_t>(M * p.ldc));
  for (auto& v : p.A) v = nd(g);
  for (auto& v : p.B) v = nd(g);
  for (auto& v : p.C) v = beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : nd(g);
  p.Ah.resize(p.A.size());
  p.Bh.resize(p.B.size());
  to_bf16(p.A.data(), p.Ah.data(), static_cast<i64>(p.A.size()));
  to_bf16(p.B.data(), p.Bh.data(), static_cast<i64>(p.B.size()));
  return p;
}

// Checks C (the bf16 product of p) element by element:
//
// - against gemm_bf16_naive (the same bf16 operands, sums in double): the two differ only by the
//   float32 rounding of the sum. Each of the K + 1 multiply-adds of a K block (one more for an odd
//   K's padding) and each block's C = alpha acc + C rounds once, with relative error at most
//   u = 2^-24, so the sum is off by at most about (K + blocks + 3) u (|alpha| sum_k |a' b'| + |beta
//   C0|) (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1), and the reference's
//   final rounding adds u |C_ref|;
// - against the exact product of the float32 operands (in double): rounding each operand to bf16
//   (unit roundoff 2^-8: 8 significant bits) moves a product a b by at most (2^-7 + 2^-16) |a b|,
//   on top of the above.
void check_against_references(Problem& p, const std::vector<float>& C) {
  std::vector<float> ref = p.C;
  gemm_bf16_naive(p.args(false, false, ref.data()));
  for (i64 m = 0; m < p.M; ++m)
    for (i64 n = 0; n < p.N; ++n) {
      double exact = 0, abs_sum = 0, abs_sum_bf = 0;
      for (i64 k = 0; k < p.K; ++k) {
        const double a = p.a(m, k), b = p.b(k, n);
        exact += a * b;
        abs_sum += std::fabs(a * b);
        abs_sum_bf += std::fabs(static_cast<double>(to_float(to_bf16(p.a(m, k)))) * to_float(to_bf16(p.b(k, n))));
      }
      const double c0 = p.beta == 0.0f ? 0.0 : static_cast<double>(p.C[m * p.ldc + n]);
      const double got = C[m * p.ldc + n], want_bf = ref[m * p.ldc + n];
      const double want = p.alpha * exact + p.beta * c0;
      const double u = std::ldexp(1.0, -24), scale = std::fabs(p.alpha) * abs_sum_bf + std::fabs(p.beta * c0);
      // K / 256 + 2 bounds the number of K blocks for blocks of 256 or more
      const double tight = (p.K + p.K / 256 + 5) * u * scale + u * std::fabs(want_bf) + 1e-30;
      const double loose = (std::ldexp(1.0, -7) + std::ldexp(1.0, -16)) * std::fabs(p.alpha) * abs_sum + tight;
      INFO("C(" << m << ", " << n << ") = " << got << ", bf16 reference " << want_bf << ", exact " << want);
      REQUIRE(std::fabs(got - want_bf) <= tight);
      REQUIRE(std::fabs(got - want) <= loose);
    }
  // Padding between rows of C is never written.
  for (i64 m = 0; m < p.M; ++m)
    for (i64 n = p.N; n < p.ldc; ++n) REQUIRE(same_bits_or_nan(C[m * p.ldc + n], p.C[m * p.ldc + n]));
}

}  // namespace

TEST_CASE("bf16 product within the bf16 error bound of float64 references, every edge and transpose", "[bf16]") {
  // Edges of the 6 x 64 tile (M, N around 6 and 64; the 8 x 48 tile's in the bit-exact test
  // below), of a block of rows (192) and of K blocks (at most 1536, in pairs: odd K pads one half
  // pair; 3075 makes blocks of 1026, 1026 and 1023, or 1056, 1056 and 963 on AMX).
  const std::tuple<i64, i64, i64> shapes[] = {{1, 1, 1},      {6, 64, 2},    {5, 63, 3},     {7, 65, 4},
                                              {13, 129, 17},  {12, 65, 1535}, {7, 70, 1536},  {9, 66, 1537},
                                              {193, 66, 9},   {200, 40, 513}, {3, 200, 600},  {8, 70, 3075}};
  std::mt19937 g(21);
  each_path([&](bool) {
    for (auto [M, N, K] : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          const bool beta0 = g() % 2 == 0;
          Problem p = make_problem(g, ta, tb, M, N, K, 1.5f, beta0 ? 0.0f : -0.75f);
          for (int types = 0; types < 4; ++types) {  // A, B each float or bf16
            INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb << " types=" << types
                      << " beta=" << p.beta);
            std::vector<float> C = p.C;
            gemm_bf16(p.args(types & 1, types & 2, C.data()));
            check_against_references(p, C);
          }
        }
  });
}

TEST_CASE("bf16 product: K = 0, alpha = 0 and empty shapes give beta C without reading A or B", "[bf16]") {
  for (auto [K, alpha] : {std::pair<i64, float>{0, 1.0f}, {5, 0.0f}})
    for (float beta : {0.0f, 2.0f}) {
      std::vector<float> C = {1, 2, std::numeric_limits<float>::quiet_NaN(), 4};
      gemm_bf16<float, float>(false, false, 2, 2, K, alpha, nullptr, 5, nullptr, 2, beta, C.data(), 2);
      CHECK(C[0] == beta * 1);
      CHECK(C[1] == beta * 2);
      CHECK((beta == 0.0f ? C[2] == 0.0f : std::isnan(C[2])));
    }
  std::vector<float> C = {3};
  gemm_bf16<float, float>(false, false, 0, 1, 4, 1.0f, nullptr, 4, nullptr, 1, 0.0f, C.data(), 1);
  CHECK(C[0] == 3);
}

namespace {

// Operands whose products and partial sums lie around FLT_MIN = 2^-126 (where each multiply-add's
// flush to zero decides bits), among subnormal bf16 (read as zero), huge values (overflow to
// infinity), infinities and NaN: every rule of sgemm_bf16.h's arithmetic gets exercised.
void fill_hard(std::mt19937& g, std::vector<float>& x) {
  for (auto& v : x) {
    const std::uint32_t r = g() % 1000;
    const float sign = g() % 2 ? -1.0f : 1.0f;
    // A bf16 significand, often 1 (sums then land on FLT_MIN exactly, and tiny products decide
    // whether the result is tiny).
    const float m = g() % 2 ? 1.0f : 1.0f + static_cast<float>(g() % 128) / 128.0f;
    if (r < 700) v = sign * std::ldexp(m, -64 + static_cast<int>(g() % 3));
    else if (r < 900) v = sign * std::ldexp(m, -70 - static_cast<int>(g() % 20));
    else if (r < 950) v = sign * from_bits(g() & 0x007FFFFFu);
    else if (r < 970) v = sign * std::ldexp(m, 60 + static_cast<int>(g() % 8));
    else if (r < 972) v = sign * std::numeric_limits<float>::infinity();
    else if (r < 974) v = std::numeric_limits<float>::quiet_NaN();
    else v = sign * m;
  }
}

}  // namespace

TEST_CASE("bf16 product: the fused multiply-add paths and vdpbf16ps give the scalar emulation's bits", "[bf16]") {
  struct Restore {
    Isa level;
    ~Restore() { set_isa(level); }
  } restore{isa()};
  const auto paths = exact_paths();
  if (paths.empty()) {
    WARN("this CPU has neither AVX2 nor AVX512_BF16: only the scalar emulation runs");
    return;
  }
  std::mt19937 g(8);
  // {9, 141, 41}: a panel of 13 columns after two whole ones of 64 (45 after two of 48: columns
  // past the last 8 x 8 block); {17, 97, 49}: one row and one column past the 8 x 48 tile's whole
  // ones, odd K; the last: two K blocks
  const std::tuple<i64, i64, i64> shapes[] = {{7, 65, 33},  {13, 70, 300}, {6, 64, 2},   {24, 128, 257},
                                              {50, 200, 9}, {9, 141, 41},  {17, 97, 49}, {7, 66, 1601}};
  for (int hard = 0; hard < 2; ++hard)
    for (auto [M, N, K] : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          Problem p = make_problem(g, ta, tb, M, N, K, hard ? 1.0f : 0.5f, g() % 2 ? 0.0f : 1.25f);
          if (hard) {
            fill_hard(g, p.A);
            fill_hard(g, p.B);
            to_bf16(p.A.data(), p.Ah.data(), static_cast<i64>(p.A.size()));
            to_bf16(p.B.data(), p.Bh.data(), static_cast<i64>(p.B.size()));
          }
          for (int ops = 0; ops < 4; ++ops) {  // each operand float32 or bf16 (the packers' two sources)
            const bool a16 = ops & 1, b16 = ops & 2;
            std::vector<float> emulated = p.C;
            bf16_impl::gemm_bf16_single(p.args(a16, b16, emulated.data()), Path::emulated);
            for (auto [path, level] : paths) {
              set_isa(level);
              std::vector<float> got = p.C;
              bf16_impl::gemm_bf16_single(p.args(a16, b16, got.data()), path);
              INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb << " hard=" << hard
                        << " A bf16=" << a16 << " B bf16=" << b16 << " isa=" << isa_name(level));
              for (std::size_t i = 0; i < got.size(); ++i) {
                INFO("element " << i << ": path 0x" << std::hex << bits_of(got[i]) << ", emulated 0x"
                                << bits_of(emulated[i]));
                REQUIRE(same_bits_or_nan(got[i], emulated[i]));
              }
            }
          }
        }
}

TEST_CASE("bf16 product: gemm_bf16 takes the fastest path each instruction set allows", "[bf16]") {
  struct Restore {
    Isa level;
    ~Restore() { set_isa(level); }
  } restore{isa()};
  for (auto [level, want] : {std::pair{Isa::portable, Path::emulated}, {Isa::avx2, Path::fma}, {Isa::avx512, Path::fma},
                             {Isa::avx512_bf16, Path::dpbf16}, {Isa::amx_bf16, Path::amx}}) {
    if (!cpu_supports(level)) continue;
    set_isa(level);
    INFO("isa=" << isa_name(level));
    CHECK(bf16_impl::path_in_use() == want);
  }
}

#if defined(__x86_64__)
TEST_CASE("bf16 product: the caller's MXCSR is left as it was and does not change the fast paths' sums", "[bf16]") {
  struct Restore {
    Isa level;
    unsigned csr;
    ~Restore() {
      set_isa(level);
      _mm_setcsr(csr);
    }
  } restore{isa(), _mm_getcsr()};
  std::mt19937 g(31);
  // Small (one thread) and large (the team) products, alone and as a pair; alpha = 1 and beta = 0,
  // so the stores are exact and the sums alone decide (the stores round in the caller's mode).
  Problem p = make_problem(g, false, true, 13, 70, 300, 1.0f, 0.0f);
  Problem q = make_problem(g, true, false, 150, 130, 300, 1.0f, 0.0f);
  for (auto [path, level] : exact_paths()) {
    set_isa(level);
    INFO("isa=" << isa_name(level));
    std::vector<float> p0 = p.C, q0 = q.C, p1 = p.C, q1 = q.C, p2 = p.C, q2 = q.C;
    gemm_bf16(p.args(false, false, p0.data()));
    gemm_bf16(q.args(false, true, q0.data()));
    // Round toward zero, flush-to-zero off, the precision flag raised: a caller's own setting.
    const unsigned caller = (restore.csr & ~0xE040u) | 0x6000u | 0x20u;
    _mm_setcsr(caller);
    gemm_bf16(p.args(false, false, p1.data()));
    gemm_bf16(q.args(false, true, q1.data()));
    gemm_bf16_pair(p.args(false, false, p2.data()), q.args(false, true, q2.data()));
    const unsigned after = _mm_getcsr();
    _mm_setcsr(restore.csr);
    CHECK(after == caller);
    for (const auto* v : {&p1, &p2}) REQUIRE(std::memcmp(v->data(), p0.data(), p0.size() * 4) == 0);
    for (const auto* v : {&q1, &q2}) REQUIRE(std::memcmp(v->data(), q0.data(), q0.size() * 4) == 0);
  }
}
#endif

TEST_CASE("bf16 product: the same bits for 1, 2 and 3 threads, alone or as a pair", "[bf16]") {
  const int saved = omp_get_max_threads();
  struct Restore {
    int n;
    ~Restore() { omp_set_num_threads(n); }
  } restore{saved};
  std::mt19937 g(13);
  each_path([&](bool fast) {
    const i64 big = fast ? 1 : 0;  // the scalar emulation is slow: smaller shapes, still shared (2^21 multiply-adds)
    Problem p = make_problem(g, false, true, 150 + 250 * big, 130 + 200 * big, 300, 1.0f, 0.5f);
    // q's K makes two K blocks on the fast paths, the second of odd length (a pad row, which the
    // team's packing by slabs of rows writes on the fma path, in the slab that ends the block)
    Problem q = make_problem(g, true, false, 130 + 200 * big, 70 + 100 * big, 301 + 1500 * big, 2.0f, 0.0f);
    std::vector<float> p1, q1;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      INFO("threads=" << threads);
      std::vector<float> pc = p.C, qc = q.C, pp = p.C, qp = q.C;
      gemm_bf16(p.args(false, false, pc.data()));
      gemm_bf16(q.args(false, true, qc.data()));
      gemm_bf16_pair(p.args(false, false, pp.data()), q.args(false, true, qp.data()));
      if (threads == 1) {
        p1 = pc;
        q1 = qc;
      }
      REQUIRE(std::memcmp(pc.data(), p1.data(), pc.size() * 4) == 0);
      REQUIRE(std::memcmp(qc.data(), q1.data(), qc.size() * 4) == 0);
      REQUIRE(std::memcmp(pp.data(), p1.data(), pp.size() * 4) == 0);
      REQUIRE(std::memcmp(qp.data(), q1.data(), qp.size() * 4) == 0);
    }
  });
}

TEST_CASE("bf16 product: a multiply-add flushes to zero exactly when its result rounds below FLT_MIN", "[bf16]") {
  // One pair, acc = 0 + a1 b1 = +-FLT_MIN, then acc + a0 b0 with a tiny a0 b0 (sgemm_bf16.h: the
  // result is flushed when, rounded to 24 bits at unbounded exponent, it is below 2^-126; the
  // numbers just below 2^-126 are 2^-150 apart).
  struct Restore {
    Isa level;
    ~Restore() { set_isa(level); }
  } restore{isa()};
  struct Case {
    float a0, b0;
    bool flushed;
  };
  const float t = std::ldexp(1.0f, -75);
  const Case cases[] = {
      {-t, std::ldexp(1.0f, -76), false},                            // FLT_MIN - 2^-151: a tie, to the even FLT_MIN
      {-t * (1 + 0x1p-5f), std::ldexp(1.0f + 0x1p-4f, -76), true},  // just past the tie: tiny
      {-t, std::ldexp(1.0f, -77), false},                            // FLT_MIN - 2^-152: rounds to FLT_MIN
      {-t, std::ldexp(1.0f, -75), true},                             // FLT_MIN - 2^-150: representable, tiny
      {t, std::ldexp(1.0f, -75), false},                             // above FLT_MIN
      {-t, std::ldexp(1.0f, -52), true},                             // FLT_MIN / 2
  };
  for (const Case& c : cases)
    for (float sign : {1.0f, -1.0f}) {
      // 64 equal columns: a whole panel of the 6 x 64 tiles, a panel and a third of the 8 x 48 one.
      const float A[2] = {sign * c.a0, sign * std::ldexp(1.0f, -63)};
      std::vector<float> B(128);
      for (int j = 0; j < 64; ++j) {
        B[j] = c.b0;
        B[64 + j] = std::ldexp(1.0f, -63);
      }
      const float want = c.flushed ? sign * 0.0f : sign * FLT_MIN;
      auto paths = exact_paths();
      paths.emplace_back(Path::emulated, Isa::portable);
      for (auto [path, level] : paths) {
        set_isa(level);
        std::vector<float> C(64, 1.0f);
        const GemmBf16 g{false, false, 1, 64, 2, 1.0f, Bf16Operand(A, 2), Bf16Operand(B.data(), 64), 0.0f,
                         C.data(), 64};
        bf16_impl::gemm_bf16_single(g, path);
        INFO("a0 b0 = " << static_cast<double>(c.a0) * c.b0 << " sign " << sign << " isa " << isa_name(level));
        for (float v : C) REQUIRE(bits_of(v) == bits_of(want));
      }
    }
}
