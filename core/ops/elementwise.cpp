// Elementwise ops: binary with NumPy broadcasting, unary, and scalar forms. The math of each
// forward and derivative sits in its functor in core/kernels/elementwise.h.
#include <cstring>

#include "dispatch.h"
#include "kernels/elementwise.h"
#include "ops/internal.h"
#include "ops/recompute.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

using namespace kernels;
using detail::dispatch_float;

namespace {

// Right-aligned broadcasting: each pair of dims must be equal or contain a 1.
Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b) {
  const int nd = std::max(a.ndim(), b.ndim());
  Shape out;
  for (int i = 0; i < nd; ++i) {
    const int ia = i - (nd - a.ndim()), ib = i - (nd - b.ndim());
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) fail(op, "shapes ", a, " and ", b, " cannot be broadcast together");
    out.push_back(da == 1 ? db : da);
  }
  return out;
}

void fill_strides(const Shape& out, const Shape& in, std::int64_t* st) {
  const int off = out.ndim() - in.ndim();
  std::int64_t acc = 1;
  for (int d = out.ndim() - 1; d >= 0; --d) {
    const int k = d - off;
    if (k < 0 || in[k] == 1) st[d] = 0;
    else { st[d] = acc; }
    if (k >= 0) acc *= in[k];
  }
}

BroadcastPlan make_plan(const Shape& out, const Shape& a, const Shape& b) {
  BroadcastPlan p;
  p.nd = out.ndim();
  p.numel = out.numel();
  for (int d = 0; d < p.nd; ++d) p.shape[d] = out[d];
  fill_strides(out, a, p.sa);
  fill_strides(out, b, p.sb);
  return p;
}

// What a binary or unary op saves for its backward: a and/or b, as its Op says (Op::kNeedA /
// kNeedB, Op::kX / kY), with no empty slot for an operand the backward does not read (x * 2 + 1
// saves nothing). saved_a / saved_b read them back, null when not saved.
template <bool A, bool B> struct SavedAB;
template <> struct SavedAB<true, true> { Tensor a, b; };
template <> struct SavedAB<true, false> { Tensor a; };
template <> struct SavedAB<false, true> { Tensor b; };
template <> struct SavedAB<false, false> {};
template <class T, class S>
const T* saved_a(const S& s) {
  if constexpr (requires { s.a; }) return s.a.template data<T>();
  else return nullptr;
}
template <class T, class S>
const T* saved_b(const S& s) {
  if constexpr (requires { s.b; }) return s.b.template data<T>();
  else return nullptr;
}

// Records op with the SavedAB<SaveA, SaveB> of a and b; backward(Node&, const SavedAB&). Returns
// the node.
template <bool SaveA, bool SaveB, class F>
Node& record_saving(const char* op, std::initializer_list<const Tensor*> in, Tensor* out, F&& backward,
                    const Tensor& a, const Tensor& b) {
  using S = SavedAB<SaveA, SaveB>;
  if constexpr (SaveA && SaveB) return record(op, in, {out}, S{a.detach(), b.detach()}, std::forward<F>(backward));
  else if constexpr (SaveA) return record(op, in, {out}, S{a.detach()}, std::forward<F>(backward));
  else if constexpr (SaveB) return record(op, in, {out}, S{b.detach()}, std::forward<F>(backward));
  else return record(op, in, {out}, [f = std::forward<F>(backward)](Node& n) { f(n, S{}); });
}

// L when r is one row of out's trailing dims (any leading dims 1), so that out is (M, L) with r
// repeated over M; 0 otherwise.
std::int64_t row_len(const Shape& out, const Shape& r) {
  const int off = out.ndim() - r.ndim();
  int k = 0;
  while (k < r.ndim() && r[k] == 1) ++k;
  for (int d = k; d < r.ndim(); ++d)
    if (r[d] != out[d + off]) return 0;
  return r.numel();
}

// Where binary() reads its operands: same shape; a row (bias, position table) repeated over the
// rows of the other (out (M, L)); general broadcasting (serial, index arithmetic).
enum class Kind { same, rows, general };
struct BinaryLayout {
  Kind kind = Kind::general;
  BroadcastPlan plan;   // general only
  std::int64_t M = 0, L = 0;
  bool row_is_b = false;  // rows: which operand is the row
};

BinaryLayout binary_layout(const Shape& out, const Shape& a, const Shape& b) {
  BinaryLayout l;
  if (a == b) {
    l.kind = Kind::same;
  } else if (a == out || b == out) {
    l.row_is_b = a == out;
    l.L = l.row_is_b ? row_len(out, b) : row_len(out, a);
    if (l.L > 0) l.kind = Kind::rows;
  }
  if (l.kind == Kind::general) l.plan = make_plan(out, a, b);
  if (l.L > 0) l.M = out.numel() / l.L;
  return l;
}

