#pragma once
// The normalisation kernels the ops run: the math of kernels/norms.h (the reference loops, which
// say what each kernel computes), blocked, threaded and, for RMSNorm's float32 rows, vectorised.
// tests/core/test_norm_kernels.cpp holds each of these equal to its reference loop.
//
// What differs from the reference, and why:
// - Row sums are 16 interleaved partial sums (sum16, kernels/reduce.h): several independent
//   chains in vector registers, added in a fixed order, so results stay deterministic.
// - Rows run in parallel (parallel_for). Parameter gradients (dg, db) are sums over rows: each
//   thread sums its rows into its own double buffer (RMSNorm's in blocks of 16 rows summed in T
//   first) and the buffers are added in thread order, deterministic for a given thread count.
// - LayerNorm and BatchNorm take the mean of the deviations from the first value, x0 + mean(a -
//   x0): a constant row then has exactly its value as mean and normalises to exactly 0 (the plain
//   mean of three 1e30 is off by an ulp, and the ulp divided by itself is +-1).
// - The elementwise terms are computed in T (float32 vectors are twice as wide as double ones);
//   LayerNorm's mean is split in two T values, mu = hi + lo (Dekker's trick: hi = T(mu), lo =
//   T(mu - hi)), so (a - hi) - lo is a - mu to T's precision, the part of mu below hi's last bit
//   included (a mean rounded to float32 would cost |mu| 2^-24 rstd in xhat).
// - RMSNorm's float32 rows whose widths are multiples of 8 take the AVX2 variant (rms_avx2.h)
//   on a CPU that has it (kernels::isa(), which TAPEGRAD_ISA can cap).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/isa.h"
#include "kernels/norms.h"
#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "kernels/rms_avx2.h"

namespace tg::kernels::fast {

// Writes tot[0, C) into dg and tot[C, 2C) into db, each when not null.
template <class T>
void write_param_grads(const std::vector<double>& tot, std::int64_t C, T* dg, T* db) {
  for (std::int64_t j = 0; j < C; ++j) {
    if (dg) dg[j] = static_cast<T>(tot[static_cast<std::size_t>(j)]);
    if (db) db[j] = static_cast<T>(tot[static_cast<std::size_t>(C + j)]);
  }
}

// ---- LayerNorm ----
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
      // the shift x0 (above); an infinite x0 would turn the deviations into NaN: then no shift
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
template <class T>
void layer_norm_backward(const T* x, const T* g, const double* mean, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t rows, std::int64_t C) {
  std::vector<T> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  const T* gg = g ? g : ones.data();
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
    for (std::int64_t j = 0; j < C; ++j) dr[j] = rs * (dxhat(j) - m1 - xhat(j) * m2);
  });
  write_param_grads(tot, C, dg, db);
}

// ---- RMSNorm: the portable loops ----
template <class T>
void rms_norm_forward_portable(const T* x, const T* g, const T* b, T* y, T* rrms, std::int64_t rows, std::int64_t C,
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

// The parameter sums run over blocks of 16 rows: within a block in T (vector-wide multiply-adds
// into a row of L1), then each block's sums into the thread's double partials, added in thread
// order. A block of 16 float terms loses at most about 16 float roundings before the double sum
// takes over; converting every term to double would cost a conversion and a double multiply-add
// per element of a memory-bound pass.
// rms_norm_backward_rows(rows, C, dg, db, block) runs block(r0, r1, pg, pb) for each block of rows
// [r0, r1), which writes those rows' dx and adds their parameter terms into pg and pb (zeroed; null
// when not wanted), and writes the sums into dg and db.
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
  write_param_grads(tot, C, dg, db);
}

