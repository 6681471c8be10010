#pragma once
// Data movement: permuted copies, strided slices, embedding gather / scatter-add. Each backward
// is the forward's adjoint: it sends dy back to the positions the forward read, into a fresh
// gradient (zeros where the forward read nothing; sums where it read one position twice).
//
// Shapes: nd dims (at most 8) for a permute; a slice takes count of the n positions along one dim
// of an (outer, n, inner) view; an embedding gathers rows (= B T for a token batch) of C channels
// from a vocabulary of V.
//   x, y    permute: x any shape, y (yshape) its permuted copy
//           slice:   x (outer, n, inner), y (outer, count, inner)
//   w       (V, C)     embedding table
//   ids     (rows)     int32 token ids in [0, V)
//   y       (rows, C)  embedding: the gathered rows
//   dy, dx, dw         gradients of y, x, w, in their shapes; the backwards write them whole
#include <cstdint>
#include <cstring>

#include "kernels/parallel.h"

namespace tg::kernels {

// x (any, nd dims) -> y (yshape): y = x permuted, y's dimension d being x's dimension perm[d];
// `ystride_in_x[d]` is the stride in x of y's dimension d. Its own backward: called with the
// inverse permutation it sends dy back into dx.
template <class T>
void permute_copy(const T* x, T* y, int nd, const std::int64_t* yshape, const std::int64_t* ystride_in_x) {
  std::int64_t n = 1;
  for (int d = 0; d < nd; ++d) n *= yshape[d];
  if (n == 0) return;
  if (nd == 0) { y[0] = x[0]; return; }
  std::int64_t idx[8] = {};
  std::int64_t off = 0;
  const int last = nd - 1;
  const std::int64_t nl = yshape[last], sl = ystride_in_x[last];
  for (std::int64_t i = 0; i < n; i += nl) {
    for (std::int64_t j = 0; j < nl; ++j) y[i + j] = x[off + j * sl];
    for (int d = last - 1; d >= 0; --d) {
      off += ystride_in_x[d];
      if (++idx[d] < yshape[d]) break;
      off -= ystride_in_x[d] * yshape[d];
      idx[d] = 0;
    }
  }
}

// x (outer, n, inner) -> y (outer, count, inner): y[o, j, i] = x[o, start + j*step, i].
template <class T>
void slice_forward(const T* x, T* y, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t start,
                   std::int64_t step, std::int64_t count) {
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < count; ++j)
      std::memcpy(y + (o * count + j) * inner, x + (o * n + start + j * step) * inner, sizeof(T) * static_cast<std::size_t>(inner));
}
// dy (outer, count, inner) -> dx (outer, n, inner): dx[o, start + j*step, i] = dy[o, j, i], zero
// elsewhere.
template <class T>
void slice_backward(const T* dy, T* dx, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t start,
                    std::int64_t step, std::int64_t count) {
  fill_zero(dx, outer * n * inner);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < count; ++j)
      std::memcpy(dx + (o * n + start + j * step) * inner, dy + (o * count + j) * inner,
                  sizeof(T) * static_cast<std::size_t>(inner));
}

// w (V, C), ids (rows) -> y (rows, C): y[r, :] = w[ids[r], :]   (ids already validated to lie in
// [0, V))
template <class T>
void embedding_forward(const T* w, const std::int32_t* ids, T* y, std::int64_t rows, std::int64_t C) {
  parallel_for(rows, rows * C, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r)
      std::memcpy(y + r * C, w + static_cast<std::int64_t>(ids[r]) * C, sizeof(T) * static_cast<std::size_t>(C));
  });
}
// dy (rows, C), ids (rows) -> dw (V, C): dw[v, :] = sum of dy[r, :] over the rows r with ids[r] = v,
// zero for an id no row has. Serial over rows: two rows may share an id.
template <class T>
void embedding_backward(const T* dy, const std::int32_t* ids, T* dw, std::int64_t rows, std::int64_t V,
                        std::int64_t C) {
  fill_zero(dw, V * C);
  for (std::int64_t r = 0; r < rows; ++r) {
    T* dst = dw + static_cast<std::int64_t>(ids[r]) * C;
    const T* src = dy + r * C;
    for (std::int64_t c = 0; c < C; ++c) dst[c] += src[c];
  }
}

}  // namespace tg::kernels
