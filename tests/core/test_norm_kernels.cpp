// The kernels the norm ops run (kernels/norms_fast.h, on rms_avx2.h's rows for RMSNorm's float32
// rows) against the reference loops of kernels/norms.h, at 1 to 3 threads and at every ISA level
// this CPU runs; and the float32 op against float64 on every RMSNorm row path.
//
// Tolerances, derived. u is T's unit roundoff (2^-24 for float, 2^-53 for double). Both sides take
// their statistics in double. The fast side computes the elementwise terms in T (at most about five
// roundings each, against the reference's one at the store), sums a row in 16 interleaved chains
// or, on the AVX2 path, in float inside chunks of 32 (about four roundings per term before the
// double sum), and sums the parameter gradients over blocks of 16 rows in T (up to 16 roundings
// per term). So each result is within K u S of the reference, S the magnitude of the terms that
// make it (computed from the data below: nothing cancels in S), with K = 8 for y, 16 for dx and
// 24 for dg and db; plus n u_double S where a double sum of n terms runs in another order.
// Where the arithmetic is the same (WeightNorm, BatchNorm's normalisation with given statistics),
// the results are the same bits.
#include <cmath>
#include <limits>
#include <random>

#include "helpers.h"
#include "isa_helpers.h"
#include "kernels/norms_fast.h"

using namespace tg;
using namespace tgtest;

namespace {

template <class T>
std::vector<T> randv(std::int64_t n, std::uint64_t seed, double sd, double mean = 0.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(mean, sd);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (T& e : v) e = static_cast<T>(d(rng));
  return v;
}
template <class T>
double maxdiff(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}
// K u S + n u_double S (above).
template <class T>
double tol(double K, double S, std::int64_t n) {
  return (K * std::numeric_limits<T>::epsilon() / 2 + static_cast<double>(n) * 0x1p-53) * S;
}
template <class T>
T* ptr(std::vector<T>& v) { return v.empty() ? nullptr : v.data(); }

// One shape of a row norm: x (rows, C), dy (rows, C), and gain / bias or none.
template <class T>
struct Rows {
  std::int64_t rows, C;
  std::vector<T> x, g, b, dy;
  Rows(std::int64_t r, std::int64_t c, bool with_gain, bool with_bias, std::uint64_t seed)
      : rows(r), C(c), x(randv<T>(r * c, seed, 1.5, 0.2)), dy(randv<T>(r * c, seed + 3, 1.0)) {
    if (with_gain) g = randv<T>(c, seed + 1, 0.5, 1.0);
    if (with_bias) b = randv<T>(c, seed + 2, 0.5);
  }
  double gain(std::int64_t j) const { return g.empty() ? 1.0 : static_cast<double>(g[static_cast<std::size_t>(j)]); }
  double bias(std::int64_t j) const { return b.empty() ? 0.0 : static_cast<double>(b[static_cast<std::size_t>(j)]); }
  std::size_t n() const { return static_cast<std::size_t>(rows * C); }
};

// Magnitudes S of the outputs: y's terms |xhat g| + |b|; dx's, per row, rho (max |g dy| + the
// statistic's term); dg's sum over rows of |dy xhat|; db's of |dy|. xhat(r, j) and the row factors
// come from the caller.
struct Mags {
  double y = 0, dx = 0, dg = 0, db = 0;
};
template <class T, class Xhat, class RowDx>
Mags magnitudes(const Rows<T>& d, Xhat&& xhat, RowDx&& row_dx) {
  Mags m;
  std::vector<double> sg(static_cast<std::size_t>(d.C)), sb(sg.size());
  for (std::int64_t r = 0; r < d.rows; ++r) {
    for (std::int64_t j = 0; j < d.C; ++j) {
      const double dyj = d.dy[static_cast<std::size_t>(r * d.C + j)];
      m.y = std::max(m.y, std::fabs(xhat(r, j) * d.gain(j)) + std::fabs(d.bias(j)));
      sg[static_cast<std::size_t>(j)] += std::fabs(dyj * xhat(r, j));
      sb[static_cast<std::size_t>(j)] += std::fabs(dyj);
    }
    m.dx = std::max(m.dx, row_dx(r));
  }
  for (std::size_t j = 0; j < sg.size(); ++j) m.dg = std::max(m.dg, sg[j]), m.db = std::max(m.db, sb[j]);
  return m;
}

template <class T>
void check_layer_norm(const Rows<T>& d) {
  const std::int64_t rows = d.rows, C = d.C;
  std::vector<T> y1(d.n()), y2(d.n()), rs1(static_cast<std::size_t>(rows)), rs2(rs1.size());
  std::vector<double> mu1(rs1.size()), mu2(rs1.size());
  const T *x = d.x.data(), *g = d.g.empty() ? nullptr : d.g.data(), *b = d.b.empty() ? nullptr : d.b.data();
  kernels::layer_norm_forward(x, g, b, y1.data(), mu1.data(), rs1.data(), rows, C, 1e-5);
  kernels::fast::layer_norm_forward(x, g, b, y2.data(), mu2.data(), rs2.data(), rows, C, 1e-5);
  auto xhat = [&](std::int64_t r, std::int64_t j) { return (d.x[static_cast<std::size_t>(r * C + j)] - mu1[static_cast<std::size_t>(r)]) * rs1[static_cast<std::size_t>(r)]; };
  auto row_dx = [&](std::int64_t r) {  // rstd (max |dxhat| + mean |dxhat| + max |xhat| mean |dxhat xhat|)
    double mx = 0, m1 = 0, m2 = 0, xm = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const double dxh = std::fabs(d.dy[static_cast<std::size_t>(r * C + j)] * d.gain(j));
      mx = std::max(mx, dxh), m1 += dxh / C, m2 += dxh * std::fabs(xhat(r, j)) / C, xm = std::max(xm, std::fabs(xhat(r, j)));
    }
    return rs1[static_cast<std::size_t>(r)] * (mx + m1 + xm * m2);
  };
  const Mags m = magnitudes(d, xhat, row_dx);
  CHECK(maxdiff(y1, y2) <= tol<T>(8, m.y, C));
  std::vector<T> dx1(d.n()), dx2(d.n()), dg1(static_cast<std::size_t>(C)), dg2(dg1.size()), db1(dg1.size()), db2(dg1.size());
  kernels::layer_norm_backward(x, g, mu1.data(), rs1.data(), d.dy.data(), dx1.data(), dg1.data(), db1.data(), rows, C);
  kernels::fast::layer_norm_backward(x, g, mu2.data(), rs2.data(), d.dy.data(), dx2.data(), dg2.data(), db2.data(), rows, C);
  CHECK(maxdiff(dx1, dx2) <= tol<T>(16, m.dx, C));
  CHECK(maxdiff(dg1, dg2) <= tol<T>(24, m.dg, rows));
  CHECK(maxdiff(db1, db2) <= tol<T>(24, m.db, rows));
}

