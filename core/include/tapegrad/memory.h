#pragma once
// Tensor memory: the caching allocator's counters and its cache (PyTorch's torch.cuda memory
// functions, for this CPU allocator).
#include <cstddef>

namespace tg {

// The caching allocator keeps freed blocks for reuse (small ones by exact size, large ones in
// segments it splits and merges: core/block_arena.h), so a training step that allocates the same
// activations every iteration stops page-faulting fresh memory after the first one or two.
// cached_bytes: bytes the cache holds from the system and does not use: the small-block lists
// (shared, and this thread's) and the segments' free space, touched or not (a segment's untouched
// tail costs no resident memory). empty_cache returns the small blocks and the segments with
// nothing in use to the system; a segment holding a live tensor stays, free space and all.
std::size_t cached_bytes();
void empty_cache();

// While one is alive on this thread, tensors of more than 64 KiB are placed in segments of their
// own, apart from the ones a training step makes and frees (as torch.cuda.use_mem_pool does with a
// pool). It is for tensors made once and kept for the run, such as an optimizer's state, which is
// made at the first step(), when the backward has freed the step's activations: placed in their
// blocks, each would split the memory that the next forward reuses. The optimizers make their
// state in one. A tensor made in one may be freed at any time, on any thread, as any other. The
// scope is the calling thread's: tensors that OpenMP's worker threads make meanwhile are not in
// it. Destroy it on the thread that made it (a local variable does).
class LongLivedAllocations {
 public:
  LongLivedAllocations();
  ~LongLivedAllocations();
  LongLivedAllocations(const LongLivedAllocations&) = delete;
  LongLivedAllocations& operator=(const LongLivedAllocations&) = delete;
};

// Bytes of tensor memory in use (all threads; the few bytes kept inside a Storage excepted), and
// the most in use at once since the program started or reset_peak_memory_stats() (PyTorch's
// torch.cuda.memory_allocated, max_memory_allocated and reset_peak_memory_stats, for this CPU
// allocator). The process's resident memory also counts the cache, the code and everything else.
std::size_t memory_allocated();
std::size_t max_memory_allocated();
void reset_peak_memory_stats();

}  // namespace tg
