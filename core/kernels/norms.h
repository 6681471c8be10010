#pragma once
// Normalisation kernels, forward and backward side by side, with the gradients of Zhang &
// Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019), section 4. Notation per row
// of n features (C in the code): a = input, g = gain, b = bias, dy = upstream gradient; RMSNorm's
// statistic uses the first k of them (k = n, or k < n for pRMSNorm).
//
// Statistics accumulate in double whatever T is, variances are two-pass (mean first, then squared
// deviations), and per-row statistics are saved for the backward so it never recomputes them.
// The per-row sums are 16 interleaved partial sums (sum16, kernels/reduce.h): several independent chains in
// vector registers, added in a fixed order, so results stay deterministic. RMSNorm's float32 rows
// also have an AVX2 variant beside the portable loops (rms_norm_forward_avx2 and
// rms_norm_backward_avx2, built on rms_avx2.h), which the op chooses where the row shape fits it.
// Parameter gradients (dg, db) are sums over rows: each thread accumulates its rows into its own
// double buffer (RMSNorm's in blocks of 16 rows summed in T first) and the buffers are added in
// thread order, so results are deterministic for a given thread count.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/fastmath.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "kernels/rms_avx2.h"

namespace tg::kernels {

// Adds tot[0, C) into dg and tot[C, 2C) into db, each when not null.
template <class T>
void add_param_grads(const std::vector<double>& tot, std::int64_t C, T* dg, T* db) {
  for (std::int64_t j = 0; j < C; ++j) {
    if (dg) dg[j] += static_cast<T>(tot[static_cast<std::size_t>(j)]);
    if (db) db[j] += static_cast<T>(tot[static_cast<std::size_t>(C + j)]);
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last axis of (rows, C):
//   mu = mean(a), var = mean((a - mu)^2) (biased), rstd = 1 / sqrt(var + eps),
//   xhat = (a - mu) rstd,  y = xhat g + b.
// g and b may be null (no affine / no bias).
// mean is kept in double: the backward recomputes xhat = (a - mu) rstd from it, and a mean rounded
// to float32 would cost |mu| 2^-24 rstd in xhat (5e-4 in the gradient for data centred at 1e4).
// The elementwise terms are computed in T (float32 vectors are twice as wide as double ones) with
// the mean split in two T values, mu = hi + lo (Dekker's trick: hi = T(mu), lo = T(mu - hi)):
// (a - hi) - lo is a - mu to T's precision, the part of mu below hi's last bit included.
template <class T>
void layer_norm_forward(const T* x, const T* g, const T* b, T* y, double* mean, T* rstd, std::int64_t rows,
                        std::int64_t C, double eps) {
  std::vector<T> ones, zeros;  // no gain / no bias: ones / zeros, so the loop has no branch
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  if (!b) zeros.assign(static_cast<std::size_t>(C), T(0));
  const T* gg = g ? g : ones.data();
  const T* bb = b ? b : zeros.data();
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      // The mean is taken of the deviations from the row's first value, x0 + mean(x - x0): a
      // constant row then has exactly its value as mean and normalises to exactly 0 (the plain
      // mean of three 1e30 is off by an ulp, and the ulp divided by itself is +-1). An infinite
      // x0 would turn the deviations into NaN: then no shift.
      const double x0 = std::isfinite(xr[0]) ? static_cast<double>(xr[0]) : 0.0;
      const double mu = x0 + sum16(C, [&](std::int64_t j) { return xr[j] - x0; }) / static_cast<double>(C);
      const double var = sum16(C, [&](std::int64_t j) {
                           const double d = xr[j] - mu;
                           return d * d;
                         }) / static_cast<double>(C);
      const double rs = 1.0 / std::sqrt(var + eps);
      mean[r] = mu;
      rstd[r] = static_cast<T>(rs);
      const T hi = static_cast<T>(mu), lo = static_cast<T>(mu - static_cast<double>(hi)), rt = static_cast<T>(rs);
      if (std::isfinite(rt))
        for (std::int64_t j = 0; j < C; ++j) yr[j] = ((xr[j] - hi) - lo) * rt * gg[j] + bb[j];
      else  // 1/std beyond T's range (a row of subnormals with eps = 0): the product in double
        for (std::int64_t j = 0; j < C; ++j) yr[j] = static_cast<T>((xr[j] - mu) * rs) * gg[j] + bb[j];
    }
  });
}
// With dxhat = g dy:  da = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat));
//                     dg += sum_rows dy xhat;  db += sum_rows dy.
template <class T>
void layer_norm_backward(const T* x, const T* g, const double* mean, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t rows, std::int64_t C, bool acc_dx) {
  std::vector<T> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  const T* gg = g ? g : ones.data();
  with_acc(acc_dx, [&](auto A) {
  const std::vector<double> tot = rows_with_partials(rows, 2 * C, rows * C, [&](std::int64_t r, double* acc) {
    const T* xr = x + r * C;
    const T* gr = dy + r * C;
    const T hi = static_cast<T>(mean[r]), lo = static_cast<T>(mean[r] - static_cast<double>(hi)), rs = rstd[r];
    auto xhat = [&](std::int64_t j) { return ((xr[j] - hi) - lo) * rs; };
    auto dxhat = [&](std::int64_t j) { return gr[j] * gg[j]; };
    // the row means in double, the terms in T
    const T m1 = static_cast<T>(sum16(C, [&](std::int64_t j) { return static_cast<double>(dxhat(j)); }) / static_cast<double>(C));
    const T m2 = static_cast<T>(sum16(C, [&](std::int64_t j) { return static_cast<double>(dxhat(j) * xhat(j)); }) /
                                static_cast<double>(C));
    if (dg)
      for (std::int64_t j = 0; j < C; ++j) acc[j] += gr[j] * xhat(j);
    if (db)
      for (std::int64_t j = 0; j < C; ++j) acc[C + j] += gr[j];
    if (!dx) return;
    T* dr = dx + r * C;
    for (std::int64_t j = 0; j < C; ++j) put<decltype(A)>(dr[j], rs * (dxhat(j) - m1 - xhat(j) * m2));
  });
  add_param_grads(tot, C, dg, db);
  });
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (k = C) and partial RMSNorm (k < C) over the last axis of (rows, C):
//   r = sqrt(mean(a[0:k]^2) + eps),  y = a / r * g + b.
// x, y (rows, C); g, b (C) or null; rrms (rows) receives 1 / r for the backward.
template <class T>
void rms_norm_forward(const T* x, const T* g, const T* b, T* y, T* rrms, std::int64_t rows, std::int64_t C,
                      std::int64_t k, double eps) {
  std::vector<T> ones;  // no gain: ones, so the loop has no branch
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  const T* gg = g ? g : ones.data();
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      const double ms = sum16(k, [&](std::int64_t j) { return static_cast<double>(xr[j]) * xr[j]; }) / static_cast<double>(k);
      const double rr = 1.0 / std::sqrt(ms + eps);
      rrms[r] = static_cast<T>(rr);
      // The statistic in double; the elementwise scaling in T, as PyTorch's.
      const T rt = static_cast<T>(rr);
      if (b)
        for (std::int64_t j = 0; j < C; ++j) yr[j] = xr[j] * rt * gg[j] + b[j];
      else
        for (std::int64_t j = 0; j < C; ++j) yr[j] = xr[j] * rt * gg[j];
    }
  });
}

