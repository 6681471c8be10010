#include "lm/parallel.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <csignal>
#include <optional>
#include <thread>

#include "lm/checkpoint.h"
#include "lm/trainer.h"

#if TAPEGRAD_WITH_DIST
#include <tapegrad/dist.h>
#else
#include "lm/dist_single.h"
#endif

namespace lm {

namespace dist = tg::dist;
using json = nlohmann::json;

namespace {

// One line on stderr, from any rank (ranks other than 0 have std::cerr silenced).
void say(const std::string& program, const std::string& line) {
  std::fprintf(stderr, "%s: error: %s\n", program.c_str(), line.c_str());
  std::fflush(stderr);
}

// Rank root's text, on every rank.
std::string broadcast_text(const std::string& mine, int root) {
  tg::Tensor n = tg::tensor({static_cast<double>(mine.size())}, {1}, tg::float64);
  dist::broadcast(n, root);
  const auto size = static_cast<std::size_t>(n.item());
  tg::Tensor bytes = tg::Tensor::empty({static_cast<std::int64_t>(size / 4 + 1)}, tg::int32);
  if (dist::rank() == root) std::memcpy(bytes.raw_data(), mine.data(), size);
  dist::broadcast(bytes, root);
  return std::string(static_cast<const char*>(bytes.raw_data()), size);
}

// The ranks for which `flag` holds, in order, known to every rank.
std::vector<int> ranks_where(bool flag) {
  const int n = dist::world_size();
  tg::Tensor f = tg::zeros({n}, tg::float64);
  f.data<double>()[dist::rank()] = flag ? 1 : 0;
  dist::all_reduce(f);
  std::vector<int> out;
  for (int r = 0; r < n; ++r)
    if (f.data<double>()[r] != 0) out.push_back(r);
  return out;
}

// How rank r's text differs from rank 0's: the first three keys whose values differ when both are
// JSON objects, else the two texts.
std::string difference(const std::string& first, const std::string& theirs, int r) {
  const json a = json::parse(first, nullptr, false), b = json::parse(theirs, nullptr, false);
  std::vector<std::string> diffs;
  if (a.is_object() && b.is_object()) {
    for (const auto& [key, va] : a.items()) {
      const std::string vb = b.contains(key) ? b.at(key).dump() : "nothing";
      if (vb != va.dump()) diffs.push_back(key + " " + vb + " (rank 0: " + va.dump() + ")");
    }
    for (const auto& [key, vb] : b.items())
      if (!a.contains(key)) diffs.push_back(key + " " + vb.dump() + " (rank 0: nothing)");
  }
  if (diffs.empty()) diffs.push_back("'" + theirs + "' (rank 0: '" + first + "')");
  std::string out = "rank " + std::to_string(r) + " has ";
  for (std::size_t i = 0; i < std::min<std::size_t>(3, diffs.size()); ++i) out += (i ? ", " : "") + diffs[i];
  return out;
}

// What must be equal on every rank for their replicas to train together: the configuration, the
// step they start at and both generators (a resumed run: the same checkpoint).
std::string run_text(const TrainConfig& cfg, std::int64_t step, const tg::Generator& batch_gen) {
  json j = json::parse(config_json(cfg));
  j["start_step"] = step;
  j["batch_rng"] = {batch_gen.seed(), batch_gen.offset()};
  j["rng"] = {tg::default_generator().seed(), tg::default_generator().offset()};
  return j.dump();
}

}  // namespace

// ---- the job ----

int job_rank() { return dist::rank(); }
int job_size() { return dist::world_size(); }

Job::Job(int* argc, char*** argv, const char* program) : program_(program) {
  if (!dist::launched()) return;  // no mpirun: one process, as always
  try {
    dist::init(argc, argv);
    mpi_ = true;
    rank_ = dist::rank();
    size_ = dist::world_size();
    if (!std::getenv("OMP_NUM_THREADS")) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      tg::set_num_threads(std::max(1, cores / dist::local_world_size()));
    }
  } catch (const std::exception& e) {
    say(program_, e.what());
    std::exit(1);
  }
  if (rank_ != 0) {  // rank 0 prints for the job
    std::cout.rdbuf(nullptr);
    std::cerr.rdbuf(nullptr);
  }
}

Job::~Job() {
  if (!mpi_) return;
  try {
    dist::finalize();
  } catch (const std::exception& e) {
    say(program_, e.what());
  }
}

int Job::settle_parse(int rc, const std::string& error) const {
  if (size_ == 1) {
    if (rc == 2) say(program_, error);
    return rc;
  }
  const std::vector<int> failed = ranks_where(rc == 2);
  if (failed.empty()) return rc;
  const std::string text = broadcast_text(error, failed[0]);
  if (rank_ == 0)
    say(program_, static_cast<int>(failed.size()) == size_ ? text : "rank " + std::to_string(failed[0]) + ": " + text);
  return 2;
}

int Job::fail(const std::exception& e, int code) const {
  if (size_ == 1) {
    say(program_, e.what());
    return code;
  }
  if (dynamic_cast<const JobError*>(&e)) {  // raised alike by every rank: reported once
    if (rank_ == 0) say(program_, e.what());
    return code;
  }
  say(program_, "rank " + std::to_string(rank_) + ": " + e.what());
  dist::abort(code);  // the other ranks may be waiting for this one: end them all
}

void agree(const char* what, const std::string& mine) {
  if (dist::world_size() == 1) return;
  const std::string first = broadcast_text(mine, 0);
  const std::vector<int> odd = ranks_where(mine != first);
  if (odd.empty()) return;
  const std::string theirs = broadcast_text(mine, odd[0]);
  fail_job(what, difference(first, theirs, odd[0]), "; every rank of the job must run the same command");
}