template <class T>
void rms_norm_backward_portable(const T* x, const T* g, const T* rrms, const T* dy, T* dx, T* dg, T* db,
                                std::int64_t rows, std::int64_t C, std::int64_t k) {
  std::vector<T> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), T(1));
  const T* gg = g ? g : ones.data();
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
      for (std::int64_t j = 0; j < k; ++j) dr[j] = gr[j] * gg[j] * rt - xr[j] * c2;
      for (std::int64_t j = k; j < C; ++j) dr[j] = gr[j] * gg[j] * rt;
    }
  });
}

#ifdef TG_RMS_AVX2
// ---- RMSNorm: float32 rows with AVX2 and FMA (the row helpers of rms_avx2.h: one pass for the
// backward's sums, float sums per chunk of 32 features, outputs past the cache streamed) ----
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
      if constexpr (decltype(S)::value) rms_avx2::fence();  // streamed lines visible before the team's barrier
    });
  });
}

inline void rms_norm_backward_avx2(const float* x, const float* g, const float* rrms, const float* dy, float* dx,
                                   float* dg, float* db, std::int64_t rows, std::int64_t C, std::int64_t k) {
  std::vector<float> ones;
  if (!g) ones.assign(static_cast<std::size_t>(C), 1.0f);
  const float* gg = g ? g : ones.data();
  with_bool(dx && rms_avx2::streamable(dx, rows * C * 4), [&](auto S) {
    constexpr bool stream = decltype(S)::value;
    rms_norm_backward_rows(rows, C, dg, db, [&](std::int64_t r0, std::int64_t r1, float* pg, float* pb) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const double rr = rrms[r];
        const float rt = static_cast<float>(rr);
        const double s = rms_avx2::backward_sums(x + r * C, dy + r * C, gg, rt, C, pg, pb);
        if (dx)
          rms_avx2::backward_dx<stream>(x + r * C, dy + r * C, gg, rt,
                                        static_cast<float>(s * rr * rr * rr / static_cast<double>(k)), C, k, dx + r * C);
      }
      // Streamed stores are weakly ordered: fenced before the block's rows count as written (and
      // so before the team's barrier, after which other threads may read them).
      if constexpr (stream) rms_avx2::fence();
    });
  });
}
#endif

// ---- RMSNorm: the ops' choice, the AVX2 variant where it applies ----
template <class T>
void rms_norm_forward(const T* x, const T* g, const T* b, T* y, T* rrms, std::int64_t rows, std::int64_t C,
                      std::int64_t k, double eps) {
#ifdef TG_RMS_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (rms_avx2::fits(C, k) && isa() >= Isa::avx2) return rms_norm_forward_avx2(x, g, b, y, rrms, rows, C, k, eps);
#endif
  rms_norm_forward_portable(x, g, b, y, rrms, rows, C, k, eps);
}
template <class T>
void rms_norm_backward(const T* x, const T* g, const T* rrms, const T* dy, T* dx, T* dg, T* db, std::int64_t rows,
                       std::int64_t C, std::int64_t k) {
#ifdef TG_RMS_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (rms_avx2::fits(C, k) && isa() >= Isa::avx2) return rms_norm_backward_avx2(x, g, rrms, dy, dx, dg, db, rows, C, k);
#endif
  rms_norm_backward_portable(x, g, rrms, dy, dx, dg, db, rows, C, k);
}

