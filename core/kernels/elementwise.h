#pragma once
// Elementwise kernels. Each op is a functor holding its forward f and its derivative df side by
// side; the kernels below apply them, the backward ones by the chain rule: dx = dy * df(x, y),
// da = dy * da(a, b), db = dy * db(a, b).
//
// Shapes: n elements of any shape, read flat (tensors are contiguous); M rows of L elements for a
// row broadcast; the output's shape held in a BroadcastPlan for general broadcasting.
//   x, y        (n)  unary input and output
//   d           (n)  f'(x), which a recorded GELU saves in place of x
//   a, b        binary operands: (n) each; or one (M, L), the other (L); or as the plan says
//   dy          gradient of y, y's shape
//   dx, da, db  gradients of x, a, b, each its input's shape, written (=) as fresh buffers; a
//               row's or a broadcast operand's gradient is a sum over the output's elements
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "kernels/fastmath.h"
#include "kernels/parallel.h"

namespace tg::kernels {

// ---- unary: y = f(x), dy/dx = df(x, y). kX / kY say which of x and y df reads (so the op saves
// only those). ----
struct NegOp {
  static constexpr bool kX = false, kY = false;
  template <class T> T f(T x) const { return -x; }
  template <class T> T df(T, T) const { return T(-1); }
};
struct ExpOp {  // d/dx e^x = e^x = y
  static constexpr bool kX = false, kY = true;
  template <class T> T f(T x) const { return fast_exp(x); }
  template <class T> T df(T, T y) const { return y; }
};
struct LogOp {  // d/dx ln x = 1/x
  static constexpr bool kX = true, kY = false;
  template <class T> T f(T x) const { return std::log(x); }
  template <class T> T df(T x, T) const { return T(1) / x; }
};
struct SqrtOp {  // d/dx sqrt x = 1 / (2 sqrt x) = 1 / (2y)
  static constexpr bool kX = false, kY = true;
  template <class T> T f(T x) const { return std::sqrt(x); }
  template <class T> T df(T, T y) const { return T(0.5) / y; }
};
struct RsqrtOp {  // d/dx x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2
  static constexpr bool kX = false, kY = true;
  template <class T> T f(T x) const { return T(1) / std::sqrt(x); }
  template <class T> T df(T, T y) const { return T(-0.5) * y * y * y; }
};
struct PowOp {  // d/dx x^p = p x^(p-1); p = 0 has gradient 0 everywhere (as PyTorch)
  double p;
  static constexpr bool kX = true, kY = false;
  template <class T> T f(T x) const { return p == 2 ? x * x : static_cast<T>(std::pow(x, static_cast<T>(p))); }
  template <class T> T df(T x, T) const {
    if (p == 0) return T(0);
    if (p == 2) return T(2) * x;
    return static_cast<T>(p) * static_cast<T>(std::pow(x, static_cast<T>(p - 1)));
  }
};
struct AbsOp {  // sign(x), 0 at 0
  static constexpr bool kX = true, kY = false;
  template <class T> T f(T x) const { return std::fabs(x); }
  template <class T> T df(T x, T) const { return x > 0 ? T(1) : x < 0 ? T(-1) : T(0); }
};
struct TanhOp {  // 1 - tanh^2
  static constexpr bool kX = false, kY = true;
  template <class T> T f(T x) const { return std::tanh(x); }
  template <class T> T df(T, T y) const { return T(1) - y * y; }
};
struct SigmoidOp {  // s (1 - s); written to avoid overflow of exp for large |x|
  static constexpr bool kX = false, kY = true;
  template <class T> T f(T x) const {
    if (x >= 0) return T(1) / (T(1) + fast_exp(-x));
    const T e = fast_exp(x);
    return e / (T(1) + e);
  }
  template <class T> T df(T, T y) const { return y * (T(1) - y); }
};
struct ReluOp {  // 1 where x > 0, else 0 (0 at 0, as PyTorch); NaN stays NaN
  static constexpr bool kX = true, kY = false;
  template <class T> T f(T x) const { return x < 0 ? T(0) : x; }
  template <class T> T df(T x, T) const { return x > 0 ? T(1) : T(0); }
};
// The GELUs give f alone (unrecorded) or f and its derivative together (fdf): a recorded GELU
// saves df(x) in place of x, sharing the erf (or tanh) between the two, and its backward is one
// multiply (see unary_forward_deriv). y is the same formula either way, so the same bits.
struct GeluErfOp {  // x Phi(x); d/dx = Phi(x) + x phi(x), phi the standard normal density
  static constexpr bool kFdf = true;
  template <class T> static T erf_(T x) { return fast_erf(x * T(std::numbers::sqrt2 / 2)); }
  template <class T> static T pdf(T x) {
    return fast_exp(T(-0.5) * x * x) * T(0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2);
  }
  template <class T> T f(T x) const { return T(0.5) * x * (T(1) + erf_(x)); }
  template <class T> void fdf(T x, T& y, T& d) const {
    const T e = erf_(x);
    y = T(0.5) * x * (T(1) + e);
    d = T(0.5) * (T(1) + e) + x * pdf(x);
  }
};
struct GeluTanhOp {  // 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)
  static constexpr bool kFdf = true;
  static constexpr double kC = 0.7978845608028654;  // sqrt(2 / pi)
  template <class T> static T th(T x) { return std::tanh(T(kC) * (x + T(0.044715) * x * x * x)); }
  template <class T> static T dfrom(T x, T t) {
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kC) * (T(1) + T(3 * 0.044715) * x * x);
  }
  template <class T> T f(T x) const { return T(0.5) * x * (T(1) + th(x)); }
  template <class T> void fdf(T x, T& y, T& d) const {
    const T t = th(x);
    y = T(0.5) * x * (T(1) + t);
    d = dfrom(x, t);
  }
};
// The backward of an op whose forward stored its derivative: dx = dy * d.
struct SavedDerivOp {
  static constexpr bool kX = true, kY = false;
  template <class T> T df(T d, T) const { return d; }
};
struct AddScalarOp {
  double s;
  static constexpr bool kX = false, kY = false;
  template <class T> T f(T x) const { return x + static_cast<T>(s); }
  template <class T> T df(T, T) const { return T(1); }
};
struct MulScalarOp {
  double s;
  static constexpr bool kX = false, kY = false;
  template <class T> T f(T x) const { return x * static_cast<T>(s); }
  template <class T> T df(T, T) const { return static_cast<T>(s); }
};
struct DivScalarOp {  // x / s, divided (not multiplied by 1/s, which overflows for subnormal s)
  double s;
  static constexpr bool kX = false, kY = false;
  template <class T> T f(T x) const { return x / static_cast<T>(s); }
  template <class T> T df(T, T) const { return T(1) / static_cast<T>(s); }
};
struct RsubScalarOp {  // s - x
  double s;
  static constexpr bool kX = false, kY = false;
  template <class T> T f(T x) const { return static_cast<T>(s) - x; }
  template <class T> T df(T, T) const { return T(-1); }
};
struct RdivScalarOp {  // s / x; d/dx = -s / x^2 = -y / x
  double s;
  static constexpr bool kX = true, kY = true;
  template <class T> T f(T x) const { return static_cast<T>(s) / x; }
  template <class T> T df(T x, T y) const { return -y / x; }
};

