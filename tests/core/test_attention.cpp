// scaled_causal_softmax and the fused causal attention (core/ops/attention.cpp) against their
// composite twins and finite differences; the tiled attention kernels (core/kernels/attention.h)
// against their naive reference at every tile edge, causal and not, across thread counts, and
// with bf16 operands within the bound that docs/attention.md derives.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>

#include "helpers.h"
#include "isa_helpers.h"
#include "kernels/attention.h"
#include "kernels/attention_dpbf16.h"
#include "kernels/bf16.h"
#include "kernels/sgemm_bf16.h"
#include "tapegrad/memory.h"

using namespace tg;
using namespace tgtest;

namespace {

using Shape4 = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;  // B, T, C, H
constexpr std::int64_t kTile = kernels::kAttnTile;

kernels::AttnDims dims(Shape4 s, bool causal, bool bf16 = false) {
  auto [B, T, C, H] = s;
  return {B, T, C, H, 1.0 / std::sqrt(static_cast<double>(C / H)), causal, bf16};
}

template <class T>
std::vector<T> values(const Shape& shape, std::uint64_t seed) {
  return param64(shape, seed).detach().to(std::is_same_v<T, float> ? float32 : float64).template to_vector<T>();
}

// y (B, T, C), lse (B, H, T), dqkv (B, T, 3C) of one kernel (flash or naive) on qkv and dy.
template <class T>
struct Outputs {
  std::vector<T> y, lse, dqkv;
};
template <class T>
Outputs<T> run_flash(const std::vector<T>& qkv, const std::vector<T>& dy, const kernels::AttnDims& d) {
  Outputs<T> o{std::vector<T>(dy.size(), T(7)), std::vector<T>(static_cast<std::size_t>(d.B * d.H * d.Tn), T(7)),
               std::vector<T>(qkv.size(), T(7))};  // 7: written over, whatever they held
  kernels::flash_attention_forward(qkv.data(), o.y.data(), o.lse.data(), d);
  if constexpr (std::is_same_v<T, float>)
    if (d.bf16) {  // y as the op keeps it under autocast: its bf16 copy
      std::vector<kernels::bf16> yb(o.y.size());
      kernels::to_bf16(o.y.data(), yb.data(), static_cast<std::int64_t>(yb.size()));
      kernels::flash_attention_backward(qkv.data(), yb.data(), o.lse.data(), dy.data(), o.dqkv.data(), d);
      return o;
    }
  kernels::flash_attention_backward(qkv.data(), o.y.data(), o.lse.data(), dy.data(), o.dqkv.data(), d);
  return o;
}
template <class T>
Outputs<double> run_naive(const std::vector<T>& qkv, const std::vector<T>& dy, const kernels::AttnDims& d) {
  const std::vector<double> q(qkv.begin(), qkv.end()), g(dy.begin(), dy.end());
  Outputs<double> o{std::vector<double>(dy.size()), std::vector<double>(static_cast<std::size_t>(d.B * d.H * d.Tn)),
                    std::vector<double>(qkv.size())};
  kernels::attention_naive_forward(q.data(), o.y.data(), o.lse.data(), d);
  kernels::attention_naive_backward(q.data(), g.data(), o.dqkv.data(), d);
  return o;
}

template <class T>
double max_diff(const std::vector<T>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// Shapes whose T puts rows on every side of the tile edges (1, Br - 1, Br, Br + 1, 2 Br + 3, ...)
// and head sizes that are no multiple of 8 or 16.
std::vector<Shape4> tile_edge_shapes() {
  return {{2, 1, 6, 2},  {1, kTile - 1, 10, 2}, {2, kTile, 5, 1},          {1, kTile + 1, 33, 1},
          {1, 2 * kTile + 3, 24, 3}, {2, 3 * kTile - 5, 17, 1}, {1, 150, 40, 2}};
}

}  // namespace

TEST_CASE("fused scaled causal softmax equals its composite twin") {
  Tensor a1 = param64({2, 3, 5, 5}, 4, 3.0), a2 = a1.detach().clone().requires_grad_();
  Tensor s1 = scaled_causal_softmax(a1, 0.7), s2 = composite::scaled_causal_softmax(a2, 0.7);
  CHECK(max_abs_diff(s1, s2) < 1e-12);
  Tensor ds = param64({2, 3, 5, 5}, 5).detach();
  s1.backward(ds);
  s2.backward(ds);
  CHECK(max_abs_diff(a1.grad(), a2.grad()) < 1e-12);
  CHECK(s1.at({0, 0, 0, 0}) == 1.0);  // the first query sees only itself
  CHECK(s1.at({1, 2, 1, 4}) == 0.0);  // masked future
}

TEST_CASE("scaled causal softmax: gradcheck and argument errors") {
  require_gradcheck([](auto& in) { return scaled_causal_softmax(in[0], 0.5); }, {param64({2, 4, 4}, 15)});
  REQUIRE_TG_ERROR(scaled_causal_softmax(zeros({2, 3}), 1.0), "scaled_causal_softmax", "(2, 3)");
}

TEST_CASE("fused causal attention equals the composite (split, permute, matmul, masked softmax)") {
  for (auto [B, T, C, H] : {Shape4{2, 5, 6, 2}, {1, 1, 4, 1}, {3, 7, 12, 3}, {2, 16, 32, 4}, {1, 37, 8, 2},
                            {2, 70, 24, 1}, {1, 2 * kTile + 3, 10, 2}}) {
    // T = 70 and 131: query tiles that see one, two and three key tiles, the last one partial.
    INFO("B " << B << " T " << T << " C " << C << " H " << H);
    Tensor a = param64({B, T, 3 * C}, static_cast<std::uint64_t>(B * 100 + T)), b = a.detach().clone().requires_grad_();
    Tensor y1 = causal_attention(a, H), y2 = composite::causal_attention(b, H);
    CHECK(max_abs_diff(y1, y2) < 1e-12);
    Tensor dy = param64({B, T, C}, 9).detach();
    y1.backward(dy);
    y2.backward(dy);
    CHECK(max_abs_diff(a.grad(), b.grad()) < 1e-12);
    // qkv's gradient already holds another path's part when the attention's backward runs (the
    // sum is recorded later, so it runs first): the attention's part is added to it, not written
    // over it.
    Tensor a2 = a.detach().clone().requires_grad_(), b2 = a.detach().clone().requires_grad_();
    Tensor z1 = (causal_attention(a2, H) * dy).sum() + (a2 * a2).sum();
    Tensor z2 = (composite::causal_attention(b2, H) * dy).sum() + (b2 * b2).sum();
    z1.backward();
    z2.backward();
    CHECK(max_abs_diff(a2.grad(), b2.grad()) < 1e-12);
  }
  // float32 agrees with float64 to float precision
  Tensor x = param64({2, 8, 24}, 4).detach();
  CHECK(max_abs_diff(causal_attention(x.to(float32), 4).to(float64), causal_attention(x, 4)) < 1e-5);
  REQUIRE_TG_ERROR(causal_attention(zeros({2, 3, 10}), 2), "causal_attention", "(2, 3, 10)");
  REQUIRE_TG_ERROR(causal_attention(zeros({2, 3, 12}), 3), "causal_attention", "n_head 3");
}

TEST_CASE("causal attention: float64 gradcheck within a tile and across tile edges") {
  require_gradcheck([](auto& in) { return causal_attention(in[0], 2); }, {param64({2, 4, 12}, 3)});
  // T = Br + 2: the second query tile's rows see a full key tile, then the diagonal one
  require_gradcheck([](auto& in) { return causal_attention(in[0], 1); }, {param64({1, kTile + 2, 6}, 13, 1.5)});
}

TEST_CASE("tiled attention kernels equal the naive reference at every tile edge, causal and not") {
  for (const Shape4& s : tile_edge_shapes())
    for (bool causal : {true, false}) {
      auto [B, T, C, H] = s;
      INFO("B " << B << " T " << T << " C " << C << " H " << H << (causal ? " causal" : " not causal"));
      const kernels::AttnDims d = dims(s, causal);
      const std::uint64_t seed = static_cast<std::uint64_t>(T * 10 + C);
      {
        const auto qkv = values<double>({B, T, 3 * C}, seed), dy = values<double>({B, T, C}, seed + 1);
        const Outputs<double> f = run_flash(qkv, dy, d), n = run_naive(qkv, dy, d);
        CHECK(max_diff(f.y, n.y) < 1e-12);
        CHECK(max_diff(f.lse, n.lse) < 1e-12);
        CHECK(max_diff(f.dqkv, n.dqkv) < 1e-11);
      }
      {  // float32 against the float64 sums of its own inputs
        const auto qkv = values<float>({B, T, 3 * C}, seed), dy = values<float>({B, T, C}, seed + 1);
        const Outputs<float> f = run_flash(qkv, dy, d);
        const Outputs<double> n = run_naive(qkv, dy, d);
        CHECK(max_diff(f.y, n.y) < 2e-6);
        CHECK(max_diff(f.lse, n.lse) < 2e-6);
        CHECK(max_diff(f.dqkv, n.dqkv) < 2e-5);
      }
    }
}

TEST_CASE("tiled attention backward, not causal: central differences of sum(dy * y)") {
  // The op is causal; the kernel's non-causal path gets its own finite-difference check (float64,
  // T across a tile edge).
  const Shape4 s{1, kTile + 3, 4, 2};
  auto [B, T, C, H] = s;
  const kernels::AttnDims d = dims(s, false);
  std::vector<double> qkv = values<double>({B, T, 3 * C}, 61);
  const std::vector<double> dy = values<double>({B, T, C}, 62);
  const Outputs<double> f = run_flash(qkv, dy, d);
  auto loss = [&] {
    std::vector<double> y(dy.size()), lse(static_cast<std::size_t>(B * H * T));
    kernels::flash_attention_forward(qkv.data(), y.data(), lse.data(), d);
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
    return l;
  };
  const double h = 1e-6;
  double worst = 0;
  for (std::size_t i = 0; i < qkv.size(); i += 7) {  // every seventh: all of q, k, v and both heads
    const double x0 = qkv[i];
    qkv[i] = x0 + h;
    const double up = loss();
    qkv[i] = x0 - h;
    const double down = loss();
    qkv[i] = x0;
    worst = std::max(worst, std::fabs((up - down) / (2 * h) - f.dqkv[i]));
  }
  INFO("largest difference " << worst);
  CHECK(worst < 1e-8);
  CHECK(*std::max_element(f.dqkv.begin(), f.dqkv.end()) > 0.01);  // gradients of some size
}

TEST_CASE("tiled attention: equal scores average v, rows across tile edges") {
  // q = 0: every score is 0, so y_i is the mean of v_0 .. v_i (causal) and lse_i = log(i + 1).
  const Shape4 s{1, kTile + 5, 2, 1};
  const kernels::AttnDims d = dims(s, true);
  const std::int64_t T = std::get<1>(s);
  std::vector<double> qkv(static_cast<std::size_t>(T * 6), 0.0), y(static_cast<std::size_t>(T * 2)), lse(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) qkv[static_cast<std::size_t>(t * 6 + 4)] = static_cast<double>(t);  // v = (t, 0)
  kernels::flash_attention_forward(qkv.data(), y.data(), lse.data(), d);
  for (std::int64_t i = 0; i < T; ++i) {
    CHECK(y[static_cast<std::size_t>(i * 2)] == Approx(i / 2.0).epsilon(1e-14));  // mean of 0 .. i
    CHECK(lse[static_cast<std::size_t>(i)] == Approx(std::log(i + 1.0)).epsilon(1e-14));
  }
}

// The attention's bf16 products take vdpbf16ps from isa avx512_bf16 on (attention_dpbf16.h), and
// float32 multiply-adds of the rounded operands below it: both paths, where the CPU has them.
const std::initializer_list<kernels::Isa> kAttnPaths = {kernels::Isa::portable, kernels::Isa::avx512_bf16};

TEMPLATE_TEST_CASE("attention's tile transpose equals the one-value-at-a-time loop at every block edge", "",
                   float, double) {
  using T = TestType;
  for (std::int64_t rows : {1, 7, 8, 9, 16, 63, 64})
    for (std::int64_t cols : {1, 5, 8, 12, 17, 64})
      for (bool bf16 : {false, true}) {
        if (bf16 && !std::is_same_v<T, float>) continue;  // bf16 operands are float32 only
        INFO("rows " << rows << " cols " << cols << (bf16 ? " bf16" : ""));
        const std::int64_t ld = cols + 3, ldo = rows + 5;  // neither a multiple of 8
        const std::vector<T> x = values<T>({rows, ld}, static_cast<std::uint64_t>(rows * 100 + cols));
        const T sentinel = static_cast<T>(-1234.5);
        std::vector<T> out(static_cast<std::size_t>(cols * ldo), sentinel);
        kernels::transpose_tile(bf16, x.data(), ld, rows, cols, out.data(), ldo);
        std::int64_t wrong = 0, touched = 0;
        for (std::int64_t c = 0; c < cols; ++c)
          for (std::int64_t r = 0; r < ldo; ++r) {
            const T got = out[static_cast<std::size_t>(c * ldo + r)];
            if (r >= rows) {
              touched += got != sentinel;  // past the rows: left alone
              continue;
            }
            T want = x[static_cast<std::size_t>(r * ld + c)];
            if constexpr (std::is_same_v<T, float>)
              if (bf16)
                want = std::bit_cast<float>(kernels::bf16_round_bits(std::bit_cast<std::uint32_t>(want)) & 0xFFFF0000u);
            wrong += std::bit_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(got) !=
                     std::bit_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(want);
          }
        CHECK(wrong == 0);
        CHECK(touched == 0);
      }
}

TEMPLATE_TEST_CASE("row_max equals a running maximum over the row, skipping NaN", "", float, double) {
  using T = TestType;
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  for (std::int64_t n = 0; n <= 70; ++n)
    for (int pattern = 0; pattern < 4; ++pattern) {
      INFO("n " << n << " pattern " << pattern);
      std::vector<T> x = values<T>({n + 1}, static_cast<std::uint64_t>(n * 7 + pattern));
      x.pop_back();
      // 1: NaN in every lane position once n passes 46 (every third value: j = 1, 4, 7, ... meets
      // every residue modulo 16 and 8), numbers in every lane too; 2: the largest value last (in
      // the scalar tail unless n is a multiple of the vector's width); 3: all -inf and NaN (the
      // maximum is -inf)
      for (std::int64_t j = 0; j < n; ++j) {
        if (pattern == 1 && j % 3 == 1) x[static_cast<std::size_t>(j)] = nan;
        if (pattern == 3) x[static_cast<std::size_t>(j)] = j % 2 ? nan : -inf;
      }
      if (pattern == 2 && n > 0) x[static_cast<std::size_t>(n - 1)] = 50;
      T want = -inf;
      for (const T v : x) want = v > want ? v : want;
      CHECK(kernels::row_max(x.data(), n) == want);
    }
}

TEST_CASE("tiled attention: the same bits at 1, 2 and 3 threads") {
  const int threads = get_num_threads();
  // hs = 256 with B H = 1: tile products large enough that a product alone could be split; hs = 15:
  // odd, a pair padded
  for (Shape4 s : {Shape4{2, 2 * kTile + 3, 48, 2}, {3, 70, 12, 3}, {1, kTile, 256, 1}, {2, 2 * kTile + 1, 30, 2}})
    for (bool causal : {true, false})
      for (bool bf16 : {false, true}) each_isa(kAttnPaths, [&](kernels::Isa level) {
        if (!bf16 && level != kernels::Isa::portable) return;  // float32 takes one path
        auto [B, T, C, H] = s;
        INFO("B " << B << " T " << T << " C " << C << " H " << H << (bf16 ? " bf16" : "") << (causal ? " causal" : ""));
        const auto qkv = values<float>({B, T, 3 * C}, 21), dy = values<float>({B, T, C}, 22);
        set_num_threads(1);
        const Outputs<float> one = run_flash(qkv, dy, dims(s, causal, bf16));
        for (int n : {2, 3}) {
          set_num_threads(n);
          const Outputs<float> many = run_flash(qkv, dy, dims(s, causal, bf16));
          CHECK(many.y == one.y);
          CHECK(many.lse == one.lse);
          CHECK(many.dqkv == one.dqkv);
        }
      });
  set_num_threads(threads);
}

TEST_CASE("tiled attention's two bf16 paths both run, and differ only in the last places") {
  if (!kernels::cpu_has_avx512_bf16()) {
    WARN("this CPU has no AVX512_BF16: only the float32 path of rounded operands runs");
    return;
  }
  const Shape4 s{2, 2 * kTile + 5, 30, 2};
  const auto qkv = values<float>({2, 2 * kTile + 5, 90}, 23), dy = values<float>({2, 2 * kTile + 5, 30}, 24);
  Outputs<float> f, v;
  {
    IsaScope scope(kernels::Isa::portable);
    f = run_flash(qkv, dy, dims(s, true, true));
  }
  {
    IsaScope scope(kernels::Isa::avx512_bf16);
    v = run_flash(qkv, dy, dims(s, true, true));
  }
  CHECK(f.y != v.y);  // vdpbf16ps sums in pairs: another order
  CHECK(f.dqkv != v.dqkv);
  // Both hold the same rounded operands: the sums differ by float32 roundings, far below bf16's.
  CHECK(max_diff(v.y, std::vector<double>(f.y.begin(), f.y.end())) < 1e-3);
  CHECK(max_diff(v.dqkv, std::vector<double>(f.dqkv.begin(), f.dqkv.end())) < 1e-3);
}

TEST_CASE("tiled attention refuses a bf16 qkv where no vdpbf16ps path would read it") {
  const Shape4 s{1, 5, 8, 2};
  const std::vector<kernels::bf16> qkv(5 * 24);
  std::vector<float> y(5 * 8), lse(2 * 5);
  IsaScope scope(kernels::Isa::portable);  // the float32 path: it reads qkv as floats only
  CHECK_THROWS_AS(kernels::flash_attention_forward(qkv.data(), y.data(), lse.data(), dims(s, true, true)),
                  std::logic_error);
}

TEST_CASE("causal attention keeps qkv, y and lse for its backward: nothing of size T x T") {
  const std::int64_t B = 2, T = 100, C = 16, H = 2;
  Tensor qkv = param64({B, T, 3 * C}, 31).detach().to(float32).requires_grad_();
  const std::size_t before = tape().bytes_saved();
  Tensor y = causal_attention(qkv, H);
  CHECK(tape().bytes_saved() - before == static_cast<std::size_t>((B * T * 3 * C + B * T * C + B * H * T) * 4));
  y.sum().backward();
  CHECK(qkv.grad().shape() == qkv.shape());
  // Under autocast qkv and y are kept as their bf16 copies (2 bytes an element); for qkv the
  // backward's bits are the float copy's, y gives D (the bound below). The output projection's
  // Linear keeps the same copy of y, not one of its own.
  Tensor y16, z;
  const Tensor w = param64({C, C}, 32).detach().to(float32).requires_grad_();
  const std::size_t before16 = tape().bytes_saved(), mem16 = memory_allocated();
  {
    AutocastGuard bf16;
    y16 = causal_attention(qkv, H);
    CHECK(tape().bytes_saved() - before16 == static_cast<std::size_t>((B * T * 3 * C + B * T * C) * 2 + B * H * T * 4));
    z = linear(y16, w);
  }
  y16 = Tensor();  // what is left: the nodes' copies of qkv and y, lse and z
  CHECK(memory_allocated() - mem16 ==
        static_cast<std::size_t>((B * T * 3 * C + B * T * C) * 2 + (B * H * T + B * T * C) * 4));
  tape().clear();
}

TEST_CASE("under autocast a Linear after attention shares the copy of y only while y is unchanged") {
  // An in-place write to y's memory after attention recorded it (through a detached handle: y
  // itself, made by a recorded op, refuses set) must not hand the Linear the stale copy: w's
  // gradient is the one of a Linear on the written y.
  const std::int64_t B = 1, T = 20, C = 16, H = 2;
  Tensor qkv = param64({B, T, 3 * C}, 33).detach().to(float32).requires_grad_();
  Tensor w = param64({C, C}, 34).detach().to(float32).requires_grad_();
  Tensor w_ref = w.detach().clone().requires_grad_();
  Tensor z, z_ref;
  {
    AutocastGuard bf16;
    Tensor y = causal_attention(qkv, H);
    y.detach().set({0, 3, 5}, 7.5);
    z = linear(y, w);
    z_ref = linear(y.detach().clone(), w_ref);
  }
  z.sum().backward();
  z_ref.sum().backward();
  CHECK(max_abs_diff(w.grad(), w_ref.grad()) == 0);
  CHECK(qkv.grad().shape() == qkv.shape());
}

TEST_CASE("causal attention on T = 0 and C = 0: empty outputs, zero gradients") {
  for (Shape s : {Shape{2, 0, 12}, Shape{2, 3, 0}}) {
    Tensor qkv = zeros(s, float64).requires_grad_();
    Tensor y = causal_attention(qkv, 2);
    CHECK(y.shape() == Shape{s[0], s[1], s[2] / 3});
    y.sum().backward();
    CHECK(qkv.grad().shape() == s);
    CHECK(qkv.grad().sum().item() == 0.0);
  }
}

// ---- bf16 operands (autocast) ----

namespace {

constexpr double kU = 1.0 / 256;  // bf16's unit roundoff: 8 significant bits, round to nearest

// The bound of docs/attention.md, element by element, for a bf16 kernel's y and dqkv against the
// exact result, from float64 quantities of the inputs. u2 = 2u + u^2 bounds the relative error of
// a product of two rounded operands; eps_i = u2 scale max_j sum_e |q_ie||k_je| bounds row i's
// score errors, which move each probability by a factor within exp(+-2 eps_i).
struct Bf16Bound {
  std::vector<double> y, dqkv;
};
Bf16Bound bf16_bound(const std::vector<float>& x, const std::vector<float>& dy, const kernels::AttnDims& d) {
  const std::int64_t Tn = d.Tn, C = d.C, hs = d.hs(), ld = 3 * C;
  const double u2 = 2 * kU + kU * kU, w = (1 + kU) * (1 + kU);
  Bf16Bound out{std::vector<double>(dy.size()), std::vector<double>(x.size())};
  auto X = [&](std::int64_t b, std::int64_t t, int part, std::int64_t h, std::int64_t e) {
    return static_cast<double>(x[static_cast<std::size_t>((b * Tn + t) * ld + part * C + h * hs + e)]);
  };
  auto G = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t e) {
    return static_cast<double>(dy[static_cast<std::size_t>((b * Tn + t) * C + h * hs + e)]);
  };
  auto dot = [&](auto&& f) {
    double s = 0;
    for (std::int64_t e = 0; e < hs; ++e) s += f(e);
    return s;
  };
  const std::size_t TT = static_cast<std::size_t>(Tn * Tn);
  std::vector<double> P(TT), dP(TT), dPb(TT), D(static_cast<std::size_t>(Tn)), eps(D.size()), dD(D.size());
  for (std::int64_t b = 0; b < d.B; ++b)
    for (std::int64_t h = 0; h < d.H; ++h) {
      auto at = [&](std::vector<double>& m, std::int64_t i, std::int64_t j) -> double& { return m[static_cast<std::size_t>(i * Tn + j)]; };
      for (std::int64_t i = 0; i < Tn; ++i) {  // P, dP, D and the score error eps
        const std::int64_t n = d.causal ? i + 1 : Tn;
        double mx = -INFINITY, l = 0, amax = 0;
        for (std::int64_t j = 0; j < Tn; ++j) at(P, i, j) = at(dP, i, j) = at(dPb, i, j) = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          at(P, i, j) = d.scale * dot([&](std::int64_t e) { return X(b, i, 0, h, e) * X(b, j, 1, h, e); });
          amax = std::max(amax, dot([&](std::int64_t e) { return std::fabs(X(b, i, 0, h, e) * X(b, j, 1, h, e)); }));
          mx = std::max(mx, at(P, i, j));
          at(dP, i, j) = dot([&](std::int64_t e) { return G(b, i, h, e) * X(b, j, 2, h, e); });
          at(dPb, i, j) = u2 * dot([&](std::int64_t e) { return std::fabs(G(b, i, h, e) * X(b, j, 2, h, e)); });
        }
        for (std::int64_t j = 0; j < n; ++j) l += (at(P, i, j) = std::exp(at(P, i, j) - mx));
        double Di = 0;
        for (std::int64_t j = 0; j < n; ++j) Di += (at(P, i, j) /= l) * at(dP, i, j);
        D[static_cast<std::size_t>(i)] = Di;
        eps[static_cast<std::size_t>(i)] = u2 * d.scale * amax;
      }
      for (std::int64_t i = 0; i < Tn; ++i) {  // y's bound, and D's through it: dy_i . round(y~_i)
        const double f = w * std::exp(2 * eps[static_cast<std::size_t>(i)]) - 1;
        double dDi = 0;
        for (std::int64_t e = 0; e < hs; ++e) {
          double s = 0;
          for (std::int64_t j = 0; j < Tn; ++j) s += at(P, i, j) * std::fabs(X(b, j, 2, h, e));
          out.y[static_cast<std::size_t>((b * Tn + i) * C + h * hs + e)] = f * s;
          dDi += std::fabs(G(b, i, h, e)) * (f + kU * (1 + f)) * s;  // |y~| <= (1 + f) s, rounded by u
        }
        dD[static_cast<std::size_t>(i)] = dDi;
      }
      for (std::int64_t i = 0; i < Tn; ++i)
        for (std::int64_t j = 0; j < Tn; ++j) {  // dS and P's errors carried to dq, dk and dv
          const auto ii = static_cast<std::size_t>(i);
          const double p = at(P, i, j), dp = p * (std::exp(2 * eps[ii]) - 1), c = at(dPb, i, j) + dD[ii];
          if (p == 0) continue;  // masked
          const double ds = d.scale * p * (at(dP, i, j) - D[ii]);
          const double dds = d.scale * (dp * (std::fabs(at(dP, i, j) - D[ii]) + c) + p * c);
          const double fs = dds * w + std::fabs(ds) * u2, fp = dp * w + p * u2;
          for (std::int64_t e = 0; e < hs; ++e) {
            auto o = [&](std::int64_t t, int part) -> double& {
              return out.dqkv[static_cast<std::size_t>((b * Tn + t) * ld + part * C + h * hs + e)];
            };
            o(i, 0) += fs * std::fabs(X(b, j, 1, h, e));
            o(j, 1) += fs * std::fabs(X(b, i, 0, h, e));
            o(j, 2) += fp * std::fabs(G(b, i, h, e));
          }
        }
    }
  return out;
}

