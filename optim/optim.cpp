#include "tapegrad/optim.h"

#include <cmath>
#include <cstring>
#include <numbers>
#include <sstream>

#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "tapegrad/error.h"


namespace tg::optim {

namespace {

// Runs f with T = float or double for the parameter's dtype.
template <class F>
void dispatch(const char* op, DType d, F&& f) {
  if (d == float32) f(float{});
  else if (d == float64) f(double{});
  else fail(op, "parameters must be float32 or float64, got ", d);
}

// The per-parameter state keys an optimizer of a known kind keeps: scalar (a float64 0-d tensor)
// or a buffer shaped like its parameter. Unknown subclasses get no entry (any key is accepted).
struct StateKey {
  const char* key;
  bool scalar;
};
bool known_state_keys(const Optimizer& o, std::vector<StateKey>& keys) {
  if (const auto* a = dynamic_cast<const Adam*>(&o)) {
    keys = {{"step", true}, {"exp_avg", false}, {"exp_avg_sq", false}};
    if (a->amsgrad) keys.push_back({"max_exp_avg_sq", false});
    return true;
  }
  if (const auto* s = dynamic_cast<const SGD*>(&o)) {
    keys.clear();
    if (s->momentum != 0) keys = {{"initialized", true}, {"momentum_buffer", false}};
    return true;
  }
  return false;
}

}  // namespace

// ---- Optimizer ----

Optimizer::Optimizer(std::vector<ParamGroup> groups, std::string name, double default_lr, double default_wd)
    : name_(std::move(name)), groups_(std::move(groups)) {
  std::size_t n = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    ParamGroup& pg = groups_[g];
    if (pg.lr < 0) pg.lr = default_lr;
    if (pg.weight_decay < 0) pg.weight_decay = default_wd;
    check_lr(pg.lr);
    if (!std::isfinite(pg.weight_decay)) fail(name_.c_str(), "invalid weight_decay value: ", pg.weight_decay);
    for (std::size_t k = 0; k < pg.params.size(); ++k) {
      const Tensor& p = pg.params[k];
      // The message says what the parameter is (PyTorch 1.13: "can't optimize a non-leaf Tensor").
      if (!p.defined()) fail(name_.c_str(), "parameter ", k, " of group ", g, " is an undefined tensor");
      if (!is_floating(p.dtype()) || !p.is_leaf())
        fail(name_.c_str(), "parameter ", k, " of group ", g, " must be a float leaf tensor, got ",
             p.is_leaf() ? "a leaf " : "a non-leaf ", p.dtype(), ' ', p.shape());
    }
    n += pg.params.size();
  }
  if (n == 0) fail(name_.c_str(), "got an empty parameter list");
  state_.resize(n);
}

void Optimizer::check_lr(double lr) const {
  if (!(lr >= 0) || !std::isfinite(lr)) fail(name_.c_str(), "invalid learning rate: ", lr);
}

void Optimizer::zero_grad() {
  for (auto& g : groups_)
    for (auto& p : g.params) p.zero_grad();
}

void Optimizer::set_lr(double lr) {
  check_lr(lr);
  for (auto& g : groups_) g.lr = lr;
}

Tensor& Optimizer::state(std::size_t i, const std::string& key, const Tensor& like) {
  for (auto& [k, t] : state_[i])
    if (k == key) return t;
  state_[i].emplace_back(key, zeros(like.shape(), like.dtype()));
  return state_[i].back().second;
}

double& Optimizer::scalar_state(std::size_t i, const std::string& key) {
  for (auto& [k, t] : state_[i])
    if (k == key) return t.data<double>()[0];
  state_[i].emplace_back(key, zeros({}, float64));
  return state_[i].back().second.data<double>()[0];
}

template <class F>
void Optimizer::for_each_param_with_grad(F&& f) {
  std::size_t i = 0;
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (p.grad().defined()) {
        f(g, i, p);
        p.bump_version();  // an in-place write: a graph that saved p refuses its backward
      }
      ++i;
    }
}