// x (n) -> y (n)
template <class T, class Op>
void unary_forward(const T* x, T* y, std::int64_t n, Op op) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) y[i] = op.f(x[i]);
  });
}

// x (n) -> y (n), d (n): y = f(x) and d = f'(x) in one pass, for an op that is recorded (Op::kFdf).
template <class T, class Op>
void unary_forward_deriv(const T* x, T* y, T* d, std::int64_t n, Op op) {
  parallel_for(n, 2 * n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) op.fdf(x[i], y[i], d[i]);
  });
}

// x (n), y (n), dy (n) -> dx (n): dx = dy * df(x, y); x or y may be null when Op does not read
// it. dx may be dy's buffer: each dy[i] is read before dx[i] is written.
template <class T, class Op>
void unary_backward(const T* x, const T* y, const T* dy, T* dx, std::int64_t n, Op op) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      T xi{}, yi{};
      if constexpr (Op::kX) xi = x[i];
      if constexpr (Op::kY) yi = y[i];
      dx[i] = dy[i] * op.df(xi, yi);
    }
  });
}

// ---- binary: y = f(a, b); partials da(a, b) and db(a, b) ----
struct AddOp {
  static constexpr bool kNeedA = false, kNeedB = false;
  template <class T> static T f(T a, T b) { return a + b; }
  template <class T> static T da(T, T) { return T(1); }
  template <class T> static T db(T, T) { return T(1); }
};
struct SubOp {
  static constexpr bool kNeedA = false, kNeedB = false;
  template <class T> static T f(T a, T b) { return a - b; }
  template <class T> static T da(T, T) { return T(1); }
  template <class T> static T db(T, T) { return T(-1); }
};
struct MulOp {
  static constexpr bool kNeedA = true, kNeedB = true;
  template <class T> static T f(T a, T b) { return a * b; }
  template <class T> static T da(T, T b) { return b; }
  template <class T> static T db(T a, T) { return a; }
};
struct DivOp {  // d(a/b)/da = 1/b, d(a/b)/db = -a/b^2
  static constexpr bool kNeedA = true, kNeedB = true;
  template <class T> static T f(T a, T b) { return a / b; }
  template <class T> static T da(T, T b) { return T(1) / b; }
  template <class T> static T db(T a, T b) { return -a / (b * b); }
};

