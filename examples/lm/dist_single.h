#pragma once
// The part of tg::dist (tapegrad/dist.h) that lm/parallel.cpp uses, for a build without MPI: a
// world of one process, where every collective leaves its data as it is.
#include <cstddef>
#include <cstdlib>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

namespace tg::dist {

inline bool launched() { return false; }
inline void init(int* = nullptr, char*** = nullptr) {}
inline void finalize() {}
inline int rank() { return 0; }
inline int world_size() { return 1; }
inline int local_world_size() { return 1; }
[[noreturn]] inline void abort(int code) { std::exit(code); }

enum class ReduceOp { sum, mean };
inline void all_reduce(Tensor&, ReduceOp = ReduceOp::sum) {}
inline double all_reduce(double v, ReduceOp = ReduceOp::sum) { return v; }
inline void broadcast(Tensor&, int = 0) {}

struct CommStats {
  int buckets = 0;
  std::size_t bytes = 0;
  double comm_s = 0, overlapped_s = 0, exposed_s = 0;
};

struct DDPOptions {
  std::size_t bucket_cap_bytes = std::size_t(1) << 20;
  bool broadcast_buffers = true;
};

class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(nn::Module&, DDPOptions = {}) {}
  void sync_buffers() {}
  void finish_gradient_sync() {}
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel&) {}
  };
  const CommStats& last_stats() const { return stats_; }

 private:
  CommStats stats_;
};

}  // namespace tg::dist
