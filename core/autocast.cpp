// The autocast scope: its switch, the cache of parameters cast to bfloat16, and the products'
// operands (ops/product.h), the one place where an op's products learn their precision.
#include "tapegrad/autocast.h"

#include <unordered_map>

#include "autocast_cache.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "ops/product.h"
#include "tapegrad/node.h"

namespace tg {

namespace detail {

thread_local constinit bool t_autocast = false;

namespace {
// The parameters cast in the current outermost scope, by the address of their data. The cache
// holds a reference to each parameter's storage, so the address cannot be reused for another
// tensor while its entry lives.
struct CastCache {
  struct Entry {
    Tensor source, cast;
  };
  std::unordered_map<const void*, Entry> entries;
  int depth = 0;
};
thread_local CastCache t_cache;

// The last activation rounded by activation_bf16 and its copy: two ops that keep the same tensor's
// copy share it (causal_attention's output and the output projection's input). The entry holds
// the source, so its memory cannot be reused by another tensor while the entry lives; a write in
// place since shows in the version. It lasts until the next copy or the end of the outermost
// scope.
struct LastCopy {
  Tensor source, copy;
  std::uint32_t version = 0;
};
thread_local LastCopy t_last;

}  // namespace

Tensor to_bf16(const Tensor& x) {
  Tensor h = Tensor::empty(x.shape(), bfloat16);
  const float* src = x.data<float>();
  auto* dst = static_cast<kernels::bf16*>(h.raw_data());
  kernels::parallel_for(x.numel(), x.numel(),
                        [&](std::int64_t lo, std::int64_t hi) { kernels::to_bf16(src + lo, dst + lo, hi - lo); });
  return h;
}

Tensor autocast_bf16(const Tensor& w) {
  // Only a recorded product keeps its copy (its node saves it for the backward anyway); without
  // recording (evaluation, a checkpointed segment's forward) each product casts and frees its own,
  // so a forward holds one layer's bf16 weights at a time rather than the model's.
  // A copy already cached is used either way.
  const bool parameter = t_cache.depth > 0 && w.requires_grad() && w.meta()->node < 0;
  if (!parameter) return to_bf16(w);
  auto it = t_cache.entries.find(w.raw_data());
  if (it != t_cache.entries.end() && it->second.source.shape() == w.shape()) return it->second.cast;
  Tensor h = to_bf16(w);
  if (t_grad_enabled) t_cache.entries[w.raw_data()] = CastCache::Entry{w.detach(), h};
  return h;
}

std::size_t autocast_cache_size() { return t_cache.entries.size(); }

// ---- the products' operands (ops/product.h) ----

bool products_in_bf16(DType d) { return t_autocast && d == float32; }
Tensor weight_bf16(const Tensor& w) { return autocast_bf16(w); }
Tensor activation_bf16(const Tensor& x) {
  const LastCopy& l = t_last;
  if (l.copy.defined() && l.source.shares_storage(x) && l.source.raw_data() == x.raw_data() &&
      l.source.shape() == x.shape() && l.version == x.version())
    return l.copy;
  Tensor h = to_bf16(x);
  if (t_cache.depth > 0) t_last = LastCopy{x.detach(), h, x.version()};
  return h;
}

struct AutocastCacheScope::Saved {
  std::unordered_map<const void*, CastCache::Entry> entries;
  int depth;
};

AutocastCacheScope::AutocastCacheScope() : saved_(new Saved{std::move(t_cache.entries), t_cache.depth}) {
  t_cache.entries.clear();
  t_last = LastCopy{};
  t_cache.depth = 1;  // caching, whether or not a guard is open around the scope
}

AutocastCacheScope::~AutocastCacheScope() {
  t_cache.entries = std::move(saved_->entries);
  t_cache.depth = saved_->depth;
  t_last = LastCopy{};
}

}  // namespace detail

AutocastGuard::AutocastGuard(bool enabled) : prev_(detail::t_autocast) {
  detail::t_autocast = enabled;
  ++detail::t_cache.depth;
}

AutocastGuard::~AutocastGuard() {
  detail::t_autocast = prev_;
  if (--detail::t_cache.depth == 0) {
    detail::t_cache.entries.clear();
    detail::t_last = detail::LastCopy{};
  }
}

bool is_autocast_enabled() { return detail::t_autocast; }

}  // namespace tg
