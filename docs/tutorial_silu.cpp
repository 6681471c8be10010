// tutorial_silu: the program docs/tutorial.md builds, piece by piece. A new differentiable op,
// SiLU, from its kernel to a model that trains with it, then partial RMSNorm from existing ops.
// Every step prints what it shows; the exit status is 0 only when every check passes. It uses the
// installed package's public headers and nothing else.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

// [forward kernel]
namespace kernels {

// s = sigmoid(x) = 1 / (1 + e^-x). For very negative x, e^-x overflows to inf and s is 0, its limit.
template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// SiLU: y = x * sigmoid(x), elementwise.
// x, y: (N)
template <class T>
void silu_forward(const T* x, T* y, std::int64_t N) {
  for (std::int64_t i = 0; i < N; ++i) y[i] = x[i] * sigmoid(x[i]);
}

}  // namespace kernels
// [end]

// [backward kernel]
namespace kernels {

// dx = dy * (s + x s (1 - s)), with s = sigmoid(x) recomputed from the saved input. dx is a
// fresh buffer: the kernel assigns every element and never adds.
// x, dy, dx: (N)
template <class T>
void silu_backward(const T* x, const T* dy, T* dx, std::int64_t N) {
  for (std::int64_t i = 0; i < N; ++i) {
    const T s = sigmoid(x[i]);
    dx[i] = dy[i] * (s + x[i] * s * (T(1) - s));
  }
}

}  // namespace kernels
// [end]

// [op]
// tapegrad has this op as tg::silu; the tutorial's own is tutorial::silu, rebuilt from nothing.
namespace tutorial {

// silu(x) = x * sigmoid(x), elementwise (PyTorch's F.silu); float32 or float64, any shape.
tg::Tensor silu(const tg::Tensor& x) {
  const char* op = "silu";
  if (!x.defined()) tg::fail(op, "input is an undefined tensor");
  if (x.dtype() != tg::float32 && x.dtype() != tg::float64)
    tg::fail(op, "expected a float32 or float64 tensor, got ", x.dtype(), " ", x.shape());

  const std::int64_t N = x.numel();
  tg::Tensor y = tg::Tensor::empty(x.shape(), x.dtype());
  if (x.dtype() == tg::float32) kernels::silu_forward(x.data<float>(), y.data<float>(), N);
  else kernels::silu_forward(x.data<double>(), y.data<double>(), N);

  if (tg::should_record({&x})) {
    struct Saved { tg::Tensor x; };  // the input; backward recomputes s from it
    tg::record(op, {&x}, {&y}, Saved{x.detach()}, [N](tg::Node& n, const Saved& s) {
      const tg::Tensor& dy = n.grad_out();  // dL/dy
      tg::Tensor dx = n.new_grad(0);         // a fresh buffer of x's shape and dtype
      if (s.x.dtype() == tg::float32)
        kernels::silu_backward(s.x.data<float>(), dy.data<float>(), dx.data<float>(), N);
      else
        kernels::silu_backward(s.x.data<double>(), dy.data<double>(), dx.data<double>(), N);
      n.pass_grad(0, std::move(dx));  // x's gradient: the tape takes it, or adds it to one there
    });
  }
  return y;
}

}  // namespace tutorial
// [end]

// [wrong op]
// The same forward with a wrong backward: dx = dy * s forgets the product rule (it treats the
// factor x as a constant). Float64 only: it exists to be caught by gradcheck.
tg::Tensor silu_forgot_product_rule(const tg::Tensor& x) {
  tg::Tensor y;
  {
    tg::NoGradGuard no_grad;  // the forward alone, no node
    y = tutorial::silu(x);
  }
  if (tg::should_record({&x})) {
    struct Saved { tg::Tensor x; };
    tg::record("silu_wrong", {&x}, {&y}, Saved{x.detach()}, [](tg::Node& n, const Saved& s) {
      tg::Tensor dx = n.new_grad(0);
      const double* xs = s.x.data<double>();
      const double* dy = n.grad_out().data<double>();
      double* g = dx.data<double>();
      for (std::int64_t i = 0; i < s.x.numel(); ++i) g[i] = dy[i] * kernels::sigmoid(xs[i]);
      n.pass_grad(0, std::move(dx));
    });
  }
  return y;
}
// [end]

// [composite]
// The composite twin: two existing ops, each its own tape node; the tape derives the gradient.
tg::Tensor silu_composite(const tg::Tensor& x) { return x * tg::sigmoid(x); }
// [end]

