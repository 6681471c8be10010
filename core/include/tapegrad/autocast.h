#pragma once
// bfloat16 mixed precision, as PyTorch's torch.autocast("cpu", dtype=torch.bfloat16).
//
// Inside an AutocastGuard, the float32 matrix products of matmul and linear take bfloat16
// operands (each float32 value rounded to the nearest bfloat16, ties to even) and accumulate in
// float32 (AMX's tile product tdpbf16ps or the AVX512_BF16 instruction vdpbf16ps where the CPU has
// them, else an emulation of vdpbf16ps's bits, much more slowly; kernels/sgemm_bf16.h). Their results are float32, and so is everything else: the norms,
// softmax, cross-entropy, the residual stream, the gradients, the master weights and the
// optimizer's state. The backward of a product recorded inside the scope is a bf16 product too,
// wherever backward() is called.
//
// Weights are cast once per scope: a leaf tensor that requires grad (a parameter) is rounded to
// bf16 at its first use inside the outermost guard and the copy is reused until that guard ends,
// as PyTorch's autocast weight cache does; so update parameters outside the scope (the optimizer
// step after it). Without recording (NoGradGuard: evaluation), each product casts its weight
// afresh and frees the copy, so that a forward holds one layer's bf16 weights, not the model's
// (a difference from PyTorch, whose cache does not depend on grad mode). A checkpointed segment's
// recomputation (tg::checkpoint) casts its weights into a cache of its own, dropped when it ends.
// An activation that a recorded linear saves for its backward is rounded once, before the
// product, and the node keeps the bf16 copy (half the bytes); other activations are rounded while
// the product packs them, with no pass of their own.
//
// Differences from PyTorch: the products' outputs are float32 (PyTorch returns bfloat16 tensors
// and casts them back at the next float32 op: the same values once rounded, but tapegrad keeps the
// float32 sum unrounded). causal_attention's products take bf16-rounded operands too, with its
// softmax statistics and output in float32 (docs/attention.md).
namespace tg {

// AutocastGuard() turns bf16 products on for its scope, AutocastGuard(false) off (PyTorch's
// autocast(enabled=False)); guards nest, per thread, and each restores the state it found.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_;
};

// Whether products on this thread run in bf16 now (PyTorch's torch.is_autocast_cpu_enabled()).
bool is_autocast_enabled();

}  // namespace tg
