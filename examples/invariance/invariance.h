#pragma once
// The paper's invariance claims (Zhang & Sennrich 2019, Table 1 and section 4) as measurements.
//
// Table 1: for y = f(norm(W x)) with inputs x (N, m) and weights W (n, m), apply each of six
// transformations and measure the largest relative change of the normalised output,
// max |y' - y| / max |y|. A cell is "invariant" when that change is at rounding level.
// Section 4: the gradient claims, as ratios that should equal 1 (or 1/delta).
#include <string>
#include <vector>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

namespace inv {

enum class Norm { batchnorm, weightnorm, layernorm, rmsnorm, prmsnorm };
enum class Transform { weight_rescale, weight_recenter, weight_vector_rescale, data_rescale, data_recenter, single_case_rescale };

const std::vector<Norm>& all_norms();
const std::vector<Transform>& all_transforms();
std::string name(Norm n);
std::string name(Transform t);
// The paper's verdict (the authors' README Table 1).
bool paper_says_invariant(Norm n, Transform t);

struct Setup {
  std::int64_t N = 16, m = 24, n = 32;  // batch, input width, output width
  double delta = 3.7;                   // the scale factor of the re-scalings
  double eps = 0.0;                     // the norm's epsilon (0: the paper's exact setting)
  double p = 0.0625;                    // pRMSNorm's fraction
  std::uint64_t seed = 0;
};

// norm(W x) in float64 for the given norm (no gain or bias: they do not affect invariance).
tg::Tensor normalised(Norm norm, const tg::Tensor& W, const tg::Tensor& x, const Setup& s);

struct Cell {
  double change;   // max |y' - y| / max |y|
  bool invariant;  // change <= kInvariantTol
};
inline constexpr double kInvariantTol = 1e-9;
Cell measure(Norm norm, Transform t, const Setup& s);

// Section 4 of the paper for RMSNorm (pRMSNorm when partial): each claim as a measured ratio
// next to the paper's value, and the largest element-wise deviation from the claim,
// max |measured - expected_ratio * reference| / max |reference|.
struct Claim {
  std::string what;
  double expected;   // the paper's ratio
  double ratio;      // measured (norm of the new quantity over the norm of the reference)
  double deviation;  // element-wise, relative
};
std::vector<Claim> measure_gradients(const Setup& s, bool partial = false);

}  // namespace inv