// The largest |got - exact| / bound, the bound widened for float32's own rounding: sums of up to
// T products add at most T 2^-24 of the same magnitudes, 2^-16 T of the bf16 terms (2u = 2^-7).
double worst_ratio(const std::vector<float>& got, const std::vector<double>& exact, const std::vector<double>& bound,
                   std::int64_t Tn) {
  const double widen = 1 + std::ldexp(static_cast<double>(Tn + 16), -16);
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - exact[i]) / (bound[i] * widen + 1e-7));
  return worst;
}

}  // namespace

TEST_CASE("tiled attention with bf16 operands stays within the derived bound, causal and not") {
  for (const Shape4& s : {Shape4{2, 1, 6, 2}, {1, kTile + 1, 33, 1}, {1, 2 * kTile + 3, 24, 3}})
    for (bool causal : {true, false}) each_isa(kAttnPaths, [&](kernels::Isa) {
      auto [B, T, C, H] = s;
      INFO("B " << B << " T " << T << " C " << C << " H " << H << (causal ? " causal" : " not causal"));
      const auto qkv = values<float>({B, T, 3 * C}, 41), dy = values<float>({B, T, C}, 42);
      const Outputs<float> h = run_flash(qkv, dy, dims(s, causal, true)), f = run_flash(qkv, dy, dims(s, causal));
      const Outputs<double> n = run_naive(qkv, dy, dims(s, causal));
      const Bf16Bound bound = bf16_bound(qkv, dy, dims(s, causal));
      const double ry = worst_ratio(h.y, n.y, bound.y, T), rg = worst_ratio(h.dqkv, n.dqkv, bound.dqkv, T);
      INFO("worst error / bound: y " << ry << ", dqkv " << rg);
      CHECK(ry <= 1);
      CHECK(rg <= 1);
      CHECK(h.y != f.y);  // the operands are rounded: bf16 differs from float32
      CHECK(max_diff(h.lse, std::vector<double>(f.lse.begin(), f.lse.end())) < 0.1);
    });
}

