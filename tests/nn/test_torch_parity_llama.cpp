// Parity with PyTorch for the LLaMA ops, against reference values that
// tests/fixtures/make_llama_fixtures.py computed with PyTorch 1.13 (tests/fixtures/llama_ops.json):
//   silu    F.silu, and its autograd gradient;
//   swiglu  F.silu(gate) * up over x.split(F, -1);
//   rope    the reference model's q * cos + rotate_half(q) * sin on the (B, H, T, hs) layout,
//           transposed back: a packed qkv with pos0 > 0 and v passed through, a (T, D) input, and
//           an odd half head size with theta 500000;
//   rope_tables  the reference's float32 cos and sin tables.
// Ops: the fused op and its composite twin in float64 against the float64 fixture, values and
// gradients, within 1e-12 of the values' size (max |diff| <= 1e-12 (1 + max |reference|)); the fused
// op in float32 against the same values within 1e-5 of their size (float32 rounding, and for rope
// float32 tables). Tables: float64 within 1e-15 of PyTorch's float64 ones; float32 within 1 ulp of
// PyTorch's float32 ones, element by element, and at least three quarters of them bit for bit (over
// 90% here: the angles are the same float32 numbers, and glibc's cosf / sinf and PyTorch's
// vectorised SLEEF ones round a few of them differently).
//
// Set TAPEGRAD_PARITY_REPORT=1 to print the largest difference seen per quantity.
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "fixtures.h"
#include "float_bits.h"
#include "helpers.h"

namespace {

using nlohmann::json;
using tgtest::from_json;

const json& fixtures() { return tgtest::fixture("llama_ops.json"); }

tg::Tensor leaf(const json& j, tg::DType d) { return tg::to(from_json(j), d).requires_grad_(); }

// got against the fixture tensor `want`: max |diff| <= tol (1 + max |want|).
void check_rel(const tg::Tensor& got, const json& want, double tol, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  const tg::Tensor ref = from_json(want);
  REQUIRE(got.shape() == ref.shape());
  const double scale = 1.0 + tg::max(tg::abs(ref)).item();
  const double d = tgtest::max_abs_diff(tg::to(got.detach(), tg::float64), ref) / scale;
  tgtest::note_parity(what, d);
  INFO("max |diff| / (1 + max |reference|) = " << d);
  CHECK(d <= tol);
}

constexpr double kTol64 = 1e-12, kTol32 = 1e-5;

// One unary op case (silu, swiglu): y and dx of fn on the fixture's x and dy, in dtype d.
void check_unary_case(const json& c, tg::DType d, const std::function<tg::Tensor(const tg::Tensor&)>& fn,
                      const std::string& what) {
  const double tol = d == tg::float64 ? kTol64 : kTol32;
  const std::string label = what + " " + tg::dtype_name(d);
  tg::Tensor x = leaf(c.at("x"), d);
  tg::Tensor y = fn(x);
  check_rel(y, c.at("y"), tol, label + " y");
  y.backward(tg::to(from_json(c.at("dy")), d));
  check_rel(x.grad(), c.at("dx"), tol, label + " dx");
}

// Signed distance in float32 ulps between two finite floats of any signs.
std::int64_t ulps(float a, float b) {
  auto key = [](float v) {
    const std::int64_t u = tgtest::bits_of(v);
    return u & 0x80000000 ? 0x80000000 - u : u;  // a monotone integer line through +-0
  };
  return key(a) - key(b);
}

}  // namespace

TEST_CASE("torch parity: the LLaMA fixture file is complete", "[torch]") {
  const json& f = fixtures();
  REQUIRE(f.at("silu").size() == 1);
  REQUIRE(f.at("swiglu").size() == 2);
  REQUIRE(f.at("rope").size() == 3);
  REQUIRE(f.at("rope_tables").size() == 3);
  // The cases cover what they are for: the far tails of SiLU, pos0 > 0 and rotated < D in RoPE.
  CHECK(from_json(f.at("silu")[0].at("x")).to_vector<double>()[0] == -100.0);
  bool partial = false, shifted = false;
  for (const json& c : f.at("rope")) {
    partial = partial || c.at("rotated").get<std::int64_t>() < c.at("x").at("shape").back().get<std::int64_t>();
    shifted = shifted || c.at("pos0").get<std::int64_t>() > 0;
  }
  CHECK(partial);
  CHECK(shifted);
}

