// Optimizer::clip_and_step (the gradient norm, clipping and the update in one call) against what it
// stands for, clip_grad_norm over the optimizer's parameters (group by group) then step():
// parameters, gradients, optimizer state, version counters and the returned norm must be
// bit-identical, for Adam and AdamW (weight decay on or off, AMSGrad on or off, clipping in effect
// or not, float32 and float64, two groups, a parameter without a gradient), for SGD (the generic
// path), and for two parameters sharing a gradient buffer (the sequential path). Also: grad_norm's
// bits do not depend on the thread count and its value is the norm; a non-finite norm changes
// nothing; the errors name the call and the value.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "helpers.h"

namespace {

using tg::Tensor;
namespace optim = tg::optim;

// Four parameters: a (300, 250), past several of the norm's blocks (2^15 elements) and the threaded
// passes' threshold; b (250,) and c (7, 3), small; d (5,), which never gets a gradient.
// Groups: {a, c} and {b, d}, with their own lr and weight decay.
struct Model {
  std::vector<Tensor> p;  // a, b, c, d
  std::vector<optim::ParamGroup> groups(double wd) const { return {{{p[0], p[2]}, 1e-2, wd}, {{p[1], p[3]}, 3e-3, 0.0}}; }
  std::vector<Tensor> in_group_order() const { return {p[0], p[2], p[1], p[3]}; }
};

Model make_model(tg::DType dt) {
  tg::Generator gen(7);
  Model m;
  for (const tg::Shape& s : {tg::Shape{300, 250}, tg::Shape{250}, tg::Shape{7, 3}, tg::Shape{5}}) {
    Tensor p = tg::randn(s, dt, &gen);
    p.requires_grad_();
    m.p.push_back(p);
  }
  return m;
}

// Step `step`'s gradients, N(0, scale^2) draws, on a, b and c (sum(p * g) has gradient g).
void set_grads(Model& m, int step, double scale) {
  tg::Generator gen(100 + static_cast<std::uint64_t>(step));
  for (std::size_t i = 0; i < 3; ++i) {
    m.p[i].zero_grad();
    tg::sum(m.p[i] * (tg::randn(m.p[i].shape(), m.p[i].dtype(), &gen) * scale)).backward();
  }
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// Parameters, gradients, version counters and state of x and y, bit for bit.
void require_same(const std::vector<Tensor>& x, const std::vector<Tensor>& y, const optim::Optimizer& ox,
                  const optim::Optimizer& oy) {
  REQUIRE(x.size() == y.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(bit_equal(x[i], y[i]));
    REQUIRE(bit_equal(x[i].grad(), y[i].grad()));
    REQUIRE(x[i].version() == y[i].version());
  }
  const tg::StateDict sx = ox.state_dict(), sy = oy.state_dict();
  REQUIRE(sx.size() == sy.size());
  for (const auto& [key, t] : sx) {
    INFO("state " << key);
    REQUIRE(sy.contains(key));
    REQUIRE(bit_equal(t, sy.at(key)));
  }
}

using MakeOpt = std::function<std::unique_ptr<optim::Optimizer>(const Model&)>;

// Three steps of twin models: clip_grad_norm then step() on one, clip_and_step on the other.
void check_twins(tg::DType dt, double grad_scale, double max_norm, const MakeOpt& make) {
  Model ref = make_model(dt), fused = make_model(dt);
  auto oref = make(ref), ofused = make(fused);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    set_grads(ref, step, grad_scale);
    set_grads(fused, step, grad_scale);
    const double nref = optim::clip_grad_norm(ref.in_group_order(), max_norm);
    oref->step();
    const double nfused = ofused->clip_and_step(max_norm);
    REQUIRE(std::memcmp(&nref, &nfused, sizeof(double)) == 0);
    require_same(ref.p, fused.p, *oref, *ofused);
  }
  REQUIRE_FALSE(fused.p[3].grad().defined());
  for (const auto& [key, t] : ofused->state_dict()) REQUIRE(key.rfind("state.3.", 0) != 0);  // d: no state
}

}  // namespace