// Reads p[i] only when the op's derivative needs it (Add/Sub save neither operand).
template <bool kNeed, class T>
inline T load(const T* p, std::int64_t i) {
  if constexpr (kNeed) return p[i];
  else return T{};
}

// Fast path, no broadcast: a (n), b (n) -> y (n).
template <class T, class Op>
void binary_forward_same(const T* a, const T* b, T* y, std::int64_t n) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) y[i] = Op::f(a[i], b[i]);
  });
}
// a (n), b (n), dy (n) -> da (n), db (n): da = dy * da(a, b), db = dy * db(a, b); a null da or db
// is skipped. da is written first: dy's buffer may be db's, or da's when db is null.
template <class T, class Op>
void binary_backward_same(const T* a, const T* b, const T* dy, T* da, T* db, std::int64_t n) {
  if (da)
    parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) da[i] = dy[i] * Op::da(load<Op::kNeedA>(a, i), load<Op::kNeedB>(b, i));
    });
  if (db)
    parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) db[i] = dy[i] * Op::db(load<Op::kNeedA>(a, i), load<Op::kNeedB>(b, i));
    });
}

// Row broadcast, the common case of a bias or a position table: the output viewed as (M, L), one
// operand full (M, L), the other a single row of L elements repeated over the M rows (its shape
// is the output's trailing dims, with leading 1s). row_is_b says which operand is the row.
// a, b: one (M, L), the other (L) -> y (M, L)
template <class T, class Op>
void binary_forward_rows(const T* a, const T* b, T* y, std::int64_t M, std::int64_t L, bool row_is_b) {
  parallel_for(M, M * L, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t m = lo; m < hi; ++m) {
      T* yr = y + m * L;
      if (row_is_b) {
        const T* ar = a + m * L;
        for (std::int64_t j = 0; j < L; ++j) yr[j] = Op::f(ar[j], b[j]);
      } else {
        const T* br = b + m * L;
        for (std::int64_t j = 0; j < L; ++j) yr[j] = Op::f(a[j], br[j]);
      }
    }
  });
}
// dy (M, L) -> d_full (M, L), d_row (L): the full operand's and the row's gradients, each
// skipped when null.
// The full operand's gradient is written element by element; the row's is a sum over the M rows,
// each thread summing its rows into its own buffer (partials added in thread order: the same bits
// for the same thread count), then written into d_row.
template <class T, class Op>
void binary_backward_rows(const T* a, const T* b, const T* dy, T* da, T* db, std::int64_t M, std::int64_t L,
                          bool row_is_b) {
  T* d_full = row_is_b ? da : db;
  T* d_row = row_is_b ? db : da;
  auto partial = [&](std::int64_t j, std::int64_t m) -> T {  // d y[m, j] / d row[j] * dy[m, j]
    const std::int64_t i = m * L + j;
    return row_is_b ? dy[i] * Op::db(load<Op::kNeedA>(a, i), load<Op::kNeedB>(b, j))
                    : dy[i] * Op::da(load<Op::kNeedA>(a, j), load<Op::kNeedB>(b, i));
  };
  if (d_full)
    parallel_for(M, M * L, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t m = lo; m < hi; ++m)
        for (std::int64_t j = 0; j < L; ++j) {
          const std::int64_t i = m * L + j;
          d_full[i] = row_is_b ? dy[i] * Op::da(load<Op::kNeedA>(a, i), load<Op::kNeedB>(b, j))
                               : dy[i] * Op::db(load<Op::kNeedA>(a, j), load<Op::kNeedB>(b, i));
        }
    });
  if (d_row) {
    const int nt = worth_parallel(M * L) ? omp_get_max_threads() : 1;
    std::vector<double> part(static_cast<std::size_t>(nt * L), 0.0);
    parallel_region(M * L, [&](int t, int n_threads) {
      double* acc = part.data() + static_cast<std::size_t>(t) * static_cast<std::size_t>(L);
      for (std::int64_t m = chunk_begin(M, t, n_threads); m < chunk_begin(M, t + 1, n_threads); ++m)
        for (std::int64_t j = 0; j < L; ++j) acc[j] += static_cast<double>(partial(j, m));
    });
    for (int t = 1; t < nt; ++t)
      for (std::int64_t j = 0; j < L; ++j) part[static_cast<std::size_t>(j)] += part[static_cast<std::size_t>(t * L + j)];
    for (std::int64_t j = 0; j < L; ++j) d_row[j] = static_cast<T>(part[static_cast<std::size_t>(j)]);
  }
}

