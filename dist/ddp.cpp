// DistributedDataParallel: replicas kept identical by averaging gradients in flat buckets whose
// reductions overlap the backward (tapegrad/dist.h, docs/distributed.md).
#include <mpi.h>

#include <algorithm>
#include <cstring>

#include "mpi_check.h"
#include "tapegrad/dist.h"
#include "tapegrad/error.h"

namespace tg::dist {

using detail::check_mpi;

// A flat buffer holding the gradients of some parameters of one dtype, back to back, reduced
// with one MPI_Iallreduce (several for more than 2^31 - 1 elements).
struct DistributedDataParallel::Bucket {
  DType dtype = float32;
  Tensor flat;                      // (numel,): the rank's gradients, then their sum over the ranks
  std::vector<std::size_t> slots;   // indices into slots_
  std::size_t pending = 0;          // slots whose gradient has not arrived in this backward
  bool started = false, done = false;
  std::vector<MPI_Request> requests;
  Clock::time_point start{}, finish{};
};

namespace {

constexpr std::int64_t kChunk = std::int64_t(1) << 30;
double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// FNV-1a over the bytes of every tensor: equal on every rank exactly when the bytes are.
std::uint64_t checksum(const std::vector<Tensor>& ts) {
  std::uint64_t h = 1469598103934665603ULL;
  for (const Tensor& t : ts) {
    const auto* p = static_cast<const unsigned char*>(t.raw_data());
    for (std::size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  }
  return h;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(nn::Module& module, DDPOptions options)
    : module_(module), options_(options) {
  if (world_size() == 1) return;  // nothing to keep in step
  if (options_.bucket_cap_bytes == 0) fail("DistributedDataParallel", "bucket_cap_bytes must be > 0");
  std::vector<Tensor> params;
  for (Tensor& p : module_.parameters()) {
    broadcast(p, 0);
    if (!p.requires_grad() || p.numel() == 0) continue;
    detail::float_type("DistributedDataParallel", p.dtype());  // refuses other dtypes, naming them
    params.push_back(p);
  }
  for (auto& [name, b] : module_.named_buffers()) broadcast(b, 0);
  build_buckets(params);
  hooks_.reserve(slots_.size());
  for (std::size_t i = 0; i < slots_.size(); ++i)
    hooks_.push_back(register_post_accumulate_grad_hook(slots_[i].param, [this, i](const Tensor& g) { on_grad_ready(i, g); }));
}

// Reductions still in flight are not waited for: after an exception in backward the other ranks
// may never join them, and the job ends anyway (docs/distributed.md, faults).
DistributedDataParallel::~DistributedDataParallel() = default;

// Parameters in reverse registration order, the order in which backward finishes them; a bucket
// closes when the next parameter would take it past the cap or has another dtype.
void DistributedDataParallel::build_buckets(const std::vector<Tensor>& params) {
  std::size_t bytes = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const Tensor& p = *it;
    const bool fits = !buckets_.empty() && buckets_.back()->dtype == p.dtype() &&
                      bytes + p.nbytes() <= options_.bucket_cap_bytes;
    if (!fits) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->dtype = p.dtype();
      bytes = 0;
    }
    Bucket& b = *buckets_.back();
    slots_.push_back(Slot{p, buckets_.size() - 1, static_cast<std::size_t>(bytes / itemsize(p.dtype()))});
    b.slots.push_back(slots_.size() - 1);
    bytes += p.nbytes();
  }
  for (auto& b : buckets_) {
    std::int64_t numel = 0;
    for (std::size_t s : b->slots) numel += slots_[s].param.numel();
    b->flat = Tensor::empty({numel}, b->dtype);
  }
  reset_step();
}

void DistributedDataParallel::reset_step() {
  for (auto& b : buckets_) {
    b->pending = b->slots.size();
    b->started = b->done = false;
    b->requests.clear();
  }
  arrived_.assign(slots_.size(), 0);
  next_launch_ = 0;
  ready_slots_ = 0;
  in_step_ = false;
}

// The hook: parameter `slot`'s gradient is final for this backward.
void DistributedDataParallel::on_grad_ready(std::size_t slot, const Tensor& grad) {
  if (!sync_) return;
  in_step_ = true;
  const Slot& s = slots_[slot];
  Bucket& b = *buckets_[s.bucket];
  if (b.started || arrived_[slot])
    fail("DistributedDataParallel", "a gradient arrived twice in one synchronised backward (two backward passes "
                                    "without finish_gradient_sync() between them; use no_sync() to accumulate)");
  if (grad.dtype() != b.dtype || grad.numel() != s.param.numel())
    fail("DistributedDataParallel", "gradient ", grad.dtype(), " ", grad.shape(), " does not match its parameter ",
         s.param.dtype(), " ", s.param.shape());
  std::memcpy(static_cast<char*>(b.flat.raw_data()) + s.offset * itemsize(b.dtype), grad.raw_data(), grad.nbytes());
  arrived_[slot] = 1;
  --b.pending;
  ++ready_slots_;
  launch_ready();
  progress();
  if (ready_slots_ == slots_.size()) complete();
}

void DistributedDataParallel::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) launch(*buckets_[next_launch_++]);
}

