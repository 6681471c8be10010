#pragma once
// The autocast scope's state, internal to tapegrad_core (the public face: tapegrad/autocast.h).
#include <cstddef>
#include <memory>

#include "tapegrad/tensor.h"

namespace tg::detail {

extern thread_local constinit bool t_autocast;

// x (float32) rounded to bfloat16 (round to nearest even), a new tensor of dtype bfloat16 of x's
// shape; in parallel.
Tensor to_bf16(const Tensor& x);

// w (float32) rounded to bfloat16, a tensor of dtype bfloat16 of w's shape. A parameter (a leaf
// that requires grad) cast while recording is cached until the outermost AutocastGuard (or the
// AutocastCacheScope around it) ends, and the copy reused; without recording, a cached copy is
// used but none is made; anything else is cast afresh.
Tensor autocast_bf16(const Tensor& w);

// For its lifetime, parameters are cast into a cache of their own, dropped when it ends (the
// enclosing scope's cache comes back as it was): a checkpointed segment keeps the bf16 copies of
// its own weights only while it runs, instead of every segment's until the outermost guard ends.
class AutocastCacheScope {
 public:
  AutocastCacheScope();
  ~AutocastCacheScope();
  AutocastCacheScope(const AutocastCacheScope&) = delete;
  AutocastCacheScope& operator=(const AutocastCacheScope&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// The number of parameters cast in the current scope (for the tests).
std::size_t autocast_cache_size();

}  // namespace tg::detail