// wants: dx, dg, db each wanted or null.
template <class T>
void check_rms_norm(const Rows<T>& d, std::int64_t k, bool want_dx = true, bool want_params = true) {
  const std::int64_t rows = d.rows, C = d.C;
  std::vector<T> y1(d.n()), y2(d.n()), rr1(static_cast<std::size_t>(rows)), rr2(rr1.size());
  const T *x = d.x.data(), *g = d.g.empty() ? nullptr : d.g.data(), *b = d.b.empty() ? nullptr : d.b.data();
  kernels::rms_norm_forward(x, g, b, y1.data(), rr1.data(), rows, C, k, 1e-5);
  kernels::fast::rms_norm_forward(x, g, b, y2.data(), rr2.data(), rows, C, k, 1e-5);
  auto xhat = [&](std::int64_t r, std::int64_t j) {
    return static_cast<double>(d.x[static_cast<std::size_t>(r * C + j)]) * rr1[static_cast<std::size_t>(r)];
  };
  auto row_dx = [&](std::int64_t r) {  // rho (max |g dy| + max |a rho| sum |g dy a rho| / k)
    double mx = 0, s = 0, xm = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const double gdy = std::fabs(d.dy[static_cast<std::size_t>(r * C + j)] * d.gain(j));
      mx = std::max(mx, gdy), s += gdy * std::fabs(xhat(r, j)), xm = std::max(xm, std::fabs(xhat(r, j)));
    }
    return rr1[static_cast<std::size_t>(r)] * (mx + xm * s / static_cast<double>(k));
  };
  const Mags m = magnitudes(d, xhat, row_dx);
  CHECK(maxdiff(y1, y2) <= tol<T>(8, m.y, k));
  const std::size_t nx = want_dx ? d.n() : 0, np = want_params ? static_cast<std::size_t>(C) : 0;
  std::vector<T> dx1(nx), dx2(nx), dg1(d.g.empty() ? 0 : np), dg2(dg1.size()), db1(np), db2(np);
  kernels::rms_norm_backward(x, g, rr1.data(), d.dy.data(), ptr(dx1), ptr(dg1), ptr(db1), rows, C, k);
  kernels::fast::rms_norm_backward(x, g, rr2.data(), d.dy.data(), ptr(dx2), ptr(dg2), ptr(db2), rows, C, k);
  CHECK(maxdiff(dx1, dx2) <= tol<T>(16, m.dx, C));
  CHECK(maxdiff(dg1, dg2) <= tol<T>(24, m.dg, rows));
  CHECK(maxdiff(db1, db2) <= tol<T>(24, m.db, rows));
}

