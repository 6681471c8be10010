#include "tapegrad/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <optional>
#include <sstream>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "tapegrad/error.h"
#include "tapegrad/memory.h"


namespace tg::optim {

namespace {

// Runs f with T = float or double for the parameter's dtype.
template <class F>
void dispatch(const char* op, DType d, F&& f) {
  if (d == float32) f(float{});
  else if (d == float64) f(double{});
  else fail(op, "parameters must be float32 or float64, got ", d);
}

// ---- blocks: the unit of the norm's summation order and of the threaded passes ----
constexpr std::int64_t kBlock = std::int64_t{1} << 15;

// Elements [lo, hi) of item `item` (a tensor, a job).
struct Block {
  std::size_t item;
  std::int64_t lo, hi;
};

// Items of the given sizes cut into blocks of at most kBlock elements, item by item, in order.
std::vector<Block> blocks_of(const std::vector<std::int64_t>& sizes) {
  std::vector<Block> blocks;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (std::int64_t lo = 0; lo < sizes[i]; lo += kBlock) blocks.push_back({i, lo, std::min(sizes[i], lo + kBlock)});
  return blocks;
}

// body(block) for every block, each thread of the team taking a contiguous run of blocks when
// `elements` (their total) is large.
template <class F>
void for_blocks(const std::vector<Block>& blocks, std::int64_t elements, F&& body) {
  kernels::parallel_for(static_cast<std::int64_t>(blocks.size()), elements, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t k = lo; k < hi; ++k) body(blocks[static_cast<std::size_t>(k)]);
  });
}

// body(item, lo, hi) over the blocks of items of the given sizes: all items in one threaded pass when
// `together`, else item after item (each threaded), for items that share memory.
template <class F>
void for_items(const std::vector<std::int64_t>& sizes, bool together, F&& body) {
  auto run = [&](std::size_t first, std::size_t count) {
    const std::vector<std::int64_t> part(sizes.begin() + static_cast<std::ptrdiff_t>(first),
                                         sizes.begin() + static_cast<std::ptrdiff_t>(first + count));
    std::int64_t elements = 0;
    for (const std::int64_t n : part) elements += n;
    const std::vector<Block> blocks = blocks_of(part);
    for_blocks(blocks, elements, [&](const Block& b) { body(first + b.item, b.lo, b.hi); });
  };
  if (together) run(0, sizes.size());
  else
    for (std::size_t i = 0; i < sizes.size(); ++i) run(i, 1);
}

// The bytes [begin, end) of n elements of dtype d at p.
using ByteRange = std::pair<const char*, const char*>;
ByteRange bytes_of(const void* p, std::int64_t n, DType d) {
  const char* b = static_cast<const char*>(p);
  return {b, b + static_cast<std::size_t>(n) * itemsize(d)};
}

// True when no two of the ranges overlap (empty ones never do).
bool disjoint(std::vector<ByteRange> r) {
  std::erase_if(r, [](const ByteRange& x) { return x.first == x.second; });
  std::sort(r.begin(), r.end());
  for (std::size_t k = 1; k < r.size(); ++k)
    if (r[k].first < r[k - 1].second) return false;
  return true;
}

// sum_{lo <= k < hi} g[k]^2 in double (g float32 or float64).
double sum_of_squares(const Tensor& g, std::int64_t lo, std::int64_t hi) {
  if (g.dtype() == float32) {
    const float* d = g.data<float>() + lo;
    return kernels::sum16(hi - lo, [&](std::int64_t k) { return static_cast<double>(d[k]) * d[k]; });
  }
  const double* d = g.data<double>() + lo;
  return kernels::sum16(hi - lo, [&](std::int64_t k) { return d[k] * d[k]; });
}

// g[lo, hi) *= coef (g float32 or float64).
void scale_range(Tensor& g, double coef, std::int64_t lo, std::int64_t hi) {
  kernels::with_bool(g.dtype() == float32, [&](auto F32) {
    using T = std::conditional_t<decltype(F32)::value, float, double>;
    T* d = g.data<T>();
    for (std::int64_t k = lo; k < hi; ++k) d[k] = d[k] * static_cast<T>(coef);
  });
}

