// mlp: the transformer MLP as one op, out = act(x w1^T + b1) w2^T + b2 (ops.h). The activation
// runs in the first product's epilogue, and the multiply by its derivative in the epilogue of the
// backward's dh = dy w2 (kernels/mlp.h), so neither takes a pass of its own over memory; and the
// node keeps x and pre = x w1^T + b1 only, recomputing h = act(pre) in the backward, where the
// unfused ops keep both h and act'(pre) from the forward.
//
// Backward, with G = d out:
//   dh = G w2, with h = act(pre) and dpre = act'(pre) dh in its epilogue;  dw2 = G^T h;
//   db2 = sum_rows G;  dx = dpre w1;  dw1 = dpre^T x;  db1 = sum_rows dpre.
// Every product, sum and activation is the unfused path's (linear, gelu / swiglu, linear; under
// autocast with pre rounded to bf16 between, kernels/mlp.h), on the same operands, so the results
// are its bits, in float32, float64 and under autocast, where the node keeps pre as bf16. The
// backward's epilogue makes h and act'(pre) from one evaluation (GELU: one erf and one exp per
// element, as the unfused forward's): neither a separate pass over memory for h nor a buffer for
// act'(pre) (docs/performance.md has what they cost).
#include <cassert>
#include <cstring>
#include <string>
#include <type_traits>

#include "dispatch.h"
#include "kernels/mlp.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "ops/internal.h"
#include "ops/product.h"
#include "tapegrad/autograd.h"
#include "tapegrad/composite.h"
#include "tapegrad/ops.h"

