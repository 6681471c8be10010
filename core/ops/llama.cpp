// The ops a LLaMA-style block adds to a GPT's: SiLU, SwiGLU over a packed [gate | up] projection,
// and rotary position embedding with its tables. Each is one tape node whose backward is the
// hand-derived one beside its forward in core/kernels/llama.h; the composite twins at the end build
// the same functions from primitive ops, and the tests hold the two together.
#include <cmath>
#include <utility>

#include "dispatch.h"
#include "kernels/llama.h"
#include "ops/llama.h"
#include "tapegrad/autograd.h"
#include "tapegrad/composite.h"
#include "tapegrad/ops.h"

namespace tg {

using namespace kernels;
using detail::dispatch_float;

std::int64_t detail::check_swiglu(const char* op, const Tensor& x) {
  detail::check_float(op, x);
  if (x.dim() < 1) fail(op, "needs at least 1 dim (..., 2F), got a 0-d tensor");
  const std::int64_t two_f = x.size(-1);
  if (two_f % 2 != 0)
    fail(op, "the last dim of x ", x.shape(), " must be even (gate and up of F columns each), got ", two_f);
  return two_f / 2;
}

namespace {

void check_head_size(const char* op, std::int64_t hs) {
  if (hs <= 0 || hs % 2 != 0) fail(op, "head_size must be even and positive, got ", hs);
}

// The tables: defined, x's dtype, (P, hs) each, P >= pos0 + Tn.
void check_rope_tables(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t hs,
                       std::int64_t pos0, std::int64_t Tn) {
  detail::check_defined(op, cos, "cos");
  detail::check_defined(op, sin, "sin");
  for (const Tensor* t : {&cos, &sin})
    if (t->dtype() != x.dtype())
      fail(op, "the tables must have x's dtype: x is ", x.dtype(), " ", x.shape(), ", cos ", cos.dtype(), " ",
           cos.shape(), ", sin ", sin.dtype(), " ", sin.shape());
  if (cos.dim() != 2 || cos.size(1) != hs || sin.shape() != cos.shape())
    fail(op, "cos and sin must both be (P, head_size ", hs, "), got cos ", cos.shape(), " and sin ", sin.shape());
  if (pos0 > cos.size(0) - Tn)  // P < pos0 + Tn, without forming pos0 + Tn (pos0 may be huge)
    fail(op, "the tables ", cos.shape(), " hold ", cos.size(0), " positions, but x ", x.shape(), " needs ", Tn,
         " positions from pos0 ", pos0);
}

}  // namespace

detail::RopeDims detail::check_rope(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin,
                                    std::int64_t hs, std::int64_t rotated, std::int64_t pos0) {
  detail::check_float(op, x);
  if (x.dim() != 2 && x.dim() != 3) fail(op, "expected x of shape (B, T, D) or (T, D), got ", x.shape());
  check_head_size(op, hs);
  const bool batched = x.dim() == 3;
  const RopeDims d{batched ? x.size(0) : 1, x.size(batched ? 1 : 0), x.size(-1), rotated < 0 ? x.size(-1) : rotated};
  if (d.D % hs != 0) fail(op, "the last dim of x ", x.shape(), " is not a multiple of head_size ", hs);
  if (rotated < -1 || d.rotated > d.D || d.rotated % hs != 0)
    fail(op, "rotated must be -1 (all of D) or a multiple of head_size ", hs, " in [0, ", d.D, "], got ", rotated,
         " for x ", x.shape());
  if (pos0 < 0) fail(op, "pos0 must be >= 0, got ", pos0);
  check_rope_tables(op, x, cos, sin, hs, pos0, d.Tn);
  return d;
}

namespace {

}  // namespace

Tensor silu(const Tensor& x) {
  const char* op = "silu";
  detail::check_float(op, x);
  const std::int64_t N = x.numel();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    silu_forward(x.data<T>(), y.data<T>(), N);
  });
  if (should_record({&x})) {
    struct Saved { Tensor x; };  // backward recomputes sigmoid(x) from it
    record(op, {&x}, {&y}, Saved{x.detach()}, [N](Node& n, const Saved& s) {
      const Tensor& dy = n.grad_out();  // read before new_grad, which may hand out dy's own buffer
      Tensor dx = n.new_grad(0);
      dispatch_float("silu", s.x.dtype(), [&](auto z) {
        using T = decltype(z);
        silu_backward(s.x.data<T>(), dy.data<T>(), dx.data<T>(), N);
      });
      n.pass_grad(0, std::move(dx));
    }).may_reuse_grad_out();  // silu_backward writes dx[i] after reading dy[i]
  }
  return y;
}

