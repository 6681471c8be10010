#pragma once
// The differentiable ops. Each validates its arguments (tg::Error naming the op and the shapes),
// runs its forward kernel (core/kernels/) and records one tape node whose backward runs the
// matching backward kernel. Float ops take float32 or float64; both operands must share a dtype
// (PyTorch would promote; tapegrad asks for an explicit to()).
#include <cstdint>
#include <utility>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

// ---- elementwise binary, NumPy broadcasting ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
// scalar forms: a + s, a - s, a * s, a / s, s - a, s / a
Tensor add(const Tensor& a, double s);
Tensor sub(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor div(const Tensor& a, double s);
Tensor rsub(double s, const Tensor& a);
Tensor rdiv(double s, const Tensor& a);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return sub(a, s); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return div(a, s); }
inline Tensor operator+(double s, const Tensor& a) { return add(a, s); }
inline Tensor operator-(double s, const Tensor& a) { return rsub(s, a); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
inline Tensor operator/(double s, const Tensor& a) { return rdiv(s, a); }

// ---- elementwise unary ----
Tensor neg(const Tensor& x);
inline Tensor operator-(const Tensor& x) { return neg(x); }
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);     // 1 / sqrt(x)
Tensor pow(const Tensor& x, double p);
Tensor abs(const Tensor& x);       // gradient sign(x), 0 at 0 (as PyTorch)
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// approximate = "none": x * Phi(x) with the erf; "tanh": GPT-2's tanh approximation (PyTorch's names).
Tensor gelu(const Tensor& x, const char* approximate = "none");

// ---- reductions over axes (empty = all axes; negative axes count from the end) ----
Tensor sum(const Tensor& x, const std::vector<int>& axes = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int>& axes = {}, bool keepdim = false);
// Variance with Bessel's correction by default (PyTorch's correction=1); two-pass, never E[x^2]-E[x]^2.
Tensor var(const Tensor& x, const std::vector<int>& axes = {}, bool keepdim = false, int correction = 1);
// Maximum (torch.amax): the gradient is shared evenly between tied maxima.
Tensor max(const Tensor& x, const std::vector<int>& axes = {}, bool keepdim = false);

// ---- linear algebra ----
// (..., M, K) @ (..., K, N) -> (..., M, N), batch dims broadcast; trans_a / trans_b read the stored
// matrix transposed without copying it (a stored as (..., K, M), b stored as (..., N, K)).
// Both operands need at least 2 dims (PyTorch also accepts 1-D vectors).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// x (..., in) @ w (out, in)^T + b (out), as PyTorch's F.linear; b may be undefined (no bias). One
// gemm, with the bias as the gemm's starting C; nn::Linear's forward. A residual (the output's
// shape; PyTorch's F.linear has none) is added to each block of the output as the product
// finishes it: residual + linear(x, w, b), the same bits as the add, without its pass.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(), const Tensor& residual = Tensor());

// The transformer MLP as one op: act(x w1^T + b1) w2^T + b2, act "gelu" (the erf GELU) or "swiglu"
// (w1 (2F, in) holds the gate's rows, then the up's). The same bits as composite::mlp, its
// unfused twin linear(gelu(linear(x, w1, b1)), w2, b2) (or swiglu), with the activation done
// in the products' epilogues and only x and x w1^T + b1 kept for the backward. A residual is added
// as linear's is. Under autocast x w1^T + b1 is rounded to bf16 before the activation, as PyTorch
// autocast's bf16 linear output is, and kept so (composite::mlp spells it out). PyTorch has no
// such op; nn::Block calls it for its MLP.
Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const char* activation = "gelu", const Tensor& residual = Tensor());

// ---- neural-network ops ----
Tensor softmax(const Tensor& x, int axis = -1);      // only the last axis is supported
Tensor log_softmax(const Tensor& x, int axis = -1);  // only the last axis is supported
// Where mask (int32, broadcastable to x) is non-zero, the output is `value`; elsewhere x.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// (T, T) int32 with 1 where key position j > query position i: the positions a causal model must not see.
Tensor causal_mask(std::int64_t T);
// Rows of weight (V, C) picked by int32 ids of any shape -> (ids..., C). Backward scatter-adds.
Tensor embedding(const Tensor& weight, const Tensor& ids);
// Mean over non-ignored rows of -log softmax(logits)[target]; logits (..., V), targets int32 (...).
// Fused log-softmax + NLL. Throws when every target is ignored (PyTorch returns NaN).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index = -100);
// Zeroes each element with probability p and scales the rest by 1/(1-p) when train; identity otherwise.
Tensor dropout(const Tensor& x, double p, bool train = true);

// ---- normalisation: each one fused op (one tape node) whose backward is the hand-derived
// gradient in core/kernels/norms.h. weight / bias may be undefined tensors (no gain / no bias).
// Each has a composite twin in tg::composite (tapegrad/composite.h) built from the primitive ops
// above, whose gradient comes from the tape; the tests hold the two together.

