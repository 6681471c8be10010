#pragma once
// train_lm as a data-parallel job: `mpirun -np N train_lm ...` runs N ranks that train one model
// together (docs/distributed.md). Without mpirun the job is one process and everything here
// leaves the run exactly as it is. Built over tg::dist (tapegrad/dist.h) when MPI is found, else
// over a world of one (lm/dist_single.h).
//
// What each rank does:
//   - it draws the global batch a single process would draw (--batch-size, which must divide by
//     N) and trains on its slice: rows [r B/N, (r+1) B/N); dropout draws the numbers of those
//     rows (tg::Generator::set_shard), so N ranks compute what one process computes;
//   - gradients are averaged over the ranks during backward (tg::dist::DistributedDataParallel),
//     the logged loss is the mean over the ranks, evaluation batches are split the same way;
//   - rank 0 alone prints and writes (metrics, logs, chart, samples, checkpoints); checkpoints
//     hold the same state for any N, so a run moves between sizes when resumed.
// Errors: an error every rank raises alike (a bad configuration, ranks that disagree, a
// divergence) is a JobError, reported once by rank 0; any other exception is this rank's alone
// and ends the whole job (MPI_Abort) after one line naming the rank.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

namespace lm {

struct TrainConfig;
struct RunResult;

// An error raised alike by every rank of the job (a single process: any error of that kind).
class JobError : public tg::Error {
 public:
  using tg::Error::Error;
};
template <class... Parts>
[[noreturn]] void fail_job(const char* op, const Parts&... parts) {
  std::ostringstream s;
  s << op << ": ";
  (s << ... << parts);
  throw JobError(s.str());
}

// The job: one per process, made first thing in main and destroyed last.
class Job {
 public:
  // Starts MPI when a launcher (mpirun) started this process. On ranks other than 0 it silences
  // std::cout and std::cerr: rank 0 prints for the job. Unless OMP_NUM_THREADS says otherwise,
  // each rank gets (cores of the machine) / (ranks on the machine) threads.
  Job(int* argc, char*** argv, const char* program);
  ~Job();  // ends MPI
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // The command line's outcome on every rank together: rc is parse()'s (-1 go on, 0 after
  // --help, 2 after an error whose text is `error`). Returns the job's: 2 when any rank failed,
  // after rank 0 printed one line (naming the rank when the others parsed well).
  int settle_parse(int rc, const std::string& error) const;
  // Ends the process after an error. Every rank alike (JobError): rank 0 prints one line and the
  // ranks return `code`. One rank alone: it prints one line with its rank and ends the job.
  int fail(const std::exception& e, int code) const;

 private:
  std::string program_;
  int rank_ = 0, size_ = 1;
  bool mpi_ = false;
};

// Throws JobError on every rank unless every rank passes the same text (JSON objects are compared
// key by key, and the message names the first key that differs and the rank).
void agree(const char* what, const std::string& mine);

// Runs f on rank 0 alone (what only rank 0 does: take the run directory); a tg::Error it throws
// is raised on every rank as a JobError with its text, reported once.
void on_rank0(const std::function<void()>& f);

// Throws JobError on every rank unless every rank read the same corpus bytes (hash: FNV-1a of the
// file, lm::Corpus::content_hash); the message names the first rank whose bytes differ.
void agree_on_corpus(const std::string& path, std::uint64_t hash);

// A JSON object's text with more keys, of string values (what agree() compares).
std::string with_keys(const std::string& json_object, const std::vector<std::pair<std::string, std::string>>& keys);

// This process's place in the job (0 and 1 without mpirun).
int job_rank();
int job_size();

// Gradient communication of a run, per step: medians over the steps of this process.
struct CommSummary {
  int buckets = 0;
  double bytes = 0, comm_ms = 0, overlapped_ms = 0, exposed_ms = 0;
};

// One replica of the model. Its constructor refuses (JobError) a batch the ranks cannot split
// evenly and ranks whose runs differ (configuration, resumed step, generators), then broadcasts
// rank 0's parameters and buffers.
class DataParallel {
 public:
  DataParallel(tg::nn::Module& model, const TrainConfig& cfg, std::int64_t step, const tg::Generator& batch_gen);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Rank 0 alone writes and prints: on other ranks, clears what makes a run write or print.
  static void only_rank0_writes(TrainConfig& cfg);
  // Cuts a global batch (B, T) to this rank's rows.
  void take_slice(tg::Tensor& x, tg::Tensor& y) const;
  // Before a training forward: rank 0's buffers; while the scope lives, random ops on the
  // default generator draw the numbers of this rank's rows of the global batch.
  class ForwardScope {
   public:
    explicit ForwardScope(bool shard);
    ~ForwardScope();
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    bool shard_;
  };
  ForwardScope forward_scope();
  void sync_buffers();
  // The mean of v over the ranks.
  double mean(double v) const;
  // After backward: every gradient averaged over the ranks; notes the step's communication.
  void finish_gradients();
  // The signal that stops the job after this step: 0 when no rank received SIGINT or SIGTERM
  // (mine: this rank's, lm::stop_signal()), else SIGTERM when any rank received it, else SIGINT.
  // Every rank calls it once per step, so all stop at the same step.
  int agree_stop(int mine) const;
  // While a Local lives, backward stays on this rank (a re-run to locate a NaN).
  class Local {
   public:
    explicit Local(DataParallel& d) : d_(d) { d_.set_sync(false); }
    ~Local() { d_.set_sync(true); }
    Local(const Local&) = delete;
    Local& operator=(const Local&) = delete;

   private:
    DataParallel& d_;
  };
  CommSummary comm_summary() const;

 private:
  void set_sync(bool on);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The gradient buckets' size for the DataParallel made from now on (tg::dist::DDPOptions; for
// bench_train --bucket-kb).
void set_bucket_cap_bytes(std::size_t bytes);

// The median time of a blocking all-reduce of n float32 values over the ranks, in ms (0 alone):
// what the gradient reduction costs when nothing hides it.
double time_all_reduce(std::int64_t n, int repeats);

}  // namespace lm