// The gradient of the paper's section 4, generalised to pRMSNorm: r depends only on a[0:k], so
//   da_i = g_i dy_i / r  -  [i < k] a_i / (k r^3) * sum_{j < n} g_j dy_j a_j
// (the sum runs over all n outputs, since every y_j is divided by r; only the d r / d a_i factor
// is restricted to the first k features);  dg += sum_rows dy a / r;  db += sum_rows dy.
//
// The parameter sums run over blocks of 16 rows: within a block in T (vector-wide multiply-adds
// into a row of L1), then each block's sums into the thread's double partials, added in thread
// order (deterministic for a given thread count). A block of 16 float terms loses at most about
// 16 float roundings before the double sum takes over; converting every term to double would
// cost a conversion and a double multiply-add per element of a memory-bound pass.
// rms_norm_backward_rows(rows, C, dg, db, block) runs block(r0, r1, pg, pb) for each block of
// rows [r0, r1), which writes those rows' dx and adds their parameter terms into pg and pb (null
// when not wanted), and adds the sums into dg and db.
template <class T, class Block>
void rms_norm_backward_rows(std::int64_t rows, std::int64_t C, T* dg, T* db, Block&& block) {
  constexpr std::int64_t kRowBlock = 16;
  const std::int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const std::vector<double> tot = rows_with_partials(blocks, 2 * C, rows * C, [&](std::int64_t blk, double* acc) {
    thread_local std::vector<T> part;
    if (dg || db) part.assign(static_cast<std::size_t>(2 * C), T(0));
    T* pg = dg ? part.data() : nullptr;
    T* pb = db ? part.data() + C : nullptr;
    block(blk * kRowBlock, std::min(rows, (blk + 1) * kRowBlock), pg, pb);
    if (dg)
      for (std::int64_t j = 0; j < C; ++j) acc[j] += static_cast<double>(pg[j]);
    if (db)
      for (std::int64_t j = 0; j < C; ++j) acc[C + j] += static_cast<double>(pb[j]);
  });
  add_param_grads(tot, C, dg, db);
}