template <class T>
void check_batch_norm(const Rows<T>& d) {
  const std::int64_t R = d.rows, C = d.C;
  std::vector<T> y1(d.n()), y2(d.n()), rs1(static_cast<std::size_t>(C)), rs2(rs1.size());
  std::vector<double> mu1(rs1.size()), mu2(rs1.size()), var1(rs1.size()), var2(rs1.size());
  const T *x = d.x.data(), *g = d.g.empty() ? nullptr : d.g.data(), *b = d.b.empty() ? nullptr : d.b.data();
  kernels::batch_norm_forward(x, g, b, y1.data(), mu1.data(), rs1.data(), var1.data(), R, C, 1e-5);
  kernels::fast::batch_norm_forward(x, g, b, y2.data(), mu2.data(), rs2.data(), var2.data(), R, C, 1e-5);
  auto xhat = [&](std::int64_t r, std::int64_t c) { return (d.x[static_cast<std::size_t>(r * C + c)] - mu1[static_cast<std::size_t>(c)]) * rs1[static_cast<std::size_t>(c)]; };
  double dx_mag = 0;  // per channel: rstd |g| (max |dy| + (sum |dy| + max |xhat| sum |dy xhat|) / R)
  for (std::int64_t c = 0; c < C; ++c) {
    double mx = 0, s1 = 0, s2 = 0, xm = 0;
    for (std::int64_t r = 0; r < R; ++r) {
      const double dyv = std::fabs(d.dy[static_cast<std::size_t>(r * C + c)]);
      mx = std::max(mx, dyv), s1 += dyv, s2 += dyv * std::fabs(xhat(r, c)), xm = std::max(xm, std::fabs(xhat(r, c)));
    }
    dx_mag = std::max(dx_mag, rs1[static_cast<std::size_t>(c)] * std::fabs(d.gain(c)) * (mx + (s1 + xm * s2) / R));
  }
  const Mags m = magnitudes(d, xhat, [](std::int64_t) { return 0.0; });
  CHECK(maxdiff(y1, y2) <= tol<T>(8, m.y, R));
  std::vector<T> dx1(d.n()), dx2(d.n()), dg1(static_cast<std::size_t>(C)), dg2(dg1.size()), db1(dg1.size()), db2(dg1.size());
  for (bool training : {true, false}) {
    kernels::batch_norm_backward(x, g, mu1.data(), rs1.data(), d.dy.data(), dx1.data(), dg1.data(), db1.data(), R, C, training);
    kernels::fast::batch_norm_backward(x, g, mu2.data(), rs2.data(), d.dy.data(), dx2.data(), dg2.data(), db2.data(), R, C,
                                       training);
    CHECK(maxdiff(dx1, dx2) <= tol<T>(16, dx_mag, R));
    CHECK(maxdiff(dg1, dg2) <= tol<T>(24, m.dg, R));
    CHECK(maxdiff(db1, db2) <= tol<T>(24, m.db, R));
  }
  // the normalisation with given statistics (training and eval): the same bits
  kernels::batch_norm_apply(x, g, b, y1.data(), mu1.data(), rs1.data(), R, C);
  kernels::fast::batch_norm_apply(x, g, b, y2.data(), mu1.data(), rs1.data(), R, C);
  CHECK(y1 == y2);
}

const std::vector<std::pair<std::int64_t, std::int64_t>> kShapes = {
    {1, 7}, {5, 16}, {37, 24}, {16, 8}, {300, 128}, {517, 70}, {64, 768}};  // 300 x 128 and up: split across threads