StateDict Optimizer::state_dict() const {
  StateDict sd;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    sd.insert("group." + std::to_string(g) + ".lr", full({}, groups_[g].lr, float64));
    sd.insert("group." + std::to_string(g) + ".weight_decay", full({}, groups_[g].weight_decay, float64));
  }
  for (std::size_t i = 0; i < state_.size(); ++i)
    for (const auto& [k, t] : state_[i]) sd.insert("state." + std::to_string(i) + "." + k, t.clone());
  return sd;
}

namespace {

// Why state entry `key` (parameter n's state `rest`, tensor t) does not fit parameter p, or "" when
// it does: a key the optimizer never creates (when its keys are known), a scalar where a buffer
// belongs, a buffer of another shape or dtype.
std::string state_entry_error(const std::string& key, const std::string& rest, const Tensor& t, const Tensor& p,
                              std::size_t n, const std::vector<StateKey>* keys, const std::string& name) {
  bool scalar = t.dim() == 0 && t.dtype() == float64;
  const bool buffer = t.shape() == p.shape() && t.dtype() == p.dtype();
  if (keys) {
    const StateKey* k = nullptr;
    for (const auto& c : *keys)
      if (rest == c.key) k = &c;
    if (!k) return key + ": unexpected key (" + name + " keeps no such state)";
    if (k->scalar && !scalar) return key + ": expected a float64 scalar";
    if (!k->scalar) scalar = false;
  }
  if (scalar || buffer) return "";
  std::ostringstream s;
  s << key << ": " << t.dtype() << ' ' << t.shape() << " does not fit parameter " << n << ' ' << p.dtype() << ' ' << p.shape();
  return s.str();
}

}  // namespace

void Optimizer::load_state_dict(const StateDict& sd) {
  // Parameter i's shape and dtype, for checking.
  std::vector<const Tensor*> params;
  for (auto& g : groups_)
    for (auto& p : g.params) params.push_back(&p);
  std::vector<std::string> errors;
  std::vector<std::vector<std::pair<std::string, Tensor>>> next(state_.size());
  std::vector<double> lrs(groups_.size(), -1), wds(groups_.size(), -1);
  // A key this optimizer never creates (another optimizer's buffer, a typo, amsgrad's maximum
  // without amsgrad) or a scalar where a buffer belongs would otherwise be accepted and then read
  // out of bounds or silently ignored by step(). (PyTorch 1.13's load_state_dict copies state
  // entries unchecked; tapegrad's step() reads raw memory, so it checks every key.)
  std::vector<StateKey> keys;
  const bool known = known_state_keys(*this, keys);
  for (const auto& [key, t] : sd) {
    std::istringstream in(key);
    std::string kind, idx, rest;
    std::getline(in, kind, '.');
    std::getline(in, idx, '.');
    std::getline(in, rest);
    char* end = nullptr;
    const unsigned long n = std::strtoul(idx.c_str(), &end, 10);
    const bool num_ok = !idx.empty() && end && *end == '\0';
    if (kind == "group" && num_ok && n < groups_.size() && (rest == "lr" || rest == "weight_decay")) {
      if (t.numel() != 1 || t.dtype() != float64) { errors.push_back(key + ": expected a float64 scalar"); continue; }
      (rest == "lr" ? lrs : wds)[n] = t.item();
    } else if (kind == "state" && num_ok && n < state_.size() && !rest.empty()) {
      const std::string why = state_entry_error(key, rest, t, *params[n], n, known ? &keys : nullptr, name_);
      if (!why.empty()) {
        errors.push_back(why);
        continue;
      }
      next[n].emplace_back(rest, t.clone());
    } else {
      errors.push_back(key + ": unexpected key");
    }
  }
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (lrs[g] < 0 || wds[g] < 0 || !std::isfinite(lrs[g])) errors.push_back("group." + std::to_string(g) + ": missing or invalid lr / weight_decay");
  if (!errors.empty()) {
    std::ostringstream s;
    for (const auto& e : errors) s << "\n  " << e;
    fail(name_.c_str(), "load_state_dict: the state does not fit this optimizer; nothing was loaded", s.str());
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].lr = lrs[g];
    groups_[g].weight_decay = wds[g];
  }
  state_ = std::move(next);
}

