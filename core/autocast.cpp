// The autocast scope: its switch, and the products' operands (ops/product.h), the one place where
// an op's products learn their precision.
#include "tapegrad/autocast.h"

#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "ops/product.h"

namespace tg {

namespace detail {

namespace {

thread_local constinit bool t_autocast = false;
thread_local constinit int t_depth = 0;  // guards open on this thread

// x (float32) rounded to bfloat16 (round to nearest even), a new tensor of dtype bfloat16 of x's
// shape; in parallel.
Tensor to_bf16(const Tensor& x) {
  Tensor h = Tensor::empty(x.shape(), bfloat16);
  const float* src = x.data<float>();
  auto* dst = static_cast<kernels::bf16*>(h.raw_data());
  kernels::parallel_for(x.numel(), x.numel(),
                        [&](std::int64_t lo, std::int64_t hi) { kernels::to_bf16(src + lo, dst + lo, hi - lo); });
  return h;
}

// The last activation rounded by activation_bf16 and its copy: the next op to ask for the same
// tensor's copy is handed it (causal_attention's output, then the output projection's input). The
// entry holds the source, so its memory cannot be reused by another tensor while the entry lives;
// a write in place since (which bumps the version: Tensor::version) shows. It lasts until it is
// handed out, the next copy is made, or a guard ends.
struct LastCopy {
  Tensor source, copy;
  std::uint32_t version = 0;
};
thread_local LastCopy t_last;

}  // namespace

bool products_in_bf16(DType d) { return t_autocast && d == float32; }

Tensor activation_bf16(const Tensor& x) {
  LastCopy& l = t_last;
  // The same memory (a tensor has no offset into its storage), shape and writes: the same values.
  if (l.copy.defined() && l.source.shares_storage(x) && l.source.shape() == x.shape() &&
      l.version == x.version()) {
    Tensor h = std::move(l.copy);
    l = LastCopy{};  // handed out once: the source is not held past its consumer
    return h;
  }
  Tensor h = to_bf16(x);
  if (t_depth > 0) t_last = LastCopy{x.detach(), h, x.version()};
  return h;
}

}  // namespace detail

AutocastGuard::AutocastGuard(bool enabled) : prev_(detail::t_autocast) {
  detail::t_autocast = enabled;
  ++detail::t_depth;
}

AutocastGuard::~AutocastGuard() {
  detail::t_autocast = prev_;
  --detail::t_depth;
  detail::t_last = detail::LastCopy{};
}

bool is_autocast_enabled() { return detail::t_autocast; }

}  // namespace tg
