// causal_attention: the fused op over core/kernels/attention.h.
#include <algorithm>
#include <cmath>

#include "dispatch.h"
#include "kernels/attention.h"
#include "tapegrad/autograd.h"
#include "tapegrad/checkpoint.h"
#include "tapegrad/ops.h"

namespace tg {

namespace {
// The checks shared by the fused op and its composite twin.
void check_attention(const char* op, const Tensor& qkv, std::int64_t H) {
  detail::check_float(op, qkv);
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0) fail(op, "expects packed qkv (B, T, 3C), got ", qkv.shape());
  const std::int64_t C = qkv.size(2) / 3;
  if (H <= 0 || C % H != 0) fail(op, "width ", C, " of ", qkv.shape(), " is not a positive multiple of n_head ", H);
}
// 1 / sqrt(head size); 1 for zero-width heads, which have no scores to scale.
double attention_scale(std::int64_t hs) { return hs > 0 ? 1.0 / std::sqrt(static_cast<double>(hs)) : 1.0; }
}  // namespace

Tensor causal_attention(const Tensor& qkv, std::int64_t H) {
  const char* op = "causal_attention";
  check_attention(op, qkv, H);
  const std::int64_t B = qkv.size(0), Tn = qkv.size(1), C = qkv.size(2) / 3;
  const double scale = attention_scale(C / H);
  Tensor y = Tensor::empty({B, Tn, C}, qkv.dtype());
  // The attention weights (B, H, T, T) are kept for the backward when it is recorded, except in a
  // checkpointed segment's recomputation, which trades memory for time already: there the
  // backward recomputes them head by head (the same bits), as the forward does without recording.
  const bool recording = should_record({&qkv});
  Tensor P = recording && !in_checkpoint_recompute() ? Tensor::empty({B, H, Tn, Tn}, qkv.dtype()) : Tensor();
  if (y.numel() > 0)
    detail::dispatch_float(op, qkv.dtype(), [&](auto z) {
      using T = decltype(z);
      kernels::attention_forward(qkv.data<T>(), y.data<T>(), P.defined() ? P.data<T>() : nullptr, B, Tn, C, H, scale);
    });
  if (recording) {
    struct Saved { Tensor qkv, P; };  // P: the attention weights, (B, H, T, T), or undefined
    record(op, {&qkv}, {&y}, Saved{qkv.detach(), P}, [B, Tn, C, H, scale](Node& n, const Saved& s) {  // writes dqkv
      detail::dispatch_float("causal_attention", s.qkv.dtype(), [&](auto z) {
        using T = decltype(z);
        GradDest dqkv = n.write_grad(0);
        if (dqkv.buf->numel() == 0) return;
        if (n.grad_out().numel() == 0) {  // no outputs (T = 0 or C = 0): nothing flows back
          if (!dqkv.acc) std::fill(dqkv.ptr<T>(), dqkv.ptr<T>() + dqkv.buf->numel(), T(0));
          return;
        }
        kernels::attention_backward(s.qkv.data<T>(), s.P.defined() ? s.P.data<T>() : nullptr, n.grad_out().data<T>(),
                                    dqkv.ptr<T>(), B, Tn, C, H, scale, dqkv.acc);
      });
    });
  }
  return y;
}

namespace composite {
Tensor causal_attention(const Tensor& qkv, std::int64_t H) {
  check_attention("composite::causal_attention", qkv, H);
  const std::int64_t B = qkv.size(0), Tn = qkv.size(1), C = qkv.size(2) / 3, hs = C / H;
  std::vector<Tensor> parts = split(permute(qkv.reshape({B, Tn, 3, H, hs}), {2, 0, 3, 1, 4}), 1, 0);
  Tensor q = parts[0].reshape({B, H, Tn, hs}), k = parts[1].reshape({B, H, Tn, hs}), v = parts[2].reshape({B, H, Tn, hs});
  Tensor att = tg::scaled_causal_softmax(matmul(q, k, false, true), attention_scale(hs));
  return permute(matmul(att, v), {0, 2, 1, 3}).reshape({B, Tn, C});
}
}  // namespace composite

}  // namespace tg
