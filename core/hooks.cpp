// Gradient hooks (PyTorch's register_post_accumulate_grad_hook): a registry of (id, leaf, hook),
// shared by every thread, and the walk's schedule of when each hook fires.
#include "tape_internal.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "dispatch.h"
#include "tapegrad/hooks.h"

namespace tg {

// ---- gradient hooks ----
//
// A registry of (id, leaf, hook), shared by every thread; backward() reads it only when it is not
// empty (g_hooks_live), so a program without hooks pays one relaxed atomic load per backward.

namespace {

struct HookEntry {
  std::uint64_t id;
  detail::Ref<AutogradMeta> leaf;  // owning: the slot cannot be reused by another tensor while hooked
  std::function<void(const Tensor&)> fn;
};
struct HookRegistry {
  std::mutex m;
  std::vector<HookEntry> entries;
  std::uint64_t next_id = 1;
};
// Never destroyed: a handle may be released during static destruction.
HookRegistry& hook_registry() {
  static HookRegistry* r = new HookRegistry;
  return *r;
}
std::atomic<std::size_t> g_hooks_live{0};



}  // namespace

bool detail::hooks_registered() { return g_hooks_live.load(std::memory_order_relaxed) != 0; }

GradHookHandle register_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(const Tensor&)> hook) {
  detail::check_defined("register_post_accumulate_grad_hook", leaf, "tensor");
  if (!leaf.requires_grad() || !leaf.is_leaf())
    fail("register_post_accumulate_grad_hook", "needs a leaf tensor that requires grad (a parameter), got a ",
         leaf.is_leaf() ? "leaf that does not require grad" : "tensor made by an op", " of shape ", leaf.shape());
  if (!hook) fail("register_post_accumulate_grad_hook", "the hook is empty");
  HookRegistry& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.m);
  const std::uint64_t id = r.next_id++;
  r.entries.push_back(HookEntry{id, leaf.meta(), std::move(hook)});
  g_hooks_live.fetch_add(1, std::memory_order_relaxed);
  return GradHookHandle(id);
}

void GradHookHandle::remove() {
  if (id_ == 0) return;
  HookRegistry& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.m);
  auto it = std::find_if(r.entries.begin(), r.entries.end(), [&](const HookEntry& e) { return e.id == id_; });
  if (it != r.entries.end()) {
    r.entries.erase(it);
    g_hooks_live.fetch_sub(1, std::memory_order_relaxed);
  }
  id_ = 0;
}

GradHookHandle& GradHookHandle::operator=(GradHookHandle&& o) noexcept {
  if (this != &o) {
    remove();
    id_ = o.id_;
    o.id_ = 0;
  }
  return *this;
}


namespace detail {

using MetaRef = Ref<AutogradMeta>;

// The hooks this walk fires, in firing order. A hooked leaf's gradient is final once the walk has
// run the earliest-recorded reached node that has the leaf as an input (the walk goes down the
// tape, so that node adds into it last). Needs the reached nodes marked (mark_graph).
std::vector<DueHook> due_hooks(Tape& tp, AutogradMeta& rm, std::uint64_t mark) {
  constexpr std::int64_t kUnreached = std::numeric_limits<std::int64_t>::max();
  std::vector<HookEntry> hooked;
  {
    HookRegistry& r = hook_registry();
    std::lock_guard<std::mutex> lock(r.m);
    hooked = r.entries;
  }
  std::unordered_map<const AutogradMeta*, std::int64_t> last;  // hooked leaf -> its last adding node
  for (const auto& e : hooked) last.emplace(e.leaf.get(), kUnreached);
  if (auto it = last.find(&rm); it != last.end()) it->second = -1;  // a hooked leaf as the root itself
  for (std::int64_t i = rm.node; i >= 0; --i) {
    const Node& n = TapeAccess::node(tp, static_cast<std::size_t>(i));
    if (n.freed()) continue;
    bool reached = false;
    for (const auto& o : n.outputs()) reached = reached || o->visit == mark;
    if (!reached) continue;
    for (const auto& in : n.inputs())
      if (in && in->node < 0)
        if (auto it = last.find(in.get()); it != last.end()) it->second = i;
  }
  std::vector<DueHook> due;
  for (auto& e : hooked)
    if (const std::int64_t at = last[e.leaf.get()]; at != kUnreached) due.push_back(DueHook{at, e.leaf, std::move(e.fn)});
  // Latest node first; stable, so the hooks of one leaf keep their registration order.
  std::stable_sort(due.begin(), due.end(), [](const DueHook& a, const DueHook& b) { return a.after > b.after; });
  return due;
}

// Fires the due hooks whose leaves no node at or below index `below` adds into any more.
void fire_hooks(std::vector<DueHook>::iterator& next, std::vector<DueHook>::iterator end, std::int64_t below) {
  for (; next != end && next->after > below; ++next)
    if (next->leaf->grad.defined()) next->fn(next->leaf->grad.get());
}

}  // namespace detail
}  // namespace tg
