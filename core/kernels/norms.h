#pragma once
// Normalisation kernels, forward and backward side by side: for each row, plain loops over its
// features. The gradients: Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS
// 2019), section 4. Per row of n features (C in the code): a = the input (x in the code), g = gain,
// b = bias, dy = upstream gradient. Statistics accumulate in double whatever T is; variances are two-pass (mean,
// then squared deviations: E[a^2] - E[a]^2 cancels catastrophically); the forward saves each row's
// statistic for the backward. g, b and any unwanted gradient may be null. Every gradient is
// written (=), never added: the tape adds it to one already there (tapegrad/node.h).
//
// These loops are the reference: the ops run the same math blocked, threaded and vectorised
// (kernels/norms_fast.h, rms_avx2.h), held equal to these by tests/core/test_norm_kernels.cpp.
// RMSNorm comes first and is the one the learner's path follows; LayerNorm, BatchNorm and weight
// norm below have the same shape.
#include <cmath>
#include <cstdint>
#include <vector>

namespace tg::kernels {

// ---- RMSNorm (k = C) and partial RMSNorm (k < C): the statistic uses the first k features,
//      r = sqrt(mean(a[0:k]^2) + eps), y = (a / r) g + b.   x, y (rows, C); rrms (rows) = 1 / r,
//      the paper's rho (rr for one row).
template <class T>
void rms_norm_forward(const T* x, const T* g, const T* b, T* y, T* rrms, std::int64_t rows, std::int64_t C,
                      std::int64_t k, double eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * C;
    double ms = 0;
    for (std::int64_t j = 0; j < k; ++j) ms += static_cast<double>(xr[j]) * xr[j];
    const double rr = 1.0 / std::sqrt(ms / static_cast<double>(k) + eps);
    rrms[r] = static_cast<T>(rr);
    for (std::int64_t j = 0; j < C; ++j)
      y[r * C + j] = static_cast<T>(xr[j] * rr * (g ? g[j] : 1.0) + (b ? b[j] : 0.0));
  }
}
// The paper's section 4, generalised to pRMSNorm: r depends on a[0:k] only, so
//   da_i = g_i dy_i / r  -  [i < k] a_i / (k r^3) sum_{j < n} g_j dy_j a_j
// (every y_j is divided by r, so the sum runs over all n; only d r / d a_i is limited to i < k);
//   dg = sum over rows of dy a / r;  db = sum over rows of dy.   dy, dx (rows, C); dg, db (C).
// Derived step by step in docs/rmsnorm.md ("Backward, derived").
template <class T>
void rms_norm_backward(const T* x, const T* g, const T* rrms, const T* dy, T* dx, T* dg, T* db, std::int64_t rows,
                       std::int64_t C, std::int64_t k) {
  std::vector<double> sums(static_cast<std::size_t>(2 * C));
  double *sum_g = sums.data(), *sum_b = sum_g + C;  // the gain's and bias's gradients, summed over rows
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * C;
    const T* dyr = dy + r * C;
    const double rr = rrms[r];  // 1 / r
    double s = 0;  // sum_j g_j dy_j a_j
    for (std::int64_t j = 0; j < C; ++j) {
      s += static_cast<double>(dyr[j]) * (g ? g[j] : 1.0) * xr[j];
      sum_g[j] += static_cast<double>(dyr[j]) * xr[j] * rr;
      sum_b[j] += dyr[j];
    }
    const double c2 = s * rr * rr * rr / static_cast<double>(k);
    if (!dx) continue;
    for (std::int64_t j = 0; j < C; ++j)
      dx[r * C + j] = static_cast<T>(dyr[j] * (g ? g[j] : 1.0) * rr - (j < k ? xr[j] * c2 : 0.0));
  }
  for (std::int64_t j = 0; j < C; ++j) {
    if (dg) dg[j] = static_cast<T>(sum_g[j]);
    if (db) db[j] = static_cast<T>(sum_b[j]);
  }
}

// ---- LayerNorm: mu = mean(a), var = mean((a - mu)^2), rstd = 1 / sqrt(var + eps),
//      xhat = (a - mu) rstd, y = xhat g + b.   x, y (rows, C); mean, rstd (rows).
template <class T>
void layer_norm_forward(const T* x, const T* g, const T* b, T* y, double* mean, T* rstd, std::int64_t rows,
                        std::int64_t C, double eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * C;
    double mu = 0, var = 0;
    for (std::int64_t j = 0; j < C; ++j) mu += xr[j];
    mu /= static_cast<double>(C);
    for (std::int64_t j = 0; j < C; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    const double rs = 1.0 / std::sqrt(var / static_cast<double>(C) + eps);
    mean[r] = mu;
    rstd[r] = static_cast<T>(rs);
    for (std::int64_t j = 0; j < C; ++j)
      y[r * C + j] = static_cast<T>((xr[j] - mu) * rs * (g ? g[j] : 1.0) + (b ? b[j] : 0.0));
  }
}
// With dxhat = g dy:  da = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (the paper's LayerNorm
// gradient); dg = sum over rows of dy xhat; db = sum over rows of dy.   dy, dx (rows, C); dg, db (C).
template <class T>
void layer_norm_backward(const T* x, const T* g, const double* mean, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t rows, std::int64_t C) {
  std::vector<double> sums(static_cast<std::size_t>(2 * C));
  double *sum_g = sums.data(), *sum_b = sum_g + C;  // sum over rows of dy xhat, of dy
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * C;
    const T* dyr = dy + r * C;
    const double rs = rstd[r];
    double s1 = 0, s2 = 0;  // sum(dxhat), sum(dxhat xhat)
    for (std::int64_t j = 0; j < C; ++j) {
      const double xhat = (xr[j] - mean[r]) * rs, dxhat = dyr[j] * (g ? g[j] : 1.0);
      s1 += dxhat;
      s2 += dxhat * xhat;
      sum_g[j] += dyr[j] * xhat;
      sum_b[j] += dyr[j];
    }
    if (!dx) continue;
    for (std::int64_t j = 0; j < C; ++j) {
      const double xhat = (xr[j] - mean[r]) * rs, dxhat = dyr[j] * (g ? g[j] : 1.0);
      dx[r * C + j] = static_cast<T>(rs * (dxhat - (s1 + xhat * s2) / static_cast<double>(C)));
    }
  }
  for (std::int64_t j = 0; j < C; ++j) {
    if (dg) dg[j] = static_cast<T>(sum_g[j]);
    if (db) db[j] = static_cast<T>(sum_b[j]);
  }
}

