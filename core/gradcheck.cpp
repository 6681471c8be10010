#include "tapegrad/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"
#include "tapegrad/random.h"

namespace tg {

std::string GradcheckReport::str() const {
  std::ostringstream s;
  s << "gradcheck " << (ok ? "passed" : "FAILED") << '\n';
  for (const Input& in : inputs)
    s << "  input " << in.index << ' ' << in.shape << ": max abs err " << in.max_abs_err << ", max rel err "
      << in.max_rel_err << (in.ok ? "" : "  <-- mismatch") << '\n';
  return s.str();
}

namespace {

void check_args(const std::vector<Tensor>& inputs, const GradcheckOptions& opt) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) fail("gradcheck", "input ", i, " is undefined");
    if (inputs[i].requires_grad() && inputs[i].dtype() != float64)
      fail("gradcheck", "input ", i, " ", inputs[i].shape(), " is ", inputs[i].dtype(), "; finite differences need float64");
  }
  if (!(opt.eps > 0)) fail("gradcheck", "eps must be positive, got ", opt.eps);
}

// Input i's analytic gradient against central differences of L, element by element:
// (L(x + eps e_k) - L(x - eps e_k)) / (2 eps).
GradcheckReport::Input compare(const std::function<double()>& L, Tensor x, std::size_t i, const GradcheckOptions& opt) {
  const Tensor ga = x.grad();
  const std::int64_t n = x.numel();
  std::vector<double> analytic = ga.defined() ? ga.to_vector<double>() : std::vector<double>(static_cast<std::size_t>(n), 0.0);
  double* p = x.data<double>();
  GradcheckReport::Input r{i, x.shape(), 0.0, 0.0, true};
  for (std::int64_t k = 0; k < n; ++k) {
    const double orig = p[k];
    p[k] = orig + opt.eps;
    const double lp = L();
    p[k] = orig - opt.eps;
    const double lm = L();
    p[k] = orig;
    const double num = (lp - lm) / (2 * opt.eps);
    const double err = std::fabs(analytic[static_cast<std::size_t>(k)] - num);
    // The worst so far, NaN once any error is NaN (std::max would keep the earlier value and
    // report a failed check with an error of 0).
    auto worst = [](double a, double b) { return std::isnan(a) ? a : (std::isnan(b) || b > a) ? b : a; };
    r.max_abs_err = worst(r.max_abs_err, err);
    r.max_rel_err = worst(r.max_rel_err, err / std::max(std::fabs(num), 1e-12));
    if (!(err <= opt.atol + opt.rtol * std::fabs(num))) r.ok = false;  // NaN fails too
  }
  return r;
}

}  // namespace

GradcheckReport gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opt) {
  check_args(inputs, opt);
  // The fixed weighting R of the output, drawn once: L = sum(f(x) * R).
  Tensor R;
  {
    NoGradGuard ng;
    Tensor y = f(inputs);
    if (!y.defined() || y.dtype() != float64) fail("gradcheck", "f must return a float64 tensor");
    Generator g(opt.seed + 0x5eed);
    R = randn(y.shape(), float64, &g);
  }
  auto L = [&](const std::vector<Tensor>& xs) { return sum(mul(f(xs), R)); };
  // Analytic: one backward pass. Clear any gradient the caller left behind, and restore it after.
  std::vector<Tensor> old_grads;
  for (const Tensor& x : inputs) {
    old_grads.push_back(x.grad());
    const_cast<Tensor&>(x).zero_grad();
  }
  Tensor loss = L(inputs);
  if (!loss.requires_grad()) fail("gradcheck", "the output does not depend on any input that requires grad");
  loss.backward();
  NoGradGuard ng;
  GradcheckReport rep;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    rep.inputs.push_back(compare([&] { return L(inputs).item(); }, inputs[i], i, opt));
    rep.ok = rep.ok && rep.inputs.back().ok;
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    Tensor x = inputs[i];
    x.zero_grad();
    if (old_grads[i].defined()) x.ensure_meta()->grad.set(old_grads[i]);
  }
  return rep;
}

}  // namespace tg