// da and db, each written whole into a fresh buffer. With same-shaped operands db is asked for
// first, so that it is the one that may be dy's buffer (the node declares may_reuse_grad_out;
// the kernel writes da before db).
template <class Op, class S>
void binary_node_backward(Node& n, const S& s, const BinaryLayout& l) {
  const Tensor& dy = n.grad_out();
  Tensor db = n.new_grad(1), da = n.new_grad(0);
  dispatch_float("backward", dy.dtype(), [&](auto z) {
    using T = decltype(z);
    const T* ap = saved_a<T>(s);
    const T* bp = saved_b<T>(s);
    const T* g = dy.data<T>();
    T* dap = detail::grad_ptr<T>(da);
    T* dbp = detail::grad_ptr<T>(db);
    switch (l.kind) {
      case Kind::same: binary_backward_same<T, Op>(ap, bp, g, dap, dbp, dy.numel()); break;
      case Kind::rows: binary_backward_rows<T, Op>(ap, bp, g, dap, dbp, l.M, l.L, l.row_is_b); break;
      case Kind::general:
        binary_backward_broadcast<T, Op>(l.plan, ap, bp, g, dap, dap ? da.numel() : 0, dbp, dbp ? db.numel() : 0);
        break;
    }
  });
  n.pass_grad(0, std::move(da));
  n.pass_grad(1, std::move(db));
}

template <class Op>
Tensor binary(const char* name, const Tensor& a, const Tensor& b) {
  detail::check_float(name, a);
  detail::check_float(name, b);
  detail::check_same_dtype(name, a, b);
  const Shape out = broadcast_shapes(name, a.shape(), b.shape());
  const BinaryLayout l = binary_layout(out, a.shape(), b.shape());
  Tensor y = Tensor::empty(out, a.dtype());
  dispatch_float(name, a.dtype(), [&](auto z) {
    using T = decltype(z);
    switch (l.kind) {
      case Kind::same: binary_forward_same<T, Op>(a.data<T>(), b.data<T>(), y.data<T>(), y.numel()); break;
      case Kind::rows: binary_forward_rows<T, Op>(a.data<T>(), b.data<T>(), y.data<T>(), l.M, l.L, l.row_is_b); break;
      case Kind::general: binary_forward_broadcast<T, Op>(l.plan, a.data<T>(), b.data<T>(), y.data<T>()); break;
    }
  });
  if (should_record({&a, &b})) {
    Node& node = record_saving<Op::kNeedA, Op::kNeedB>(
        name, {&a, &b}, &y, [l](Node& n, const auto& s) { binary_node_backward<Op>(n, s, l); }, a, b);
    if (l.kind == Kind::same) node.may_reuse_grad_out();
  }
  return y;
}

// The backward of a recorded unary op: writes dx = dy * op.df(x, y), x and y read from what the
// node saved (s.a = x, s.b = y; null when not saved). The node declares may_reuse_grad_out:
// dx may be dy's own buffer.
template <class Op, class S>
void unary_node_backward(Node& n, const S& s, Op op) {
  const Tensor& dy = n.grad_out();
  Tensor dx = n.new_grad(0);
  dispatch_float("backward", dy.dtype(), [&](auto z) {
    using T = decltype(z);
    unary_backward<T>(saved_a<T>(s), saved_b<T>(s), dy.data<T>(), dx.data<T>(), dy.numel(), op);
  });
  n.pass_grad(0, std::move(dx));
}

template <class Op>
constexpr bool has_fdf() {
  if constexpr (requires { Op::kFdf; }) return Op::kFdf;
  else return false;
}

// A unary op whose forward gives its derivative too: when recorded, d = f'(x) is saved instead of
// x and the backward is dx = dy * d (the GELUs: their backward had recomputed erf and exp, or
// tanh, per element). d has x's size: the same bytes held where nothing else holds x (a Linear's
// output in an MLP), one more buffer where something does.
template <class Op>
Tensor unary_saving_deriv(const char* name, const Tensor& x, Op op) {
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  Tensor d = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(name, x.dtype(), [&](auto z) {
    using T = decltype(z);
    unary_forward_deriv<T>(x.data<T>(), y.data<T>(), d.data<T>(), x.numel(), op);
  });
  using Saved = SavedAB<true, false>;  // a = f'(x)
  record(name, {&x}, {&y}, Saved{d}, [](Node& n, const Saved& s) { unary_node_backward(n, s, SavedDerivOp{}); })
      .may_reuse_grad_out();
  return y;
}

