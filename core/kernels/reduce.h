#pragma once
// Reductions over the middle axis of an (O, R, I) view: y[o, i] = reduce_r x[o, r, i].
// Any set of contiguous axes is such a view (O = product of the dims before, R of the reduced
// dims, I of the dims after); other axis sets are permuted to it first (core/ops/reduce.cpp).
// Accumulation is in double for both dtypes; variance is two-pass (mean, then squared
// deviations), which does not cancel catastrophically the way E[x^2] - E[x]^2 does.
// Also the row helpers the other kernels share: sum16 (a vectorisable double sum), row_max,
// exp_shifted (the softmax's exp and sum), each over one row x (n), and rows_with_partials
// (per-thread column sums of a (rows, width) pass).
//
// Shapes: O outer, R reduced, I inner, each a product of contiguous dims (O R I = x's size).
//   x      (O, R, I)  input
//   y      (O, I)     the reduction (sum / mean, variance, max)
//   mean   (O, I)     var's mean, saved for its backward
//   dy     (O, I)     gradient of y
//   dx     (O, R, I)  gradient of x, written (=)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/fastmath.h"
#include "kernels/parallel.h"

namespace tg::kernels {

// A value as a double: float or double as it is, a bf16 widened exactly.
template <class T>
inline double widen(T x) {
  return static_cast<double>(x);
}
inline double widen(bf16 x) { return static_cast<double>(to_float(x)); }

inline constexpr std::int64_t kReduceBlock = 256;  // columns handled together when I > 1

// sum_{j < n} f(j) in double, as 16 interleaved partial sums added in a fixed order at the end: the
// compiler keeps them in four vector registers (an OpenMP simd reduction over float data compiles
// to gathers and stack spills), and the bits do not depend on anything but n. Four independent
// chains rather than two, as each add waits 4-5 cycles for the previous one in its chain. On large
// rows a norm is bound by memory, not by these chains (docs/performance.md).
template <class F>
inline double sum16(std::int64_t n, F&& f) {
  double p[16] = {};
  std::int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) p[l] += f(j + l);
  double tail = 0;
  for (; j < n; ++j) tail += f(j);
  for (int l = 0; l < 8; ++l) p[l] += p[l + 8];
  return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7])) + tail;
}

// x (n) -> max_{j < n} x[j], over the lanes of one 64-byte vector (GCC's vector extension; two
// ymm or four xmm registers where there is no zmm): a single running maximum is a loop-carried
// dependency that GCC keeps scalar without -ffast-math, as it does an array of scalar lanes. NaN
// entries are skipped (comparisons with NaN are false), as a plain running max skips them; -inf
// for n = 0. The maximum is the same value in any order; only the sign of a zero maximum, when
// both +0 and -0 occur, depends on it.
template <class T>
inline T row_max(const T* x, std::int64_t n) {
  typedef T V __attribute__((vector_size(64)));
  constexpr std::int64_t W = sizeof(V) / sizeof(T);
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  V lane = V{} + ninf;
  std::int64_t j = 0;
  for (; j + W <= n; j += W) {
    V v;
    std::memcpy(&v, x + j, sizeof(V));  // unaligned load
    lane = v > lane ? v : lane;
  }
  T m = ninf;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  for (std::int64_t l = 0; l < W; ++l) m = lane[l] > m ? lane[l] : m;
  return m;
}

// x (n) -> y (n): y[j] = exp(x[j] - m) (y may be x), returning sum_j y[j] in double. Two loops,
// so that the exp loop vectorises: with the running double sum in the same loop, fast_exp stays
// scalar.
template <class T>
inline double exp_shifted(const T* x, T m, T* y, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) y[j] = fast_exp(x[j] - m);
  return sum16(n, [&](std::int64_t j) { return static_cast<double>(y[j]); });
}

// Calls body(r, acc) for r in [0, rows), in parallel when work is large; acc is the calling
// thread's zero-initialised double buffer (width). Returns the element-wise sum of the buffers
// (width).
template <class F>
std::vector<double> rows_with_partials(std::int64_t rows, std::int64_t width, std::int64_t work, F&& body) {
  const bool par = rows > 1 && worth_parallel(work);
  const int nt = par ? omp_get_max_threads() : 1;
  std::vector<double> part(static_cast<std::size_t>(nt * width), 0.0);
  parallel_region(par ? work : 0, [&](int t, int n_threads) {
    double* acc = part.data() + static_cast<std::size_t>(t) * static_cast<std::size_t>(width);
    for (std::int64_t r = chunk_begin(rows, t, n_threads); r < chunk_begin(rows, t + 1, n_threads); ++r) body(r, acc);
  });
  for (int t = 1; t < nt; ++t)
    for (std::int64_t j = 0; j < width; ++j) part[static_cast<std::size_t>(j)] += part[static_cast<std::size_t>(t * width + j)];
  part.resize(static_cast<std::size_t>(width));
  return part;
}

// Calls body(o, i0, i1) over blocks of the output grid, in parallel when the work is large.
template <class F>
void for_reduce_blocks(std::int64_t O, std::int64_t R, std::int64_t I, F&& body) {
  const std::int64_t nb = (I + kReduceBlock - 1) / kReduceBlock;
  const std::int64_t total = O * nb;
  parallel_for(total, O * R * I, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t) {
      const std::int64_t o = t / nb, b = t % nb;
      body(o, b * kReduceBlock, std::min(I, (b + 1) * kReduceBlock));
    }
  });
}

