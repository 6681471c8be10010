// Optimizers, schedules and gradient clipping against PyTorch 1.13, from reference values that
// tests/fixtures/make_optim_fixtures.py computed in float64 (tests/fixtures/optim.json).
//
// Problem: W (3, 4), b (4,), u (2,) (u is not in the loss, so it never gets a gradient and every
// optimizer must skip it), loss = mean((tanh(x @ W + b) - t)^2) + 0.1 * sum(W^4). Each fixture run
// takes 20 steps of zero_grad / backward / [clip_grad_norm] / step with one optimizer
// configuration (SGD plain, momentum, dampening, nesterov, weight decay, StepLR; Adam and AdamW
// defaults, weight decay, amsgrad, betas and eps; AdamW with two parameter groups, and with a
// warmup-cosine schedule and clipping), and every parameter after every step must equal
// PyTorch's to within 1e-10 absolute. Also: WarmupCosineLR against the reference benchmark's
// lr_at at all 2000 steps, clip_grad_norm / clip_grad_value, bit-identical resume through
// state_dict + safetensors, and the errors for invalid hyperparameters and bad state dicts.
//
// Set TAPEGRAD_PARITY_REPORT=1 to print the largest difference seen per run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <unistd.h>

#include "fixtures.h"
#include "helpers.h"