// An fdf op's value and derivative alone, from the one fdf (so the same bits as it gives).
template <class Op>
struct ValueOf {
  Op op;
  template <class T> T f(T x) const {
    T y, d;
    op.fdf(x, y, d);
    return y;
  }
};
template <class Op>
struct DerivOf {
  Op op;
  static constexpr bool kX = true, kY = false;
  template <class T> T df(T x, T) const {
    T y, d;
    op.fdf(x, y, d);
    return d;
  }
};

// Where an op keeps no buffer its backward can recompute (detail::keep_recomputable: a
// checkpointed segment's recomputation, where memory comes first): the node saves x, which the
// caller's tensor holds anyway until the op returns, and the backward computes f'(x) again from it,
// rather than a derivative buffer of x's size made beside y.
template <class Op>
Tensor unary_recomputing_deriv(const char* name, const Tensor& x, Op op) {
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(name, x.dtype(), [&](auto z) {
    using T = decltype(z);
    unary_forward<T>(x.data<T>(), y.data<T>(), x.numel(), ValueOf<Op>{op});
  });
  record_saving<true, false>(name, {&x}, &y, [op](Node& n, const auto& s) { unary_node_backward(n, s, DerivOf<Op>{op}); },
                             x, y)
      .may_reuse_grad_out();
  return y;
}

template <class Op>
Tensor unary(const char* name, const Tensor& x, Op op) {
  detail::check_float(name, x);
  if constexpr (has_fdf<Op>())
    if (should_record({&x}))
      return detail::keep_recomputable() ? unary_saving_deriv(name, x, op) : unary_recomputing_deriv(name, x, op);
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(name, x.dtype(), [&](auto z) {
    using T = decltype(z);
    unary_forward<T>(x.data<T>(), y.data<T>(), x.numel(), op);
  });
  if constexpr (!has_fdf<Op>()) {
    if (should_record({&x}))
      record_saving<Op::kX, Op::kY>(
          name, {&x}, &y, [op](Node& n, const auto& s) { unary_node_backward(n, s, op); }, x, y)
          .may_reuse_grad_out();
  }
  return y;
}

void check_scalar(const char* op, double s) {
  if (std::isnan(s)) fail(op, "scalar operand is NaN");
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary<AddOp>("add", a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary<SubOp>("sub", a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary<MulOp>("mul", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary<DivOp>("div", a, b); }

Tensor add(const Tensor& a, double s) { check_scalar("add", s); return unary("add", a, AddScalarOp{s}); }
Tensor sub(const Tensor& a, double s) { check_scalar("sub", s); return unary("sub", a, AddScalarOp{-s}); }
Tensor mul(const Tensor& a, double s) { check_scalar("mul", s); return unary("mul", a, MulScalarOp{s}); }
Tensor div(const Tensor& a, double s) {
  check_scalar("div", s);
  if (s == 0) fail("div", "division of ", a.shape(), " by the scalar 0");
  return unary("div", a, DivScalarOp{s});
}
Tensor rsub(double s, const Tensor& a) { check_scalar("rsub", s); return unary("rsub", a, RsubScalarOp{s}); }
Tensor rdiv(double s, const Tensor& a) { check_scalar("rdiv", s); return unary("rdiv", a, RdivScalarOp{s}); }

Tensor neg(const Tensor& x) { return unary("neg", x, NegOp{}); }
Tensor exp(const Tensor& x) { return unary("exp", x, ExpOp{}); }
Tensor log(const Tensor& x) { return unary("log", x, LogOp{}); }
Tensor sqrt(const Tensor& x) { return unary("sqrt", x, SqrtOp{}); }
Tensor rsqrt(const Tensor& x) { return unary("rsqrt", x, RsqrtOp{}); }
Tensor pow(const Tensor& x, double p) {
  if (!std::isfinite(p)) fail("pow", "exponent must be finite, got ", p);
  return unary("pow", x, PowOp{p});
}
Tensor abs(const Tensor& x) { return unary("abs", x, AbsOp{}); }
Tensor tanh(const Tensor& x) { return unary("tanh", x, TanhOp{}); }
Tensor sigmoid(const Tensor& x) { return unary("sigmoid", x, SigmoidOp{}); }
Tensor relu(const Tensor& x) { return unary("relu", x, ReluOp{}); }
Tensor gelu(const Tensor& x, const char* approximate) {
  const std::string a = approximate ? approximate : "";
  if (a == "none") return unary("gelu", x, GeluErfOp{});
  if (a == "tanh") return unary("gelu_tanh", x, GeluTanhOp{});
  fail("gelu", "approximate must be \"none\" or \"tanh\", got \"", a, "\"");
}

}  // namespace tg