Tensor swiglu(const Tensor& x) {
  const char* op = "swiglu";
  const std::int64_t F = detail::check_swiglu(op, x), rows = F > 0 ? x.numel() / (2 * F) : 0;
  Shape out = x.shape();
  out[out.ndim() - 1] = F;
  Tensor y = Tensor::empty(out, x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    swiglu_forward(x.data<T>(), y.data<T>(), rows, F);
  });
  if (should_record({&x})) {
    struct Saved { Tensor x; };  // gate and up; backward recomputes sigmoid(gate)
    record(op, {&x}, {&y}, Saved{x.detach()}, [rows, F](Node& n, const Saved& s) {
      Tensor dx = n.new_grad(0);
      dispatch_float("swiglu", s.x.dtype(), [&](auto z) {
        using T = decltype(z);
        swiglu_backward(s.x.data<T>(), n.grad_out().data<T>(), dx.data<T>(), rows, F);
      });
      n.pass_grad(0, std::move(dx));
    });
  }
  return y;
}

std::pair<Tensor, Tensor> rope_tables(std::int64_t max_pos, std::int64_t head_size, double theta, DType dtype) {
  const char* op = "rope_tables";
  if (max_pos < 0) fail(op, "max_pos must be >= 0, got ", max_pos);
  check_head_size(op, head_size);
  if (!(theta > 0) || !std::isfinite(theta)) fail(op, "theta must be finite and positive, got ", theta);
  if (!is_floating(dtype)) fail(op, "dtype must be float32 or float64, got ", dtype);
  Tensor cos = Tensor::empty(Shape{max_pos, head_size}, dtype), sin = Tensor::empty(Shape{max_pos, head_size}, dtype);
  dispatch_float(op, dtype, [&](auto z) {
    using T = decltype(z);
    rope_tables_fill(cos.data<T>(), sin.data<T>(), max_pos, head_size, theta);
  });
  return {cos, sin};
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t head_size, std::int64_t rotated,
            std::int64_t pos0) {
  const char* op = "rope";
  const detail::RopeDims d = detail::check_rope(op, x, cos, sin, head_size, rotated, pos0);
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(op, x.dtype(), [&](auto z) {
    using T = decltype(z);
    rope_forward(x.data<T>(), cos.data<T>(), sin.data<T>(), y.data<T>(), d.B, d.Tn, d.D, head_size, d.rotated, pos0);
  });
  if (should_record({&x})) {  // cos and sin are constants: no gradient reaches them
    struct Saved { Tensor cos, sin; };  // the tables; the backward does not read x
    record(op, {&x}, {&y}, Saved{cos.detach(), sin.detach()},
           [d, head_size, pos0](Node& n, const Saved& s) {
             Tensor dx = n.new_grad(0);
             dispatch_float("rope", s.cos.dtype(), [&](auto z) {
               using T = decltype(z);
               rope_backward(n.grad_out().data<T>(), s.cos.data<T>(), s.sin.data<T>(), dx.data<T>(), d.B, d.Tn, d.D,
                             head_size, d.rotated, pos0);
             });
             n.pass_grad(0, std::move(dx));
           });
  }
  return y;
}

}  // namespace tg
