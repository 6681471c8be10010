// Composite twins of the fused norm, attention and LLaMA ops, written with primitive ops only: their
// gradients come from the tape, independently of the hand-derived kernels. Slower and hungrier
// (every intermediate is a tensor kept for backward); they exist to check the fused ops and to
// read next to them.
#include <cmath>
#include <limits>
#include <string>

#include "dispatch.h"
#include "ops/attention.h"
#include "ops/llama.h"
#include "tapegrad/autocast.h"
#include "tapegrad/composite.h"
#include "tapegrad/ops.h"

namespace tg::composite {

namespace {
Tensor affine(Tensor y, const Tensor& weight, const Tensor& bias) {
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}
}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  Tensor mu = mean(x, {-1}, true);
  Tensor xc = x - mu;
  Tensor var = mean(xc * xc, {-1}, true);  // biased, two-pass
  return affine(xc * rsqrt(var + eps), weight, bias);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, double p) {
  const std::int64_t C = x.size(-1);
  const std::int64_t k = prms_k(C, p);
  Tensor xk = k == C ? x : slice(x, -1, 0, k);
  Tensor ms = mean(xk * xk, {-1}, true);
  return affine(x * rsqrt(ms + eps), weight, bias);
}

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double eps, bool channels_last) {
  if (!channels_last && x.dim() == 3)
    return transpose(batch_norm(transpose(x, 1, 2), running_mean, running_var, weight, bias, training, eps, true), 1, 2);
  const std::int64_t C = x.size(-1);
  Tensor x2 = x.reshape({-1, C});
  Tensor y;
  if (training || !running_mean.defined()) {
    Tensor mu = mean(x2, {0}, true);
    Tensor xc = x2 - mu;
    Tensor var = mean(xc * xc, {0}, true);
    y = xc * rsqrt(var + eps);
  } else {
    y = (x2 - running_mean) * rsqrt(running_var + eps);
  }
  return affine(y, weight, bias).reshape(x.shape());
}

Tensor weight_norm(const Tensor& v, const Tensor& g) {
  Tensor norm = sqrt(sum(v * v, {1}, true));  // (out, 1)
  return v * (g.reshape({-1, 1}) / norm);
}

Tensor scaled_causal_softmax(const Tensor& x, double scale) {
  return softmax(masked_fill(x * scale, causal_mask(x.size(-1)), -std::numeric_limits<double>::infinity()));
}

// split, permute, two batched matmuls and the masked softmax: the textbook version
Tensor causal_attention(const Tensor& qkv, std::int64_t H) {
  detail::check_attention("composite::causal_attention", qkv, H);
  const std::int64_t B = qkv.size(0), Tn = qkv.size(1), C = qkv.size(2) / 3, hs = C / H;
  std::vector<Tensor> parts = split(permute(qkv.reshape({B, Tn, 3, H, hs}), {2, 0, 3, 1, 4}), 1, 0);
  Tensor q = parts[0].reshape({B, H, Tn, hs}), k = parts[1].reshape({B, H, Tn, hs}), v = parts[2].reshape({B, H, Tn, hs});
  Tensor att = tg::scaled_causal_softmax(matmul(q, k, false, true), detail::attention_scale(hs));
  return permute(matmul(att, v), {0, 2, 1, 3}).reshape({B, Tn, C});
}

// ---- the LLaMA block's ops ----

Tensor silu(const Tensor& x) { return x * sigmoid(x); }

Tensor swiglu(const Tensor& x) {
  const std::int64_t F = detail::check_swiglu("swiglu", x);
  return composite::silu(slice(x, -1, 0, F)) * slice(x, -1, F, 2 * F);
}

Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const char* activation, const Tensor& residual) {
  const std::string a = activation ? activation : "";
  if (a != "gelu" && a != "swiglu") fail("mlp", "activation must be \"gelu\" or \"swiglu\", got \"", a, "\"");
  Tensor pre = linear(x, w1, b1);
  // Under autocast the activation reads pre rounded to bf16, and pre's gradient is rounded too, as
  // in PyTorch's autocast, whose linear returns bf16 (kernels/mlp.h).
  if (is_autocast_enabled() && pre.dtype() == float32) pre = pre.to(bfloat16).to(float32);
  const Tensor y = linear(a == "gelu" ? tg::gelu(pre) : tg::swiglu(pre), w2, b2);  // the ops.h activations
  return residual.defined() ? residual + y : y;
}

// The reference's layout: q (B, H, Tn, hs) from the rotated columns, q * cos + rotate_half(q) * sin
// with rotate_half(q) = cat(-q[..., half:], q[..., :half]), then back to (B, Tn, D) beside the
// columns that pass through.
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t head_size, std::int64_t rotated,
            std::int64_t pos0) {
  const detail::RopeDims d = detail::check_rope("rope", x, cos, sin, head_size, rotated, pos0);
  if (d.rotated == 0) return clone(x);
  const std::int64_t hs = head_size, half = hs / 2, H = d.rotated / hs;
  Tensor x3 = x.reshape({d.B, d.Tn, d.D});
  Tensor q = permute(slice(x3, 2, 0, d.rotated).reshape({d.B, d.Tn, H, hs}), {0, 2, 1, 3});
  Tensor q_half = cat({neg(slice(q, 3, half, hs)), slice(q, 3, 0, half)}, 3);
  Tensor c = slice(cos, 0, pos0, pos0 + d.Tn), s = slice(sin, 0, pos0, pos0 + d.Tn);  // (Tn, hs)
  Tensor y = permute(q * c + q_half * s, {0, 2, 1, 3}).reshape({d.B, d.Tn, d.rotated});
  if (d.rotated < d.D) y = cat({y, slice(x3, 2, d.rotated, d.D)}, 2);
  return y.reshape(x.shape());
}

}  // namespace tg::composite