// x, dy, dx (rows, C); g (C) or null; rrms (rows) from the forward; dg, db (C) or null.
// acc_dx: add into dx instead of writing it.
template <class T>
void rms_norm_backward(const T* x, const T* g, const T* rrms, const T* dy, T* dx, T* dg, T* db, std::int64_t rows,
                       std::int64_t C, std::int64_t k, bool acc_dx) {
  std::vector<T> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  const T* gg = g ? g : ones.data();
  with_acc(acc_dx, [&](auto A) {
    rms_norm_backward_rows(rows, C, dg, db, [&](std::int64_t r0, std::int64_t r1, T* pg, T* pb) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const T* xr = x + r * C;
        const T* gr = dy + r * C;
        const double rr = rrms[r];
        const T rt = static_cast<T>(rr);
        const double s = sum16(C, [&](std::int64_t j) { return static_cast<double>(gr[j] * gg[j]) * xr[j]; });
        if (pg)
          for (std::int64_t j = 0; j < C; ++j) pg[j] += gr[j] * xr[j] * rt;
        if (pb)
          for (std::int64_t j = 0; j < C; ++j) pb[j] += gr[j];
        if (!dx) continue;
        T* dr = dx + r * C;
        const T c2 = static_cast<T>(s * rr * rr * rr / static_cast<double>(k));
        for (std::int64_t j = 0; j < k; ++j) put<decltype(A)>(dr[j], gr[j] * gg[j] * rt - xr[j] * c2);
        for (std::int64_t j = k; j < C; ++j) put<decltype(A)>(dr[j], gr[j] * gg[j] * rt);
      }
    });
  });
}

#ifdef TG_RMS_AVX2
// The same two kernels for float32 rows with AVX2 and FMA (rms_avx2.h: one pass for the
// backward's sums, float sums per chunk of 32 features, outputs past the cache streamed). The op
// (core/ops/norms.cpp) takes them where rms_avx2::fits(C, k) and kernels::isa() has AVX2.
inline void rms_norm_forward_avx2(const float* x, const float* g, const float* b, float* y, float* rrms,
                                  std::int64_t rows, std::int64_t C, std::int64_t k, double eps) {
  std::vector<float> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), 1.0f);
  const float* gg = g ? g : ones.data();
  with_bool(rms_avx2::streamable(y, rows * C * 4), [&](auto S) {
    parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const double rr = 1.0 / std::sqrt(rms_avx2::sum_squares(x + r * C, k) / static_cast<double>(k) + eps);
        rrms[r] = static_cast<float>(rr);
        rms_avx2::scale_row<decltype(S)::value>(x + r * C, gg, b, static_cast<float>(rr), C, y + r * C);
      }
      if constexpr (decltype(S)::value) _mm_sfence();  // streamed lines visible before the team's barrier
    });
  });
}

