#pragma once
// bfloat16 mixed precision, as PyTorch's torch.autocast("cpu", dtype=torch.bfloat16).
//
// Inside an AutocastGuard, the float32 matrix products of matmul and linear take bfloat16
// operands (each float32 value rounded to the nearest bfloat16, ties to even) and accumulate in
// float32 (AMX's tile product tdpbf16ps or the AVX512_BF16 instruction vdpbf16ps where the CPU has
// them, else vdpbf16ps's bits on float32 fused multiply-adds, at about float32's speed;
// kernels/sgemm_bf16.h). Their results are float32, and so is everything else: the norms,
// softmax, cross-entropy, the residual stream, the gradients, the master weights and the
// optimizer's state. The backward of a product recorded inside the scope is a bf16 product too,
// wherever backward() is called.
//
// Weights are not copied: a product reads the float32 weight and rounds it as it packs it, the
// same bits a bf16 copy would give, with no memory of its own. (PyTorch's autocast keeps a bf16
// copy of each weight for the scope, and its backward keeps them until it runs.) An activation
// that a recorded op saves for its backward is rounded once, before the product, and the node
// keeps the bf16 copy (half the bytes); an op saving the tensor whose copy was just made, unchanged,
// shares that copy (the output projection after causal_attention). Other activations are rounded
// while the product packs them, with no pass of their own.
//
// Differences from PyTorch: the products' outputs are float32 (PyTorch returns bfloat16 tensors
// and casts them back at the next float32 op: the same values once rounded, but tapegrad keeps the
// float32 sum unrounded), except where an op rounds them as PyTorch would (mlp's pre, ops.h).
// causal_attention's products take bf16-rounded operands too, with its softmax statistics and
// output in float32 (docs/attention.md).
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