// ---- BatchNorm ----
// The reference's y, its rows in parallel (the same bits).
template <class T>
void batch_norm_apply(const T* x, const T* g, const T* b, T* y, const double* mu, const T* rstd, std::int64_t R,
                      std::int64_t C) {
  parallel_for(R, R * C, [&](std::int64_t lo, std::int64_t hi) {
    kernels::batch_norm_apply(x + lo * C, g, b, y + lo * C, mu, rstd, hi - lo, C);
  });
}
template <class T>
void batch_norm_forward(const T* x, const T* g, const T* b, T* y, double* mean, T* rstd, double* var_out,
                        std::int64_t R, std::int64_t C, double eps) {
  // Per channel, the mean of the deviations from the first row (above).
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
  fast::batch_norm_apply(x, g, b, y, mu.data(), rstd, R, C);
}
// Eval: the running statistics normalise, mu = running_mean, rstd = 1 / sqrt(running_var + eps).
template <class T>
void batch_norm_forward_eval(const T* x, const T* g, const T* b, T* y, const T* running_mean, const T* running_var,
                             double* mean, T* rstd, std::int64_t R, std::int64_t C, double eps) {
  for (std::int64_t c = 0; c < C; ++c) {
    mean[c] = running_mean[c];
    rstd[c] = static_cast<T>(1.0 / std::sqrt(static_cast<double>(running_var[c]) + eps));
  }
  fast::batch_norm_apply(x, g, b, y, mean, rstd, R, C);
}
// PyTorch's running statistics: running = (1 - momentum) running + momentum batch, the variance's
// batch value unbiased (times R / (R - 1)).
template <class T>
void batch_norm_update_running(T* running_mean, T* running_var, const double* mean, const double* var, std::int64_t R,
                               std::int64_t C, double momentum) {
  const double unbias = static_cast<double>(R) / static_cast<double>(R - 1);
  for (std::int64_t c = 0; c < C; ++c) {
    running_mean[c] = static_cast<T>((1 - momentum) * running_mean[c] + momentum * mean[c]);
    running_var[c] = static_cast<T>((1 - momentum) * running_var[c] + momentum * var[c] * unbias);
  }
}
template <class T>
void batch_norm_backward(const T* x, const T* g, const double* mu, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t R, std::int64_t C, bool training) {
  // sums per channel: [0, C) sum dy xhat, [C, 2C) sum dy
  const std::vector<double> tot = rows_with_partials(R, 2 * C, R * C, [&](std::int64_t r, double* acc) {
    const T* xr = x + r * C;
    const T* gr = dy + r * C;
    for (std::int64_t c = 0; c < C; ++c) {
      acc[c] += gr[c] * (xr[c] - mu[c]) * rstd[c];
      acc[C + c] += gr[c];
    }
  });
  if (dx) {
    const double invR = 1.0 / static_cast<double>(R);
    parallel_for(R, R * C, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const T* xr = x + r * C;
        const T* gr = dy + r * C;
        T* dr = dx + r * C;
        for (std::int64_t c = 0; c < C; ++c) {
          const double gc = g ? static_cast<double>(g[c]) : 1.0;
          if (!training) {
            dr[c] = static_cast<T>(gc * rstd[c] * gr[c]);
            continue;
          }
          const double xh = (xr[c] - mu[c]) * rstd[c];
          // sum(dxhat) = g_c sum(dy), sum(dxhat xhat) = g_c sum(dy xhat)
          dr[c] = static_cast<T>(gc * rstd[c] * (gr[c] - invR * (tot[static_cast<std::size_t>(C + c)] + xh * tot[static_cast<std::size_t>(c)])));
        }
      }
    });
  }
  write_param_grads(tot, C, dg, db);
}

// ---- WeightNorm: the reference's rows in parallel (the same bits) ----
template <class T>
void weight_norm_forward(const T* v, const T* g, T* w, T* norm, std::int64_t rows, std::int64_t n) {
  parallel_for(rows, rows * n, [&](std::int64_t lo, std::int64_t hi) {
    kernels::weight_norm_forward(v + lo * n, g + lo, w + lo * n, norm + lo, hi - lo, n);
  });
}
template <class T>
void weight_norm_backward(const T* v, const T* g, const T* norm, const T* dw, T* dv, T* dg, std::int64_t rows,
                          std::int64_t n) {
  parallel_for(rows, rows * n, [&](std::int64_t lo, std::int64_t hi) {
    kernels::weight_norm_backward(v + lo * n, g + lo, norm + lo, dw + lo * n, dv ? dv + lo * n : nullptr,
                                  dg ? dg + lo : nullptr, hi - lo, n);
  });
}

}  // namespace tg::kernels::fast