// ---- BatchNorm over the R rows of a channels-last (R, C) view, per channel c: mu_c = mean over
//      rows, var_c = biased variance, rstd_c = 1 / sqrt(var_c + eps), y = (a - mu_c) rstd_c g_c + b_c.
// y from given statistics (the batch's in training, the running ones in eval); mean, rstd (C).
template <class T>
void batch_norm_apply(const T* x, const T* g, const T* b, T* y, const double* mu, const T* rstd, std::int64_t R,
                      std::int64_t C) {
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      T v = static_cast<T>((x[r * C + c] - mu[c]) * rstd[c]);
      if (g) v *= g[c];
      if (b) v += b[c];
      y[r * C + c] = v;
    }
}
// Training: the batch's statistics; var (C) for the running statistics.
template <class T>
void batch_norm_forward(const T* x, const T* g, const T* b, T* y, double* mean, T* rstd, double* var,
                        std::int64_t R, std::int64_t C, double eps) {
  for (std::int64_t c = 0; c < C; ++c) mean[c] = var[c] = 0;
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) mean[c] += x[r * C + c];
  for (std::int64_t c = 0; c < C; ++c) mean[c] /= static_cast<double>(R);
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) var[c] += (x[r * C + c] - mean[c]) * (x[r * C + c] - mean[c]);
  for (std::int64_t c = 0; c < C; ++c) {
    var[c] /= static_cast<double>(R);
    rstd[c] = static_cast<T>(1.0 / std::sqrt(var[c] + eps));
  }
  batch_norm_apply(x, g, b, y, mean, rstd, R, C);
}
// Training (the statistics depend on every row), with dxhat = g dy, per channel over R rows:
//   da = rstd / R (R dxhat - sum(dxhat) - xhat sum(dxhat xhat));  dg = sum dy xhat;  db = sum dy.
// Eval (fixed running statistics: y is affine in a):  da = g rstd dy.
template <class T>
void batch_norm_backward(const T* x, const T* g, const double* mu, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                         std::int64_t R, std::int64_t C, bool training) {
  std::vector<double> sums(static_cast<std::size_t>(2 * C));
  double *sum_g = sums.data(), *sum_b = sum_g + C;  // per channel: sum dy xhat, sum dy
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      sum_g[c] += dy[r * C + c] * (x[r * C + c] - mu[c]) * rstd[c];
      sum_b[c] += dy[r * C + c];
    }
  for (std::int64_t r = 0; dx && r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) {  // sum(dxhat) = g_c sum dy, sum(dxhat xhat) = g_c sum dy xhat
      const double xhat = (x[r * C + c] - mu[c]) * rstd[c], gc = g ? static_cast<double>(g[c]) : 1.0;
      const double d = training ? dy[r * C + c] - (sum_b[c] + xhat * sum_g[c]) / static_cast<double>(R) : dy[r * C + c];
      dx[r * C + c] = static_cast<T>(gc * rstd[c] * d);
    }
  for (std::int64_t c = 0; c < C; ++c) {
    if (dg) dg[c] = static_cast<T>(sum_g[c]);
    if (db) db[c] = static_cast<T>(sum_b[c]);
  }
}

// ---- Weight normalisation (Salimans & Kingma 2016) of each row i of v (rows, n):
//      w_i = g_i v_i / |v_i|.   norm (rows) = |v_i|.
template <class T>
void weight_norm_forward(const T* v, const T* g, T* w, T* norm, std::int64_t rows, std::int64_t n) {
  for (std::int64_t i = 0; i < rows; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(v[i * n + j]) * v[i * n + j];
    const double nm = std::sqrt(s);
    norm[i] = static_cast<T>(nm);
    for (std::int64_t j = 0; j < n; ++j) w[i * n + j] = static_cast<T>(g[i] * v[i * n + j] / nm);
  }
}
// With s_i = sum_j dw_ij v_ij:  dg_i = s_i / |v_i|;  dv_ij = g_i / |v_i| (dw_ij - v_ij s_i / |v_i|^2).
template <class T>
void weight_norm_backward(const T* v, const T* g, const T* norm, const T* dw, T* dv, T* dg, std::int64_t rows,
                          std::int64_t n) {
  for (std::int64_t i = 0; i < rows; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(dw[i * n + j]) * v[i * n + j];
    const double nm = norm[i];
    if (dg) dg[i] = static_cast<T>(s / nm);
    if (!dv) continue;
    for (std::int64_t j = 0; j < n; ++j)
      dv[i * n + j] = static_cast<T>(g[i] / nm * (dw[i * n + j] - v[i * n + j] * s / (nm * nm)));
  }
}

}  // namespace tg::kernels
