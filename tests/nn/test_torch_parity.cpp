// Parity with PyTorch for the normalisation layers, against reference values that
// tests/fixtures/make_norm_fixtures.py computed with PyTorch 1.13 in float64 (tests/fixtures/norms.json):
// LayerNorm (affine and not), RMSNorm / pRMSNorm (k = ceil(n p)), BatchNorm1d (three training steps
// and an eval step on (N, C), one training step on (N, C, L)). Each case runs the nn module and the
// composite twin of its fused op (tg::composite::*) in float64 and compares outputs, gradients and
// running statistics to within 1e-10 absolute.
//
// Set TAPEGRAD_PARITY_REPORT=1 to print the largest difference seen per case.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixtures.h"
#include "helpers.h"
#include "tapegrad/nn/norms.h"

namespace {

using nlohmann::json;

constexpr double kTol = 1e-10;

const json& fixtures() { return tgtest::fixture("norms.json"); }

using tgtest::from_json;
tg::Tensor leaf(const json& j) {
  tg::Tensor t = from_json(j);
  t.requires_grad_();
  return t;
}


// got must match the fixture tensor want (shape and every value to kTol).
void check_close(const tg::Tensor& got, const json& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(got.dtype() == tg::float64);
  const tg::Tensor ref = from_json(want);
  REQUIRE(got.shape() == ref.shape());
  const double d = tgtest::max_abs_diff(got, ref);
  tgtest::note_parity(what, d);
  INFO("max |diff| = " << d);
  CHECK(d <= kTol);
}

tg::StateDict params_sd(const json& c, bool with_bias) {
  tg::StateDict sd;
  sd.insert("weight", from_json(c.at("weight")));
  if (with_bias) sd.insert("bias", from_json(c.at("bias")));
  return sd;
}

}  // namespace

TEST_CASE("torch parity: fixture file is complete", "[torch]") {
  const json& f = fixtures();
  REQUIRE(f.at("layer_norm").size() == 3);
  REQUIRE(f.at("rms_norm").size() == 4);
  REQUIRE(f.at("batch_norm").size() == 2);
  REQUIRE(f.at("batch_norm")[0].at("steps").size() == 4);
  REQUIRE(f.at("batch_norm")[1].at("steps").size() == 1);
  // The pRMSNorm cases exercise k = ceil(n p) < n, as the library computes it.
  for (const json& c : f.at("rms_norm")) {
    const auto n = c.at("n").get<std::int64_t>();
    const auto p = c.at("p").get<double>();
    CHECK(c.at("k").get<std::int64_t>() == static_cast<std::int64_t>(std::ceil(static_cast<double>(n) * p)));
  }
}

TEST_CASE("torch parity: LayerNorm matches torch.nn.LayerNorm", "[torch]") {
  for (const json& c : fixtures().at("layer_norm")) {
    const std::string name = c.at("name").get<std::string>();
    const bool affine = c.at("elementwise_affine").get<bool>();
    const auto n = c.at("n").get<std::int64_t>();
    const double eps = c.at("eps").get<double>();
    SECTION("module " + name) {
      tg::nn::LayerNorm m(n, eps, affine, true, tg::float64);
      REQUIRE(m.weight.defined() == affine);
      REQUIRE(m.bias.defined() == affine);
      if (affine) {
        m.load_state_dict(params_sd(c, true));
        // The fixture's weight is not the default, so the loaded module is not the default one.
        CHECK(tgtest::max_abs_diff(m.weight, tg::ones({n}, tg::float64)) > 0.1);
      } else {
        CHECK(m.state_dict().empty());
      }
      tg::Tensor x = leaf(c.at("x"));
      tg::Tensor y = m(x);
      check_close(y, c.at("y"), "LayerNorm y");
      y.backward(from_json(c.at("dy")));
      check_close(x.grad(), c.at("dx"), "LayerNorm dx");
      if (affine) {
        check_close(m.weight.grad(), c.at("dweight"), "LayerNorm dweight");
        check_close(m.bias.grad(), c.at("dbias"), "LayerNorm dbias");
      }
    }
    SECTION("composite " + name) {
      tg::Tensor x = leaf(c.at("x"));
      tg::Tensor w = affine ? leaf(c.at("weight")) : tg::Tensor();
      tg::Tensor b = affine ? leaf(c.at("bias")) : tg::Tensor();
      tg::Tensor y = tg::composite::layer_norm(x, w, b, eps);
      check_close(y, c.at("y"), "composite layer_norm y");
      y.backward(from_json(c.at("dy")));
      check_close(x.grad(), c.at("dx"), "composite layer_norm dx");
      if (affine) {
        check_close(w.grad(), c.at("dweight"), "composite layer_norm dweight");
        check_close(b.grad(), c.at("dbias"), "composite layer_norm dbias");
      }
    }
  }
}