template <class F>
void at_threads(F&& body) {
  const int before = get_num_threads();
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    INFO("threads " << threads);
    body();
  }
  set_num_threads(before);
}

}  // namespace

TEST_CASE("the fast LayerNorm kernels equal the reference loops") {
  at_threads([] {
    std::uint64_t seed = 10;
    for (auto [rows, C] : kShapes)
      for (bool gain : {true, false})
        for (bool bias : {true, false}) {
          INFO("rows " << rows << " C " << C << " gain " << gain << " bias " << bias);
          check_layer_norm(Rows<float>(rows, C, gain, bias, seed));
          check_layer_norm(Rows<double>(rows, C, gain, bias, seed++));
        }
  });
}

TEST_CASE("the fast RMSNorm kernels equal the reference loops on every ISA path") {
  // float32 rows whose C and k are multiples of 8 take the AVX2 path at the avx2 level; 8192 x 512
  // floats (16 MiB) stream their outputs past the caches
  each_isa({kernels::Isa::portable, kernels::Isa::avx2}, [](kernels::Isa) {
    at_threads([] {
      std::uint64_t seed = 100;
      for (auto [rows, C] : kShapes)
        for (double p : {1.0, 0.5, 0.0625, 0.3})
          for (bool bias : {false, true}) {
            const std::int64_t k = prms_k(C, p);
            INFO("rows " << rows << " C " << C << " k " << k << " bias " << bias);
            check_rms_norm(Rows<float>(rows, C, true, bias, seed), k);
            check_rms_norm(Rows<double>(rows, C, true, bias, seed++), k);
          }
      check_rms_norm(Rows<float>(33, 200, false, false, 7), 200);       // no gain
      check_rms_norm(Rows<float>(40, 64, true, true, 8), 64, false);     // no dx
      check_rms_norm(Rows<float>(40, 64, true, true, 9), 64, true, false);  // no dg, db
    });
    check_rms_norm(Rows<float>(8192, 512, true, true, 11), 512);
  });
}

TEST_CASE("the fast BatchNorm kernels equal the reference loops") {
  at_threads([] {
    std::uint64_t seed = 200;
    for (auto [R, C] : kShapes)
      if (R > 1)
        for (bool affine : {true, false}) {
          INFO("R " << R << " C " << C << " affine " << affine);
          check_batch_norm(Rows<float>(R, C, affine, affine, seed));
          check_batch_norm(Rows<double>(R, C, affine, affine, seed++));
        }
  });
}

TEST_CASE("the fast WeightNorm kernels are the reference loops' bits") {
  at_threads([] {
    for (auto [rows, n] : kShapes) {
      INFO("rows " << rows << " n " << n);
      const auto v = randv<float>(rows * n, 1, 1.0), g = randv<float>(rows, 2, 0.5, 1.0), dw = randv<float>(rows * n, 3, 1.0);
      std::vector<float> w1(v.size()), w2(v.size()), nm1(g.size()), nm2(g.size()), dv1(v.size()), dv2(v.size()),
          dg1(g.size()), dg2(g.size());
      kernels::weight_norm_forward(v.data(), g.data(), w1.data(), nm1.data(), rows, n);
      kernels::fast::weight_norm_forward(v.data(), g.data(), w2.data(), nm2.data(), rows, n);
      CHECK(w1 == w2);
      CHECK(nm1 == nm2);
      kernels::weight_norm_backward(v.data(), g.data(), nm1.data(), dw.data(), dv1.data(), dg1.data(), rows, n);
      kernels::fast::weight_norm_backward(v.data(), g.data(), nm1.data(), dw.data(), dv2.data(), dg2.data(), rows, n);
      CHECK(dv1 == dv2);
      CHECK(dg1 == dg2);
    }
  });
}

