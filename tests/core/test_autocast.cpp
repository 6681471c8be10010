// bfloat16 autocast (tapegrad/autocast.h): inside a scope, float32 linear and matmul compute with
// operands rounded to bfloat16 and float32 sums, forward and backward; float64 and everything
// outside the scope are untouched; weights are read in float32 and rounded as they are packed.
#include "float_bits.h"
#include "helpers.h"
#include "isa_helpers.h"
#include "kernels/bf16.h"
#include "kernels/sgemm_bf16.h"
#include "tapegrad/memory.h"

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

// Same dtype, shape and bytes.
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
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

TEST_CASE("autocast keeps no copy of a weight: products round the float32 weight as they pack it") {
  Generator g(14);
  Tensor w = randn({8, 16}, float32, &g).requires_grad_();
  const Tensor x = randn({4, 16}, float32, &g);
  AutocastGuard autocast;
  // A recorded linear whose weight needs a gradient holds its output and its input's bf16 copy,
  // and nothing of the weight but the weight itself.
  const std::size_t before = memory_allocated();
  Tensor y1 = linear(x, w);
  CHECK(memory_allocated() - before == static_cast<std::size_t>(4 * 8 * 4 + 4 * 16 * 2));
  // A weight written in place within the scope is read anew (PyTorch's autocast weight cache would
  // hand out the copy made before the write).
  {
    NoGradGuard ng;
    w.data<float>()[0] += 1000.0f;
  }
  const Tensor y2 = linear(x, w);
  const Tensor ref = matmul(round_bf16(x).to(float64), round_bf16(w).to(float64), false, true);
  CHECK(rel_diff(y2, ref) < 1e-5);
  CHECK(max_abs_diff(y1, y2) > 1);
  tape().clear();  // graphs recorded here and never walked
}

TEST_CASE("autocast: an input written through data() and then bump_version() is rounded anew, not handed the old copy") {
  Generator g(16);
  const Tensor w1 = randn({8, 16}, float32, &g).requires_grad_(), w2 = randn({8, 16}, float32, &g).requires_grad_();
  Tensor x = randn({4, 16}, float32, &g);
  AutocastGuard autocast;
  const Tensor y1 = linear(x, w1);  // rounds x to bf16 and keeps that copy for the next op asking for x's
  x.data<float>()[0] += 1000.0f;    // a raw write, which version() does not see ...
  x.bump_version();                 // ... until it is told
  const Tensor y2 = linear(x, w2);
  const Tensor ref = matmul(round_bf16(x).to(float64), round_bf16(w2).to(float64), false, true);
  CHECK(rel_diff(y2, ref) < 1e-5);
  CHECK(max_abs_diff(y1, linear(x, w1)) > 1);  // the write reached the products
  tape().clear();  // graphs recorded here and never walked
}

TEST_CASE("autocast: a recorded linear keeps its input as bf16, with the bits of the product of the float32 input") {
  // The reference is the bf16 kernels on the float32 input, rounded while they pack it:
  // the copy rounded before the product and the product's own rounding while it packs agree, on
  // ties, on float32 subnormals (one of which rounds up to the smallest normal bf16), on a value
  // that rounds to infinity, and on a row of tiny values whose sums the flush to zero decides.
  using kernels::Isa;
  const std::int64_t B = 3, T = 5, rows = B * T, in = 70, out = 45;
  Generator g(15);
  const Tensor x0 = randn({B, T, in}, float32, &g), w0 = randn({out, in}, float32, &g), b0 = randn({out}, float32, &g);
  const Tensor dy = randn({B, T, out}, float32, &g);
  {
    float* xp = Tensor(x0).data<float>();
    const std::uint32_t specials[] = {0x3F808000u, 0x3F818000u, 0xBF818000u, 0x007FFFFFu, 0x00008000u,
                                      0x00018000u, 0x80400000u, 0x7F7FFFFFu, 0x3F7FFFFFu};
    for (std::size_t i = 0; i < std::size(specials); ++i) xp[i * in + 3 * i + 1] = from_bits(specials[i]);  // row i
    for (std::int64_t k = 0; k < in; ++k) {  // the last row: float32 subnormals, some rounding to normal bf16
      const std::uint32_t below = 0x1000u * static_cast<std::uint32_t>(k);
      xp[(rows - 1) * in + k] = from_bits((k % 2 ? 0x00800000u : 0x007FFFFFu) - below);
    }
  }
  each_isa({Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}, [&](Isa) {
    std::vector<kernels::bf16> wh(static_cast<std::size_t>(out * in));
    kernels::to_bf16(w0.data<float>(), wh.data(), out * in);
    Tensor y_ref = Tensor::empty(dy.shape()), dx_ref = Tensor::empty(x0.shape()), dw_ref = Tensor::empty(w0.shape());
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy(b0.data<float>(), b0.data<float>() + out, y_ref.data<float>() + r * out);
    kernels::gemm_bf16(false, true, rows, out, in, 1.0f, x0.data<float>(), in, wh.data(), in, 1.0f, y_ref.data<float>(),
                       out);
    kernels::gemm_bf16(false, false, rows, in, out, 1.0f, dy.data<float>(), out, wh.data(), in, 0.0f,
                       dx_ref.data<float>(), in);
    kernels::gemm_bf16(true, false, out, in, rows, 1.0f, dy.data<float>(), out, x0.data<float>(), in, 0.0f,
                       dw_ref.data<float>(), in);
    for (bool x_grad : {true, false}) {
      INFO((x_grad ? "x and w require grad" : "w alone requires grad"));
      Tensor x = x0.clone(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
      if (x_grad) x.requires_grad_();
      tape().clear();
      Tensor y, y_unrecorded;
      {
        AutocastGuard autocast;
        y = linear(x, w, b);
        {
          NoGradGuard ng;
          y_unrecorded = linear(x, w, b);
        }
      }
      // The node keeps x as bf16 (2 bytes an element) and the weight itself (no bf16 copy of it).
      CHECK(tape().bytes_saved() == static_cast<std::size_t>(rows * in * 2 + out * in * 4));
      y.backward(dy);
      CHECK(same_bits(y, y_ref));
      CHECK(same_bits(y_unrecorded, y_ref));
      CHECK(same_bits(w.grad(), dw_ref));
      if (x_grad) CHECK(same_bits(x.grad(), dx_ref));
      else CHECK_FALSE(x.grad().defined());
      CHECK(rel_diff(b.grad(), sum(dy, {0, 1})) < 1e-6);
      CHECK(std::isinf(y.at({1, 2, 0})));  // row 7 holds the value that rounds to infinity
    }
  });
}

TEST_CASE("autocast: products give the same bits recorded or not") {
  Generator g(16);
  Tensor w1 = randn({8, 16}, float32, &g).requires_grad_(), w2 = randn({6, 8}, float32, &g).requires_grad_();
  const Tensor x = randn({4, 16}, float32, &g);
  AutocastGuard autocast;
  Tensor unrecorded;
  {
    NoGradGuard ng;
    unrecorded = linear(linear(x, w1), w2);
  }
  const Tensor recorded = linear(linear(x, w1), w2);
  CHECK(same_bits(unrecorded, recorded));
  tape().clear();  // graphs recorded here and never walked
}