// grad *= coef for every parameter with a gradient, in list order (a tensor listed twice is
// scaled twice, as torch.nn.utils.clip_grad_norm_ does): one threaded pass over all of them,
// or tensor after tensor where gradients share memory.
void scale_grads(const std::vector<Tensor>& params, double coef) {
  std::vector<Tensor> grads;
  std::vector<std::int64_t> sizes;
  std::vector<ByteRange> ranges;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    dispatch("clip_grad_norm", g.dtype(), [](auto) {});
    sizes.push_back(g.numel());
    ranges.push_back(bytes_of(g.raw_data(), g.numel(), g.dtype()));
    grads.push_back(std::move(g));
  }
  for_items(sizes, disjoint(std::move(ranges)),
            [&](std::size_t i, std::int64_t lo, std::int64_t hi) { scale_range(grads[i], coef, lo, hi); });
}

void check_max_norm(const std::string& op, double max_norm) {
  if (!(max_norm > 0) || !std::isfinite(max_norm)) fail(op.c_str(), "max_norm must be positive, got ", max_norm);
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
  // A parameter is its memory: handles that share it (copies of one Tensor, or an alias under
  // another shape) are one parameter, and each data pointer belongs to one Storage. Listed twice,
  // it would take two updates per step and keep two sets of state.
  std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> first;  // data -> (group, index)
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    ParamGroup& pg = groups_[g];
    if (pg.lr < 0) pg.lr = default_lr;
    if (pg.weight_decay < 0) pg.weight_decay = default_wd;
    if (const std::string why = hyperparameter_error(pg); !why.empty()) fail(name_.c_str(), why);
    for (std::size_t k = 0; k < pg.params.size(); ++k) {
      const Tensor& p = pg.params[k];
      // The message says what the parameter is (PyTorch 1.13: "can't optimize a non-leaf Tensor").
      if (!p.defined()) fail(name_.c_str(), "parameter ", k, " of group ", g, " is an undefined tensor");
      if (!is_floating(p.dtype()) || !p.is_leaf())
        fail(name_.c_str(), "parameter ", k, " of group ", g, " must be a float leaf tensor, got ",
             p.is_leaf() ? "a leaf " : "a non-leaf ", p.dtype(), ' ', p.shape());
      const auto [it, added] = first.emplace(p.raw_data(), std::pair{g, k});
      if (!added)
        fail(name_.c_str(), "parameter ", k, " of group ", g, " (", p.dtype(), ' ', p.shape(), ") is parameter ",
             it->second.second, " of group ", it->second.first,
             " again (the same memory); list each parameter once, or a step updates it twice");
    }
    n += pg.params.size();
    made_.push_back(pg.params);
  }
  if (n == 0) fail(name_.c_str(), "got an empty parameter list");
  state_.resize(n);
}

void Optimizer::check_lr(double lr) const {
  if (!(lr >= 0) || !std::isfinite(lr)) fail(name_.c_str(), "invalid learning rate: ", lr);
}

std::string Optimizer::hyperparameter_error(const ParamGroup& g) {
  std::ostringstream s;
  if (!(g.lr >= 0) || !std::isfinite(g.lr)) s << "invalid learning rate: " << g.lr;
  else if (!(g.weight_decay >= 0) || !std::isfinite(g.weight_decay)) s << "invalid weight_decay value: " << g.weight_decay;
  return s.str();
}

void Optimizer::check_groups() const {
  const char* me = name_.c_str();
  if (groups_.size() != made_.size())
    fail(me, "param_groups() holds ", groups_.size(), " groups where the optimizer was made with ", made_.size(),
         "; its state follows the parameters it was made with: make a new optimizer for others");
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& pg = groups_[g];
    if (const std::string why = hyperparameter_error(pg); !why.empty()) fail(me, "group ", g, ": ", why);
    if (pg.params.size() != made_[g].size())
      fail(me, "group ", g, " of param_groups() holds ", pg.params.size(), " parameters where the optimizer was made with ",
           made_[g].size(), "; its state follows the parameters it was made with: make a new optimizer for others");
    for (std::size_t k = 0; k < pg.params.size(); ++k) {
      const Tensor &p = pg.params[k], &m = made_[g][k];
      if (!p.defined() || p.raw_data() != m.raw_data() || p.dtype() != m.dtype() || p.shape() != m.shape())
        fail(me, "parameter ", k, " of group ", g, " (",
             p.defined() ? std::string(dtype_name(p.dtype())) + " " + p.shape().str() : "undefined",
             ") is not the one the optimizer was made with (", m.dtype(), ' ', m.shape(),
             "); its state follows the parameters it was made with: make a new optimizer for others");
    }
  }
}

