#pragma once
// Data-parallel training over MPI, in PyTorch's terms (torch.distributed and
// torch.nn.parallel.DistributedDataParallel); docs/distributed.md explains the design.
//
//   tg::dist::init(&argc, &argv);              // under mpirun -np N: one process per rank
//   tg::nn::GPT model(cfg);                      // the same seed on every rank
//   tg::dist::DistributedDataParallel ddp(model);  // rank 0's parameters and buffers everywhere
//   for (...) {
//     ddp.sync_buffers();                        // rank 0's buffers (BatchNorm statistics)
//     Tensor loss = model.loss(x_r, y_r);       // this rank's slice of the batch
//     opt.zero_grad();
//     loss.backward();                           // gradients averaged over the ranks on return
//     ddp.finish_gradient_sync();                // a no-op then; needed when a parameter got no gradient
//     opt.step();                                // the same update on every rank
//   }
//   tg::dist::finalize();
//
// The process group is MPI_COMM_WORLD. Until init() (or without MPI, in a single process) the
// world is one process: rank() is 0, world_size() is 1, and every collective leaves its data as
// it is, so the same program runs with or without mpirun. Collectives are called from the thread
// that called init() (MPI_THREAD_FUNNELED), in the same order on every rank, and are not recorded
// on the tape. Errors are tg::Error naming the function; an MPI failure names the MPI call.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/autograd.h"
#include "tapegrad/hooks.h"
#include "tapegrad/nn/module.h"
#include "tapegrad/tensor.h"

namespace tg::dist {

// ---- the process group ----

// True when a launcher started this process as one rank of a job: OpenMPI's mpirun
// (OMPI_COMM_WORLD_SIZE), MPICH's Hydra (PMI_SIZE) or a PMIx launcher such as srun (PMIX_RANK).
// A program can call init() only then, and so run unchanged without mpirun.
bool launched();
// Starts MPI (MPI_Init_thread, MPI_THREAD_FUNNELED). Without a launcher MPI starts a world of one
// process. Calling it again does nothing; after finalize() it throws.
void init(int* argc = nullptr, char*** argv = nullptr);
// Ends MPI, after every rank has called it (MPI_Finalize). Does nothing if init() was not called.
void finalize();
bool is_initialized();
int rank();        // this process's rank in [0, world_size())
int world_size();  // the number of processes
// Ranks of the job on this machine (MPI_COMM_TYPE_SHARED), e.g. to share its cores among them.
int local_world_size();
// Ends every process of the job with exit code `code` (MPI_Abort); for a failure on one rank
// that the others cannot know of. In a world of one, std::exit(code).
[[noreturn]] void abort(int code);

// ---- collectives (torch.distributed) ----

enum class ReduceOp { sum, mean };
// In place: t becomes the element-wise sum (or mean) of t over all ranks. float32 or float64, the
// same shape on every rank. Every rank gets the same bits (docs/distributed.md).
void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum);
// One number, as all_reduce of a float64 tensor of one element.
double all_reduce(double v, ReduceOp op = ReduceOp::sum);
// In place: rank `root`'s data replaces t's on every rank (any dtype; the same shape and dtype
// on every rank).
void broadcast(Tensor& t, int root = 0);
// Returns when every rank has called it.
void barrier();

// ---- DistributedDataParallel ----

struct DDPOptions {
  // Gradients travel in flat buckets of about this many bytes (a parameter larger than this has a
  // bucket of its own). PyTorch's default is 25 MiB, sized for GPUs; on CPUs a bucket's reduction
  // must be small enough to hide behind the rest of the backward.
  std::size_t bucket_cap_bytes = std::size_t(1) << 20;
  // Rank 0's buffers to every rank at each sync_buffers() (PyTorch's broadcast_buffers).
  bool broadcast_buffers = true;
};

// What the last synchronised backward spent on communication, on this rank.
struct CommStats {
  int buckets = 0;
  std::size_t bytes = 0;         // gradient bytes reduced
  double comm_s = 0;             // from the first bucket's start to the last one's completion
  double overlapped_s = 0;       // of comm_s, the part before the backward's last hook (hidden)
  double exposed_s = 0;          // waited for after the backward's last hook (not hidden)
};

// Keeps the replicas of a module identical across the ranks, as PyTorch's DDP:
// - at construction, rank 0's parameters and buffers are broadcast to every rank;
// - during backward, each parameter's gradient is copied into its bucket the moment the walk
//   has finished it (a post-accumulate-grad hook, tg::register_post_accumulate_grad_hook); a
//   full bucket starts its sum over the ranks (MPI_Iallreduce) while the backward goes on;
// - when the last bucket is full the gradients are averaged (sum / world_size) and written back
//   into each parameter's grad() before backward() returns.
// Buckets hold the parameters in reverse registration order (the order backward finishes them)
// and start strictly in bucket order, whatever order their gradients arrive in: every rank issues
// the same reductions in the same order, and a run's numbers do not depend on timing.
// BatchNorm's batch statistics are computed per rank, on the rank's slice of the batch (PyTorch
// DDP without SyncBatchNorm); its running statistics are rank 0's when broadcast_buffers is on.
// In a world of one process it does nothing at all.
class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(nn::Module& module, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  nn::Module& module() { return module_; }
  // Before each forward: rank 0's buffers to every rank (when broadcast_buffers is on).
  void sync_buffers();
  // Completes the averaging of the last backward: starts the buckets not started yet (a
  // parameter that received no gradient counts as zeros, PyTorch's find_unused_parameters),
  // waits for all and writes the averaged gradients. Does nothing when backward() already did.
  void finish_gradient_sync();
  // While the returned guard lives, backward accumulates gradients locally without communicating
  // (PyTorch's no_sync(), for gradient accumulation or a local re-run); the next synchronised
  // backward averages what has accumulated.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& d);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& d_;
    bool prev_;
  };
  NoSync no_sync() { return NoSync(*this); }
  // Throws tg::Error when the ranks' parameters are not bit-identical (a checksum compared over the
  // ranks); a check for tests and long runs.
  void check_replicas() const;
  const CommStats& last_stats() const { return stats_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Of the backward in progress, the buckets whose reduction has started.
  int buckets_started() const { return static_cast<int>(next_launch_); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Bucket;
  struct Slot {  // one parameter's place in its bucket
    Tensor param;
    std::size_t bucket, offset;  // offset in elements
  };
  void build_buckets(const std::vector<Tensor>& params);
  void on_grad_ready(std::size_t slot, const Tensor& grad);
  void launch_ready();
  void launch(Bucket& b);
  void progress();
  void complete();
  void start_remaining();
  void collect_stats(Clock::time_point backward_end);
  void write_averages();
  void reset_step();

  nn::Module& module_;
  DDPOptions options_;
  std::vector<Slot> slots_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<GradHookHandle> hooks_;
  std::vector<char> arrived_;     // per slot: its gradient is in its bucket for this backward
  std::size_t next_launch_ = 0;   // buckets start in order: the next one to start
  std::size_t ready_slots_ = 0;   // parameters of this backward whose gradient is in its bucket
  bool in_step_ = false;          // a backward has delivered gradients not yet averaged
  bool sync_ = true;              // off inside no_sync()
  Clock::time_point first_launch_{};
  CommStats stats_;
};

}  // namespace tg::dist
