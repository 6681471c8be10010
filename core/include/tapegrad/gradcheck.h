#pragma once
// Finite-difference gradient check, like torch.autograd.gradcheck.
//
// For a function f of float64 tensors, take a fixed random weighting R of its output and the
// scalar L(x) = sum(f(x) * R). The analytic gradient dL/dx comes from one backward pass over the
// tape; the numeric one from central differences (L(x + h e_i) - L(x - h e_i)) / 2h, element by
// element. Comparing J^T R for a random R catches the same errors as comparing the full Jacobian
// (a wrong entry survives only if it is orthogonal to R, probability zero) at a fraction of the cost.
#include <functional>
#include <string>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

struct GradcheckOptions {
  double eps = 1e-6;   // finite-difference step h
  double atol = 1e-5;  // |analytic - numeric| <= atol + rtol * |numeric|
  double rtol = 1e-3;
  std::uint64_t seed = 0;  // for the output weighting R
};

struct GradcheckReport {
  struct Input {
    std::size_t index;     // position in the inputs vector
    Shape shape;
    double max_abs_err;    // max over elements of |analytic - numeric| (NaN when any is NaN)
    double max_rel_err;    // max over elements of |analytic - numeric| / max(|numeric|, 1e-12) (likewise)
    bool ok;
  };
  std::vector<Input> inputs;  // one per input that requires grad
  bool ok = true;
  std::string str() const;
};

// Inputs that require grad are checked; the rest are constants. All must be float64.
GradcheckReport gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opt = {});

}  // namespace tg