// ---- SGD ----

SGD::SGD(std::vector<ParamGroup> groups, double lr, double m, double d, double wd, bool nest)
    : Optimizer(std::move(groups), "SGD", lr, wd), momentum(m), dampening(d), nesterov(nest) {
  check_lr(lr);
  if (!(m >= 0) || !std::isfinite(m)) fail("SGD", "invalid momentum value: ", m);
  if (!(wd >= 0) || !std::isfinite(wd)) fail("SGD", "invalid weight_decay value: ", wd);
  if (!std::isfinite(d)) fail("SGD", "invalid dampening value: ", d);
  // PyTorch 1.13's rule ("Nesterov momentum requires a momentum and zero dampening"), plus the values.
  if (nesterov && (m <= 0 || d != 0))
    fail("SGD", "nesterov momentum requires a momentum and zero dampening, got momentum ", m, " and dampening ", d);
}

SGD::SGD(std::vector<Tensor> params, double lr, double m, double d, double wd, bool nest)
    : SGD(std::vector<ParamGroup>{{std::move(params), lr, wd}}, lr, m, d, wd, nest) {}

void SGD::step() {
  for_each_param_with_grad([&](ParamGroup& g, std::size_t i, Tensor& p) {
    const double lr = g.lr, wd = g.weight_decay, m = momentum, damp = dampening;
    const bool first = m != 0 && scalar_state(i, "initialized") == 0;
    Tensor buf = m != 0 ? state(i, "momentum_buffer", p) : Tensor();
    if (m != 0) scalar_state(i, "initialized") = 1;
    dispatch("SGD", p.dtype(), [&](auto z) {
      using T = decltype(z);
      T* w = p.data<T>();
      const T* gr = p.grad().template data<T>();
      T* b = m != 0 ? buf.data<T>() : nullptr;
      const std::int64_t n = p.numel();
      const bool nest = nesterov;
      kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t k = lo; k < hi; ++k) {
          T d = gr[k];
          if (wd != 0) d = d + static_cast<T>(wd) * w[k];
          if (m != 0) {
            b[k] = first ? d : static_cast<T>(m) * b[k] + static_cast<T>(1 - damp) * d;
            d = nest ? d + static_cast<T>(m) * b[k] : b[k];
          }
          w[k] = w[k] - static_cast<T>(lr) * d;
        }
      });
    });
  });
}

// ---- Adam / AdamW ----

Adam::Adam(std::vector<ParamGroup> groups, std::string name, double lr, double b1, double b2, double e, double wd,
           bool ams, bool decoupled)
    : Optimizer(std::move(groups), name, lr, wd), beta1(b1), beta2(b2), eps(e), amsgrad(ams), decoupled_(decoupled) {
  const char* nm = this->name().c_str();
  check_lr(lr);
  if (!(b1 >= 0 && b1 < 1)) fail(nm, "invalid beta parameter at index 0: ", b1);
  if (!(b2 >= 0 && b2 < 1)) fail(nm, "invalid beta parameter at index 1: ", b2);
  if (!(e > 0) || !std::isfinite(e)) fail(nm, "invalid epsilon value: ", e);
  if (!(wd >= 0) || !std::isfinite(wd)) fail(nm, "invalid weight_decay value: ", wd);
  for (const auto& g : param_groups())
    if (!(g.weight_decay >= 0)) fail(nm, "invalid weight_decay value: ", g.weight_decay);
}