// Step 1: values against the formula in double, in both dtypes, and far out in both tails.
bool check_forward() {
  std::printf("== 1. forward\n");
  const std::vector<double> xs = {-100, -5, -1, 0, 1, 5, 100};
  tg::Tensor y32 = tutorial::silu(tg::tensor(xs, {7}, tg::float32));
  tg::Tensor y64 = tutorial::silu(tg::tensor(xs, {7}, tg::float64));
  bool ok = true;
  for (std::int64_t i = 0; i < 7; ++i) {
    const double x = xs[static_cast<std::size_t>(i)], want = x / (1 + std::exp(-x));
    std::printf("  silu(%6.1f) = %15.8g (float32) %23.16g (float64)\n", x, y32.at({i}), y64.at({i}));
    ok = ok && std::fabs(y32.at({i}) - want) <= 1e-6 * (1 + std::fabs(want)) &&
         std::fabs(y64.at({i}) - want) <= 1e-15 * (1 + std::fabs(want));
  }
  return ok;
}

// [kernel check]
// Step 2: the backward kernel against a central difference of the forward kernel, no tape.
bool check_backward_kernel() {
  std::printf("== 2. backward kernel\n");
  const std::vector<double> xs = {-5, -1, 0, 1, 5};
  const double h = 1e-6, one = 1;
  bool ok = true;
  for (double x : xs) {
    double dx = 0, lo = 0, hi = 0;
    const double xlo = x - h, xhi = x + h;
    kernels::silu_backward(&x, &one, &dx, 1);
    kernels::silu_forward(&xlo, &lo, 1);
    kernels::silu_forward(&xhi, &hi, 1);
    const double numeric = (hi - lo) / (2 * h);
    std::printf("  x = %4.1f: dy/dx = %.10f, central difference %.10f\n", x, dx, numeric);
    ok = ok && std::fabs(dx - numeric) < 1e-8;
  }
  return ok;
}
// [end]

// [errors]
// Step 3: a bad argument is a tg::Error whose message names the op and the shape.
bool check_errors() {
  std::printf("== 3. errors\n");
  try {
    tutorial::silu(tg::tensor({1, 2, 3}, {3}, tg::int32));
  } catch (const tg::Error& e) {
    std::printf("  %s\n", e.what());
    return std::string(e.what()) == "silu: expected a float32 or float64 tensor, got int32 (3,)";
  }
  return false;
}
// [end]

// [gradcheck]
// Step 4: the backward against central differences in float64.
bool check_gradients() {
  std::printf("== 4. gradcheck\n");
  tg::manual_seed(0);
  tg::Tensor x = (tg::randn({3, 4}, tg::float64) * 3.0).requires_grad_();

  tg::GradcheckReport once =
      tg::gradcheck([](const std::vector<tg::Tensor>& in) { return tutorial::silu(in[0]); }, {x});
  // x reaches two silu nodes: the tape takes the first one's gradient and adds the second's.
  tg::GradcheckReport twice = tg::gradcheck(
      [](const std::vector<tg::Tensor>& in) { return tutorial::silu(in[0]) + tutorial::silu(in[0]); }, {x});
  tg::GradcheckReport wrong = tg::gradcheck(
      [](const std::vector<tg::Tensor>& in) { return silu_forgot_product_rule(in[0]); }, {x});

  std::cout << "  silu(x): " << once.str() << "  silu(x) + silu(x): " << twice.str()
            << "  forgot the product rule: " << wrong.str();
  return once.ok && twice.ok && !wrong.ok;
}
// [end]

// [compare]
// max |a - b| over all elements (not recorded: nothing will differentiate it).
double max_abs_diff(const tg::Tensor& a, const tg::Tensor& b) {
  tg::NoGradGuard no_grad;
  return tg::max(tg::abs(a - b)).item();
}

// Step 5: the fused op and its composite twin agree in value and gradient.
bool check_composite() {
  std::printf("== 5. fused op and composite twin\n");
  tg::manual_seed(1);
  tg::Tensor x = (tg::randn({64, 32}, tg::float64) * 4.0).requires_grad_();
  tg::Tensor dy = tg::randn({64, 32}, tg::float64);  // an upstream gradient

  const std::size_t nodes0 = tg::tape().live(), bytes0 = tg::tape().bytes_saved();
  tg::Tensor y_fused = tutorial::silu(x);
  const std::size_t nodes1 = tg::tape().live(), bytes1 = tg::tape().bytes_saved();
  tg::Tensor y_comp = silu_composite(x);
  const std::size_t nodes2 = tg::tape().live(), bytes2 = tg::tape().bytes_saved();
  std::printf("  fused:     %zu tape node,  %zu bytes saved for backward\n", nodes1 - nodes0, bytes1 - bytes0);
  std::printf("  composite: %zu tape nodes, %zu bytes saved for backward\n", nodes2 - nodes1, bytes2 - bytes1);

  y_fused.backward(dy);
  tg::Tensor dx_fused = x.grad();
  x.zero_grad();
  y_comp.backward(dy);
  tg::Tensor dx_comp = x.grad();

  const double dvalue = max_abs_diff(y_fused, y_comp), dgrad = max_abs_diff(dx_fused, dx_comp);
  std::printf("  max |difference|: value %.2e, gradient %.2e\n", dvalue, dgrad);
  return dvalue < 1e-12 && dgrad < 1e-12;
}
// [end]