// ---- the vdpbf16ps tile products (attention_dpbf16.h) ----

namespace {

// (rows, cols) values of both signs, every 7th a float subnormal (a bf16 read as zero) and every
// 11th about 2^-64 (products that flush to zero): vdpbf16ps's edges.
std::vector<float> dp_values(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  auto v = values<float>({rows, cols}, seed);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] *= i % 7 == 3 ? 0x1p-130f : i % 11 == 5 ? 0x1p-64f : 1.0f;
  return v;
}

std::vector<float> transposed(const std::vector<float>& x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(x.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) t[static_cast<std::size_t>(c * rows + r)] = x[static_cast<std::size_t>(r * cols + c)];
  return t;
}

std::vector<kernels::bf16> as_bf16(const std::vector<float>& x) {
  std::vector<kernels::bf16> h(x.size());
  kernels::to_bf16(x.data(), h.data(), static_cast<std::int64_t>(h.size()));
  return h;
}

// Words of A (M, K) and B (K, N), made from the row-major matrix or from its transpose, from
// floats or from their bf16 copies: each of the three word makers, both element types.
struct DpOperands {
  std::vector<std::uint32_t> A, B;
  std::int64_t si, sk, ldb;
};
template <class T>
DpOperands dp_operands(const std::vector<T>& a, const std::vector<T>& at, const std::vector<T>& b,
                       const std::vector<T>& bt, std::int64_t M, std::int64_t N, std::int64_t K, bool transposed_storage) {
  const std::int64_t ka = (K + 1) / 2;
  DpOperands o{std::vector<std::uint32_t>(static_cast<std::size_t>(M * ka)),
               std::vector<std::uint32_t>(static_cast<std::size_t>(ka * N)), 0, 0, N};
  if (transposed_storage) {  // A from A^T (K, M) down its columns; B from B^T (N, K) along its rows
    kernels::words_down_cols(at.data(), M, K, M, o.A.data(), M);
    o.si = 1, o.sk = M;
    kernels::words_along_rows_t(bt.data(), K, N, K, o.B.data(), N);
  } else {  // A along its rows; B down its columns
    kernels::words_along_rows(a.data(), K, M, K, o.A.data(), ka);
    o.si = ka, o.sk = 1;
    kernels::words_down_cols(b.data(), N, K, N, o.B.data(), N);
  }
  return o;
}

}  // namespace

