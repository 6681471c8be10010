#pragma once
// Row-wise softmax and log-softmax over the last axis of a (rows, C) view, the fused
// cross-entropy, and attention's scaled causal softmax. All subtract the row maximum first, so exp
// never overflows.
//
// Shapes: rows = product of the leading dims (B T for logits), C the softmax axis (V for logits).
//   x    (rows, C)  input (the logits, for cross-entropy)
//   y    (rows, C)  softmax or log-softmax of x, saved for the backward
//   t    (rows)     int32 target class per row, or ignore_index
//   lse  (rows)     logsumexp of each row of x, saved by cross-entropy for its backward
//   dy   (rows, C)  gradient of y
//   dx   (rows, C)  gradient of x, written (=)
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/fastmath.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"

namespace tg::kernels {

// x (rows, C) -> y (rows, C): y = exp(x - max) / sum exp(x - max). A row that is entirely -inf
// (fully masked) gives NaN, as in PyTorch.
template <class T>
void softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t C) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      const T inv = static_cast<T>(1.0 / exp_shifted(xr, row_max(xr, C), yr, C));
      for (std::int64_t c = 0; c < C; ++c) yr[c] *= inv;
    }
  });
}
// y (rows, C), dy (rows, C) -> dx (rows, C): dx = y * (dy - sum_c dy_c y_c)
template <class T>
void softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t C) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* yr = y + r * C;
      const T* gr = dy + r * C;
      T* dr = dx + r * C;
      const double dot = sum16(C, [&](std::int64_t c) { return static_cast<double>(gr[c]) * yr[c]; });
      for (std::int64_t c = 0; c < C; ++c) dr[c] = yr[c] * (gr[c] - static_cast<T>(dot));
    }
  });
}

// x (rows, C) -> y (rows, C): y = x - max - log sum exp(x - max)
template <class T>
void log_softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t C) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<T> e(static_cast<std::size_t>(C));  // the exps, only summed
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      const T mx = row_max(xr, C);
      const double s = exp_shifted(xr, mx, e.data(), C);
      // (x - max) - log(s), not x - (max + log(s)): x - max is exact (Sterbenz) and log(s) is
      // small, whereas rounding max + log(s) to T first loses log(s)'s low digits when |max| is
      // large (a float32 ulp near 1000 is 6e-5).
      const T logs = static_cast<T>(std::log(s));
      for (std::int64_t c = 0; c < C; ++c) yr[c] = (xr[c] - mx) - logs;
    }
  });
}
// y (rows, C), dy (rows, C) -> dx (rows, C): dx = dy - exp(y) * sum_c dy_c
template <class T>
void log_softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t C) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* yr = y + r * C;
      const T* gr = dy + r * C;
      T* dr = dx + r * C;
      const T s = static_cast<T>(sum16(C, [&](std::int64_t c) { return static_cast<double>(gr[c]); }));
      for (std::int64_t c = 0; c < C; ++c) dr[c] = gr[c] - fast_exp(yr[c]) * s;
    }
  });
}

// x (rows, C), t (rows) -> lse (rows), and the summed loss. Cross-entropy, fused:
// loss_r = logsumexp(x_r) - x_r[t_r] for rows whose target is not ignored; returns the sum over
// those rows (in double) and writes each row's logsumexp for the backward.
template <class T>
double cross_entropy_forward(const T* x, const std::int32_t* t, T* lse, std::int64_t rows, std::int64_t C,
                             std::int64_t ignore_index) {
  // Per-thread partial sums added in thread order (not an OpenMP reduction, whose combining order
  // is unspecified): the same loss bits on every run with the same thread count.
  std::vector<double> part(static_cast<std::size_t>(omp_get_max_threads()), 0.0);
  parallel_region(rows * C, [&](int th, int nt) {
    double total = 0;
    std::vector<T> e(static_cast<std::size_t>(C));  // the exps, only summed
    for (std::int64_t r = chunk_begin(rows, th, nt); r < chunk_begin(rows, th + 1, nt); ++r) {
      const T* xr = x + r * C;
      const T mx = row_max(xr, C);
      const double l = mx + std::log(exp_shifted(xr, mx, e.data(), C));
      lse[r] = static_cast<T>(l);
      if (t[r] != ignore_index) total += l - xr[t[r]];
    }
    part[static_cast<std::size_t>(th)] = total;
  });
  double total = 0;
  for (double v : part) total += v;
  return total;
}
// x (rows, C), t (rows), lse (rows) -> dx (rows, C): dx_r = (softmax(x_r) - onehot(t_r)) * scale
// for non-ignored rows, 0 for ignored ones; scale = dloss / count.
template <class T>
void cross_entropy_backward(const T* x, const std::int32_t* t, const T* lse, T scale, T* dx, std::int64_t rows,
                            std::int64_t C, std::int64_t ignore_index) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      T* dr = dx + r * C;
      if (t[r] == ignore_index) {
        for (std::int64_t c = 0; c < C; ++c) dr[c] = T(0);
        continue;
      }
      const T* xr = x + r * C;
      for (std::int64_t c = 0; c < C; ++c) dr[c] = scale * fast_exp(xr[c] - lse[r]);
      dr[t[r]] -= scale;
    }
  });
}

// ---- scaled causal softmax over (rows, T), row r being query position i = r mod T:
//   y_j = exp(s x_j - m) / sum_{j' <= i} exp(s x_j' - m) for j <= i, and 0 for j > i.
// One pass replaces scale + masked_fill(-inf) + softmax.

// One row: query position i, `width` entries written (0 past i). x and y may be the same row.
template <class T>
void causal_softmax_row(const T* xr, T* yr, std::int64_t i, std::int64_t width, T sc) {
  // The scaled scores are stored (rounded) before the maximum is taken, so the largest one minus
  // the maximum is exactly 0: computed on the fly, s x_j - m contracts to a fused multiply-add
  // whose exact product differs from the rounded m, and at large scales that difference alone
  // overflows exp.
  // Each step is its own loop so that it vectorises (row_max, exp_shifted): one loop with a
  // running sum keeps fast_exp scalar.
  const std::int64_t n = i + 1;
  for (std::int64_t j = 0; j < n; ++j) yr[j] = sc * xr[j];
  const T m = row_max(yr, n);
  const double inv = 1.0 / exp_shifted(yr, m, yr, n);
  for (std::int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(yr[j] * inv);
  for (std::int64_t j = n; j < width; ++j) yr[j] = T(0);
}

// x (rows, T) -> y (rows, T)
template <class T>
void causal_softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t Tn, double scale) {
  parallel_for(rows, rows * Tn, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) causal_softmax_row(x + r * Tn, y + r * Tn, r % Tn, Tn, static_cast<T>(scale));
  });
}
// y (rows, T), dy (rows, T) -> dx (rows, T): dx_j = s y_j (dy_j - sum_j' dy_j' y_j'), 0 where
// masked (y_j = 0 there). dx may be dy.
template <class T>
void causal_softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t Tn, double scale) {
  parallel_for(rows, rows * Tn, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const std::int64_t i = r % Tn;
      const T* yr = y + r * Tn;
      const T* gr = dy + r * Tn;
      T* dr = dx + r * Tn;
      const double dot = sum16(i + 1, [&](std::int64_t j) { return static_cast<double>(gr[j]) * yr[j]; });
      for (std::int64_t j = 0; j <= i; ++j) dr[j] = static_cast<T>(scale * yr[j] * (gr[j] - dot));
      for (std::int64_t j = i + 1; j < Tn; ++j) dr[j] = T(0);
    }
  });
}

}  // namespace tg::kernels