TEST_CASE("torch parity: silu matches F.silu, value and gradient", "[torch]") {
  for (const json& c : fixtures().at("silu")) {
    const std::string name = c.at("name").get<std::string>();
    for (tg::DType d : tgtest::kFloatTypes) {
      SECTION("fused " + name + " " + tg::dtype_name(d)) {
        check_unary_case(c, d, [](const tg::Tensor& x) { return tg::silu(x); }, "silu");
      }
    }
    SECTION("composite " + name) {
      check_unary_case(c, tg::float64, [](const tg::Tensor& x) { return tg::composite::silu(x); }, "composite silu");
    }
  }
}

TEST_CASE("torch parity: swiglu matches F.silu(gate) * up, value and gradient", "[torch]") {
  for (const json& c : fixtures().at("swiglu")) {
    const std::string name = c.at("name").get<std::string>();
    for (tg::DType d : tgtest::kFloatTypes) {
      SECTION("fused " + name + " " + tg::dtype_name(d)) {
        check_unary_case(c, d, [](const tg::Tensor& x) { return tg::swiglu(x); }, "swiglu");
      }
    }
    SECTION("composite " + name) {
      check_unary_case(c, tg::float64, [](const tg::Tensor& x) { return tg::composite::swiglu(x); }, "composite swiglu");
    }
  }
}

TEST_CASE("torch parity: rope matches q * cos + rotate_half(q) * sin, value and gradient", "[torch]") {
  for (const json& c : fixtures().at("rope")) {
    const std::string name = c.at("name").get<std::string>();
    const auto hs = c.at("head_size").get<std::int64_t>(), rotated = c.at("rotated").get<std::int64_t>(),
               pos0 = c.at("pos0").get<std::int64_t>();
    const double theta = c.at("theta").get<double>();
    const tg::Tensor cos64 = from_json(c.at("cos")), sin64 = from_json(c.at("sin"));
    SECTION("float64 tables " + name) {
      auto [cos, sin] = tg::rope_tables(cos64.size(0), hs, theta, tg::float64);
      const double dc = tgtest::max_abs_diff(cos, cos64), ds = tgtest::max_abs_diff(sin, sin64);
      tgtest::note_parity("rope_tables float64", std::max(dc, ds));
      CHECK(dc <= 1e-15);
      CHECK(ds <= 1e-15);
    }
    SECTION("fused float64 " + name) {
      check_unary_case(c, tg::float64, [&](const tg::Tensor& x) { return tg::rope(x, cos64, sin64, hs, rotated, pos0); },
                       "rope");
    }
    SECTION("composite " + name) {
      check_unary_case(
          c, tg::float64,
          [&](const tg::Tensor& x) { return tg::composite::rope(x, cos64, sin64, hs, rotated, pos0); }, "composite rope");
    }
    SECTION("fused float32 with float32 tables " + name) {
      const std::pair<tg::Tensor, tg::Tensor> tables = tg::rope_tables(cos64.size(0), hs, theta, tg::float32);
      const tg::Tensor &cos = tables.first, &sin = tables.second;
      check_unary_case(c, tg::float32, [&](const tg::Tensor& x) { return tg::rope(x, cos, sin, hs, rotated, pos0); },
                       "rope (float32 tables)");
    }
  }
}

TEST_CASE("torch parity: rope_tables in float32 are PyTorch's float32 tables within 1 ulp", "[torch]") {
  for (const json& c : fixtures().at("rope_tables")) {
    const auto P = c.at("max_pos").get<std::int64_t>(), hs = c.at("head_size").get<std::int64_t>();
    const double theta = c.at("theta").get<double>();
    INFO("max_pos " << P << ", head_size " << hs << ", theta " << theta);
    auto [cos, sin] = tg::rope_tables(P, hs, theta, tg::float32);
    for (const auto& [got, key] : {std::pair{cos, "cos"}, std::pair{sin, "sin"}}) {
      INFO(key);
      const tg::Tensor want = tg::to(from_json(c.at(key)), tg::float32);  // each decimal rounds to its float32
      REQUIRE(got.shape() == want.shape());
      const std::vector<float> g = got.to_vector<float>(), w = want.to_vector<float>();
      std::int64_t worst = 0, exact = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        worst = std::max(worst, std::abs(ulps(g[i], w[i])));
        exact += g[i] == w[i];
      }
      INFO(exact << " of " << g.size() << " bit for bit, the largest difference " << worst << " ulp");
      tgtest::note_parity(std::string("rope_tables float32 ") + key, tgtest::max_abs_diff(got, want));
      CHECK(worst <= 1);
      CHECK(static_cast<double>(exact) >= 0.75 * static_cast<double>(g.size()));  // 91% and more here
    }
  }
}