// General NumPy broadcasting: the output index (over `shape`) maps to a and b through strides
// that are 0 along broadcast dimensions. Visits every output element in order, serially (the
// backward sums into broadcast inputs, where parallel writes would race).
struct BroadcastPlan {
  int nd = 0;
  std::int64_t shape[8] = {};
  std::int64_t sa[8] = {}, sb[8] = {};
  std::int64_t numel = 1;
};

template <class F>
void for_each_broadcast(const BroadcastPlan& p, F&& f) {
  if (p.numel == 0) return;
  if (p.nd == 0) { f(0, 0, 0); return; }
  std::int64_t idx[8] = {};
  std::int64_t ia = 0, ib = 0;
  const int last = p.nd - 1;
  const std::int64_t n_last = p.shape[last], sa_last = p.sa[last], sb_last = p.sb[last];
  for (std::int64_t i = 0; i < p.numel; i += n_last) {
    for (std::int64_t j = 0; j < n_last; ++j) f(i + j, ia + j * sa_last, ib + j * sb_last);
    // advance the multi-index over all but the last dimension
    for (int d = last - 1; d >= 0; --d) {
      ia += p.sa[d];
      ib += p.sb[d];
      if (++idx[d] < p.shape[d]) break;
      ia -= p.sa[d] * p.shape[d];
      ib -= p.sb[d] * p.shape[d];
      idx[d] = 0;
    }
  }
}

// a, b (their shapes in p.sa, p.sb strides) -> y (p.shape)
template <class T, class Op>
void binary_forward_broadcast(const BroadcastPlan& p, const T* a, const T* b, T* y) {
  for_each_broadcast(p, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) { y[i] = Op::f(a[ia], b[ib]); });
}
// dy (p.shape) -> da (na), db (nb), a's and b's shapes: each a sum over the output elements that
// read that operand's element, into a buffer zero-filled here; a null one is skipped.
template <class T, class Op>
void binary_backward_broadcast(const BroadcastPlan& p, const T* a, const T* b, const T* dy, T* da, std::int64_t na,
                               T* db, std::int64_t nb) {
  if (da) fill_zero(da, na);
  if (db) fill_zero(db, nb);
  for_each_broadcast(p, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) {
    const T av = load<Op::kNeedA>(a, ia), bv = load<Op::kNeedB>(b, ib);
    if (da) da[ia] += dy[i] * Op::da(av, bv);
    if (db) db[ib] += dy[i] * Op::db(av, bv);
  });
}

}  // namespace tg::kernels