inline void rms_norm_backward_avx2(const float* x, const float* g, const float* rrms, const float* dy, float* dx,
                                   float* dg, float* db, std::int64_t rows, std::int64_t C, std::int64_t k,
                                   bool acc_dx) {
  std::vector<float> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), 1.0f);
  const float* gg = g ? g : ones.data();
  const bool stream = dx && !acc_dx && rms_avx2::streamable(dx, rows * C * 4);
  with_bool(acc_dx, [&](auto A) {
    with_bool(stream, [&](auto S) {
      constexpr bool acc_v = decltype(A)::value, stream_v = decltype(S)::value && !acc_v;
      rms_norm_backward_rows(rows, C, dg, db, [&](std::int64_t r0, std::int64_t r1, float* pg, float* pb) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const double rr = rrms[r];
          const float rt = static_cast<float>(rr);
          const double s = rms_avx2::backward_sums(x + r * C, dy + r * C, gg, rt, C, pg, pb);
          if (dx)
            rms_avx2::backward_dx<acc_v, stream_v>(x + r * C, dy + r * C, gg, rt,
                                                   static_cast<float>(s * rr * rr * rr / static_cast<double>(k)), C, k,
                                                   dx + r * C);
        }
        // Streamed stores are weakly ordered: fenced before the block's rows count as written (and
        // so before the team's barrier, after which other threads may read them).
        if constexpr (stream_v) _mm_sfence();
      });
    });
  });
}
#endif

// ---------------------------------------------------------------------------------------------
// y = (a - mu_c) rstd_c g_c + b_c with given statistics (used by train and eval).
template <class T>
void batch_norm_apply(const T* x, const T* g, const T* b, T* y, const double* mu, const T* rstd, std::int64_t R,
                      std::int64_t C) {
  parallel_for(R, R * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      for (std::int64_t c = 0; c < C; ++c) {
        T v = static_cast<T>((xr[c] - mu[c]) * rstd[c]);
        if (g) v *= g[c];
        if (b) v += b[c];
        yr[c] = v;
      }
    }
  });
}

// BatchNorm over the rows of a channels-last (R, C) view: per channel c,
//   mu_c = mean over rows, var_c = biased variance, rstd_c = 1 / sqrt(var_c + eps),
//   y = (a - mu_c) rstd_c g_c + b_c.   (Training mode: batch statistics.)
// Writes mean, rstd and the biased variance per channel (the caller updates running stats).
template <class T>
void batch_norm_forward_train(const T* x, const T* g, const T* b, T* y, double* mean, T* rstd, double* var_out,
                              std::int64_t R, std::int64_t C, double eps) {
  // Per channel, the mean of the deviations from the first row (see layer_norm_forward).
  std::vector<double> shift(static_cast<std::size_t>(C));
  for (std::int64_t c = 0; c < C; ++c) shift[static_cast<std::size_t>(c)] = std::isfinite(x[c]) ? static_cast<double>(x[c]) : 0.0;
  std::vector<double> mu = rows_with_partials(R, C, R * C, [&](std::int64_t r, double* acc) {
    const T* xr = x + r * C;
    for (std::int64_t c = 0; c < C; ++c) acc[c] += static_cast<double>(xr[c]) - shift[static_cast<std::size_t>(c)];
  });
  for (std::int64_t c = 0; c < C; ++c)
    mu[static_cast<std::size_t>(c)] = shift[static_cast<std::size_t>(c)] + mu[static_cast<std::size_t>(c)] / static_cast<double>(R);
  std::vector<double> var = rows_with_partials(R, C, R * C, [&](std::int64_t r, double* acc) {
    const T* xr = x + r * C;
    for (std::int64_t c = 0; c < C; ++c) {
      const double d = xr[c] - mu[static_cast<std::size_t>(c)];
      acc[c] += d * d;
    }
  });
  for (std::int64_t c = 0; c < C; ++c) {
    const auto cc = static_cast<std::size_t>(c);
    var[cc] /= static_cast<double>(R);
    var_out[c] = var[cc];
    mean[c] = mu[cc];
    rstd[c] = static_cast<T>(1.0 / std::sqrt(var[cc] + eps));
  }
  batch_norm_apply(x, g, b, y, mu.data(), rstd, R, C);
}
// Training mode (the statistics depend on every row), with dxhat = g dy, per channel over R rows:
//   da = rstd / R (R dxhat - sum(dxhat) - xhat sum(dxhat xhat));  dg += sum dy xhat;  db += sum dy.
// Eval mode (fixed running statistics, so y is affine in a):  da = g rstd dy.
template <class T>
void batch_norm_backward(const T* x, const T* g, const double* mu, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t R, std::int64_t C, bool training, bool acc_dx) {
  // sums per channel: [0, C) sum dy xhat, [C, 2C) sum dy
  const std::vector<double> tot = rows_with_partials(R, 2 * C, R * C, [&](std::int64_t r, double* acc) {
    const T* xr = x + r * C;
    const T* gr = dy + r * C;
    for (std::int64_t c = 0; c < C; ++c) {
      acc[c] += gr[c] * (xr[c] - mu[c]) * rstd[c];
      acc[C + c] += gr[c];
    }
  });
  if (dx) with_acc(acc_dx, [&](auto A) {
    const double invR = 1.0 / static_cast<double>(R);
    parallel_for(R, R * C, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const T* xr = x + r * C;
        const T* gr = dy + r * C;
        T* dr = dx + r * C;
        for (std::int64_t c = 0; c < C; ++c) {
          const double gc = g ? static_cast<double>(g[c]) : 1.0;
          if (!training) {
            put<decltype(A)>(dr[c], static_cast<T>(gc * rstd[c] * gr[c]));
            continue;
          }
          const double xh = (xr[c] - mu[c]) * rstd[c];
          // sum(dxhat) = g_c sum(dy), sum(dxhat xhat) = g_c sum(dy xhat)
          put<decltype(A)>(dr[c], static_cast<T>(gc * rstd[c] * (gr[c] - invR * (tot[static_cast<std::size_t>(C + c)] + xh * tot[static_cast<std::size_t>(c)]))));
        }
      }
    });
  });
  add_param_grads(tot, C, dg, db);
}

