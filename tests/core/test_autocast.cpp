// bfloat16 autocast (tapegrad/autocast.h): inside a scope, float32 linear and matmul compute with
// operands rounded to bfloat16 and float32 sums, forward and backward; float64 and everything
// outside the scope are untouched; parameters are cast once per scope.
#include "autocast_cache.h"
#include "helpers.h"
#include "kernels/bf16.h"

using namespace tg;
using namespace tgtest;

namespace {

// t with every element rounded to bfloat16 (still a float32 tensor).
Tensor round_bf16(const Tensor& t) {
  Tensor r = t.detach().clone();
  float* p = r.data<float>();
  for (std::int64_t i = 0; i < r.numel(); ++i) p[i] = kernels::to_float(kernels::to_bf16(p[i]));
  return r;
}

// The largest |a - b| relative to the largest |b|.
double rel_diff(const Tensor& a, const Tensor& b) {
  return max_abs_diff(a.to(float64), b.to(float64)) / max(abs(b.to(float64))).item();
}

}  // namespace

TEST_CASE("autocast: linear's forward and backward use bf16 operands with float32 sums") {
  Generator g(11);
  const Tensor x0 = randn({37, 70}, float32, &g), w0 = randn({45, 70}, float32, &g), b0 = randn({45}, float32, &g);
  const Tensor dy = randn({37, 45}, float32, &g);
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor y;
  {
    AutocastGuard autocast;
    CHECK(is_autocast_enabled());
    y = linear(x, w, b);
  }
  CHECK_FALSE(is_autocast_enabled());
  CHECK(y.dtype() == float32);
  y.backward(dy);  // outside the scope: the recorded product stays a bf16 one
  // The same products of the rounded operands in float64: the only differences left are float32
  // sums of exact products.
  const Tensor xr = round_bf16(x0).to(float64), wr = round_bf16(w0).to(float64), dyr = round_bf16(dy).to(float64);
  CHECK(rel_diff(y, add(matmul(xr, wr, false, true), b0.to(float64))) < 1e-5);
  CHECK(rel_diff(x.grad(), matmul(dyr, wr)) < 1e-5);
  CHECK(rel_diff(w.grad(), matmul(dyr, xr, true, false)) < 1e-5);
  CHECK(rel_diff(b.grad(), sum(dy, {0})) < 1e-6);
  // ... and they are not the float32 products (bf16 keeps 8 significant bits).
  CHECK(rel_diff(y, linear(x0, w0, b0)) > 1e-4);
  tape().clear();  // graphs recorded here and never walked
}

TEST_CASE("autocast: matmul, batched and with a transposed operand, uses bf16 operands") {
  Generator g(12);
  const Tensor a0 = randn({3, 20, 33}, float32, &g), b0 = randn({3, 20, 17}, float32, &g);
  const Tensor dc = randn({3, 33, 17}, float32, &g);
  Tensor a = a0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor c;
  {
    AutocastGuard autocast;
    c = matmul(a, b, true, false);  // a^T b per batch entry
  }
  c.backward(dc);
  const Tensor ar = round_bf16(a0).to(float64), br = round_bf16(b0).to(float64), dcr = round_bf16(dc).to(float64);
  CHECK(rel_diff(c, matmul(ar, br, true, false)) < 1e-5);
  CHECK(rel_diff(a.grad(), matmul(br, dcr, false, true)) < 1e-5);
  CHECK(rel_diff(b.grad(), matmul(ar, dcr)) < 1e-5);
  CHECK(rel_diff(c, matmul(a0, b0, true, false)) > 1e-4);
  tape().clear();  // graphs recorded here and never walked
}

TEST_CASE("autocast leaves float64 products and products outside the scope alone") {
  Generator g(13);
  const Tensor x = randn({9, 12}, float64, &g), w = randn({5, 12}, float64, &g);
  const Tensor plain = linear(x, w);
  Tensor inside;
  {
    AutocastGuard autocast;
    inside = linear(x, w);
    AutocastGuard off(false);  // a nested scope can turn it off
    CHECK_FALSE(is_autocast_enabled());
    const Tensor xf = x.to(float32), wf = w.to(float32);
    CHECK(max_abs_diff(linear(xf, wf), linear(x.to(float32), w.to(float32))) == 0);
  }
  CHECK(max_abs_diff(inside, plain) == 0);
  tape().clear();  // graphs recorded here and never walked
}

TEST_CASE("autocast casts each parameter once per scope and forgets the casts when the scope ends") {
  Generator g(14);
  Tensor w = randn({8, 16}, float32, &g).requires_grad_();
  const Tensor x = randn({4, 16}, float32, &g);
  {
    AutocastGuard autocast;
    const Tensor y1 = linear(x, w);
    const Tensor y2 = linear(x, w);
    CHECK(detail::autocast_cache_size() == 1);  // one cast for two uses
    CHECK(max_abs_diff(y1, y2) == 0);
    const Tensor z = linear(x, mul(w, 2.0));    // not a leaf: cast afresh, not cached
    CHECK(detail::autocast_cache_size() == 1);
    {
      AutocastGuard inner;  // nested scopes share the outermost one's casts
      (void)linear(x, w);
      CHECK(detail::autocast_cache_size() == 1);
    }
    CHECK(detail::autocast_cache_size() == 1);
  }
  CHECK(detail::autocast_cache_size() == 0);
  // A new scope casts the parameter's new values.
  {
    NoGradGuard ng;
    w.data<float>()[0] += 1000.0f;
  }
  Tensor y;
  {
    AutocastGuard autocast;
    y = linear(x, w);
  }
  const Tensor ref = matmul(round_bf16(x).to(float64), round_bf16(w).to(float64), false, true);
  CHECK(rel_diff(y, ref) < 1e-5);
  tape().clear();  // graphs recorded here and never walked
}
