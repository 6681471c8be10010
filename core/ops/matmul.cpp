// matmul: C = op(A) op(B) over broadcast batch dims, every product a gemm; and linear (x w^T + b,
// PyTorch's F.linear) at the end of the file. The products' precision (float32, float64, or bf16
// operands inside an autocast scope) is ops/product.h's business: an op asks it once.
//
// Backward, with dC the upstream gradient (per batch):
//   d op(A) = dC op(B)^T,   d op(B) = op(A)^T dC,
// and when A itself is stored transposed (trans_a) the gradient of the stored matrix is the
// transpose of d op(A) — which gemm computes directly by swapping operands and flags, so no
// transposed copy is ever made. Each gradient is written into a fresh buffer with beta = 0 and
// handed to the tape; beta = 1 sums the contributions of broadcast batch entries that share one
// matrix of the gradient (into a buffer zero-filled first).
#include <algorithm>
#include <cstring>

#include "dispatch.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "ops/internal.h"
#include "ops/product.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

using detail::dispatch_float;

namespace {

struct MatmulPlan {
  bool ta = false, tb = false;
  std::int64_t M = 0, N = 0, K = 0;
  std::int64_t batch = 1;  // number of output matrices
  // for output batch index i: offsets (in matrices) of a's and b's matrix
  std::vector<std::int64_t> ia, ib;
  bool fold = false;       // b is one 2-D matrix and a is not transposed: one gemm over all rows
  bool bf16 = false;       // bf16 operands, float32 sums (detail::products_in_bf16)
};

// C = op(A) op(B) + beta C, in bf16 when the op's products are (detail::run).
template <class T>
void product(bool bf16, bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A,
             std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  detail::run(detail::Product<T>{ta, tb, M, N, K, detail::operand(A, lda), detail::operand(B, ldb), beta, C, ldc, bf16});
}

MatmulPlan plan_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb, Shape& out) {
  const char* op = "matmul";
  if (a.dim() < 2 || b.dim() < 2)
    fail(op, "needs tensors with at least 2 dims, got ", a.shape(), " @ ", b.shape());
  MatmulPlan p;
  p.ta = ta;
  p.tb = tb;
  const std::int64_t ar = a.size(-2), ac = a.size(-1), br = b.size(-2), bc = b.size(-1);
  p.M = ta ? ac : ar;
  p.K = ta ? ar : ac;
  const std::int64_t kb = tb ? bc : br;
  p.N = tb ? br : bc;
  if (p.K != kb)
    fail(op, "inner dimensions differ: ", a.shape(), (ta ? "^T" : ""), " @ ", b.shape(), (tb ? "^T" : ""));
  // broadcast the batch dims
  const int na = a.dim() - 2, nb = b.dim() - 2, nd = std::max(na, nb);
  Shape bshape;
  for (int i = 0; i < nd; ++i) {
    const int ka = i - (nd - na), kb2 = i - (nd - nb);
    const std::int64_t da = ka >= 0 ? a.shape()[ka] : 1, db = kb2 >= 0 ? b.shape()[kb2] : 1;
    if (da != db && da != 1 && db != 1) fail(op, "batch dimensions cannot be broadcast: ", a.shape(), " @ ", b.shape());
    bshape.push_back(std::max(da, db) == 1 ? std::min(da, db) : std::max(da, db));
  }
  out = bshape;
  out.push_back(p.M);
  out.push_back(p.N);
  p.batch = bshape.numel();
  p.fold = nb == 0 && !ta;
  if (p.fold) return p;
  // map each output batch index to a's and b's matrix index
  p.ia.resize(static_cast<std::size_t>(p.batch));
  p.ib.resize(static_cast<std::size_t>(p.batch));
  for (std::int64_t i = 0; i < p.batch; ++i) {
    std::int64_t rem = i, oa = 0, ob = 0, sa = 1, sb = 1;
    for (int d = nd - 1; d >= 0; --d) {
      const std::int64_t idx = rem % bshape[d];
      rem /= bshape[d];
      const int ka = d - (nd - na), kb2 = d - (nd - nb);
      if (ka >= 0) { if (a.shape()[ka] != 1) oa += idx * sa; sa *= a.shape()[ka]; }
      if (kb2 >= 0) { if (b.shape()[kb2] != 1) ob += idx * sb; sb *= b.shape()[kb2]; }
    }
    p.ia[static_cast<std::size_t>(i)] = oa;
    p.ib[static_cast<std::size_t>(i)] = ob;
  }
  return p;
}