Adam::Adam(std::vector<ParamGroup> groups, double lr, double b1, double b2, double e, double wd, bool ams)
    : Adam(std::move(groups), "Adam", lr, b1, b2, e, wd, ams, false) {}
Adam::Adam(std::vector<Tensor> params, double lr, double b1, double b2, double e, double wd, bool ams)
    : Adam(std::vector<ParamGroup>{{std::move(params), lr, wd}}, "Adam", lr, b1, b2, e, wd, ams, false) {}
AdamW::AdamW(std::vector<ParamGroup> groups, double lr, double b1, double b2, double e, double wd, bool ams)
    : Adam(std::move(groups), "AdamW", lr, b1, b2, e, wd, ams, true) {}
AdamW::AdamW(std::vector<Tensor> params, double lr, double b1, double b2, double e, double wd, bool ams)
    : Adam(std::vector<ParamGroup>{{std::move(params), lr, wd}}, "AdamW", lr, b1, b2, e, wd, ams, true) {}

void Adam::step() {
  for_each_param_with_grad([&](ParamGroup& g, std::size_t i, Tensor& p) {
    double& t = scalar_state(i, "step");
    t += 1;
    Tensor m = state(i, "exp_avg", p), v = state(i, "exp_avg_sq", p);
    Tensor vmax = amsgrad ? state(i, "max_exp_avg_sq", p) : Tensor();
    const double lr = g.lr, wd = g.weight_decay, b1 = beta1, b2 = beta2, e = eps;
    const double bc1 = 1 - std::pow(b1, t), bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
    const double step_size = lr / bc1;
    const bool ams = amsgrad, dec = decoupled_;
    dispatch(name().c_str(), p.dtype(), [&](auto z) {
      using T = decltype(z);
      T* w = p.data<T>();
      const T* gr = p.grad().template data<T>();
      T* mp = m.data<T>();
      T* vp = v.data<T>();
      T* vm = ams ? vmax.data<T>() : nullptr;
      const std::int64_t n = p.numel();
      // The variant is chosen once, outside the loop: decoupled decay, an L2 term, AMSGrad. Tested
      // inside the loop, the three branches (two of them conditional stores) keep GCC from
      // vectorising it.
      kernels::with_bool(dec, [&](auto Dec) {
        kernels::with_bool(!dec && wd != 0, [&](auto L2) {
          kernels::with_bool(ams, [&](auto Ams) {
            kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
              const T decay = static_cast<T>(1 - lr * wd), l2 = static_cast<T>(wd), beta1_ = static_cast<T>(b1),
                      beta2_ = static_cast<T>(b2), one_b1 = static_cast<T>(1 - b1), one_b2 = static_cast<T>(1 - b2),
                      bc2 = static_cast<T>(bc2_sqrt), eps_ = static_cast<T>(e), step = static_cast<T>(step_size);
              for (std::int64_t k = lo; k < hi; ++k) {
                T gk = gr[k];
                if constexpr (decltype(Dec)::value) w[k] = w[k] * decay;  // AdamW: decoupled decay
                if constexpr (decltype(L2)::value) gk = gk + l2 * w[k];   // Adam: L2 in the gradient
                mp[k] = mp[k] * beta1_ + gk * one_b1;
                vp[k] = vp[k] * beta2_ + one_b2 * gk * gk;
                T vk = vp[k];
                if constexpr (decltype(Ams)::value) {
                  vm[k] = vm[k] > vk ? vm[k] : vk;
                  vk = vm[k];
                }
                const T denom = std::sqrt(vk) / bc2 + eps_;
                w[k] = w[k] - step * (mp[k] / denom);
              }
            });
          });
        });
      });
    });
  });
}

// ---- schedules ----

ConstantLR::ConstantLR(double lr) : lr_(lr) {
  if (!(lr >= 0) || !std::isfinite(lr)) fail("ConstantLR", "invalid learning rate: ", lr);
}