void Optimizer::zero_grad() {
  for (auto& g : groups_)
    for (auto& p : g.params) p.zero_grad();
}

void Optimizer::set_lr(double lr) {
  check_lr(lr);
  for (auto& g : groups_) g.lr = lr;
}

std::vector<Tensor> Optimizer::all_params() const {
  std::vector<Tensor> ps;
  for (const auto& g : groups_) ps.insert(ps.end(), g.params.begin(), g.params.end());
  return ps;
}

double Optimizer::clip_and_step(double max_norm) {
  check_max_norm(name_ + ".clip_and_step", max_norm);
  check_groups();
  const std::vector<Tensor> ps = all_params();
  const double total = grad_norm(ps);
  if (!std::isfinite(total)) return total;
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) scale_grads(ps, coef);
  step();
  return total;
}

Tensor& Optimizer::state(std::size_t i, const std::string& key, const Tensor& like) {
  for (auto& [k, t] : state_[i])
    if (k == key) return t;
  const LongLivedAllocations kept_for_the_run;  // apart from the step's activations (tapegrad/memory.h)
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
  check_groups();
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
  check_groups();
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

// v as the messages print numbers (1e-05, nan, -1), not std::to_string's six decimals.
std::string num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

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
    // A step count is a whole number >= 0 (Adam divides by 1 - beta^step: a count of -1 or NaN makes
    // the next step write NaN into the parameter); SGD's flag is 0 or 1.
    const double v = scalar ? t.item() : 0;
    if (rest == "step" && !(v >= 0 && v == std::floor(v) && std::isfinite(v)))
      return key + ": a step count must be a whole number >= 0, got " + num(v);
    if (rest == "initialized" && v != 0 && v != 1) return key + ": must be 0 or 1, got " + num(v);
  }
  if (scalar || buffer) return "";
  std::ostringstream s;
  s << key << ": " << t.dtype() << ' ' << t.shape() << " does not fit parameter " << n << ' ' << p.dtype() << ' ' << p.shape();
  return s.str();
}

}  // namespace

void Optimizer::load_state_dict(const StateDict& sd) {
  check_groups();
  // Parameter i's shape and dtype, for checking.
  std::vector<const Tensor*> params;
  for (auto& g : groups_)
    for (auto& p : g.params) params.push_back(&p);
  std::vector<std::string> errors;
  std::vector<std::vector<std::pair<std::string, Tensor>>> next(state_.size());
  std::vector<std::optional<double>> lrs(groups_.size()), wds(groups_.size());  // empty: no key gave it
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
      const LongLivedAllocations kept_for_the_run;  // as state() makes it
      next[n].emplace_back(rest, t.clone());
    } else {
      errors.push_back(key + ": unexpected key");
    }
  }
  // The constructor's checks: lr and weight_decay finite and >= 0 (NaN fails both comparisons).
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (const auto& [what, v] : {std::pair{"lr", lrs[g]}, {"weight_decay", wds[g]}}) {
      const std::string key = "group." + std::to_string(g) + "." + what;
      if (!v) errors.push_back(key + ": missing");
      else if (!(*v >= 0) || !std::isfinite(*v)) errors.push_back(key + ": must be finite and >= 0, got " + num(*v));
    }
  if (!errors.empty()) {
    std::ostringstream s;
    for (const auto& e : errors) s << "\n  " << e;
    fail(name_.c_str(), "load_state_dict: the state does not fit this optimizer; nothing was loaded", s.str());
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].lr = *lrs[g];
    groups_[g].weight_decay = *wds[g];
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