TEST_CASE("attention's vdpbf16ps tile products give gemm_bf16's bits at every tile edge") {
  if (!kernels::cpu_has_avx512_bf16()) {
    WARN("this CPU has no AVX512_BF16: the vdpbf16ps tile products do not run");
    return;
  }
  IsaScope scope(kernels::Isa::avx512_bf16);
  // The last shape crosses the word makers' chunks of 512 values, in K and in N.
  std::vector<std::array<std::int64_t, 3>> shapes{{7, 530, 531}};
  for (std::int64_t M : {1, 5, 6, 7, 13, 64})
    for (std::int64_t N : {1, 15, 16, 17, 40, 64, 65})
      for (std::int64_t K : {1, 2, 7, 31, 64}) shapes.push_back({M, N, K});
  for (auto [M, N, K] : shapes) {
    const auto a = dp_values(M, K, 51 + M), b = dp_values(K, N, 52 + N), c0 = dp_values(M, N, 53);
    const auto at = transposed(a, M, K), bt = transposed(b, K, N);
    for (bool from_bf16 : {false, true})
      for (bool storage_t : {false, true})
        for (bool acc : {false, true}) {
          INFO("M " << M << " N " << N << " K " << K << (from_bf16 ? " bf16" : " float") << (storage_t ? " transposed" : "")
                    << (acc ? " C +=" : " C ="));
          const DpOperands o = from_bf16 ? dp_operands(as_bf16(a), as_bf16(at), as_bf16(b), as_bf16(bt), M, N, K, storage_t)
                                         : dp_operands(a, at, b, bt, M, N, K, storage_t);
          std::vector<float> got = c0, want = c0;
          kernels::tile_product_dpbf16(kernels::Tri::none, M, N, K, o.A.data(), o.si, o.sk, o.B.data(), o.ldb,
                                       got.data(), N, acc);
          kernels::GemmBf16 g;
          g.M = M, g.N = N, g.K = K, g.A = {a.data(), K}, g.B = {b.data(), N}, g.beta = acc ? 1.0f : 0.0f;
          g.C = want.data(), g.ldc = N;
          kernels::bf16_impl::gemm_bf16_single(g, kernels::bf16_impl::Path::emulated);  // the emulated path: vdpbf16ps's arithmetic
          CHECK(got == want);
        }
  }
}