namespace {

using nlohmann::json;
using tg::Tensor;
namespace optim = tg::optim;

constexpr double kTol = 1e-10;

const json& fixtures() { return tgtest::fixture("optim.json"); }

using tgtest::from_json;

void note(const std::string& what, double d) { tgtest::note_parity(what, d); }

// Every element of t within kTol of the flat values want.
void require_close(const Tensor& t, const std::vector<double>& want, const std::string& what) {
  INFO(what);
  REQUIRE(t.dtype() == tg::float64);
  REQUIRE(t.numel() == static_cast<std::int64_t>(want.size()));
  const double* p = t.data<double>();
  double d = 0;
  for (std::size_t i = 0; i < want.size(); ++i) d = std::max(d, std::fabs(p[i] - want[i]));
  note(what, d);
  INFO("max |diff| = " << d);
  REQUIRE(d <= kTol);
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// ---- the problem ----

struct Problem {
  Tensor x, t, W, b, u;
  std::vector<Tensor> params() const { return {W, b, u}; }
  const Tensor& param(const std::string& n) const {
    if (n == "W") return W;
    if (n == "b") return b;
    if (n == "u") return u;
    FAIL("unknown parameter " << n);
    return W;
  }
};

Problem make_problem() {
  const json& p = fixtures().at("problem");
  Problem pr{from_json(p.at("x")), from_json(p.at("t")), from_json(p.at("W")), from_json(p.at("b")),
             from_json(p.at("u"))};
  pr.W.requires_grad_();
  pr.b.requires_grad_();
  pr.u.requires_grad_();
  return pr;
}

// mean((tanh(x @ W + b) - t)^2) + 0.1 * sum(W^4); u takes no part.
Tensor loss_fn(const Problem& p) {
  return tg::mean(tg::pow(tg::tanh(tg::matmul(p.x, p.W) + p.b) - p.t, 2.0)) + tg::sum(tg::pow(p.W, 4.0)) * 0.1;
}

double hp(const json& h, const char* key, double def) { return h.contains(key) ? h.at(key).get<double>() : def; }

// The fixture run's optimizer over the problem's parameters; lr and weight_decay may be overridden
// (a fresh optimizer that a resume will load the real values into).
std::unique_ptr<optim::Optimizer> make_optimizer(const json& run, const Problem& p, double lr_override = -1,
                                                 double wd_override = -1) {
  const std::string kind = run.at("optimizer").get<std::string>();
  const json& h = run.at("hyperparameters");
  const bool adamw = kind == "AdamW";
  const double lr = lr_override >= 0 ? lr_override : h.at("lr").get<double>();
  const double wd = wd_override >= 0 ? wd_override : hp(h, "weight_decay", adamw ? 1e-2 : 0.0);
  std::vector<optim::ParamGroup> groups;
  if (run.contains("groups")) {
    for (const json& g : run.at("groups")) {
      optim::ParamGroup pg;
      for (const json& n : g.at("params")) pg.params.push_back(p.param(n.get<std::string>()));
      pg.weight_decay = wd_override >= 0 ? wd_override : g.at("weight_decay").get<double>();
      groups.push_back(pg);
    }
  } else {
    groups.push_back({p.params(), lr, wd});
  }
  if (kind == "SGD")
    return std::make_unique<optim::SGD>(groups, lr, hp(h, "momentum", 0), hp(h, "dampening", 0), wd,
                                        h.value("nesterov", false));
  const double b1 = h.contains("betas") ? h.at("betas")[0].get<double>() : 0.9;
  const double b2 = h.contains("betas") ? h.at("betas")[1].get<double>() : 0.999;
  const double eps = hp(h, "eps", 1e-8);
  const bool ams = h.value("amsgrad", false);
  if (kind == "Adam") return std::make_unique<optim::Adam>(groups, lr, b1, b2, eps, wd, ams);
  REQUIRE(kind == "AdamW");
  return std::make_unique<optim::AdamW>(groups, lr, b1, b2, eps, wd, ams);
}

std::unique_ptr<optim::Schedule> make_schedule(const json& run) {
  if (!run.contains("schedule")) return nullptr;
  const json& s = run.at("schedule");
  if (s.at("kind") == "StepLR")
    return std::make_unique<optim::StepLR>(s.at("lr").get<double>(), s.at("step_size").get<std::int64_t>(),
                                           s.at("gamma").get<double>());
  REQUIRE(s.at("kind") == "WarmupCosineLR");
  return std::make_unique<optim::WarmupCosineLR>(s.at("lr").get<double>(), s.at("min_lr").get<double>(),
                                                 s.at("warmup").get<std::int64_t>(),
                                                 s.at("lr_decay_iters").get<std::int64_t>());
}

bool rel_close(double got, double want, double rel) { return std::fabs(got - want) <= rel * std::fabs(want); }

// One fixture run: 20 steps, every parameter after every step against PyTorch. fused: a run that
// clips calls clip_and_step instead of clip_grad_norm then step().
void check_run(const json& run, bool fused = false) {
  const std::string name = run.at("name").get<std::string>();
  INFO("run " << name);
  Problem p = make_problem();
  const Tensor u0 = p.u.clone();
  auto opt = make_optimizer(run, p);
  auto sched = make_schedule(run);
  const bool clip = run.contains("clip_grad_norm");
  const json& steps = run.at("steps");
  REQUIRE(steps.size() == fixtures().at("steps").get<std::size_t>());
  for (std::size_t it = 0; it < steps.size(); ++it) {
    INFO("step " << it);
    if (sched) {
      sched->apply(*opt, static_cast<std::int64_t>(it));
      const double want = run.at("lrs")[it].get<double>();
      for (const auto& g : opt->param_groups()) REQUIRE(rel_close(g.lr, want, 1e-15));
    }
    opt->zero_grad();
    Tensor loss = loss_fn(p);
    const double ld = std::fabs(loss.item() - run.at("losses")[it].get<double>());
    note(name + " loss", ld);
    REQUIRE(ld <= kTol);
    loss.backward();
    REQUIRE(p.W.grad().defined());
    REQUIRE_FALSE(p.u.grad().defined());
    if (clip) {
      const double max_norm = run.at("clip_grad_norm").get<double>();
      const double n = fused ? opt->clip_and_step(max_norm) : optim::clip_grad_norm(p.params(), max_norm);
      const double nd = std::fabs(n - run.at("grad_norms")[it].get<double>());
      note(name + " grad norm", nd);
      REQUIRE(nd <= kTol);
    }
    if (!clip || !fused) opt->step();
    const json& want = steps[it];
    require_close(p.W, want.at("W").get<std::vector<double>>(), name + " W");
    require_close(p.b, want.at("b").get<std::vector<double>>(), name + " b");
    require_close(p.u, want.at("u").get<std::vector<double>>(), name + " u");
    REQUIRE(bit_equal(p.u, u0));  // skipped: no gradient, no update, no weight decay
  }
  // Like PyTorch, no state for the parameter that never had a gradient (index 2).
  for (const auto& [key, t] : opt->state_dict()) REQUIRE(key.rfind("state.2.", 0) != 0);
}

void check_runs_of(const std::string& kind, std::size_t expected) {
  std::size_t n = 0;
  for (const json& run : fixtures().at("runs"))
    if (run.at("optimizer") == kind) {
      check_run(run);
      ++n;
    }
  REQUIRE(n == expected);
}

const json& fixture_run(const std::string& name) {
  for (const json& run : fixtures().at("runs"))
    if (run.at("name") == name) return run;
  FAIL("no fixture run " << name);
  return fixtures();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parity with PyTorch 1.13

TEST_CASE("SGD matches PyTorch 1.13 step by step", "[optim]") {
  // plain, momentum, momentum + dampening, nesterov, weight decay, nesterov + weight decay, StepLR
  check_runs_of("SGD", 7);
}

TEST_CASE("Adam matches PyTorch 1.13 step by step", "[optim]") {
  // defaults, weight decay, amsgrad, amsgrad + weight decay, betas (0.8, 0.9) eps 1e-6, amsgrad beta2 0.5
  check_runs_of("Adam", 6);
}

TEST_CASE("AdamW matches PyTorch 1.13 step by step", "[optim]") {
  // defaults, weight decay, amsgrad, amsgrad + weight decay, two groups, two groups + cosine + clipping
  check_runs_of("AdamW", 6);
}

TEST_CASE("clip_and_step matches PyTorch 1.13's clip_grad_norm_ then step() step by step", "[optim]") {
  // two groups + cosine + clipping (max_norm 1.1: the first steps clip, later ones do not)
  std::size_t n = 0;
  for (const json& run : fixtures().at("runs"))
    if (run.contains("clip_grad_norm")) {
      check_run(run, true);
      ++n;
    }
  REQUIRE(n == 1);
}

TEST_CASE("WarmupCosineLR equals the reference benchmark's lr_at at every step", "[optim]") {
  const json& f = fixtures().at("lr_at");
  const optim::WarmupCosineLR s(f.at("lr").get<double>(), f.at("min_lr").get<double>(),
                                f.at("warmup").get<std::int64_t>(), f.at("lr_decay_iters").get<std::int64_t>());
  const std::vector<double> want = f.at("values").get<std::vector<double>>();
  REQUIRE(want.size() == 2000);
  double worst = 0;
  for (std::size_t it = 0; it < want.size(); ++it) {
    const double got = s(static_cast<std::int64_t>(it));
    INFO("it " << it << ": " << got << " vs " << want[it]);
    REQUIRE(rel_close(got, want[it], 1e-15));
    worst = std::max(worst, std::fabs(got - want[it]) / want[it]);
  }
  note("lr_at (relative)", worst);
  // the reference values: warmup start, peak, end of decay
  CHECK(want[0] == 1e-3 / 101);
  CHECK(want[100] == 1e-3);
  CHECK(want[1999] > 1e-4);
}

TEST_CASE("a run shorter than its warmup warms up for all its steps, as the reference's lr_at", "[optim]") {
  // torch_gpt.py with --steps 30 (lr_decay_iters = 30) and warmup 100: lr (it + 1) / 101 throughout.
  optim::WarmupCosineLR s(1e-3, 1e-4, 100, 30);
  for (std::int64_t it = 0; it < 30; ++it) CHECK(s(it) == 1e-3 * static_cast<double>(it + 1) / 101.0);
  CHECK(s(100) == 1e-4);  // after the warmup, past the decay: min_lr
  REQUIRE_TG_ERROR(optim::WarmupCosineLR(1e-3, 1e-4, 10, -1), "WarmupCosineLR", "decay_steps");
  // A step before the first (a negative one) has no rate; the formulas would give a negative lr.
  REQUIRE_TG_ERROR(s(-5), "WarmupCosineLR", "step must be >= 0", "-5");
  REQUIRE_TG_ERROR(optim::StepLR(1e-3, 10)(-1), "StepLR", "step must be >= 0", "-1");
}

TEST_CASE("clip_grad_norm and clip_grad_value match PyTorch 1.13", "[optim]") {
  // Parameters whose gradients are the fixture's (the last one has none): d/dp sum(p * g) = g.
  auto params_with = [](const json& grads) {
    std::vector<Tensor> ps;
    for (const json& g : grads) {
      if (g.is_null()) {
        ps.push_back(tg::zeros({2}, tg::float64).requires_grad_());
        continue;
      }
      const Tensor gt = from_json(g);
      Tensor p = tg::zeros(gt.shape(), tg::float64);
      p.requires_grad_();
      tg::sum(p * gt).backward();
      REQUIRE(bit_equal(p.grad(), gt));
      ps.push_back(p);
    }
    return ps;
  };
  SECTION("clip_grad_norm") {
    const json& cases = fixtures().at("clip_grad_norm");
    REQUIRE(cases.size() == 2);
    for (const json& c : cases) {
      const double max_norm = c.at("max_norm").get<double>();
      INFO("max_norm " << max_norm);
      std::vector<Tensor> ps = params_with(c.at("grads"));
      const double n = optim::clip_grad_norm(ps, max_norm);
      note("clip_grad_norm norm", std::fabs(n - c.at("norm").get<double>()));
      REQUIRE(std::fabs(n - c.at("norm").get<double>()) <= kTol);
      const json& clipped = c.at("clipped");
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (clipped[i].is_null()) {
          REQUIRE_FALSE(ps[i].grad().defined());
          continue;
        }
        require_close(ps[i].grad(), clipped[i].at("data").get<std::vector<double>>(), "clip_grad_norm grads");
        if (max_norm > n) REQUIRE(bit_equal(ps[i].grad(), from_json(c.at("grads")[i])));  // untouched
      }
    }
  }
  SECTION("clip_grad_value") {
    const json& cases = fixtures().at("clip_grad_value");
    REQUIRE(cases.size() == 2);
    for (const json& c : cases) {
      INFO("clip_value " << c.at("clip_value").get<double>());
      std::vector<Tensor> ps = params_with(c.at("grads"));
      optim::clip_grad_value(ps, c.at("clip_value").get<double>());
      const json& clipped = c.at("clipped");
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (clipped[i].is_null()) {
          REQUIRE_FALSE(ps[i].grad().defined());
          continue;
        }
        REQUIRE(bit_equal(ps[i].grad(), from_json(clipped[i])));  // clamping is exact
      }
    }
  }
  SECTION("a total that is not finite: NaN leaves the gradients, infinity scales them by 0") {
    auto param_with = [](std::vector<double> g) {
      Tensor p = tg::zeros({static_cast<std::int64_t>(g.size())}, tg::float64);
      p.requires_grad_();
      tg::sum(p * tg::tensor(g, {static_cast<std::int64_t>(g.size())}, tg::float64)).backward();
      return p;
    };
    std::vector<Tensor> nan_ps{param_with({3.0, std::nan("")}), param_with({4.0})};
    REQUIRE(std::isnan(optim::clip_grad_norm(nan_ps, 1.0)));
    CHECK(nan_ps[0].grad().at({0}) == 3.0);
    CHECK(std::isnan(nan_ps[0].grad().at({1})));
    CHECK(nan_ps[1].grad().at({0}) == 4.0);
    std::vector<Tensor> inf_ps{param_with({3.0, INFINITY}), param_with({-4.0})};
    REQUIRE(std::isinf(optim::clip_grad_norm(inf_ps, 1.0)));
    CHECK(inf_ps[0].grad().at({0}) == 0.0);
    CHECK(std::isnan(inf_ps[0].grad().at({1})));  // inf * 0, as in PyTorch
    CHECK(inf_ps[1].grad().at({0}) == 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// Resume: 10 steps, save, load into fresh parameters and a fresh optimizer, 10 more steps ==
// 20 uninterrupted steps, bit for bit.

namespace {

void run_steps(const Problem& p, optim::Optimizer& opt, int n) {
  for (int i = 0; i < n; ++i) {
    opt.zero_grad();
    Tensor loss = loss_fn(p);
    loss.backward();
    opt.step();
  }
}

void check_resume(const std::string& run_name) {
  INFO("run " << run_name);
  const json& run = fixture_run(run_name);

  Problem straight = make_problem();
  auto opt1 = make_optimizer(run, straight);
  run_steps(straight, *opt1, 20);

  Problem first = make_problem();
  auto opt2 = make_optimizer(run, first);
  run_steps(first, *opt2, 10);
  tg::StateDict ckpt;
  for (const char* n : {"W", "b", "u"}) ckpt.insert(std::string("model.") + n, first.param(n).detach());
  for (const auto& [k, t] : opt2->state_dict()) ckpt.insert("optim." + k, t);
  const std::filesystem::path file = std::filesystem::temp_directory_path() /
                                     ("tapegrad_test_optim_" + std::to_string(::getpid()) + ".safetensors");
  tg::save_safetensors(file.string(), ckpt);
  const tg::StateDict loaded = tg::load_safetensors(file.string());
  std::filesystem::remove(file);
  REQUIRE(loaded.size() == ckpt.size());

  // Fresh parameters (zeros, then the checkpoint's values) and a fresh optimizer built with a
  // different lr and weight decay: both must come from the checkpoint.
  Problem resumed = make_problem();
  for (const char* n : {"W", "b", "u"}) {
    Tensor p = resumed.param(n);
    std::memset(p.raw_data(), 0, p.nbytes());
    const Tensor& src = loaded.at(std::string("model.") + n);
    REQUIRE(src.shape() == p.shape());
    REQUIRE(src.dtype() == p.dtype());
    std::memcpy(p.raw_data(), src.raw_data(), p.nbytes());
  }
  auto opt3 = make_optimizer(run, resumed, 0.5, 0.3);
  tg::StateDict osd;
  for (const auto& [k, t] : loaded)
    if (k.rfind("optim.", 0) == 0) osd.insert(k.substr(6), t);
  opt3->load_state_dict(osd);
  REQUIRE(opt3->param_groups().size() == opt1->param_groups().size());
  for (std::size_t g = 0; g < opt3->param_groups().size(); ++g) {
    CHECK(opt3->param_groups()[g].lr == opt1->param_groups()[g].lr);
    CHECK(opt3->param_groups()[g].weight_decay == opt1->param_groups()[g].weight_decay);
  }
  run_steps(resumed, *opt3, 10);

  for (const char* n : {"W", "b", "u"}) {
    INFO("parameter " << n);
    REQUIRE(bit_equal(resumed.param(n), straight.param(n)));
  }
  // and the optimizer state too
  const tg::StateDict s1 = opt1->state_dict(), s3 = opt3->state_dict();
  REQUIRE(s1.size() == s3.size());
  for (const auto& [k, t] : s1) {
    INFO("state " << k);
    REQUIRE(s3.contains(k));
    REQUIRE(bit_equal(s3.at(k), t));
  }
}

}  // namespace

TEST_CASE("resume through state_dict and safetensors is bit-identical", "[optim]") {
  SECTION("AdamW, two parameter groups") { check_resume("adamw_two_groups"); }
  SECTION("SGD with momentum") { check_resume("sgd_momentum"); }
  SECTION("Adam with amsgrad") { check_resume("adam_amsgrad_weight_decay"); }
  SECTION("SGD nesterov with weight decay") { check_resume("sgd_nesterov_weight_decay"); }
}

TEST_CASE("an optimizer's state keeps out of the memory that a step frees", "[optim]") {
  // The state is made at the first step(), after the backward has freed the step's activations; in
  // a LongLivedAllocations scope it stays out of their blocks, which the next forward reuses.
  for (const std::string name : {"AdamW", "SGD"}) {
    INFO(name);
    tg::empty_cache();
    Tensor w = tg::zeros({1 << 20}).requires_grad_();  // 4 MiB: the caching allocator's arena
    tg::sum(w * w).backward();
    std::unique_ptr<tg::optim::Optimizer> opt;
    if (name == "AdamW") opt = std::make_unique<tg::optim::AdamW>(std::vector<Tensor>{w});
    else opt = std::make_unique<tg::optim::SGD>(std::vector<Tensor>{w}, 0.1, 0.9);
    [[maybe_unused]] void* freed = nullptr;  // read only where the cache runs (not under ASan)
    { Tensor activation = tg::zeros({1 << 20}); freed = activation.raw_data(); }
    opt->step();
    CHECK(opt->state_dict().contains(name == "AdamW" ? "state.0.exp_avg" : "state.0.momentum_buffer"));
#if !defined(__SANITIZE_ADDRESS__)  // (no cache under AddressSanitizer)
    Tensor next = tg::zeros({1 << 20});
    CHECK(next.raw_data() == freed);
#endif
  }
  tg::empty_cache();
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST_CASE("invalid hyperparameters name the optimizer and the bad value", "[optim]") {
  using tgtest::param64;
  const std::vector<Tensor> ps{param64({3, 4}, 1), param64({4}, 2)};

  SECTION("SGD") {
    REQUIRE_TG_ERROR(optim::SGD(ps, -0.1), "SGD", "learning rate", "-0.1");
    REQUIRE_TG_ERROR(optim::SGD(ps, 0.1, -0.5), "SGD", "momentum", "-0.5");
    REQUIRE_TG_ERROR(optim::SGD(ps, 0.1, 0.9, 0, -0.01), "SGD", "weight_decay", "-0.01");
    REQUIRE_TG_ERROR(optim::SGD(ps, 0.1, 0.0, 0, 0, true), "SGD", "nesterov", "momentum 0");
    REQUIRE_TG_ERROR(optim::SGD(ps, 0.1, 0.9, 0.1, 0, true), "SGD", "nesterov", "dampening 0.1");
    REQUIRE_TG_ERROR(optim::SGD(std::vector<Tensor>{}, 0.1), "SGD", "empty");
  }
  for (const char* name : {"Adam", "AdamW"}) {
    DYNAMIC_SECTION(name) {
      const bool w = std::string(name) == "AdamW";
      auto make = [&](std::vector<Tensor> p, double lr, double b1, double b2, double eps, double wd) {
        if (w) return std::unique_ptr<optim::Optimizer>(new optim::AdamW(std::move(p), lr, b1, b2, eps, wd));
        return std::unique_ptr<optim::Optimizer>(new optim::Adam(std::move(p), lr, b1, b2, eps, wd));
      };
      REQUIRE_TG_ERROR(make(ps, -0.01, 0.9, 0.999, 1e-8, 0), name, "learning rate", "-0.01");
      REQUIRE_TG_ERROR(make(ps, 0.01, 1.0, 0.999, 1e-8, 0), name, "beta parameter at index 0: 1");
      REQUIRE_TG_ERROR(make(ps, 0.01, 0.9, -0.1, 1e-8, 0), name, "beta parameter at index 1: -0.1");
      REQUIRE_TG_ERROR(make(ps, 0.01, 0.9, 0.999, 0.0, 0), name, "epsilon", ": 0");
      REQUIRE_TG_ERROR(make(ps, 0.01, 0.9, 0.999, -1e-8, 0), name, "epsilon", "-1e-08");
      REQUIRE_TG_ERROR(make(ps, 0.01, 0.9, 0.999, 1e-8, -0.1), name, "weight_decay", "-0.1");
      REQUIRE_TG_ERROR(make({}, 0.01, 0.9, 0.999, 1e-8, 0), name, "empty");
      // a group's own weight decay
      std::vector<optim::ParamGroup> groups{{{ps[0]}, 0.01, std::nan("")}};
      if (w) REQUIRE_TG_ERROR(optim::AdamW(groups), name, "weight_decay", "nan");
      else REQUIRE_TG_ERROR(optim::Adam(groups), name, "weight_decay", "nan");
      // the message names the optimizer, not its base class
      try {
        (void)make(ps, -1.0, 0.9, 0.999, 1e-8, 0);
      } catch (const tg::Error& e) {
        CHECK(std::string(e.what()).rfind(std::string(name) + ":", 0) == 0);
      }
    }
  }
  SECTION("parameters that cannot be optimized") {
    const Tensor nonleaf = ps[0] * 2.0;
    REQUIRE_FALSE(nonleaf.is_leaf());
    const Tensor ints = tg::zeros({3}, tg::int32);
    REQUIRE_TG_ERROR(optim::SGD({ps[0], nonleaf}, 0.1), "SGD", "parameter 1", "non-leaf");
    REQUIRE_TG_ERROR(optim::Adam({nonleaf}, 0.1), "Adam", "non-leaf");
    REQUIRE_TG_ERROR(optim::AdamW({nonleaf}, 0.1), "AdamW", "non-leaf");
    REQUIRE_TG_ERROR(optim::SGD({ints}, 0.1), "SGD", "int32");
    REQUIRE_TG_ERROR(optim::Adam({ps[1], ints}, 0.1), "Adam", "parameter 1", "int32");
    REQUIRE_TG_ERROR(optim::AdamW({ints}, 0.1), "AdamW", "int32");
    REQUIRE_TG_ERROR(optim::SGD({Tensor()}, 0.1), "SGD", "undefined");
  }
  SECTION("set_lr") {
    optim::AdamW opt(ps, 0.01);
    REQUIRE_TG_ERROR(opt.set_lr(-1e-3), "AdamW", "learning rate", "-0.001");
    CHECK(opt.param_groups()[0].lr == 0.01);
  }
}

TEST_CASE("a parameter listed twice, in one group or two, is refused naming both places", "[optim]") {
  using tgtest::param64;
  const Tensor w = param64({3, 4}, 1), b = param64({4}, 2), u = param64({2}, 3);
  const Tensor w_again = w;  // a copy of the handle: the same parameter
  // Within one group (PyTorch warns), for every optimizer.
  REQUIRE_TG_ERROR(optim::SGD({w, b, w_again}, 0.1),
                   "SGD: parameter 2 of group 0 (float64 (3, 4)) is parameter 0 of group 0 again");
  REQUIRE_TG_ERROR(optim::Adam({b, u, b}, 0.1), "Adam: parameter 2 of group 0", "is parameter 0 of group 0 again");
  REQUIRE_TG_ERROR(optim::AdamW({u, u}, 0.1), "AdamW: parameter 1 of group 0", "parameter 0 of group 0 again");
  // Across groups (PyTorch raises ValueError).
  const std::vector<optim::ParamGroup> across{{{w, b}, 0.1, 0.0}, {{u, b}, 0.01, 0.0}};
  REQUIRE_TG_ERROR(optim::AdamW(across),
                   "AdamW: parameter 1 of group 1 (float64 (4,)) is parameter 1 of group 0 again");
  REQUIRE_TG_ERROR(optim::SGD(across, 0.1), "SGD: parameter 1 of group 1", "list each parameter once");
  // The same memory under another shape (an alias) is the same parameter too.
  Tensor flat = w.detach().reshape({12});
  flat.requires_grad_();
  REQUIRE_TG_ERROR(optim::Adam({w, flat}, 0.1),
                   "Adam: parameter 1 of group 0 (float64 (12,)) is parameter 0 of group 0");
  // Distinct parameters of equal values and shapes are two parameters; each is updated once.
  const Tensor w2 = w.detach().clone().requires_grad_();
  optim::SGD opt({w, w2}, 0.5);
  tg::sum(w * 1.0).backward();
  tg::sum(w2 * 1.0).backward();
  const std::vector<double> before = w.to_vector<double>();
  opt.step();
  const std::vector<double> after = w.to_vector<double>(), after2 = w2.to_vector<double>();
  for (std::size_t k = 0; k < before.size(); ++k) {
    CHECK(after[k] == before[k] - 0.5);
    CHECK(after2[k] == after[k]);
  }
}

TEST_CASE("param_groups() changes its hyperparameters, and a changed parameter list is refused before anything moves",
          "[optim]") {
  using tgtest::param64;
  const Tensor w = param64({3, 4}, 1), b = param64({4}, 2), big = param64({64}, 3);
  optim::AdamW opt({{{w, b}, 0.1, 0.0}});
  tg::sum(w * 1.0).backward();
  tg::sum(b * 1.0).backward();
  tg::sum(big * 1.0).backward();
  opt.step();  // state for w and b
  // A new lr through param_groups(), as PyTorch's opt.param_groups[0]['lr'] = ..., is taken.
  opt.param_groups()[0].lr = 0.05;
  opt.step();
  CHECK(opt.state_dict().at("group.0.lr").item() == 0.05);
  const tg::StateDict state = opt.state_dict();
  const std::vector<double> w_now = w.to_vector<double>(), big_now = big.to_vector<double>();
  const auto unchanged = [&] {
    CHECK(w.to_vector<double>() == w_now);
    CHECK(big.to_vector<double>() == big_now);
    const tg::StateDict again = opt.state_dict();
    CHECK(again.size() == state.size());
    for (const auto& [k, t] : state) CHECK(again.at(k).to_vector<double>() == t.to_vector<double>());
  };
  // A parameter added, replaced, or a group added: its state would be another's (big would take
  // b's 4-element moments and the update would run past them).
  opt.param_groups()[0].params.push_back(big);
  REQUIRE_TG_ERROR(opt.step(), "AdamW: group 0 of param_groups() holds 3 parameters where the optimizer was made with 2",
                   "make a new optimizer");
  REQUIRE_TG_ERROR(opt.clip_and_step(1.0), "AdamW: group 0 of param_groups() holds 3 parameters");
  REQUIRE_TG_ERROR(opt.state_dict(), "holds 3 parameters");
  REQUIRE_TG_ERROR(opt.load_state_dict(state), "holds 3 parameters");
  opt.param_groups()[0].params.pop_back();
  opt.param_groups()[0].params[1] = big;
  REQUIRE_TG_ERROR(opt.step(), "AdamW: parameter 1 of group 0 (float64 (64,)) is not the one the optimizer was made with "
                               "(float64 (4,))");
  opt.param_groups()[0].params[1] = b;
  opt.param_groups().push_back({{big}, 0.1, 0.0});
  REQUIRE_TG_ERROR(opt.step(), "AdamW: param_groups() holds 2 groups where the optimizer was made with 1");
  opt.param_groups().pop_back();
  // An lr or weight decay that is not valid, set through param_groups().
  opt.param_groups()[0].lr = std::nan("");
  REQUIRE_TG_ERROR(opt.step(), "AdamW: group 0: invalid learning rate: nan");
  opt.param_groups()[0].lr = 0.05;
  opt.param_groups()[0].weight_decay = INFINITY;
  REQUIRE_TG_ERROR(opt.step(), "AdamW: group 0: invalid weight_decay value: inf");
  opt.param_groups()[0].weight_decay = -1;  // the constructors' "default" means nothing here
  REQUIRE_TG_ERROR(opt.step(), "AdamW: group 0: invalid weight_decay value: -1");
  opt.param_groups()[0].weight_decay = 0.0;
  unchanged();
  optim::SGD sgd({w}, 0.1, 0.9);
  sgd.param_groups()[0].params.push_back(b);
  REQUIRE_TG_ERROR(sgd.step(), "SGD: group 0 of param_groups() holds 2 parameters");
  REQUIRE_TG_ERROR(sgd.clip_and_step(1.0), "SGD: group 0 of param_groups() holds 2 parameters");
  unchanged();
  // Put back as they were made, the groups step again, at the lr set through param_groups().
  sgd.param_groups()[0].params.pop_back();
  sgd.param_groups()[0].lr = 0.0;
  sgd.step();
  CHECK(w.to_vector<double>() == w_now);
  sgd.param_groups()[0].lr = 0.25;
  sgd.step();  // its second step: buf = 0.9 * 1 + 1 (the gradient, 1), w -= 0.25 buf
  const std::vector<double> w_after = w.to_vector<double>();
  for (std::size_t k = 0; k < w_after.size(); ++k) CHECK(w_after[k] == w_now[k] - 0.25 * (0.9 * 1.0 + 1.0));
  opt.step();
}

namespace {

// Two identical runs of `run_name` take 3 steps; on the second, load(bad) must throw and change
// nothing: after 2 more steps both are bit-identical. `bad` is built from a state dict of a
// different trajectory (1 step at another lr), so a partial load would show.
void check_failed_load(const std::string& run_name,
                       const std::function<void(tg::StateDict&)>& spoil, const char* fragment) {
  INFO("run " << run_name << ", expecting '" << fragment << "'");
  const json& run = fixture_run(run_name);
  Problem a = make_problem(), b = make_problem(), c = make_problem();
  auto oa = make_optimizer(run, a), ob = make_optimizer(run, b), oc = make_optimizer(run, c, 0.2, 0.05);
  run_steps(a, *oa, 3);
  run_steps(b, *ob, 3);
  run_steps(c, *oc, 1);
  tg::StateDict bad = oc->state_dict();
  spoil(bad);
  REQUIRE_TG_ERROR(ob->load_state_dict(bad), ob->name().c_str(), "load_state_dict", fragment);
  run_steps(a, *oa, 2);
  run_steps(b, *ob, 2);
  for (const char* n : {"W", "b", "u"}) {
    INFO("parameter " << n);
    REQUIRE(bit_equal(a.param(n), b.param(n)));
  }
}

// The same dict with `key` replaced by t (or added).
std::function<void(tg::StateDict&)> put(std::string key, Tensor t) {
  return [key = std::move(key), t = std::move(t)](tg::StateDict& sd) { sd.insert(key, t); };
}

}  // namespace

TEST_CASE("load_state_dict rejects hyperparameters and step counts a step cannot use, and changes nothing", "[optim]") {
  // Each would load and then write NaN or inf into every parameter at the next step: a weight
  // decay of NaN or inf, an lr of inf, Adam's step count -1 (1 - beta1^0 = 0 divides) or NaN.
  using tg::float64;
  const double nan = std::nan("");
  const double inf = HUGE_VAL;
  check_failed_load("sgd_momentum", put("group.0.weight_decay", tg::full({}, nan, float64)), "group.0.weight_decay: must be finite and >= 0, got nan");
  check_failed_load("adamw_two_groups", put("group.1.weight_decay", tg::full({}, inf, float64)), "group.1.weight_decay: must be finite and >= 0, got inf");
  check_failed_load("adam_default", put("group.0.weight_decay", tg::full({}, -0.5, float64)), "group.0.weight_decay");
  check_failed_load("adam_default", put("group.0.lr", tg::full({}, inf, float64)), "group.0.lr: must be finite and >= 0, got inf");
  check_failed_load("adam_default", put("state.0.step", tg::full({}, -1.0, float64)), "state.0.step: a step count must be a whole number >= 0, got -1");
  check_failed_load("adamw_default", put("state.1.step", tg::full({}, nan, float64)), "state.1.step");
  check_failed_load("adam_amsgrad", put("state.0.step", tg::full({}, 2.5, float64)), "state.0.step");
  check_failed_load("sgd_momentum", put("state.0.initialized", tg::full({}, 0.5, float64)), "state.0.initialized: must be 0 or 1, got 0.5");
}

TEST_CASE("load_state_dict rejects a state that does not fit and changes nothing", "[optim]") {
  using tg::float32;
  using tg::float64;
  SECTION("wrong-shaped buffers") {
    check_failed_load("sgd_momentum", put("state.0.momentum_buffer", tg::zeros({4, 3}, float64)), "state.0.momentum_buffer");
    check_failed_load("adam_default", put("state.1.exp_avg", tg::zeros({3}, float64)), "state.1.exp_avg");
    check_failed_load("adamw_two_groups", put("state.0.exp_avg_sq", tg::zeros({3, 4}, float32)), "state.0.exp_avg_sq");
    check_failed_load("adam_amsgrad", put("state.0.max_exp_avg_sq", tg::zeros({}, float64)), "state.0.max_exp_avg_sq");
    check_failed_load("adam_default", put("state.0.step", tg::zeros({3, 4}, float64)), "state.0.step");
    check_failed_load("sgd_momentum", put("group.0.lr", tg::zeros({2}, float64)), "group.0.lr");
  }
  SECTION("unknown keys") {
    check_failed_load("sgd_momentum", put("foo", tg::zeros({}, float64)), "foo");
    check_failed_load("sgd_momentum", put("state.3.momentum_buffer", tg::zeros({2}, float64)), "state.3");
    check_failed_load("adamw_two_groups", put("group.2.lr", tg::zeros({}, float64)), "group.2.lr");
    check_failed_load("adam_default", put("state.0.bogus", tg::zeros({3, 4}, float64)), "state.0.bogus");
    // another optimizer's buffer, and amsgrad's maximum without amsgrad
    check_failed_load("adam_default", put("state.0.momentum_buffer", tg::zeros({3, 4}, float64)), "momentum_buffer");
    check_failed_load("sgd_momentum", put("state.0.exp_avg", tg::zeros({3, 4}, float64)), "exp_avg");
    check_failed_load("adamw_default", put("state.0.max_exp_avg_sq", tg::zeros({3, 4}, float64)), "max_exp_avg_sq");
  }
  SECTION("missing group hyperparameters") {
    check_failed_load("adamw_two_groups",
                      [](tg::StateDict& sd) {
                        tg::StateDict keep;
                        for (const auto& [k, t] : sd)
                          if (k != "group.1.weight_decay") keep.insert(k, t);
                        sd = keep;
                      },
                      "group.1");
  }
}