// [model]
// Step 6: a model with SiLU activations, 1 -> 32 -> 32 -> 1.
class SiluMLP : public tg::nn::UnaryModule {
 public:
  tg::Tensor forward(const tg::Tensor& x) override {
    return fc3->forward(tutorial::silu(fc2->forward(tutorial::silu(fc1->forward(x)))));
  }
  std::string type_name() const override { return "SiluMLP"; }

  std::shared_ptr<tg::nn::Linear> fc1 = register_module("fc1", std::make_shared<tg::nn::Linear>(1, 32));
  std::shared_ptr<tg::nn::Linear> fc2 = register_module("fc2", std::make_shared<tg::nn::Linear>(32, 32));
  std::shared_ptr<tg::nn::Linear> fc3 = register_module("fc3", std::make_shared<tg::nn::Linear>(32, 1));
};

// Fits y = sin(3x) on [-1, 1] by mean squared error with Adam.
bool check_training() {
  std::printf("== 6. training an MLP with SiLU\n");
  tg::manual_seed(2);
  std::vector<float> xs, ys;
  for (int i = 0; i < 64; ++i) {
    xs.push_back(-1.0f + static_cast<float>(i) / 32);
    ys.push_back(std::sin(3 * xs.back()));
  }
  tg::Tensor x = tg::from_vector(xs, {64, 1}), y = tg::from_vector(ys, {64, 1});  // (64, 1) each

  SiluMLP model;
  tg::optim::Adam opt(model.parameters(), /*lr=*/5e-3);
  double first = 0, last = 0;
  for (int step = 0; step <= 300; ++step) {
    tg::Tensor err = model(x) - y;
    tg::Tensor loss = tg::mean(err * err);
    opt.zero_grad();
    loss.backward();  // runs silu's backward twice per step, once per activation
    opt.step();
    last = loss.item();
    if (step == 0) first = last;
    if (step % 50 == 0) std::printf("  step %3d  loss %.5f\n", step, last);
  }
  return last < first / 100;
}
// [end]

// [prmsnorm]
// pRMSNorm from existing ops: y = x / sqrt(mean(x[..., :k]^2) + eps) * g, with k = ceil(C p).
tg::Tensor prms_norm_composite(const tg::Tensor& x, const tg::Tensor& g, double eps, double p) {
  const std::int64_t k = tg::prms_k(x.size(-1), p);
  tg::Tensor xk = tg::slice(x, -1, 0, k);                     // the first k features, (..., k)
  tg::Tensor ms = tg::mean(xk * xk, {-1}, /*keepdim=*/true);  // their mean square, (..., 1)
  return x * tg::rsqrt(ms + eps) * g;                         // scales all C features, (..., C)
}
// [end]

// [prmsnorm check]
// Step 7: the composite against the fused tg::rms_norm(x, g, no bias, eps, p).
bool check_prms_norm() {
  std::printf("== 7. pRMSNorm: composite and fused\n");
  tg::manual_seed(3);
  const double eps = 1e-5, p = 0.25;  // C = 16 features, k = 4 of them in the statistic
  tg::Tensor x = tg::randn({8, 16}, tg::float64).requires_grad_();
  tg::Tensor g = (tg::randn({16}, tg::float64) + 1.0).requires_grad_();
  tg::Tensor dy = tg::randn({8, 16}, tg::float64);

  tg::Tensor y_fused = tg::rms_norm(x, g, tg::Tensor(), eps, p);
  y_fused.backward(dy);
  tg::Tensor dx_fused = x.grad(), dg_fused = g.grad();
  x.zero_grad();
  g.zero_grad();
  tg::Tensor y_comp = prms_norm_composite(x, g, eps, p);
  y_comp.backward(dy);

  const double dv = max_abs_diff(y_fused, y_comp), dx = max_abs_diff(dx_fused, x.grad()),
               dg = max_abs_diff(dg_fused, g.grad());
  std::printf("  k = %lld of 16; max |difference|: value %.2e, dx %.2e, dg %.2e\n",
              static_cast<long long>(tg::prms_k(16, p)), dv, dx, dg);
  return dv < 1e-12 && dx < 1e-12 && dg < 1e-12;
}
// [end]

// [main]
int main() {
  int failed = 0;
  auto report = [&](bool ok) {
    std::printf("  -> %s\n\n", ok ? "ok" : "FAILED");
    failed += ok ? 0 : 1;
  };
  report(check_forward());
  report(check_backward_kernel());
  report(check_errors());
  report(check_gradients());
  report(check_composite());
  report(check_training());
  report(check_prms_norm());
  if (failed) std::printf("%d check(s) FAILED\n", failed);
  else std::printf("every check passed\n");
  return failed ? 1 : 0;
}
// [end]