namespace {

// One parameter's Adam / AdamW update: its buffers (n elements of `dtype`), the step's constants
// and the loop variant that runs it over a range of elements.
struct AdamJob;
using AdamFn = void (*)(const AdamJob&, std::int64_t lo, std::int64_t hi);
struct AdamJob {
  DType dtype;
  void *w, *g, *m, *v, *vmax;  // p, grad, exp_avg, exp_avg_sq (n); vmax: AMSGrad's maximum, else null
  std::int64_t n;
  double lr, wd, b1, b2, eps, step_size, bc2_sqrt, coef;  // step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t)
  bool l2;  // Adam with weight decay: wd p added to the gradient
  AdamFn fn;
};

// Elements [lo, hi) of one job, with g = clip ? grad coef : grad (the clipped gradient written
// back):  AdamW: p *= 1 - lr wd;  Adam: g += wd p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
// AMSGrad: vmax = max(vmax, v), used for v;  p -= step_size m / (sqrt(v) / bc2_sqrt + eps).
// Each variant is its own plain loop (a flag tested inside the loop, above all one guarding a
// store, keeps GCC from vectorising it); the arithmetic is the same expression, in the same
// order, in every variant, so clipped-in-registers and clipped-in-memory gradients give the same
// bits. The buffers never overlap (Adam::update checks).
template <class T, bool Dec, bool L2, bool Ams, bool Clip>
void adam_range(const AdamJob& j, std::int64_t lo, std::int64_t hi) {
  T* __restrict w = static_cast<T*>(j.w);
  T* __restrict gr = static_cast<T*>(j.g);
  T* __restrict mp = static_cast<T*>(j.m);
  T* __restrict vp = static_cast<T*>(j.v);
  T* __restrict vm = static_cast<T*>(j.vmax);
  const T decay = static_cast<T>(1 - j.lr * j.wd), l2 = static_cast<T>(j.wd), beta1 = static_cast<T>(j.b1),
          beta2 = static_cast<T>(j.b2), one_b1 = static_cast<T>(1 - j.b1), one_b2 = static_cast<T>(1 - j.b2),
          bc2 = static_cast<T>(j.bc2_sqrt), eps = static_cast<T>(j.eps), step = static_cast<T>(j.step_size),
          coef = static_cast<T>(j.coef);
  for (std::int64_t k = lo; k < hi; ++k) {
    T gk = gr[k];
    if constexpr (Clip) {
      gk = gk * coef;
      gr[k] = gk;
    }
    if constexpr (Dec) w[k] = w[k] * decay;  // AdamW: decoupled decay
    if constexpr (L2) gk = gk + l2 * w[k];   // Adam: L2 in the gradient
    mp[k] = mp[k] * beta1 + gk * one_b1;
    vp[k] = vp[k] * beta2 + one_b2 * gk * gk;
    T vk = vp[k];
    if constexpr (Ams) {
      vm[k] = vm[k] > vk ? vm[k] : vk;
      vk = vm[k];
    }
    const T denom = std::sqrt(vk) / bc2 + eps;
    w[k] = w[k] - step * (mp[k] / denom);
  }
}

template <class T>
AdamFn adam_variant(bool dec, bool l2, bool ams, bool clip) {
  AdamFn fn = nullptr;
  kernels::with_bool(dec, [&](auto D) {
    kernels::with_bool(l2, [&](auto L) {
      kernels::with_bool(ams, [&](auto A) {
        kernels::with_bool(clip, [&](auto C) {
          fn = &adam_range<T, decltype(D)::value, decltype(L)::value, decltype(A)::value, decltype(C)::value>;
        });
      });
    });
  });
  return fn;
}

// True when no two jobs share parameter or gradient memory (parameters never do: the constructor
// refuses a parameter listed twice; gradients may share a buffer): only then may all jobs run in
// one pass, and clip in registers.
bool disjoint(const std::vector<AdamJob>& jobs) {
  std::vector<ByteRange> r;
  for (const AdamJob& j : jobs)
    for (const void* p : {j.w, j.g}) r.push_back(bytes_of(p, j.n, j.dtype));
  return disjoint(std::move(r));
}

}  // namespace

