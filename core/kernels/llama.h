#pragma once
// The kernels of a LLaMA-style block's own ops, forward and backward side by side: SiLU, SwiGLU
// over a packed [gate | up] projection, and rotary position embedding (RoPE) with its tables.
//
// Shapes: n elements of an elementwise op, read flat; rows = the product of the leading dims.
//   x, y        (n)             SiLU's input and output
//   x           (rows, 2F)      SwiGLU's input: gate = columns [0, F), up = columns [F, 2F)
//   y           (rows, F)       silu(gate) * up
//   x, y        (B, Tn, D)      RoPE's input and output (Tn positions; D columns of packed heads)
//   hs, half    head size and hs / 2, the distance between the two elements of a rotated pair
//   cos, sin    (P, hs)         the tables: row p for position p
//   dy, dx      gradients, each shaped as y and x; dx is written (=), a fresh buffer
#include <cmath>
#include <cstdint>

#include "kernels/fastmath.h"
#include "kernels/parallel.h"

namespace tg::kernels {

// ---------------------------------------------------------------------------------------------
// The logistic sigmoid s = 1 / (1 + e^-x) and its complement 1 - s, both from e = e^-|x| in (0, 1]:
//   x >= 0:  s = 1 / (1 + e),  1 - s = e / (1 + e);     x < 0:  s = e / (1 + e),  1 - s = 1 / (1 + e).
// No intermediate overflows for any finite x, and 1 - s keeps its relative precision in the right
// tail (computed as 1 - s it rounds to 0 above x = 17 in float32). For x >= 0 and x < 0 the value
// of s is that of tg::sigmoid (kernels/elementwise.h, SigmoidOp), so SiLU's composite twin
// x * sigmoid(x) gives the same bits. Branch-free: the selects vectorise.
template <class T>
inline void sigmoid_and_complement(T x, T& s, T& c) {
  const T e = fast_exp(-std::fabs(x));
  const T d = T(1) + e;
  const T one_over = T(1) / d, e_over = e / d;
  s = x >= 0 ? one_over : e_over;
  c = x >= 0 ? e_over : one_over;
}

// ---------------------------------------------------------------------------------------------
// SiLU (swish): y = x s, s = sigmoid(x) (Elfwing, Uchibe and Doya 2018; PyTorch's F.silu).
// Derivative by the product rule, with s' = s (1 - s):
//   dy/dx = s + x s (1 - s) = s (1 + x (1 - s)).
// The backward recomputes s from the saved x (one exponential) rather than saving it.
// x (n) -> y (n)
template <class T>
void silu_forward(const T* x, T* y, std::int64_t n) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      T s, c;
      sigmoid_and_complement(x[i], s, c);
      y[i] = x[i] * s;
    }
  });
}
// x (n), dy (n) -> dx (n): dx = dy s (1 + x (1 - s)). dx may be dy's buffer: each element of dy
// is read before the same element of dx is written.
template <class T>
void silu_backward(const T* x, const T* dy, T* dx, std::int64_t n) {
  parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      T s, c;
      sigmoid_and_complement(x[i], s, c);
      dx[i] = dy[i] * (s * (T(1) + x[i] * c));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020; LLaMA's MLP) over a packed
// projection: per row, with g = x[j] (gate) and u = x[F + j] (up), j < F, and s = sigmoid(g):
//   y[j] = silu(g) u = (g s) u.
// Backward, silu'(g) as above:
//   dg = dy u silu'(g) = dy u s (1 + g (1 - s)),    du = dy silu(g) = dy g s,
// written into the two halves of the (rows, 2F) gradient.
// One element: silu(g) u.
template <class T>
inline T swiglu_one(T g, T u) {
  T s, c;
  sigmoid_and_complement(g, s, c);
  return (g * s) * u;
}
// One row: x (2F) -> y (F).
template <class T>
void swiglu_row(const T* x, T* y, std::int64_t F) {
  for (std::int64_t j = 0; j < F; ++j) y[j] = swiglu_one(x[j], x[F + j]);
}
// One row: x (2F), dy (F) -> dx (2F), every element written.
template <class T>
void swiglu_grad_row(const T* x, const T* dy, T* dx, std::int64_t F) {
  const T* g = x;
  const T* u = g + F;
  T* dg = dx;
  T* du = dg + F;
  for (std::int64_t j = 0; j < F; ++j) {
    T s, c;
    sigmoid_and_complement(g[j], s, c);
    dg[j] = dy[j] * u[j] * (s * (T(1) + g[j] * c));
    du[j] = dy[j] * (g[j] * s);
  }
}
// x (rows, 2F) -> y (rows, F)
template <class T>
void swiglu_forward(const T* x, T* y, std::int64_t rows, std::int64_t F) {
  parallel_for(rows, rows * F, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) swiglu_row(x + r * 2 * F, y + r * F, F);
  });
}
// x (rows, 2F), dy (rows, F) -> dx (rows, 2F): every element written.
template <class T>
void swiglu_backward(const T* x, const T* dy, T* dx, std::int64_t rows, std::int64_t F) {
  parallel_for(rows, 2 * rows * F, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) swiglu_grad_row(x + r * 2 * F, dy + r * F, dx + r * 2 * F, F);
  });
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding (Su et al., "RoFormer", 2021) in Hugging Face Llama's "rotate_half"
// layout: within each head of hs columns, element j < half pairs with element j + half (RoFormer
// pairs 2j with 2j + 1). At position p, with c1 = cos[p, j], s1 = sin[p, j], c2 = cos[p, j + half],
// s2 = sin[p, j + half], the pair (a, b) = (x[j], x[j + half]) becomes
//   y[j] = a c1 - b s1,    y[j + half] = b c2 + a s2,
// which is the reference's q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[half:], q[:half]).
// With the tables below (c1 = c2 = cos(p w_j), s1 = s2 = sin(p w_j)) it turns the pair by the angle
// p w_j, so the product of a query at p and a key at p' depends on the positions through p - p'.
// The map is linear in x with the 2 x 2 matrix M = [[c1, -s1], [s2, c2]] per pair, so the backward
// applies M^T = [[c1, s2], [-s1, c2]] (a turn by -p w_j):
//   dx[j] = dy[j] c1 + dy[j + half] s2,    dx[j + half] = dy[j + half] c2 - dy[j] s1.
// Only the first `rotated` columns of a row (whole heads) turn; the rest are copied, and their
// gradient passes through. Row r = b Tn + t is at position p = pos0 + t.

