#pragma once
// The tape's machinery, internal to tapegrad_core: the arena that holds nodes' arrays and
// closures, and the tape operations that recording, backward and the sweep use. Public users see
// tapegrad/autograd.h and tapegrad/node.h.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "tapegrad/autograd.h"

namespace tg::detail {

// The tape's bump allocator: a node's small arrays and its backward closure are carved out of
// blocks by moving a pointer, and all given back at once when the tape is emptied (the blocks are
// kept for the next step). A training step records a few hundred nodes; with the general-purpose
// heap each would cost several malloc/free pairs, more than the op itself at small sizes.
class Arena {
 public:
  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  // bytes at the given alignment (a power of two), valid until reset().
  void* allocate(std::size_t bytes, std::size_t align) {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr_);
    const std::uintptr_t a = (p + align - 1) & ~(static_cast<std::uintptr_t>(align) - 1);
    if (ptr_ && a + bytes <= reinterpret_cast<std::uintptr_t>(end_)) {
      ptr_ = reinterpret_cast<char*>(a + bytes);
      return reinterpret_cast<void*>(a);
    }
    return allocate_slow(bytes, align);
  }
  void reset();  // forgets every allocation, keeps the blocks

 private:
  void* allocate_slow(std::size_t bytes, std::size_t align);  // moves to the next block
  std::vector<std::pair<char*, std::size_t>> blocks_;
  std::size_t block_ = 0;  // index of the block being carved
  char* ptr_ = nullptr;
  char* end_ = nullptr;
};

// The operations on a tape that recording, backward() and the sweep need (core/autograd.cpp).
struct TapeAccess {
  static Node& node(Tape& t, std::size_t i) { return t.nodes_[i]; }
  static const Node& node(const Tape& t, std::size_t i) { return t.nodes_[i]; }
  static void run(Node& n) { n.ops_->call(n.closure_, n); }
  // Whether the walk frees n once its backward returns (Node::reusable_saved).
  static void set_freed_after_run(Node& n, bool freed) { n.freed_after_run_ = freed; }
  static std::uint64_t undefined_inputs(const Node& n) { return n.undefined_inputs_; }
  static std::size_t n_saved(const Node& n) { return n.n_saved_; }
  static const Tensor* saved(const Node& n) { return n.saved_; }
  // Destroys node n's saved tensors, closure and slots (their memory goes back with the tape's
  // arena), leaves its arrays empty and marks it freed.
  static void release(Node& n);
  static void fill(Node& n, const char* op, Tensor* saved, std::size_t n_saved, std::size_t n_in, std::size_t n_out,
                   std::size_t n_other, std::uint64_t undefined, void* closure);
  static std::uint64_t generation(const Tape& t) { return t.generation_; }
  static bool same_tape(const Tape& t, std::uint64_t g) { return g >> Tape::kGenerationBits == t.generation_ >> Tape::kGenerationBits; }
  static bool cleared_by_user(const Tape& t, std::uint64_t g);
  // An input recorded under an older generation (its graph was freed and the tape emptied, or it
  // comes from another thread's tape): backward() then marks the graph first, and refuses.
  static void note_stale_input(Tape& t) { t.stale_input_ = true; }
  static bool has_stale_input(const Tape& t) { return t.stale_input_; }
  // Drops every node and starts a new generation (clear(), and a backward or sweep that left
  // nothing live).
  static void empty(Tape& t);
  // Refuses node n (at tape index `index`) when a tensor it saved was written in place since.
  static void check_saved_versions(const Node& n, std::size_t index);
  static Arena& arena(Tape& t) { return *t.arena_; }
  // A new node at the end of the tape; sweeps first when a trigger is reached.
  static Node& push(Tape& t);
  // Counts the bytes a new node saved for its backward (the sweep's byte trigger).
  static void note_saved(Tape& t, std::size_t bytes) { t.saved_live_ += bytes; }
  // Releases node i's saved tensors, closure, input references and output slots.
  static void free_node(Tape& t, std::size_t i);
  // Removes the last node, which holds nothing yet: a recording whose allocation failed.
  static void discard_last(Tape& t);
  // Frees every live node whose outputs no tensor and no later node refers to, from the newest
  // back (freeing one may make an earlier one unreachable); empties the tape when nothing is left.
  static void sweep(Tape& t);
};

// ---- gradient hooks (core/hooks.cpp) ----
// A hook due during a walk: it fires once every node with an index above `after` has run.
struct DueHook {
  std::int64_t after;  // the index of the last node that adds into the leaf (-1: the leaf is the root)
  Ref<AutogradMeta> leaf;
  std::function<void(const Tensor&)> fn;
};
bool hooks_registered();  // one relaxed atomic load: a backward without hooks pays nothing more
// The hooks a walk from root (its reached nodes marked with `mark`) fires, in firing order.
std::vector<DueHook> due_hooks(Tape& tp, AutogradMeta& root, std::uint64_t mark);
// Fires the due hooks whose leaves no node at or below index `below` adds into any more.
void fire_hooks(std::vector<DueHook>::iterator& next, std::vector<DueHook>::iterator end, std::int64_t below);

// When set, backward() on this thread fires no gradient hooks: a checkpointed segment's inner
// backward (core/checkpoint.cpp), whose parameters' hooks the outer walk fires once it has passed
// the checkpoint's node.
extern thread_local constinit bool t_hooks_off;
// This thread's anomaly switch (set_detect_anomaly).
extern thread_local constinit bool t_anomaly;
// Anomaly mode's check of the gradients node i's backward wrote.
void check_anomaly_backward(const Node& node, std::size_t index);
// node.run_backward(), timed when op timing is on (set_op_timing).
void run_backward_timed(Node& node);
// Whether retain_grad() was ever called (in any thread): backward then takes its careful first pass.
void note_retain_grad();
bool retain_grad_used();

}  // namespace tg::detail