void DistributedDataParallel::launch(Bucket& b) {
  const MPI_Datatype type = detail::float_type("DistributedDataParallel", b.dtype);
  char* p = static_cast<char*>(b.flat.raw_data());
  for (std::int64_t at = 0; at < b.flat.numel(); at += kChunk) {
    MPI_Request r = MPI_REQUEST_NULL;
    const int count = static_cast<int>(std::min(kChunk, b.flat.numel() - at));
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, p + static_cast<std::size_t>(at) * itemsize(b.dtype), count, type, MPI_SUM,
                             MPI_COMM_WORLD, &r),
              "DistributedDataParallel", "MPI_Iallreduce");
    b.requests.push_back(r);
  }
  b.started = true;
  b.start = Clock::now();
  if (&b == buckets_.front().get()) first_launch_ = b.start;
}

// MPI moves a non-blocking reduction forward only inside MPI calls: every hook tests the ones in
// flight, so they advance while the backward computes.
void DistributedDataParallel::progress() {
  for (std::size_t k = 0; k < next_launch_; ++k) {
    Bucket& b = *buckets_[k];
    if (b.done) continue;
    int flag = 0;
    check_mpi(MPI_Testall(static_cast<int>(b.requests.size()), b.requests.data(), &flag, MPI_STATUSES_IGNORE),
              "DistributedDataParallel", "MPI_Testall");
    if (!flag) continue;
    b.done = true;
    b.finish = Clock::now();
  }
}

// Starts what is left, waits for every bucket in order, writes the averages, and is ready for the
// next backward.
void DistributedDataParallel::complete() {
  const Clock::time_point backward_end = Clock::now();
  start_remaining();
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    if (b.done) continue;
    check_mpi(MPI_Waitall(static_cast<int>(b.requests.size()), b.requests.data(), MPI_STATUSES_IGNORE),
              "DistributedDataParallel", "MPI_Waitall");
    b.done = true;
    b.finish = Clock::now();
  }
  collect_stats(backward_end);
  write_averages();
  reset_step();
}

// A parameter whose gradient did not arrive (it took no part in this rank's loss) counts as zeros.
void DistributedDataParallel::start_remaining() {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (arrived_[i]) continue;
    const Slot& s = slots_[i];
    Bucket& b = *buckets_[s.bucket];
    std::memset(static_cast<char*>(b.flat.raw_data()) + s.offset * itemsize(b.dtype), 0, s.param.nbytes());
    arrived_[i] = 1;
    --b.pending;
  }
  launch_ready();
}

// The union of the buckets' flight intervals (they start in order), split at the end of the
// backward into the part hidden behind it and the part waited for.
void DistributedDataParallel::collect_stats(Clock::time_point backward_end) {
  stats_ = CommStats{static_cast<int>(buckets_.size()), 0, 0, 0, 0};
  Clock::time_point covered = first_launch_;
  for (const auto& bp : buckets_) {
    const Bucket& b = *bp;
    stats_.bytes += b.flat.nbytes();
    const Clock::time_point from = std::max(b.start, covered);
    if (b.finish <= from) continue;
    const Clock::time_point split = std::clamp(backward_end, from, b.finish);
    stats_.overlapped_s += seconds(split - from);
    stats_.exposed_s += seconds(b.finish - split);
    covered = b.finish;
  }
  stats_.comm_s = stats_.overlapped_s + stats_.exposed_s;
}

// grad = (sum over the ranks) / world_size, into each parameter's gradient (made if it had none).
void DistributedDataParallel::write_averages() {
  const int n = world_size();
  for (const Slot& s : slots_) {
    Tensor& g = s.param.meta()->grad_accumulator();
    const Bucket& b = *buckets_[s.bucket];
    if (b.dtype == float32) {
      const float* src = b.flat.data<float>() + s.offset;
      float* dst = g.data<float>();
      for (std::int64_t i = 0; i < g.numel(); ++i) dst[i] = src[i] / static_cast<float>(n);
    } else {
      const double* src = b.flat.data<double>() + s.offset;
      double* dst = g.data<double>();
      for (std::int64_t i = 0; i < g.numel(); ++i) dst[i] = src[i] / n;
    }
  }
}

void DistributedDataParallel::finish_gradient_sync() {
  if (in_step_) complete();
}

void DistributedDataParallel::sync_buffers() {
  if (world_size() == 1 || !options_.broadcast_buffers) return;
  for (auto& [name, b] : module_.named_buffers()) broadcast(b, 0);
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& d) : d_(d), prev_(d.sync_) { d_.sync_ = false; }
DistributedDataParallel::NoSync::~NoSync() { d_.sync_ = prev_; }

void DistributedDataParallel::check_replicas() const {
  if (world_size() == 1) return;
  std::vector<Tensor> state = module_.parameters();
  for (auto& [name, b] : module_.named_buffers()) state.push_back(b);
  const std::uint64_t mine = checksum(state);
  std::uint64_t lo = mine, hi = mine;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD), "check_replicas", "MPI_Allreduce");
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD), "check_replicas", "MPI_Allreduce");
  if (lo != hi)
    fail("DistributedDataParallel", "the replicas differ: rank ", rank(), "'s parameters and buffers have checksum ",
         mine, ", the ranks range over [", lo, ", ", hi, "]");
}

}  // namespace tg::dist