// The tables: w_j = 1 / theta^(2j / hs) for j < half, angle[p, j] = angle[p, j + half] = p w_j,
// cos (P, hs) = cos(angle), sin (P, hs) = sin(angle). Each step is rounded in T, as the reference
// computes it (Hugging Face's LlamaRotaryEmbedding: inv_freq = 1 / theta ** (arange(0, hs, 2).float()
// / hs), angle = outer(positions, inv_freq), both halves equal), so a float32 table agrees with
// PyTorch's within one ulp in each cos and sin (libm's cosf and sinf against PyTorch's vectorised ones).
template <class T>
void rope_tables_fill(T* cos, T* sin, std::int64_t P, std::int64_t hs, double theta) {
  const std::int64_t half = hs / 2;
  for (std::int64_t j = 0; j < half; ++j) {
    const T w = T(1) / std::pow(static_cast<T>(theta), static_cast<T>(2 * j) / static_cast<T>(hs));
    for (std::int64_t p = 0; p < P; ++p) {
      const T angle = static_cast<T>(p) * w;
      cos[p * hs + j] = cos[p * hs + j + half] = std::cos(angle);
      sin[p * hs + j] = sin[p * hs + j + half] = std::sin(angle);
    }
  }
}

// x (B, Tn, D), cos, sin (P >= pos0 + Tn, hs) -> y (B, Tn, D)
template <class T>
void rope_forward(const T* x, const T* cos, const T* sin, T* y, std::int64_t B, std::int64_t Tn, std::int64_t D,
                  std::int64_t hs, std::int64_t rotated, std::int64_t pos0) {
  const std::int64_t half = hs / 2;
  parallel_for(B * Tn, B * Tn * D, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* c = cos + (pos0 + r % Tn) * hs;
      const T* s = sin + (pos0 + r % Tn) * hs;
      const T* xr = x + r * D;
      T* yr = y + r * D;
      for (std::int64_t h = 0; h < rotated; h += hs) {
        const T* a = xr + h;
        const T* b = a + half;
        T* ya = yr + h;
        T* yb = ya + half;
        for (std::int64_t j = 0; j < half; ++j) {
          ya[j] = a[j] * c[j] - b[j] * s[j];
          yb[j] = b[j] * c[half + j] + a[j] * s[half + j];
        }
      }
      for (std::int64_t k = rotated; k < D; ++k) yr[k] = xr[k];
    }
  });
}
// dy (B, Tn, D), cos, sin (P, hs) -> dx (B, Tn, D): dx = M^T dy per pair, dy itself past `rotated`.
template <class T>
void rope_backward(const T* dy, const T* cos, const T* sin, T* dx, std::int64_t B, std::int64_t Tn, std::int64_t D,
                   std::int64_t hs, std::int64_t rotated, std::int64_t pos0) {
  const std::int64_t half = hs / 2;
  parallel_for(B * Tn, B * Tn * D, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* c = cos + (pos0 + r % Tn) * hs;
      const T* s = sin + (pos0 + r % Tn) * hs;
      const T* gr = dy + r * D;
      T* dr = dx + r * D;
      for (std::int64_t h = 0; h < rotated; h += hs) {
        const T* ga = gr + h;
        const T* gb = ga + half;
        T* da = dr + h;
        T* db = da + half;
        for (std::int64_t j = 0; j < half; ++j) {
          da[j] = ga[j] * c[j] + gb[j] * s[half + j];
          db[j] = gb[j] * c[half + j] - ga[j] * s[j];
        }
      }
      for (std::int64_t k = rotated; k < D; ++k) dr[k] = gr[k];
    }
  });
}

}  // namespace tg::kernels