TEST_CASE("torch parity: RMSNorm and pRMSNorm match the torch formula", "[torch]") {
  for (const json& c : fixtures().at("rms_norm")) {
    const std::string name = c.at("name").get<std::string>();
    const auto n = c.at("n").get<std::int64_t>();
    const double eps = c.at("eps").get<double>(), p = c.at("p").get<double>();
    SECTION("module " + name) {
      tg::nn::RMSNorm m(n, eps, true, false, p, tg::float64);
      REQUIRE_FALSE(m.bias.defined());
      m.load_state_dict(params_sd(c, false));
      CHECK(tgtest::max_abs_diff(m.weight, tg::ones({n}, tg::float64)) > 0.1);
      tg::Tensor x = leaf(c.at("x"));
      tg::Tensor y = m(x);
      check_close(y, c.at("y"), "RMSNorm y");
      y.backward(from_json(c.at("dy")));
      check_close(x.grad(), c.at("dx"), "RMSNorm dx");
      check_close(m.weight.grad(), c.at("dweight"), "RMSNorm dweight");
    }
    SECTION("composite " + name) {
      tg::Tensor x = leaf(c.at("x"));
      tg::Tensor w = leaf(c.at("weight"));
      tg::Tensor y = tg::composite::rms_norm(x, w, tg::Tensor(), eps, p);
      check_close(y, c.at("y"), "composite rms_norm y");
      y.backward(from_json(c.at("dy")));
      check_close(x.grad(), c.at("dx"), "composite rms_norm dx");
      check_close(w.grad(), c.at("dweight"), "composite rms_norm dweight");
    }
  }
}

TEST_CASE("torch parity: BatchNorm1d matches torch.nn.BatchNorm1d over training steps and eval", "[torch]") {
  for (const json& c : fixtures().at("batch_norm")) {
    const std::string name = c.at("name").get<std::string>();
    const auto C = c.at("C").get<std::int64_t>();
    const double eps = c.at("eps").get<double>(), momentum = c.at("momentum").get<double>();
    const json& steps = c.at("steps");
    SECTION("module " + name) {
      tg::nn::BatchNorm1d m(C, eps, momentum, true, true, /*channels_last=*/false, tg::float64);
      tg::StateDict sd = params_sd(c, true);
      sd.insert("running_mean", from_json(c.at("running_mean")));
      sd.insert("running_var", from_json(c.at("running_var")));
      tg::Tensor nbt = tg::zeros({}, tg::int32);
      sd.insert("num_batches_tracked", nbt);
      m.load_state_dict(sd);
      check_close(m.running_mean, c.at("running_mean"), "BatchNorm1d initial running_mean");
      check_close(m.running_var, c.at("running_var"), "BatchNorm1d initial running_var");
      for (std::size_t s = 0; s < steps.size(); ++s) {
        const json& st = steps[s];
        const bool training = st.at("training").get<bool>();
        INFO("step " << s << (training ? " (train)" : " (eval)"));
        m.zero_grad();
        REQUIRE_FALSE(m.weight.grad().defined());
        if (training) m.train(); else m.eval();
        tg::Tensor x = leaf(st.at("x"));
        tg::Tensor y = m(x);
        check_close(y, st.at("y"), "BatchNorm1d y");
        y.backward(from_json(st.at("dy")));
        check_close(x.grad(), st.at("dx"), "BatchNorm1d dx");
        check_close(m.weight.grad(), st.at("dweight"), "BatchNorm1d dweight");
        check_close(m.bias.grad(), st.at("dbias"), "BatchNorm1d dbias");
        check_close(m.running_mean, st.at("running_mean"), "BatchNorm1d running_mean");
        check_close(m.running_var, st.at("running_var"), "BatchNorm1d running_var");
        CHECK(m.num_batches_tracked.item() == st.at("num_batches_tracked").get<double>());
      }
    }
    SECTION("composite " + name) {
      // tg::composite::batch_norm does not update running statistics: each step gets the ones the
      // module held when PyTorch ran it (eval normalises with them; training ignores them).
      json running_mean = c.at("running_mean"), running_var = c.at("running_var");
      for (std::size_t s = 0; s < steps.size(); ++s) {
        const json& st = steps[s];
        const bool training = st.at("training").get<bool>();
        INFO("step " << s << (training ? " (train)" : " (eval)"));
        tg::Tensor x = leaf(st.at("x"));
        tg::Tensor w = leaf(c.at("weight")), b = leaf(c.at("bias"));
        tg::Tensor y = tg::composite::batch_norm(x, from_json(running_mean), from_json(running_var), w, b, training, eps,
                                                 /*channels_last=*/false);
        check_close(y, st.at("y"), "composite batch_norm y");
        y.backward(from_json(st.at("dy")));
        check_close(x.grad(), st.at("dx"), "composite batch_norm dx");
        check_close(w.grad(), st.at("dweight"), "composite batch_norm dweight");
        check_close(b.grad(), st.at("dbias"), "composite batch_norm dbias");
        running_mean = st.at("running_mean");
        running_var = st.at("running_var");
      }
    }
  }
}