// Per-matrix gemms over the batch; parallel across matrices (each gemm then runs on one thread)
// when the matrices are small and the destinations distinct.
template <class F>
void for_batch(std::int64_t batch, std::int64_t flops_each, bool distinct, F&& f) {
  const bool par = distinct && batch > 1 && flops_each < (1 << 21);
  kernels::parallel_for(batch, par ? batch * flops_each : 0, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) f(i);
  });
}

bool is_distinct(const std::vector<std::int64_t>& idx) {
  for (std::size_t i = 0; i < idx.size(); ++i)
    if (idx[i] != static_cast<std::int64_t>(i)) return false;
  return true;
}


// What matmul's backward reads, and the geometry it shares with the forward: leading dimensions
// (lda, ldb) and the strides of one batch entry of A, B and C (sa, sb, sc).
struct MatmulSaved { Tensor a, b; };
struct MatmulGeom { std::int64_t lda, ldb, sa, sb, sc; };

// C = op(A) op(B) per batch entry (or one folded product).
template <class T>
void matmul_forward(const MatmulPlan& p, const MatmulGeom& g, const T* A, const T* B, T* C, std::int64_t numel) {
  if (p.M * p.N == 0) return;
  if (p.K == 0) {  // an empty sum: zeros (and no BLAS call with a zero leading dimension)
    std::fill(C, C + numel, T(0));
    return;
  }
  if (p.fold) {
    product<T>(p.bf16, false, p.tb, p.batch * p.M, p.N, p.K, A, g.lda, B, g.ldb, T(0), C, p.N);
    return;
  }
  for_batch(p.batch, p.M * p.N * p.K, true, [&](std::int64_t i) {
    product<T>(p.bf16, p.ta, p.tb, p.M, p.N, p.K, A + p.ia[i] * g.sa, g.lda, B + p.ib[i] * g.sb, g.ldb, T(0), C + i * g.sc, p.N);
  });
}

// A fresh gradient for input i that the product writes with beta: zero-filled first when the
// gemms add into it (beta = 1: broadcast batch entries that share a matrix).
Tensor product_grad(Node& n, std::size_t i, bool whole) {
  Tensor d = n.new_grad(i);
  if (d.defined() && !whole && d.nbytes()) std::memset(d.raw_data(), 0, d.nbytes());
  return d;
}

// dA = dC op(B)^T (or op(B) dC^T when A is transposed) and dB = op(A)^T dC (or dC^T op(A)), per
// batch entry, each into a fresh buffer: beta = 0 where one gemm writes a whole matrix, beta = 1
// where broadcast batch entries share one.
template <class T>
void matmul_backward(Node& n, const MatmulSaved& s, const MatmulPlan& p, const MatmulGeom& g) {
  const bool whole_a = p.fold || is_distinct(p.ia), whole_b = p.fold || is_distinct(p.ib);
  Tensor dA = product_grad(n, 0, whole_a), dB = product_grad(n, 1, whole_b);
  const T* A = s.a.data<T>();
  const T* B = s.b.data<T>();
  const T* G = n.grad_out().data<T>();
  const bool ta = p.ta, tb = p.tb;
  const T beta_a = whole_a ? T(0) : T(1), beta_b = whole_b ? T(0) : T(1);
  if (p.fold) {
    const std::int64_t BM = p.batch * p.M;
    // dA (BM, K) = dC (BM, N) op(B)^T
    if (dA.defined()) product<T>(p.bf16, false, !tb, BM, p.K, p.N, G, p.N, B, g.ldb, T(0), dA.data<T>(), g.lda);
    // dB = A^T dC  (B stored (K, N)),  or  dC^T A  (B stored (N, K))
    if (dB.defined()) {
      if (!tb) product<T>(p.bf16, true, false, p.K, p.N, BM, A, g.lda, G, p.N, T(0), dB.data<T>(), g.ldb);
      else product<T>(p.bf16, true, false, p.N, p.K, BM, G, p.N, A, g.lda, T(0), dB.data<T>(), g.ldb);
    }
  } else {
    if (dA.defined()) {
      T* D = dA.data<T>();
      for_batch(p.batch, p.M * p.N * p.K, whole_a, [&](std::int64_t i) {
        const T* Bi = B + p.ib[i] * g.sb;
        const T* Gi = G + i * g.sc;
        T* Di = D + p.ia[i] * g.sa;
        if (!ta) product<T>(p.bf16, false, !tb, p.M, p.K, p.N, Gi, p.N, Bi, g.ldb, beta_a, Di, g.lda);  // dC op(B)^T
        else product<T>(p.bf16, tb, true, p.K, p.M, p.N, Bi, g.ldb, Gi, p.N, beta_a, Di, g.lda);        // op(B) dC^T
      });
    }
    if (dB.defined()) {
      T* D = dB.data<T>();
      for_batch(p.batch, p.M * p.N * p.K, whole_b, [&](std::int64_t i) {
        const T* Ai = A + p.ia[i] * g.sa;
        const T* Gi = G + i * g.sc;
        T* Di = D + p.ib[i] * g.sb;
        if (!tb) product<T>(p.bf16, !ta, false, p.K, p.N, p.M, Ai, g.lda, Gi, p.N, beta_b, Di, g.ldb);  // op(A)^T dC
        else product<T>(p.bf16, true, ta, p.N, p.K, p.M, Gi, p.N, Ai, g.lda, beta_b, Di, g.ldb);        // dC^T op(A)
      });
    }
  }
  n.pass_grad(0, std::move(dA));
  n.pass_grad(1, std::move(dB));
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  detail::check_float("matmul", a);
  detail::check_float("matmul", b);
  detail::check_same_dtype("matmul", a, b);
  Shape out;
  MatmulPlan p = plan_matmul(a, b, ta, tb, out);
  p.bf16 = detail::products_in_bf16(a.dtype());
  Tensor y = Tensor::empty(out, a.dtype());
  const std::int64_t lda = a.size(-1), ldb = b.size(-1);
  const MatmulGeom g{lda, ldb, a.size(-2) * lda, b.size(-2) * ldb, p.M * p.N};
  dispatch_float("matmul", a.dtype(), [&](auto z) {
    using T = decltype(z);
    matmul_forward<T>(p, g, a.data<T>(), b.data<T>(), y.data<T>(), y.numel());
  });
  if (should_record({&a, &b})) {
    record("matmul", {&a, &b}, {&y}, MatmulSaved{a.detach(), b.detach()},
           [p, g](Node& n, const MatmulSaved& s) {
             if (p.batch * p.M * p.N * p.K == 0) {  // empty products: the gradients are zeros (or empty)
               detail::pass_zeros(n, 0);
               detail::pass_zeros(n, 1);
               return;
             }
             dispatch_float("matmul", s.a.dtype(), [&](auto z) { matmul_backward<decltype(z)>(n, s, p, g); });
           });
  }
  return y;
}