void Adam::step() { update(1); }

double Adam::clip_and_step(double max_norm) {
  check_max_norm(name() + ".clip_and_step", max_norm);  // the groups are checked by update(), first
  const double total = grad_norm(all_params());
  if (std::isfinite(total)) update(max_norm / (total + 1e-6));
  return total;
}

void Adam::update(double coef) {
  std::vector<AdamJob> jobs;
  for_each_param_with_grad([&](ParamGroup& g, std::size_t i, Tensor& p) {
    dispatch(name().c_str(), p.dtype(), [](auto) {});
    Tensor grad = p.grad();
    if (grad.dtype() != p.dtype() || grad.numel() != p.numel())
      fail(name().c_str(), "parameter ", i, ' ', p.dtype(), ' ', p.shape(), " has a ", grad.dtype(), ' ', grad.shape(),
           " gradient");
    double& t = scalar_state(i, "step");
    t += 1;
    Tensor m = state(i, "exp_avg", p), v = state(i, "exp_avg_sq", p);
    Tensor vmax = amsgrad ? state(i, "max_exp_avg_sq", p) : Tensor();
    jobs.push_back({p.dtype(), p.raw_data(), grad.raw_data(), m.raw_data(), v.raw_data(),
                    amsgrad ? vmax.raw_data() : nullptr, p.numel(), g.lr, g.weight_decay, beta1, beta2, eps,
                    g.lr / (1 - std::pow(beta1, t)), std::sqrt(1 - std::pow(beta2, t)), coef,
                    !decoupled_ && g.weight_decay != 0, nullptr});
  });
  // Clipping as clip_grad_norm does it (a pass scaling every gradient, then the update, parameter
  // by parameter) where memory is shared; in the update's registers otherwise.
  const bool clip = coef < 1, together = disjoint(jobs);
  if (clip && !together) scale_grads(all_params(), coef);
  for (AdamJob& j : jobs)
    j.fn = j.dtype == float32 ? adam_variant<float>(decoupled_, j.l2, amsgrad, clip && together)
                              : adam_variant<double>(decoupled_, j.l2, amsgrad, clip && together);
  std::vector<std::int64_t> sizes;
  for (const AdamJob& j : jobs) sizes.push_back(j.n);
  for_items(sizes, together, [&](std::size_t i, std::int64_t lo, std::int64_t hi) { jobs[i].fn(jobs[i], lo, hi); });
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
  if (step < 0) fail("StepLR", "step must be >= 0, got ", step);
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
  if (it < 0) fail("WarmupCosineLR", "step must be >= 0, got ", it);
  if (it < warmup_) return lr_ * static_cast<double>(it + 1) / static_cast<double>(warmup_ + 1);
  if (it > decay_ || decay_ <= warmup_) return min_lr_;  // (a run shorter than its warmup never gets here)
  const double ratio = static_cast<double>(it - warmup_) / static_cast<double>(decay_ - warmup_);
  return min_lr_ + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (lr_ - min_lr_);
}

// ---- clipping ----

double grad_norm(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  std::vector<std::int64_t> sizes;
  std::int64_t elements = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) fail("grad_norm", "parameter ", i, " is an undefined tensor");
    Tensor g = params[i].grad();
    if (!g.defined()) continue;
    if (g.dtype() != float32 && g.dtype() != float64)
      fail("grad_norm", "the gradient of parameter ", i, " must be float32 or float64, got ", g.dtype());
    sizes.push_back(g.numel());
    elements += g.numel();
    grads.push_back(std::move(g));
  }
  const std::vector<Block> blocks = blocks_of(sizes);
  std::vector<double> part(blocks.size());
  for_blocks(blocks, elements, [&](const Block& b) {
    part[static_cast<std::size_t>(&b - blocks.data())] = sum_of_squares(grads[b.item], b.lo, b.hi);
  });
  double total = 0;
  for (const double s : part) total += s;
  return std::sqrt(total);
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  check_max_norm("clip_grad_norm", max_norm);
  const double total = grad_norm(params);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) scale_grads(params, coef);
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