// x (O, R, I) -> y (O, I): y[o, i] = scale * sum_r x[o, r, i]   (scale = 1 for sum, 1/R for mean).
// X is T, or bf16 (a bias gradient under autocast), whose values are exact in double (widen).
template <class X, class T>
void sum_forward(const X* x, T* y, std::int64_t O, std::int64_t R, std::int64_t I, double scale) {
  static_assert(std::is_same_v<X, T> || std::is_same_v<X, bf16>, "sum_forward reads T or bf16");
  if (O * ((I + kReduceBlock - 1) / kReduceBlock) < omp_get_max_threads() && R > 1 && worth_parallel(O * R * I)) {
    // Fewer output blocks than threads (a bias gradient: column sums of a (rows, 128) matrix is
    // one block): the reduced axis is split instead, each thread summing its rows into its own
    // double buffer, the buffers added in thread order (the same bits on every run).
    for (std::int64_t o = 0; o < O; ++o) {
      const std::vector<double> tot = rows_with_partials(R, I, R * I, [&](std::int64_t r, double* acc) {
        const X* row = x + (o * R + r) * I;
        for (std::int64_t i = 0; i < I; ++i) acc[i] += widen(row[i]);
      });
      for (std::int64_t i = 0; i < I; ++i) y[o * I + i] = static_cast<T>(tot[static_cast<std::size_t>(i)] * scale);
    }
    return;
  }
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    double acc[kReduceBlock] = {};
    for (std::int64_t r = 0; r < R; ++r) {
      const X* row = x + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) acc[i - i0] += widen(row[i]);
    }
    for (std::int64_t i = i0; i < i1; ++i) y[o * I + i] = static_cast<T>(acc[i - i0] * scale);
  });
}
// dy (O, I) -> dx (O, R, I): dx[o, r, i] = scale * dy[o, i]
template <class T>
void sum_backward(const T* dy, T* dx, std::int64_t O, std::int64_t R, std::int64_t I, double scale) {
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    for (std::int64_t r = 0; r < R; ++r) {
      T* row = dx + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) row[i] = static_cast<T>(scale * dy[o * I + i]);
    }
  });
}

// x (O, R, I) -> y (O, I), mean_out (O, I): y = sum_r (x - mean)^2 / (R - correction); the mean
// is written out for the backward.
template <class T>
void var_forward(const T* x, T* y, T* mean_out, std::int64_t O, std::int64_t R, std::int64_t I, int correction) {
  const double denom = static_cast<double>(R - correction);
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    double mu[kReduceBlock] = {}, m2[kReduceBlock] = {};
    for (std::int64_t r = 0; r < R; ++r) {
      const T* row = x + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) mu[i - i0] += row[i];
    }
    for (std::int64_t i = i0; i < i1; ++i) mu[i - i0] /= static_cast<double>(R);
    for (std::int64_t r = 0; r < R; ++r) {
      const T* row = x + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) {
        const double d = row[i] - mu[i - i0];
        m2[i - i0] += d * d;
      }
    }
    for (std::int64_t i = i0; i < i1; ++i) {
      y[o * I + i] = static_cast<T>(m2[i - i0] / denom);
      mean_out[o * I + i] = static_cast<T>(mu[i - i0]);
    }
  });
}
// x (O, R, I), mean (O, I), dy (O, I) -> dx (O, R, I):
// d var / d x_r = 2 (x_r - mean) / (R - correction)   (the mean's own dependence on x_r cancels,
// because sum_r (x_r - mean) = 0)
template <class T>
void var_backward(const T* x, const T* mean, const T* dy, T* dx, std::int64_t O, std::int64_t R, std::int64_t I,
                  int correction) {
  const double k = 2.0 / static_cast<double>(R - correction);
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    for (std::int64_t r = 0; r < R; ++r) {
      const T* xr = x + (o * R + r) * I;
      T* dr = dx + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i)
        dr[i] = static_cast<T>(k * dy[o * I + i] * (xr[i] - mean[o * I + i]));
    }
  });
}

// x (O, R, I) -> y (O, I): y = max_r x. NaN propagates (as PyTorch's amax).
template <class T>
void max_forward(const T* x, T* y, std::int64_t O, std::int64_t R, std::int64_t I) {
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) y[o * I + i] = -std::numeric_limits<T>::infinity();
    for (std::int64_t r = 0; r < R; ++r) {
      const T* row = x + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) {
        T& m = y[o * I + i];
        if (row[i] > m || std::isnan(row[i])) m = std::isnan(m) ? m : row[i];
      }
    }
  });
}
// x (O, R, I), y (O, I), dy (O, I) -> dx (O, R, I): the gradient goes to the elements equal to
// the max, shared evenly between ties (torch.amax); the others get 0.
template <class T>
void max_backward(const T* x, const T* y, const T* dy, T* dx, std::int64_t O, std::int64_t R, std::int64_t I) {
  for_reduce_blocks(O, R, I, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    std::int64_t ties[kReduceBlock] = {};
    for (std::int64_t r = 0; r < R; ++r) {
      const T* row = x + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i) ties[i - i0] += row[i] == y[o * I + i];
    }
    for (std::int64_t r = 0; r < R; ++r) {
      const T* row = x + (o * R + r) * I;
      T* dr = dx + (o * R + r) * I;
      for (std::int64_t i = i0; i < i1; ++i)
        dr[i] = row[i] == y[o * I + i] ? dy[o * I + i] / static_cast<T>(ties[i - i0]) : T(0);
    }
  });
}

}  // namespace tg::kernels