TEST_CASE("attention's vdpbf16ps tile products skip only what the causal masks make zero or unneeded") {
  if (!kernels::cpu_has_avx512_bf16()) {
    WARN("this CPU has no AVX512_BF16: the vdpbf16ps tile products do not run");
    return;
  }
  IsaScope scope(kernels::Isa::avx512_bf16);
  using kernels::Tri;
  for (std::int64_t T : {1, 7, 17, 63, 64}) {
    INFO("T " << T);
    const std::int64_t ka = (T + 1) / 2;
    auto full = [&](Tri tri, const std::vector<float>& a, const std::vector<float>& b) {
      std::vector<std::uint32_t> A(static_cast<std::size_t>(T * ka)), B(static_cast<std::size_t>(ka * T));
      kernels::words_along_rows(a.data(), T, T, T, A.data(), ka);
      kernels::words_down_cols(b.data(), T, T, T, B.data(), T);
      std::vector<float> c(static_cast<std::size_t>(T * T), 7.0f);
      kernels::tile_product_dpbf16(tri, T, T, T, A.data(), ka, 1, B.data(), T, c.data(), T, false);
      return c;
    };
    const auto a = dp_values(T, T, 61), b = dp_values(T, T, 62);
    auto lower = a, upper = a;  // a(i, k) = 0 for k > i, and for k < i
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t k = 0; k < T; ++k) (k > i ? lower : upper)[static_cast<std::size_t>(i * T + k)] = k == i ? a[static_cast<std::size_t>(i * T + k)] : 0.0f;
    CHECK(full(Tri::lower_a, lower, b) == full(Tri::none, lower, b));
    CHECK(full(Tri::upper_a, upper, b) == full(Tri::none, upper, b));
    const auto some = full(Tri::lower_c, a, b), all = full(Tri::none, a, b);
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t j = 0; j <= i; ++j) CHECK(some[static_cast<std::size_t>(i * T + j)] == all[static_cast<std::size_t>(i * T + j)]);
  }
}

TEST_CASE("causal attention under autocast makes its products in bf16, forward and backward") {
  const Shape4 s{2, kTile + 9, 24, 2};
  auto [B, T, C, H] = s;
  const auto qkv = values<float>({B, T, 3 * C}, 51), dy = values<float>({B, T, C}, 52);
  const Outputs<float> want = run_flash(qkv, dy, dims(s, true, true));
  Tensor x = tensor(std::vector<double>(qkv.begin(), qkv.end()), {B, T, 3 * C}, float32).requires_grad_();
  Tensor y;
  {
    AutocastGuard bf16;
    y = causal_attention(x, H);
  }
  CHECK(y.dtype() == float32);  // the output stays float32
  CHECK(y.to_vector<float>() == want.y);
  y.backward(tensor(std::vector<double>(dy.begin(), dy.end()), {B, T, C}, float32));  // outside the scope
  CHECK(x.grad().to_vector<float>() == want.dqkv);
  // float64 is never rounded: autocast applies to float32 only
  Tensor x64 = x.detach().to(float64), plain = causal_attention(x64, H);
  AutocastGuard bf16;
  CHECK(max_abs_diff(causal_attention(x64, H), plain) == 0);
}