TEST_CASE("Adam and AdamW clip_and_step equal clip_grad_norm then step(), bit for bit", "[optim]") {
  for (const bool decoupled : {false, true})
    for (const double wd : {0.0, 0.1})
      for (const bool ams : {false, true})
        for (const tg::DType dt : tgtest::kFloatTypes)
          for (const double max_norm : {1.0, 1e6}) {  // the norm is about 270: clipped, not clipped
            INFO((decoupled ? "AdamW" : "Adam") << " wd " << wd << " amsgrad " << ams << ' ' << dtype_name(dt)
                                                << " max_norm " << max_norm);
            check_twins(dt, 1.0, max_norm, [&](const Model& m) -> std::unique_ptr<optim::Optimizer> {
              if (decoupled) return std::make_unique<optim::AdamW>(m.groups(wd), 1e-2, 0.9, 0.95, 1e-8, wd, ams);
              return std::make_unique<optim::Adam>(m.groups(wd), 1e-2, 0.9, 0.95, 1e-8, wd, ams);
            });
          }
}

TEST_CASE("SGD's clip_and_step (scale, then step) equals clip_grad_norm then step(), bit for bit", "[optim]") {
  for (const tg::DType dt : tgtest::kFloatTypes)
    for (const double max_norm : {1.0, 1e6}) {
      INFO(dt << " max_norm " << max_norm);
      check_twins(dt, 1.0, max_norm, [](const Model& m) -> std::unique_ptr<optim::Optimizer> {
        return std::make_unique<optim::SGD>(m.groups(0.01), 0.1, 0.9, 0.0, 0.01, true);
      });
    }
}

TEST_CASE("clip_and_step with two parameters sharing one gradient buffer equals clip_grad_norm then step()",
          "[optim]") {
  // The list {a, b, e}, e a (300, 250) parameter of its own whose gradient slot holds a's gradient
  // buffer: clip_grad_norm counts and scales that buffer twice, step() reads it for a and for e.
  for (const double max_norm : {1.0, 1e6}) {
    INFO("max_norm " << max_norm);
    Model ref = make_model(tg::float32), fused = make_model(tg::float32);
    tg::Generator gen(11);
    const Tensor e_values = tg::randn({300, 250}, tg::float32, &gen);
    Tensor e_ref = e_values.clone().requires_grad_(), e_fused = e_values.clone().requires_grad_();
    optim::AdamW oref(std::vector<Tensor>{ref.p[0], ref.p[1], e_ref}, 1e-2);
    optim::AdamW ofused(std::vector<Tensor>{fused.p[0], fused.p[1], e_fused}, 1e-2);
    for (int step = 0; step < 2; ++step) {
      set_grads(ref, step, 1.0);
      set_grads(fused, step, 1.0);
      e_ref.meta()->grad.set(ref.p[0].grad());
      e_fused.meta()->grad.set(fused.p[0].grad());
      REQUIRE(e_ref.grad().shares_storage(ref.p[0].grad()));
      const std::vector<float> g0 = ref.p[0].grad().to_vector<float>();
      const double nref = optim::clip_grad_norm({ref.p[0], ref.p[1], e_ref}, max_norm);
      const float c = static_cast<float>(max_norm / (nref + 1e-6));
      const std::vector<float> g1 = ref.p[0].grad().to_vector<float>();
      std::size_t wrong = 0;  // the shared buffer is scaled twice when clipped
      for (std::size_t k = 0; k < g0.size(); ++k) wrong += g1[k] != (c < 1 ? g0[k] * c * c : g0[k]);
      REQUIRE(wrong == 0);
      oref.step();
      REQUIRE(ofused.clip_and_step(max_norm) == nref);
      require_same({ref.p[0], ref.p[1], e_ref}, {fused.p[0], fused.p[1], e_fused}, oref, ofused);
    }
  }
}

TEST_CASE("grad_norm gives the same bits for any thread count, and the norm", "[optim]") {
  const int threads = tg::get_num_threads();
  Model m = make_model(tg::float32);
  set_grads(m, 0, 1.0);
  long double want = 0;  // the plain sum of squares, in extended precision
  for (const Tensor& p : m.p)
    if (p.grad().defined())
      for (const double g : p.grad().to_vector<double>()) want += static_cast<long double>(g) * g;
  std::vector<double> norms;
  for (const int nt : {1, 2, 3}) {
    tg::set_num_threads(nt);
    norms.push_back(optim::grad_norm(m.p));
  }
  tg::set_num_threads(threads);
  INFO("norms " << norms[0] << ' ' << norms[1] << ' ' << norms[2]);
  CHECK(std::memcmp(&norms[0], &norms[1], sizeof(double)) == 0);
  CHECK(std::memcmp(&norms[0], &norms[2], sizeof(double)) == 0);
  CHECK(std::fabs(norms[0] - std::sqrt(static_cast<double>(want))) <= 1e-13 * norms[0]);
  CHECK(norms[0] > 250);  // (75,271 N(0, 1) draws: about 274)
  CHECK(optim::grad_norm({m.p[3]}) == 0);  // no gradient: nothing to add
}

