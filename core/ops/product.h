#pragma once
// The matrix products of matmul and linear, and the one place that decides their precision.
// Inside an autocast scope (tapegrad/autocast.h) a float32 op's products take bfloat16 operands
// and sum in float32 (kernels/sgemm_bf16.h); everywhere else they are kernels::gemm in the
// tensors' own dtype. An op asks products_in_bf16 once, when it runs; its forward and its
// backward (whenever backward() is called) pass that answer to every product they make.
//
// Shapes as kernels::gemm: C (M, N) = op(A) op(B) + beta C, op(A) (M, K), op(B) (K, N), row-major
// with leading dimensions; beta = 0 ignores C.
#include <cassert>
#include <cstdint>
#include <type_traits>

#include "kernels/gemm.h"
#include "kernels/sgemm_bf16.h"
#include "tapegrad/node.h"
#include "tapegrad/tensor.h"

namespace tg::detail {

// Whether an op on dtype d makes its products in bf16 now: float32 inside an autocast scope.
bool products_in_bf16(DType d);
// A float32 activation rounded to bf16: the copy a node keeps for a bf16 product in its backward
// (half the bytes, and the bits the product's own rounding would give). Asked twice in a row for
// the same tensor, unchanged since (every write in place bumps its version, Tensor::version), it
// hands out the same copy the second time: the two nodes keeping it share the memory.
Tensor activation_bf16(const Tensor& x);

// One operand: T data or bf16 data (exactly one non-null), with its leading dimension.
template <class T>
struct Operand {
  const T* f = nullptr;
  const kernels::bf16* h = nullptr;
  std::int64_t ld = 0;
};
template <class T>
Operand<T> operand(const T* p, std::int64_t ld) {
  return {p, nullptr, ld};
}
// A tensor's data as an operand: its bf16 bits when it is a bfloat16 copy, else as T.
template <class T>
Operand<T> operand(const Tensor& t, std::int64_t ld) {
  if (t.dtype() == bfloat16) return {nullptr, static_cast<const kernels::bf16*>(t.raw_data()), ld};
  return {t.data<T>(), nullptr, ld};
}

// One product; bf16: bf16 operands and float32 sums (T = float only).
template <class T>
struct Product {
  bool ta = false, tb = false;
  std::int64_t M = 0, N = 0, K = 0;
  Operand<T> A, B;
  T beta = 0;
  T* C = nullptr;
  std::int64_t ldc = 0;
  bool bf16 = false;
  kernels::Epilogue ep{};  // work on C's blocks as they are finished (kernels/gemm.h)
};

inline kernels::Bf16Operand as_bf16(const Operand<float>& o) {
  return o.h ? kernels::Bf16Operand(o.h, o.ld) : kernels::Bf16Operand(o.f, o.ld);
}
inline kernels::GemmBf16 as_bf16(const Product<float>& p) {
  return {p.ta, p.tb, p.M, p.N, p.K, 1.0f, as_bf16(p.A), as_bf16(p.B), p.beta, p.C, p.ldc, p.ep};
}
template <class T>
kernels::Gemm<T> as_gemm(const Product<T>& p) {
  assert(p.A.f && p.B.f);  // a bf16 operand comes only with bf16 products
  return {p.ta, p.tb, p.M, p.N, p.K, T(1), p.A.f, p.A.ld, p.B.f, p.B.ld, p.beta, p.C, p.ldc, p.ep};
}

// An epilogue adding a residual: y[r, c] += res[r, c] on a block of y (rows, n), the add of
// x + linear(...) done while the block is in cache. One rounding of y + res, as add's.
template <class T>
struct ResidualEpilogue {
  const T* res;
  T* y;
  std::int64_t n;
  static void run(const void* ctx, std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
    const auto& e = *static_cast<const ResidualEpilogue*>(ctx);
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) e.y[r * e.n + c] = e.res[r * e.n + c] + e.y[r * e.n + c];
  }
  kernels::Epilogue epilogue() const { return res ? kernels::Epilogue{&ResidualEpilogue::run, this} : kernels::Epilogue{}; }
};

// The gradient of a residual added to an op's output 0: the output's gradient itself. Call first
// in the backward (slot: the residual's input), on a node recorded with may_reuse_grad_out, so
// that new_grad can hand over dy's own buffer; else it is copied into the fresh one. Pass it last,
// after every read of grad_out(): the residual may be another input too (linear(x, w, b, x)), and
// the tape then adds that input's part into this very buffer.
Tensor residual_grad(const Node& n, std::size_t slot);

template <class T>
void run(const Product<T>& p) {
  if constexpr (std::is_same_v<T, float>)
    if (p.bf16) return kernels::gemm_bf16(as_bf16(p));
  kernels::gemm(as_gemm(p));
}
// run(p); run(q) for two products of one precision, neither reading the other's output, side by
// side on halves of the team (kernels::gemm_pair).
template <class T>
void run_pair(const Product<T>& p, const Product<T>& q) {
  if constexpr (std::is_same_v<T, float>)
    if (p.bf16) return kernels::gemm_bf16_pair(as_bf16(p), as_bf16(q));
  kernels::gemm_pair(as_gemm(p), as_gemm(q));
}

}  // namespace tg::detail