TEST_CASE("float32 RMSNorm agrees with float64 on every row path: vector rows, streamed outputs, odd widths") {
  // Float32 rows whose width C and statistic length k are multiples of 8 take the AVX2 variant on a
  // CPU with AVX2 (kernels/rms_avx2.h: float sums in chunks of 32, outputs of 16 MiB and more
  // streamed past the caches); other widths, other builds and TAPEGRAD_ISA=portable the portable
  // loops; the test runs at both levels. Either way the float32 result must be the float64 one to
  // float32 accuracy: output, dx (alone, or added by the tape to a gradient another path passed
  // first), dg and db.
  const int before = get_num_threads();
  set_num_threads(2);
  struct Case {
    std::int64_t rows, C;
    double p;
    bool gain, bias, acc, dx;
    bool vec;  // the shape qualifies for the AVX2 variant (C and k multiples of 8; taken at the avx2 level)
  };
  const std::vector<Case> cases = {
      {64, 768, 1.0, true, false, false, true, true},    {64, 768, 0.0625, true, true, false, true, true},  // k = 48
      {33, 200, 1.0, true, true, true, true, true},      {5, 8, 1.0, false, false, false, true, true},      // C % 32 = 8
      {40, 100, 1.0, true, false, false, true, false},   {40, 768, 0.3, true, false, true, true, false},    // C; k = 231
      {300, 128, 1.0, true, true, false, false, true},   {7, 24, 0.5, true, false, true, true, false},      // no dx; k = 12
      {8192, 512, 1.0, true, false, false, true, true},  {8192, 512, 1.0, true, true, true, true, true}};  // 16 MiB: streamed
  each_isa({kernels::Isa::portable, kernels::Isa::avx2}, [&](kernels::Isa) {
    std::uint64_t seed = 900;
    for (const Case& c : cases) {
      INFO("rows " << c.rows << " C " << c.C << " p " << c.p << " gain " << c.gain << " bias " << c.bias << " acc "
                   << c.acc << " dx " << c.dx);
      Tensor x64 = param64({c.rows, c.C}, seed++, 1.5, 0.2).detach();
      Tensor g64 = c.gain ? param64({c.C}, seed++, 0.5, 1.0).detach() : Tensor();
      Tensor b64 = c.bias ? param64({c.C}, seed++).detach() : Tensor();
      Generator gen(seed++);
      const Tensor dy64 = randn({c.rows, c.C}, float64, &gen);
      const Tensor other = randn({c.rows, c.C}, float64, &gen);
      struct Out {
        Tensor y, x, g, b;
        bool streamable = false;  // the float32 output qualified for non-temporal stores
      };
      auto run = [&](DType dt) {
        Tensor x = x64.clone().to(dt).requires_grad_(c.dx);
        Tensor g = c.gain ? g64.to(dt).requires_grad_() : Tensor();
        Tensor b = c.bias ? b64.to(dt).requires_grad_() : Tensor();
        Tensor y = rms_norm(x, g, b, 1e-5, c.p);
        Tensor loss = sum(mul(y, dy64.to(dt)));
        // recorded after the norm, so its backward runs first and the norm's dx is added to it
        if (c.acc && c.dx) loss = add(loss, sum(mul(x, other.to(dt))));
        loss.backward();
        bool streamable = false;
#ifdef TG_RMS_AVX2
        if (dt == float32) streamable = kernels::rms_avx2::streamable(y.data<float>(), y.numel() * 4);
#endif
        return Out{y.detach().to(float64), c.dx ? x.grad().to(float64) : Tensor(),
                   c.gain ? g.grad().to(float64) : Tensor(), c.bias ? b.grad().to(float64) : Tensor(), streamable};
      };
      const Out r64 = run(float64), r32 = run(float32);
#ifdef TG_RMS_AVX2
      // The shapes meet the conditions their comments say (a changed condition would quietly move
      // them all to the portable loops at the avx2 level, which would still pass the comparisons).
      CHECK(kernels::rms_avx2::fits(c.C, prms_k(c.C, c.p)) == c.vec);
      // 16 MiB as a literal, not the kernel's constant: if the threshold moves, the streamed cases
      // stop streaming and this fails, instead of the test silently losing them.
      CHECK(r32.streamable == (c.rows * c.C * 4 >= (std::int64_t{16} << 20)));
#endif
      auto rel = [](const Tensor& a, const Tensor& ref) { return max_abs_diff(a, ref) / max(abs(ref)).item(); };
      CHECK(rel(r32.y, r64.y) <= 1e-6);
      if (c.dx) {
        CHECK(rel(r32.x, r64.x) <= 1e-5);
        if (c.acc) CHECK(max_abs_diff(r64.x, other) > 0.1);  // the norm's part is in there too
      }
      if (c.gain) CHECK(rel(r32.g, r64.g) <= 2e-6);
      if (c.bias) CHECK(rel(r32.b, r64.b) <= 2e-6);
    }
  });
  set_num_threads(before);
}

