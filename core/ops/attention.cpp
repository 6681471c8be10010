// The attention ops: scaled_causal_softmax (core/kernels/softmax.h), and causal_attention fused
// over a packed qkv, tiled as FlashAttention (core/kernels/attention.h).
#include "ops/attention.h"

#include <cmath>
#include <type_traits>

#include "dispatch.h"
#include "kernels/attention.h"
#include "kernels/softmax.h"
#include "ops/internal.h"
#include "ops/product.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

void detail::check_attention(const char* op, const Tensor& qkv, std::int64_t H) {
  detail::check_float(op, qkv);
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0) fail(op, "expects packed qkv (B, T, 3C), got ", qkv.shape());
  const std::int64_t C = qkv.size(2) / 3;
  if (H <= 0 || C % H != 0) fail(op, "width ", C, " of ", qkv.shape(), " is not a positive multiple of n_head ", H);
}

double detail::attention_scale(std::int64_t hs) { return hs > 0 ? 1.0 / std::sqrt(static_cast<double>(hs)) : 1.0; }

Tensor scaled_causal_softmax(const Tensor& x, double scale) {
  const char* op = "scaled_causal_softmax";
  detail::check_float(op, x);
  if (x.dim() < 2 || x.size(-1) != x.size(-2)) fail(op, "expects (..., T, T) scores, got ", x.shape());
  if (!std::isfinite(scale)) fail(op, "scale must be finite, got ", scale);
  const std::int64_t Tn = x.size(-1), rows = Tn ? x.numel() / Tn : 0;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  detail::dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    kernels::causal_softmax_forward(x.data<T>(), y.data<T>(), rows, Tn, scale);
  });
  if (should_record({&x})) {
    struct Saved { Tensor y; };  // the softmax's output: dx = scale * y * (dy - sum(dy * y))
    record(op, {&x}, {&y}, Saved{y.detach()}, [rows, Tn, scale](Node& n, const Saved& s) {
      Tensor dx = n.new_grad(0);
      detail::dispatch_float("scaled_causal_softmax", s.y.dtype(), [&](auto z) {
        using T = decltype(z);
        kernels::causal_softmax_backward(s.y.data<T>(), n.grad_out().data<T>(), dx.data<T>(), rows, Tn, scale);
      });
      n.pass_grad(0, std::move(dx));
    });
  }
  return y;
}

Tensor causal_attention(const Tensor& qkv, std::int64_t H) {
  const char* op = "causal_attention";
  detail::check_attention(op, qkv, H);
  const std::int64_t B = qkv.size(0), Tn = qkv.size(1), C = qkv.size(2) / 3;
  // Inside an autocast scope a float32 op's products take bf16-rounded operands (the output, the
  // softmax statistics and the sums stay float32); the backward makes its products the same way.
  const kernels::AttnDims d{B, Tn, C, H, detail::attention_scale(C / H), true, detail::products_in_bf16(qkv.dtype())};
  Tensor y = Tensor::empty({B, Tn, C}, qkv.dtype()), lse = Tensor::empty({B, H, Tn}, qkv.dtype());
  // With bf16 products the backward keeps qkv's bf16 copy (below). On vdpbf16ps the forward's
  // words come from that copy too: the same bits, and qkv rounded once.
  const bool recording = should_record({&qkv}), copies = recording && d.bf16 && y.numel() > 0;
  const Tensor qkv_b = copies ? detail::activation_bf16(qkv) : Tensor();
  if (y.numel() > 0)
    detail::dispatch_float(op, qkv.dtype(), [&](auto z) {
      using T = decltype(z);
      if constexpr (std::is_same_v<T, float>)
        if (qkv_b.defined() && kernels::attention_dpbf16())
          return kernels::flash_attention_forward(static_cast<const kernels::bf16*>(qkv_b.raw_data()), y.data<T>(),
                                                  lse.data<T>(), d);
      kernels::flash_attention_forward(qkv.data<T>(), y.data<T>(), lse.data<T>(), d);
    });
  if (recording) {
    // What the backward needs of the softmax is each row's log-sum-exp: it recomputes the
    // probabilities tile by tile, and keeps nothing of size T x T. With bf16 products, qkv is
    // kept as its bf16 copy: the backward's products round q, k and v to bf16 anyway, so the bits
    // are the same, in half the memory. (The float path's forward rounds its tiles from the float
    // qkv: the copy's k tiles would be transposed element by element, docs/performance.md.) So is
    // y, which the backward reads only for D_i = dy_i . y_i (docs/attention.md gives the bound):
    // y's copy is made last, so that the output projection's Linear, the next op to ask for one,
    // is handed this same copy by activation_bf16, and y's float32 memory is not kept at all.
    struct Saved { Tensor qkv, y, lse; };  // (B, T, 3C), (B, T, C), float or both bf16; (B, H, T)
    Saved saved{copies ? qkv_b : qkv.detach(), Tensor(), lse};
    saved.y = copies ? detail::activation_bf16(y) : y.detach();
    record(op, {&qkv}, {&y}, std::move(saved), [d](Node& n, const Saved& s) {
      if (n.grad_out().numel() == 0) return detail::pass_zeros(n, 0);  // no outputs (T = 0 or C = 0)
      Tensor dqkv = n.new_grad(0);
      detail::dispatch_float("causal_attention", s.lse.dtype(), [&](auto z) {
        using T = decltype(z);
        if constexpr (std::is_same_v<T, float>)  // the bf16 copies: float32 only (products_in_bf16)
          if (s.qkv.dtype() == bfloat16)
            return kernels::flash_attention_backward(static_cast<const kernels::bf16*>(s.qkv.raw_data()),
                                                     static_cast<const kernels::bf16*>(s.y.raw_data()),
                                                     s.lse.data<T>(), n.grad_out().data<T>(), dqkv.data<T>(), d);
        kernels::flash_attention_backward(s.qkv.data<T>(), s.y.data<T>(), s.lse.data<T>(), n.grad_out().data<T>(),
                                          dqkv.data<T>(), d);
      });
      n.pass_grad(0, std::move(dqkv));
    });
  }
  return y;
}

}  // namespace tg