// LayerNorm over the last axis (F.layer_norm with normalized_shape = (C,)).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// RMSNorm over the last axis: x / sqrt(mean(x[..., :k]^2) + eps) * weight + bias with
// k = ceil(C * p); p = 1 is RMSNorm, p < 1 partial RMSNorm. eps inside the square root.
Tensor rms_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5, double p = 1.0);
// The number of features pRMSNorm's statistic uses: k = ceil(n p), at least 1 (the paper's text;
// its code takes the floor). A 1e-9 slack keeps n p = 7.000000000000001 at 7.
std::int64_t prms_k(std::int64_t n, double p);
// BatchNorm (F.batch_norm) of x (N, C) or (N, C, L); with channels_last, x (..., C) normalised over
// all leading dims (a (B, T, C) activation over B*T rows). In training the batch statistics are
// used and, when running_mean / running_var are defined, updated in place:
// running = (1 - momentum) running + momentum * batch, with the unbiased batch variance.
// Not training (and running stats given): the running statistics normalise.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5,
                  bool channels_last = false);
// Weight normalisation of each row: w_i = g_i v_i / |v_i|, v (out, in), g (out,).
Tensor weight_norm(const Tensor& v, const Tensor& g);
// softmax(scale * x) over the last axis of x (..., T, T) with key positions j > query i masked out:
// scale, masked_fill(causal_mask(T), -inf) and softmax in one op.
Tensor scaled_causal_softmax(const Tensor& x, double scale);

// Multi-head causal self-attention, fused: qkv (B, T, 3C) packs q, k, v (head h = columns
// [h C/H, (h+1) C/H) of each); returns softmax(q k^T / sqrt(C/H), causal) v per head, heads side
// by side: (B, T, C). Reads and writes the packed layout in place (no split, permute or merge).
Tensor causal_attention(const Tensor& qkv, std::int64_t n_head);

// ---- a LLaMA-style block's ops: each fused (one node; the hand-derived backward is in
// core/kernels/llama.h), each with a composite twin in tg::composite. PyTorch's names. ----
// SiLU (swish), F.silu: x * sigmoid(x), elementwise; finite for every finite x.
Tensor silu(const Tensor& x);
// SwiGLU over a packed projection: x (..., 2F) holds [gate | up] along the last axis (gate =
// columns [0, F), up = [F, 2F)); returns silu(gate) * up, (..., F). LLaMA's MLP
// down(silu(gate(h)) * up(h)) with gate and up fused in one Linear, its rows [0, F) gate, [F, 2F) up.
Tensor swiglu(const Tensor& x);
// Rotary position tables, Hugging Face Llama's: cos and sin, each (max_pos, head_size), row p holding
// cos / sin of p * theta^(-2j / head_size) at columns j and j + head_size / 2, j < head_size / 2.
// float32 tables are computed in float32 step by step as the reference computes them, float64 ones
// in float64. head_size even and positive.
std::pair<Tensor, Tensor> rope_tables(std::int64_t max_pos, std::int64_t head_size, double theta = 10000.0,
                                      DType dtype = float32);
// Rotary position embedding, Hugging Face Llama's "rotate_half" convention, of x (B, T, D) or (T, D),
// D a multiple of head_size: columns [0, rotated) (whole heads; -1: all of D) turn head by head, the
// rest are copied. Row t is at position p = pos0 + t (generation with a KV cache starts T new
// positions at pos0); within a head, for j < hs / 2:
//   y[j] = x[j] cos[p, j] - x[j + hs/2] sin[p, j],  y[j + hs/2] = x[j + hs/2] cos[p, j + hs/2] + x[j] sin[p, j + hs/2].
// cos and sin (P >= pos0 + T, head_size), x's dtype (rope_tables), are constants: no gradient
// reaches them, even when they require one. A packed qkv (B, T, 3C): rope(qkv, cos, sin, hs, 2 * C, pos0)
// turns q and k and passes v through.
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, std::int64_t head_size, std::int64_t rotated = -1,
            std::int64_t pos0 = 0);

// ---- shape ops (all copy except reshape/view; all differentiable) ----
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor transpose(const Tensor& x, int d0, int d1);
Tensor permute(const Tensor& x, const std::vector<int>& dims);
// Elements start, start+step, ... < end along dim; negative start/end count from the end and are
// clamped to the dimension, as in Python slicing. step >= 1.
Tensor slice(const Tensor& x, int dim, std::int64_t start, std::int64_t end, std::int64_t step = 1);
Tensor cat(const std::vector<Tensor>& xs, int dim = 0);
// Pieces of split_size along dim (the last may be smaller), or of the given sizes.
std::vector<Tensor> split(const Tensor& x, std::int64_t split_size, int dim = 0);
std::vector<Tensor> split(const Tensor& x, const std::vector<std::int64_t>& sizes, int dim = 0);
Tensor to(const Tensor& x, DType dtype);  // differentiable between float32, float64 and bfloat16
Tensor clone(const Tensor& x);  // a copy of the data (same dtype); differentiable

}  // namespace tg