namespace tg {

namespace {

using i64 = std::int64_t;

enum class Act { gelu, swiglu };

struct MlpDims {
  i64 rows, C, H, F, out;  // x (rows, C), w1 (H, C), h (rows, F), w2 (out, F)
  Act act;
  bool bf16;
};

// The epilogues' work on a block of rows [r0, r1) x columns [c0, c1) of the product's output:
// the forward's h = act(pre); the backward's h again and dpre = act'(pre) dh.
template <class T>
struct ActEpilogue {
  MlpDims d;
  const T* pre = nullptr;  // the product's pre, or the saved one (float pre; null under autocast in the backward)
  const T* dh = nullptr;   // null in the forward
  T* out = nullptr;        // h (forward) or dpre (backward), both float
  T* h = nullptr;          // the backward's h
  // Under autocast (T = float): h as bf16, instead of the forward's out or the backward's h; and
  // pre as bf16, which the forward writes (keep, when the node saves it) and the backward reads
  // (saved). kernels/mlp.h's _bf16 epilogues.
  kernels::bf16* hb = nullptr;
  kernels::bf16* keep = nullptr;
  const kernels::bf16* saved = nullptr;
  kernels::bf16* dpre_b = nullptr;  // under autocast the backward's dpre, as bf16 (out is unused)
  void apply(i64 r0, i64 r1, i64 c0, i64 c1) const {
    T* hout = dh ? h : out;
    if (d.act == Act::swiglu) {
      if (dh) kernels::swiglu_grad_rows(pre, dh, out, hout, d.F, r0, r1);
      else kernels::swiglu_rows(pre, hout, d.F, r0, r1);
    } else {
      if (dh) kernels::gelu_grad_block(pre, dh, out, hout, d.H, r0, r1, c0, c1);
      else kernels::gelu_block(pre, hout, d.H, r0, r1, c0, c1);
    }
  }
  void apply_bf16(i64 r0, i64 r1, i64 c0, i64 c1) const {
    if constexpr (std::is_same_v<T, float>) {
      if (d.act == Act::swiglu) {
        if (dh) kernels::swiglu_grad_rows_bf16(saved, dh, dpre_b, hb, d.F, r0, r1);
        else if (saved) kernels::swiglu_rows_bf16(saved, nullptr, hb, d.F, r0, r1);
        else kernels::swiglu_rows_bf16(pre, keep, hb, d.F, r0, r1);
      } else {
        if (dh) kernels::gelu_grad_block_bf16(saved, dh, dpre_b, hb, d.H, r0, r1, c0, c1);
        else if (saved) kernels::gelu_block_bf16(saved, nullptr, hb, d.H, r0, r1, c0, c1);
        else kernels::gelu_block_bf16(pre, keep, hb, d.H, r0, r1, c0, c1);
      }
    }
  }
  static void run(const void* ctx, i64 r0, i64 r1, i64 c0, i64 c1) {
    const auto& e = *static_cast<const ActEpilogue*>(ctx);
    assert(!e.hb || (std::is_same_v<T, float>));  // bf16 products are float32 ones (products_in_bf16)
    if (e.hb) e.apply_bf16(r0, r1, c0, c1);
    else e.apply(r0, r1, c0, c1);
  }
  kernels::Epilogue epilogue() const { return {&ActEpilogue::run, this, d.act == Act::swiglu}; }
};

// Y (rows, n) = the bias in every row; returns the product's beta (1 over a bias, 0 without).
template <class T>
T fill_bias(T* Y, const Tensor& b, i64 rows, i64 n) {
  if (!b.defined()) return T(0);
  const T* bias = b.data<T>();
  kernels::parallel_for(rows, rows * n, [&](i64 lo, i64 hi) {
    for (i64 r = lo; r < hi; ++r) std::memcpy(Y + r * n, bias, static_cast<std::size_t>(n) * sizeof(T));
  });
  return T(1);
}

struct MlpWeights { Tensor w1, w2; };  // float32 under autocast too: the products round them as they pack
struct MlpSaved { Tensor x, x_bf16, pre; MlpWeights w; };

// Under autocast s.pre is bf16 (or undefined when nothing is recorded): the product writes a float
// pre of its own, which the epilogue rounds.
template <class T>
void mlp_forward(const Tensor& x, MlpSaved& s, const Tensor& b1, const Tensor& b2, const Tensor& res, Tensor& y,
                 const MlpDims& d) {
  using detail::operand;
  Tensor pre_t = d.bf16 ? Tensor::empty({d.rows, d.H}, x.dtype()) : s.pre;
  T* pre = pre_t.data<T>();
  // h: float, or bf16 when the products are (ActEpilogue::hb).
  Tensor h = Tensor::empty({d.rows, d.F}, d.bf16 ? bfloat16 : x.dtype());
  kernels::bf16* hb = d.bf16 ? static_cast<kernels::bf16*>(h.raw_data()) : nullptr;
  const ActEpilogue<T> act{.d = d, .pre = pre, .out = hb ? nullptr : h.data<T>(), .hb = hb,
                           .keep = d.bf16 && s.pre.defined() ? static_cast<kernels::bf16*>(s.pre.raw_data()) : nullptr};
  const Tensor& xs = s.x_bf16.defined() ? s.x_bf16 : x;
  detail::run(detail::Product<T>{false, true, d.rows, d.H, d.C, operand<T>(xs, d.C),
                                 operand<T>(s.w.w1, d.C), fill_bias(pre, b1, d.rows, d.H), pre,
                                 d.H, d.bf16, act.epilogue()});
  T* Y = y.data<T>();
  const detail::ResidualEpilogue<T> add{res.defined() ? res.data<T>() : nullptr, Y, d.out};
  detail::run(detail::Product<T>{false, true, d.rows, d.out, d.F, operand<T>(h, d.F),
                                 operand<T>(s.w.w2, d.F), fill_bias(Y, b2, d.rows, d.out), Y,
                                 d.out, d.bf16, add.epilogue()});
}

// Column sums of G (rows, n; T, or bf16 under autocast) into the gradient of a bias, when it is
// wanted.
template <class T, class X>
void pass_bias_grad(Node& n, int slot, const X* G, i64 rows, i64 cols) {
  Tensor db = n.new_grad(slot);
  if (db.defined()) kernels::sum_forward(G, db.data<T>(), 1, rows, cols, 1.0);
  n.pass_grad(slot, std::move(db));
}

// The two products of one Linear's backward, dx = G w and dw = G^T x, side by side when both are
// wanted (as linear's backward); px carries the epilogue, if any.
template <class T>
void run_backward_pair(const detail::Product<T>& px, const detail::Product<T>& pw, bool want_x, bool want_w) {
  if (want_x && want_w) detail::run_pair(px, pw);
  else if (want_x) detail::run(px);
  else if (want_w) detail::run(pw);
}

// Inputs: x 0, w1 1, b1 2, w2 3, b2 4, residual 5.
template <class T>
void mlp_backward(Node& n, const MlpSaved& s, const MlpDims& d) {
  using detail::operand;
  Tensor dres = n.needs_grad(5) ? detail::residual_grad(n, 5) : Tensor();  // first: it may be dy's buffer
  const T* G = n.grad_out().data<T>();
  const T* pre = d.bf16 ? nullptr : s.pre.data<T>();
  const auto* saved = d.bf16 ? static_cast<const kernels::bf16*>(s.pre.raw_data()) : nullptr;
  // dh = G w2, whose epilogue makes h again (for dw2 = G^T h: the forward's bits) and dpre; then
  // dw2. Without dpre to make (x, w1 and b1 need no gradient) h takes a pass of its own.
  // h: bf16 as the forward's, or float. A float GELU h goes over the saved pre when no one reads pre
  // after this backward (Node::reusable_saved): the epilogue reads each pre[i] before it writes
  // h[i] at the same place, and nothing else reads pre. That saves a (rows, F) buffer where the
  // last block's backward runs, the step's peak of memory.
  const DType dt = n.grad_out().dtype();
  Tensor h = !d.bf16 && d.act == Act::gelu ? n.reusable_saved(s.pre) : Tensor();
  if (!h.defined()) h = Tensor::empty({d.rows, d.F}, d.bf16 ? bfloat16 : dt);
  kernels::bf16* hb = d.bf16 ? static_cast<kernels::bf16*>(h.raw_data()) : nullptr;
  const bool want_pre = n.needs_grad(0) || n.needs_grad(1) || n.needs_grad(2);  // dpre is read by x's, w1's, b1's
  // dpre: over dh (GELU, float32), its own float buffer (SwiGLU), or, under autocast, bf16: the
  // two products after it round it anyway, so they read half the bytes and convert nothing. dh
  // goes when the product is done (unless dpre is over it).
  Tensor dpre;
  if (want_pre) {
    Tensor dh = Tensor::empty({d.rows, d.F}, dt);
    dpre = d.bf16 ? Tensor::empty({d.rows, d.H}, bfloat16) : d.act == Act::gelu ? dh : Tensor::empty({d.rows, d.H}, dt);
    const ActEpilogue<T> back{.d = d, .pre = pre, .dh = dh.data<T>(), .out = d.bf16 ? nullptr : dpre.data<T>(),
                              .h = hb ? nullptr : h.data<T>(), .hb = hb, .saved = saved,
                              .dpre_b = d.bf16 ? static_cast<kernels::bf16*>(dpre.raw_data()) : nullptr};
    detail::run(detail::Product<T>{false, false, d.rows, d.F, d.out, operand(G, d.out),
                                   operand<T>(s.w.w2, d.F), T(0), dh.data<T>(), d.F, d.bf16,
                                   back.epilogue()});
  } else {
    const ActEpilogue<T> fwd{.d = d, .pre = pre, .out = hb ? nullptr : h.data<T>(), .hb = hb, .saved = saved};
    kernels::parallel_for(d.rows, d.rows * d.H, [&](i64 lo, i64 hi) { fwd.run(&fwd, lo, hi, 0, d.H); });
  }
  Tensor dw2 = n.new_grad(3);
  if (dw2.defined())
    detail::run(detail::Product<T>{true, false, d.out, d.F, d.rows, operand(G, d.out), operand<T>(h, d.F), T(0),
                                   dw2.data<T>(), d.F, d.bf16});
  h = Tensor();
  n.pass_grad(3, std::move(dw2));
  pass_bias_grad<T>(n, 4, G, d.rows, d.out);
  if (!want_pre) return n.pass_grad(5, std::move(dres));
  Tensor dx = n.new_grad(0), dw1 = n.new_grad(1);
  const Tensor& xs = s.x_bf16.defined() ? s.x_bf16 : s.x;
  detail::Product<T> p_dx{false, false, d.rows, d.C, d.H, operand<T>(dpre, d.H),
                          operand<T>(s.w.w1, d.C), T(0), detail::grad_ptr<T>(dx), d.C, d.bf16};
  detail::Product<T> p_dw1{true, false, d.H, d.C, d.rows, operand<T>(dpre, d.H), {}, T(0), detail::grad_ptr<T>(dw1),
                           d.C, d.bf16};
  if (dw1.defined()) p_dw1.B = operand<T>(xs, d.C);
  run_backward_pair(p_dx, p_dw1, dx.defined(), dw1.defined());
  n.pass_grad(0, std::move(dx));
  n.pass_grad(1, std::move(dw1));
  if (d.bf16) pass_bias_grad<T>(n, 2, static_cast<const kernels::bf16*>(dpre.raw_data()), d.rows, d.H);
  else pass_bias_grad<T>(n, 2, dpre.data<T>(), d.rows, d.H);
  n.pass_grad(5, std::move(dres));
}

void check_bias(const char* op, const Tensor& x, const Tensor& b, const char* name, i64 n) {
  if (!b.defined()) return;
  detail::check_same_dtype(op, x, b);
  if (b.dim() != 1 || b.size(0) != n) fail(op, "expects ", name, " (", n, ",), got ", b.shape());
}

MlpDims check_mlp(const char* op, const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                  const Tensor& b2, const char* activation, const Tensor& res) {
  if (!x.defined() || !w1.defined() || !w2.defined()) fail(op, "needs an input and two weights");
  const std::string a = activation ? activation : "";
  if (a != "gelu" && a != "swiglu") fail(op, "activation must be \"gelu\" or \"swiglu\", got \"", a, "\"");
  for (const Tensor* t : {&x, &w1, &w2}) detail::check_float(op, *t);
  detail::check_same_dtype(op, x, w1);
  detail::check_same_dtype(op, x, w2);
  const Act act = a == "gelu" ? Act::gelu : Act::swiglu;
  if (x.dim() < 1 || w1.dim() != 2 || x.size(-1) != w1.size(1))
    fail(op, "expects input (..., in) and w1 (hidden, in), got ", x.shape(), " and ", w1.shape());
  const i64 H = w1.size(0), F = act == Act::gelu ? H : H / 2;
  if (act == Act::swiglu && H % 2 != 0) fail(op, "swiglu needs an even w1 width (gate and up), got ", w1.shape());
  if (w2.dim() != 2 || w2.size(1) != F)
    fail(op, "expects w2 (out, ", F, ") after ", a, " of w1 ", w1.shape(), ", got ", w2.shape());
  check_bias(op, x, b1, "b1", H);
  check_bias(op, x, b2, "b2", w2.size(0));
  i64 rows = 1;  // the product of x's leading dims
  for (int i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  if (res.defined()) {
    detail::check_same_dtype(op, x, res);
    Shape yshape = x.shape();
    yshape[yshape.ndim() - 1] = w2.size(0);
    if (res.shape() != yshape) fail(op, "expects residual ", yshape, " (the output's shape), got ", res.shape());
  }
  return {rows, x.size(-1), H, F, w2.size(0), act, false};
}

}  // namespace

Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const char* activation, const Tensor& residual) {
  const char* op = "mlp";
  MlpDims d = check_mlp(op, x, w1, b1, w2, b2, activation, residual);
  // An empty product somewhere: the unfused twin handles every such case.
  if (d.rows * d.C * d.H * d.out == 0) return composite::mlp(x, w1, b1, w2, b2, activation, residual);
  d.bf16 = detail::products_in_bf16(x.dtype());
  const bool recording = should_record({&x, &w1, &b1, &w2, &b2, &residual});
  Shape yshape = x.shape();
  yshape[yshape.ndim() - 1] = d.out;
  Tensor y = Tensor::empty(yshape, x.dtype());
  // As linear: in bf16 x is kept as its bf16 copy when w1's gradient (dw1 = dpre^T x) will read
  // it, and the products round the float32 weights as they pack them. pre: float; under autocast
  // bf16, and only when recorded (kernels/mlp.h).
  MlpSaved s{x.detach(), Tensor(),
             d.bf16 && !recording ? Tensor() : Tensor::empty({d.rows, d.H}, d.bf16 ? bfloat16 : x.dtype()),
             {w1.detach(), w2.detach()}};
  if (d.bf16 && recording && w1.requires_grad()) s.x_bf16 = detail::activation_bf16(x);
  detail::dispatch_float(op, x.dtype(), [&](auto z) { mlp_forward<decltype(z)>(x, s, b1, b2, residual, y, d); });
  if (recording) {
    if (s.x_bf16.defined()) s.x = Tensor();
    Node& node = record(op, {&x, &w1, &b1, &w2, &b2, &residual}, {&y}, std::move(s), [d](Node& n, const MlpSaved& saved) {
      detail::dispatch_float("mlp", saved.w.w1.dtype(), [&](auto z) { mlp_backward<decltype(z)>(n, saved, d); });
    });
    // The residual's gradient is dy itself, asked for first (only then: see new_grad).
    if (residual.defined() && residual.requires_grad()) node.may_reuse_grad_out();
  }
  return y;
}

}  // namespace tg