StepLR::StepLR(double lr, std::int64_t step_size, double gamma) : lr_(lr), step_size_(step_size), gamma_(gamma) {
  if (!(lr >= 0) || !std::isfinite(lr)) fail("StepLR", "invalid learning rate: ", lr);
  if (step_size < 1) fail("StepLR", "step_size must be >= 1, got ", step_size);
  if (!(gamma > 0) || !std::isfinite(gamma)) fail("StepLR", "invalid gamma: ", gamma);
}
double StepLR::operator()(std::int64_t step) const {
  return lr_ * std::pow(gamma_, static_cast<double>(step / step_size_));
}

WarmupCosineLR::WarmupCosineLR(double lr, double min_lr, std::int64_t warmup, std::int64_t decay)
    : lr_(lr), min_lr_(min_lr), warmup_(warmup), decay_(decay) {
  if (!(lr >= 0) || !std::isfinite(lr)) fail("WarmupCosineLR", "invalid learning rate: ", lr);
  if (!(min_lr >= 0) || min_lr > lr) fail("WarmupCosineLR", "min_lr must be in [0, lr], got ", min_lr);
  if (warmup < 0) fail("WarmupCosineLR", "warmup must be >= 0, got ", warmup);
  if (decay < 0) fail("WarmupCosineLR", "decay_steps must be >= 0, got ", decay);
}
double WarmupCosineLR::operator()(std::int64_t it) const {
  if (it < warmup_) return lr_ * static_cast<double>(it + 1) / static_cast<double>(warmup_ + 1);
  if (it > decay_ || decay_ <= warmup_) return min_lr_;  // (a run shorter than its warmup never gets here)
  const double ratio = static_cast<double>(it - warmup_) / static_cast<double>(decay_ - warmup_);
  return min_lr_ + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (lr_ - min_lr_);
}

// ---- clipping ----

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  if (!(max_norm > 0) || !std::isfinite(max_norm)) fail("clip_grad_norm", "max_norm must be positive, got ", max_norm);
  double total = 0;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    dispatch("clip_grad_norm", g.dtype(), [&](auto z) {
      using T = decltype(z);
      const T* d = g.data<T>();
      const std::int64_t n = g.numel();
      // Per-thread partial sums added in thread order (an OpenMP reduction's order is unspecified):
      // the same norm, bit for bit, on every run with the same thread count.
      std::vector<double> part(static_cast<std::size_t>(omp_get_max_threads()), 0.0);
      kernels::parallel_region(n, [&](int t, int nt) {
        const T* c = d + kernels::chunk_begin(n, t, nt);
        part[static_cast<std::size_t>(t)] = kernels::sum16(kernels::chunk_begin(n, t + 1, nt) - kernels::chunk_begin(n, t, nt),
                                                           [&](std::int64_t k) { return static_cast<double>(c[k]) * c[k]; });
      });
      for (double s : part) total += s;
    });
  }
  total = std::sqrt(total);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      dispatch("clip_grad_norm", g.dtype(), [&](auto z) {
        using T = decltype(z);
        T* d = g.data<T>();
        const std::int64_t n = g.numel();
        kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t k = lo; k < hi; ++k) d[k] = d[k] * static_cast<T>(coef);
        });
      });
    }
  }
  return total;
}

void clip_grad_value(const std::vector<Tensor>& params, double clip_value) {
  if (!(clip_value >= 0) || !std::isfinite(clip_value)) fail("clip_grad_value", "clip_value must be >= 0, got ", clip_value);
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    dispatch("clip_grad_value", g.dtype(), [&](auto z) {
      using T = decltype(z);
      T* d = g.data<T>();
      const T c = static_cast<T>(clip_value);
      for (std::int64_t k = 0; k < g.numel(); ++k) d[k] = d[k] > c ? c : d[k] < -c ? -c : d[k];
    });
  }
}

}  // namespace tg::optim