namespace {

// linear's backward: dx (rows, in) = dy w;  dw (out, in) = dy^T x;  db = column sums of dy, each
// into a fresh buffer. dx and dw take the same number of multiply-adds and are computed side by
// side (detail::run_pair). In bf16 the node keeps x_bf16, the input's bf16 copy, when dw is
// wanted: x is then undefined. The weight is read in float32 either way (bf16 products round it
// as they pack it).
struct LinearSaved { Tensor x, w, x_bf16; };

template <class T>
void linear_backward_products(Node& n, const LinearSaved& s, bool bf16, const T* G, std::int64_t rows,
                              std::int64_t in, std::int64_t out) {
  Tensor dx = n.new_grad(0), dw = n.new_grad(1);
  const Tensor& x = s.x_bf16.defined() ? s.x_bf16 : s.x;
  using detail::operand;
  const detail::Product<T> px{false, false, rows, in, out, operand(G, out), operand<T>(s.w, in),
                              T(0), detail::grad_ptr<T>(dx), in, bf16};
  detail::Product<T> pw{true, false, out, in, rows, operand(G, out), {}, T(0), detail::grad_ptr<T>(dw), in, bf16};
  if (dw.defined()) pw.B = operand<T>(x, in);
  if (dx.defined() && dw.defined()) detail::run_pair(px, pw);
  else if (dx.defined()) detail::run(px);
  else if (dw.defined()) detail::run(pw);
  n.pass_grad(0, std::move(dx));
  n.pass_grad(1, std::move(dw));
}

template <class T>
void linear_backward(Node& n, const LinearSaved& s, bool bf16, std::int64_t rows, std::int64_t in, std::int64_t out) {
  Tensor dres = n.needs_grad(3) ? detail::residual_grad(n, 3) : Tensor();  // first: it may be dy's buffer
  const T* G = n.grad_out().data<T>();
  if (rows * out * in == 0) {  // empty products: zero (or empty) gradients for x and w
    detail::pass_zeros(n, 0);
    detail::pass_zeros(n, 1);
  } else {
    linear_backward_products<T>(n, s, bf16, G, rows, in, out);
  }
  Tensor db = n.new_grad(2);
  if (db.defined()) kernels::sum_forward(G, db.data<T>(), 1, rows, out, 1.0);
  n.pass_grad(2, std::move(db));
  n.pass_grad(3, std::move(dres));
}

// y (rows, out) = x w^T + b (+ res): the bias rows are written into y first, and the product adds
// to them (beta = 1); a residual is added to each block of y as the product finishes it.
template <class T>
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& res, bool bf16,
                    const Tensor& x_bf16, Tensor& y, std::int64_t rows, std::int64_t in, std::int64_t out) {
  T* Y = y.data<T>();
  if (rows * out == 0) return;
  const detail::ResidualEpilogue<T> add{res.defined() ? res.data<T>() : nullptr, Y, out};
  if (b.defined()) {
    const T* bias = b.data<T>();
    kernels::parallel_for(rows, rows * out, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) std::copy(bias, bias + out, Y + r * out);
    });
  }
  if (in == 0) {
    if (!b.defined()) std::fill(Y, Y + rows * out, T(0));  // an empty sum
    return add.epilogue().whole(rows, out);
  }
  const Tensor& xs = x_bf16.defined() ? x_bf16 : x;
  detail::run(detail::Product<T>{false, true, rows, out, in, detail::operand<T>(xs, in), detail::operand<T>(w, in),
                                 b.defined() ? T(1) : T(0), Y, out, bf16, add.epilogue()});
}