void on_rank0(const std::function<void()>& f) {
  std::string error;
  if (dist::rank() == 0) {
    try {
      f();
    } catch (const tg::Error& e) {
      if (dist::world_size() == 1) throw;
      error = e.what();
    }
  }
  if (dist::world_size() == 1) return;
  const std::string text = broadcast_text(error, 0);
  if (!text.empty()) throw JobError(text);
}

void agree_on_corpus(const std::string& path, std::uint64_t hash) {
  if (dist::world_size() == 1) return;
  char mine[24];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(hash));
  const std::string first = broadcast_text(mine, 0);
  const std::vector<int> odd = ranks_where(mine != first);
  if (odd.empty()) return;
  const std::string theirs = broadcast_text(mine, odd[0]);
  fail_job("data", "rank ", odd[0], " read other bytes from '", path, "' than rank 0 (FNV-1a ", theirs, ", rank 0: ",
           first, "); every rank must train on the same corpus");
}

std::string with_keys(const std::string& json_object, const std::vector<std::pair<std::string, std::string>>& keys) {
  json j = json::parse(json_object);
  for (const auto& [k, v] : keys) j[k] = v;
  return j.dump();
}

// ---- one replica ----

namespace {
std::size_t g_bucket_cap = dist::DDPOptions{}.bucket_cap_bytes;
}  // namespace

void set_bucket_cap_bytes(std::size_t bytes) { g_bucket_cap = bytes; }

struct DataParallel::Impl {
  explicit Impl(tg::nn::Module& model) : ddp(model, dist::DDPOptions{g_bucket_cap, true}) {}
  dist::DistributedDataParallel ddp;
  int rank = dist::rank(), size = dist::world_size();
  std::optional<dist::DistributedDataParallel::NoSync> local;
  std::vector<dist::CommStats> steps;
};

DataParallel::DataParallel(tg::nn::Module& model, const TrainConfig& cfg, std::int64_t step,
                           const tg::Generator& batch_gen) {
  agree("run", run_text(cfg, step, batch_gen));
  const int n = dist::world_size();
  if (cfg.batch_size % n != 0)
    fail_job("train", "--batch-size ", cfg.batch_size, " does not divide by the ", n,
             " ranks of the job: each rank trains on an equal slice of the batch; give a multiple of ", n);
  impl_ = std::make_unique<Impl>(model);
}

DataParallel::~DataParallel() = default;

void DataParallel::only_rank0_writes(TrainConfig& cfg) {
  if (dist::rank() == 0) return;
  cfg.out.clear();
  cfg.progress = false;
  cfg.sample = 0;
}

void DataParallel::take_slice(tg::Tensor& x, tg::Tensor& y) const {
  if (impl_->size == 1) return;
  const std::int64_t b = x.size(0) / impl_->size, lo = impl_->rank * b;
  x = x.slice(0, lo, lo + b);
  y = y.slice(0, lo, lo + b);
}

DataParallel::ForwardScope::ForwardScope(bool shard) : shard_(shard) {
  if (shard_) tg::default_generator().set_shard(static_cast<std::uint64_t>(dist::rank()), static_cast<std::uint64_t>(dist::world_size()));
}
DataParallel::ForwardScope::~ForwardScope() {
  if (shard_) tg::default_generator().set_shard(0, 1);
}

DataParallel::ForwardScope DataParallel::forward_scope() {
  sync_buffers();
  return ForwardScope(impl_->size > 1);
}

void DataParallel::sync_buffers() { impl_->ddp.sync_buffers(); }

double DataParallel::mean(double v) const { return dist::all_reduce(v, dist::ReduceOp::mean); }

void DataParallel::finish_gradients() {
  impl_->ddp.finish_gradient_sync();
  if (impl_->size > 1) impl_->steps.push_back(impl_->ddp.last_stats());
}

int DataParallel::agree_stop(int mine) const {
  if (impl_->size == 1) return mine;
  tg::Tensor f = tg::zeros({2}, tg::float64);
  f.data<double>()[0] = mine == SIGINT ? 1 : 0;
  f.data<double>()[1] = mine == SIGTERM ? 1 : 0;
  dist::all_reduce(f);
  return f.data<double>()[1] > 0 ? SIGTERM : f.data<double>()[0] > 0 ? SIGINT : 0;
}

void DataParallel::set_sync(bool on) {
  if (on) impl_->local.reset();
  else impl_->local.emplace(impl_->ddp);
}

CommSummary DataParallel::comm_summary() const {
  CommSummary s;
  if (impl_->steps.empty()) return s;
  std::vector<double> comm, over, exposed;
  for (const auto& st : impl_->steps) {
    comm.push_back(st.comm_s * 1e3);
    over.push_back(st.overlapped_s * 1e3);
    exposed.push_back(st.exposed_s * 1e3);
  }
  s.buckets = impl_->steps.back().buckets;
  s.bytes = static_cast<double>(impl_->steps.back().bytes);
  s.comm_ms = median(comm);
  s.overlapped_ms = median(over);
  s.exposed_ms = median(exposed);
  return s;
}

double time_all_reduce(std::int64_t n, int repeats) {
  if (dist::world_size() == 1) return 0;
  tg::Tensor t = tg::zeros({n});
  dist::all_reduce(t);  // warm-up: connections and buffers
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    dist::all_reduce(t);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return dist::all_reduce(median(ms), dist::ReduceOp::mean);
}

}  // namespace lm
