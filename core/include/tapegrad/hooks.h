#pragma once
// Gradient hooks: a function that runs as soon as a parameter's gradient is final during a
// backward (data parallelism starts reducing from here: tg::dist).
#include <cstdint>
#include <functional>

#include "tapegrad/tensor.h"

namespace tg {

// ---- gradient hooks (PyTorch's Tensor.register_post_accumulate_grad_hook) ----
// hook(grad) runs during a backward() that reaches `leaf`, as soon as leaf's gradient is final for
// that backward: right after the last node of the walk that adds into it (the earliest-recorded of
// its consumers), before the walk goes on, with leaf.grad() as argument. It runs on the thread
// of the backward, with recording off; an exception from it stops the backward. A backward
// that does not reach the leaf does not call it. Data parallelism (tg::dist) starts reducing a
// bucket of gradients from here while the rest of the backward runs.
// The hook stays until its handle is destroyed or remove()d; register only on a leaf that
// requires grad (a parameter). A backward with no hook registered anywhere costs nothing extra.
class GradHookHandle {
 public:
  GradHookHandle() = default;
  ~GradHookHandle() { remove(); }
  GradHookHandle(GradHookHandle&& o) noexcept : id_(o.id_) { o.id_ = 0; }
  GradHookHandle& operator=(GradHookHandle&& o) noexcept;
  GradHookHandle(const GradHookHandle&) = delete;
  GradHookHandle& operator=(const GradHookHandle&) = delete;
  void remove();  // idempotent
  bool active() const { return id_ != 0; }

 private:
  friend GradHookHandle register_post_accumulate_grad_hook(const Tensor&, std::function<void(const Tensor&)>);
  explicit GradHookHandle(std::uint64_t id) : id_(id) {}
  std::uint64_t id_ = 0;
};
[[nodiscard]] GradHookHandle register_post_accumulate_grad_hook(const Tensor& leaf,
                                                                std::function<void(const Tensor& grad)> hook);

}  // namespace tg