void check_linear(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& res) {
  if (!x.defined() || !w.defined()) fail(op, "needs an input and a weight");
  detail::check_float(op, x);
  detail::check_float(op, w);
  detail::check_same_dtype(op, x, w);
  if (w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1))
    fail(op, "expects input (..., in) and weight (out, in), got ", x.shape(), " and ", w.shape());
  if (b.defined()) {
    detail::check_same_dtype(op, x, b);
    if (b.dim() != 1 || b.size(0) != w.size(0)) fail(op, "expects bias (", w.size(0), ",), got ", b.shape());
  }
  if (res.defined()) {
    detail::check_same_dtype(op, x, res);
    Shape yshape = x.shape();
    yshape[yshape.ndim() - 1] = w.size(0);
    if (res.shape() != yshape) fail(op, "expects residual ", yshape, " (the output's shape), got ", res.shape());
  }
}

}  // namespace

// linear: y = x w^T + b over the rows of x, PyTorch's F.linear. The bias rows are written into y
// where the gemm would otherwise zero-fill it (kernels/gemm.cpp), and the gemm adds the product to
// them (beta = 1): no separate add pass and one tape node instead of two. The backward is matmul's,
// with the bias gradient as the column sums of dy:
//   dx = dy w,  dw = dy^T x,  db = sum over rows of dy.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& residual) {
  const char* op = "linear";
  check_linear(op, x, w, b, residual);
  Shape yshape = x.shape();
  yshape[yshape.ndim() - 1] = w.size(0);
  const std::int64_t in = w.size(1), out = w.size(0);
  std::int64_t rows = 1;  // the product of x's leading dims
  for (int d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  Tensor y = Tensor::empty(yshape, x.dtype());
  // In bf16 the products round the float32 weight as they pack it: no copy of it is made or kept.
  // When the op is recorded and w needs a gradient (the backward's dw = dy^T x reads x), x is
  // rounded to bf16 once, before the product, and the node keeps that copy instead of x: half the
  // bytes kept from the forward to the backward, and the same bits (the product rounds a float32
  // operand the same way while it packs it).
  const bool bf16 = detail::products_in_bf16(x.dtype()) && in > 0;
  const bool recording = should_record({&x, &w, &b, &residual});
  const Tensor x_bf16 = bf16 && recording && w.requires_grad() && rows * out > 0 ? detail::activation_bf16(x) : Tensor();
  dispatch_float(op, x.dtype(),
                 [&](auto z) { linear_forward<decltype(z)>(x, w, b, residual, bf16, x_bf16, y, rows, in, out); });
  if (recording) {
    Node& node = record(op, {&x, &w, &b, &residual}, {&y},
                        LinearSaved{x_bf16.defined() ? Tensor() : x.detach(), w.detach(), x_bf16},
                        [bf16, rows, in, out](Node& n, const LinearSaved& s) {
                          dispatch_float("linear", s.w.dtype(),
                                         [&](auto z) { linear_backward<decltype(z)>(n, s, bf16, rows, in, out); });
                        });
    // The residual's gradient is dy itself, asked for first (only then: see new_grad).
    if (residual.defined() && residual.requires_grad()) node.may_reuse_grad_out();
  }
  return y;
}

Tensor detail::residual_grad(const Node& n, std::size_t slot) {
  Tensor g = n.new_grad(slot);
  const Tensor& dy = n.grad_out();
  if (g.defined() && g.raw_data() != dy.raw_data())
    std::memcpy(g.raw_data(), dy.raw_data(), static_cast<std::size_t>(dy.numel()) * itemsize(dy.dtype()));
  return g;
}

}  // namespace tg