TEST_CASE("AdamW's clip_and_step gives the same bits for any thread count", "[optim]") {
  const int threads = tg::get_num_threads();
  std::vector<Model> runs;
  for (const int nt : {1, 2, 3}) {
    tg::set_num_threads(nt);
    Model m = make_model(tg::float32);
    optim::AdamW opt(m.groups(0.1), 1e-2, 0.9, 0.95, 1e-8, 0.1, true);
    for (int step = 0; step < 2; ++step) {
      set_grads(m, step, 1.0);
      opt.clip_and_step(1.0);
    }
    runs.push_back(m);
  }
  tg::set_num_threads(threads);
  for (std::size_t r = 1; r < runs.size(); ++r)
    for (std::size_t i = 0; i < 4; ++i) {
      INFO("run " << r << " parameter " << i);
      REQUIRE(bit_equal(runs[0].p[i], runs[r].p[i]));
      REQUIRE(bit_equal(runs[0].p[i].grad(), runs[r].p[i].grad()));
    }
}

TEST_CASE("clip_and_step with a non-finite gradient norm changes nothing and returns it", "[optim]") {
  const double bad_values[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()};
  for (const double bad : bad_values)
    for (const bool adam : {true, false}) {
      INFO((adam ? "AdamW" : "SGD") << " gradient entry " << bad);
      Model m = make_model(tg::float32);
      std::unique_ptr<optim::Optimizer> opt;
      if (adam) opt = std::make_unique<optim::AdamW>(m.groups(0.1), 1e-2);
      else opt = std::make_unique<optim::SGD>(m.groups(0.1), 0.1, 0.9);
      set_grads(m, 0, 1.0);
      REQUIRE(std::isfinite(opt->clip_and_step(1.0)));
      set_grads(m, 1, 1.0);
      m.p[1].grad().data<float>()[17] = static_cast<float>(bad);
      std::vector<Tensor> before, grads_before;
      for (const Tensor& p : m.p) {
        before.push_back(p.detach().clone());
        grads_before.push_back(p.grad().defined() ? p.grad().detach().clone() : Tensor());
      }
      const tg::StateDict state = opt->state_dict();
      const double n = opt->clip_and_step(1.0);
      CHECK((std::isnan(bad) ? std::isnan(n) : std::isinf(n)));
      for (std::size_t i = 0; i < m.p.size(); ++i) {
        INFO("parameter " << i);
        REQUIRE(bit_equal(before[i], m.p[i]));
        REQUIRE(bit_equal(grads_before[i], m.p[i].grad()));
      }
      for (const auto& [key, t] : opt->state_dict()) REQUIRE(bit_equal(t, state.at(key)));
    }
}

TEST_CASE("clip_and_step and grad_norm refuse bad arguments, naming the call and the value", "[optim]") {
  Model m = make_model(tg::float32);
  set_grads(m, 0, 1.0);
  const Tensor a0 = m.p[0].detach().clone();
  optim::AdamW adamw(m.groups(0.1), 1e-2);
  optim::SGD sgd(m.groups(0.1), 0.1);
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    INFO("max_norm " << bad);
    REQUIRE_TG_ERROR(adamw.clip_and_step(bad), "AdamW.clip_and_step", "max_norm must be positive");
    REQUIRE_TG_ERROR(sgd.clip_and_step(bad), "SGD.clip_and_step", "max_norm must be positive");
  }
  REQUIRE_TG_ERROR(adamw.clip_and_step(-2.5), "-2.5");
  REQUIRE(bit_equal(a0, m.p[0]));  // nothing was updated
  REQUIRE(adamw.state_dict().size() == 4);  // the groups' lr and weight_decay only
  REQUIRE_TG_ERROR(optim::grad_norm({m.p[0], Tensor()}), "grad_norm", "parameter 1", "undefined");
}