// ---------------------------------------------------------------------------------------------
// Weight normalisation (Salimans & Kingma 2016) of each row i of v (rows, n): w_i = g_i v_i / |v_i|.
template <class T>
void weight_norm_forward(const T* v, const T* g, T* w, T* norm, std::int64_t rows, std::int64_t n) {
  parallel_for(rows, rows * n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      const T* vi = v + i * n;
      double s = 0;
      for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(vi[j]) * vi[j];
      const double nm = std::sqrt(s);
      norm[i] = static_cast<T>(nm);
      for (std::int64_t j = 0; j < n; ++j) w[i * n + j] = static_cast<T>(g[i] * vi[j] / nm);
    }
  });
}
// With s_i = sum_j dw_ij v_ij:  dg_i += s_i / |v_i|;  dv_ij += g_i / |v_i| (dw_ij - v_ij s_i / |v_i|^2).
template <class T>
void weight_norm_backward(const T* v, const T* g, const T* norm, const T* dw, T* dv, T* dg, std::int64_t rows,
                          std::int64_t n, bool acc_dv) {
  with_acc(acc_dv, [&](auto A) {
  parallel_for(rows, rows * n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      const T* vi = v + i * n;
      const T* di = dw + i * n;
      double s = 0;
      for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(di[j]) * vi[j];
      const double nm = norm[i];
      if (dg) dg[i] += static_cast<T>(s / nm);
      if (dv)
        for (std::int64_t j = 0; j < n; ++j) put<decltype(A)>(dv[i * n + j], static_cast<T>(g[i] / nm * (di[j] - vi[j] * s / (nm * nm))));
    }
  });
  });
}

// ---------------------------------------------------------------------------------------------
// Scaled causal softmax over (rows, T) where row r is query position i = r mod T:
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

template <class T>
void causal_softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t Tn, double scale) {
  parallel_for(rows, rows * Tn, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) causal_softmax_row(x + r * Tn, y + r * Tn, r % Tn, Tn, static_cast<T>(scale));
  });
}
// dx_j = s y_j (dy_j - sum_j' dy_j' y_j')   (zero where masked, since y_j = 0 there)
template <class T>
void causal_softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t Tn, double scale, bool acc) {
  with_acc(acc, [&](auto A) {
  parallel_for(rows, rows * Tn, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const std::int64_t i = r % Tn;
      const T* yr = y + r * Tn;
      const T* gr = dy + r * Tn;
      T* dr = dx + r * Tn;
      const double dot = sum16(i + 1, [&](std::int64_t j) { return static_cast<double>(gr[j]) * yr[j]; });
      for (std::int64_t j = 0; j <= i; ++j) put<decltype(A)>(dr[j], static_cast<T>(scale * yr[j] * (gr[j] - dot)));
      if constexpr (!decltype(A)::value)
        for (std::int64_t j = i + 1; j < Tn; ++j) dr[j] = T(0);  // masked: no gradient
    }
  });
  });
}

}  // namespace tg::kernels
