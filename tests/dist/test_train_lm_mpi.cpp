// train_lm under mpirun, as a user runs it (the real binaries, ranks on this machine):
//  - equality: 2 ranks train what 1 process trains (losses step by step and final weights within
//    1e-5; the checkpoints' generator states equal), for rmsnorm and layernorm;
//  - resume across sizes: a checkpoint written by 2 ranks continues in 1 process, and the other
//    way, to the uninterrupted run's losses and weights;
//  - faults: a rank killed with SIGKILL ends the job within 30 s and its last checkpoint resumes
//    in one process; an exception on one rank ends the job with one line naming the rank; ranks
//    given different options, or a batch size that does not divide by the ranks, are refused
//    with one line before training; ranks that read different corpus bytes at the same path are
//    refused with one line naming the rank;
//  - signals: SIGTERM to one rank stops every rank at the same step, after a checkpoint there.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "helpers.h"
#include "lm_helpers.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace tg;
using Clock = std::chrono::steady_clock;

namespace {

#if !defined(TAPEGRAD_TRAIN_LM) || !defined(TAPEGRAD_MPIEXEC)
#error "TAPEGRAD_TRAIN_LM and TAPEGRAD_MPIEXEC must name train_lm and mpirun"
#endif
const std::string kTrainLm = TAPEGRAD_TRAIN_LM;
const std::string kMpirun = TAPEGRAD_MPIEXEC;

fs::path scratch(const std::string& name) { return lmtest::scratch("tapegrad_dist", name); }
using lmtest::read_file;

// The children's environment: OpenMPI started as root needs the two ALLOW variables; OpenMP's
// idle threads sleep (ranks share the cores with the test's other processes).
std::vector<char*> child_environment() {
  static std::vector<std::string> owned = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                           "OMP_WAIT_POLICY=passive"};
  std::vector<char*> env;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "OMPI_ALLOW_RUN_AS_ROOT", 22) != 0 && std::strncmp(*e, "OMP_WAIT_POLICY=", 16) != 0)
      env.push_back(*e);
  for (auto& s : owned) env.push_back(s.data());
  env.push_back(nullptr);
  return env;
}

// Starts args[0] in a process group of its own, stdout and stderr to log.
pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> env = child_environment();
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, &attr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) FAIL("cannot start " << args[0] << ": " << std::strerror(rc));
  return pid;
}

// The processes whose parent is `parent` (mpirun starts each rank as its child, in a process
// group of the rank's own), by the rank OpenMPI gave them (OMPI_COMM_WORLD_RANK).
std::map<int, pid_t> ranks_of(pid_t parent) {
  std::map<int, pid_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file(e.path() / "stat");  // pid (comm) state ppid ...
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    const std::string env = read_file(e.path() / "environ");
    const auto at = env.find("OMPI_COMM_WORLD_RANK=");
    if (at != std::string::npos) out[std::stoi(env.substr(at + 21))] = std::stoi(name);
  }
  return out;
}

// Running: not gone and not a zombie (a rank whose parent exited first waits to be reaped).
bool alive(pid_t pid) {
  const std::string stat = read_file(fs::path("/proc") / std::to_string(pid) / "stat");
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

// Whether pid is gone (or a zombie) within `limit` seconds. When mpirun returns, a rank it has
// just sent SIGKILL may still be tearing down its memory for a moment, not yet a zombie; a rank
// that outlives mpirun stays alive past the limit.
bool gone_within(pid_t pid, double limit) {
  const auto t0 = Clock::now();
  while (alive(pid)) {
    if (std::chrono::duration<double>(Clock::now() - t0).count() > limit) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// Waits up to `limit` seconds; then kills mpirun, its ranks and the process group, and fails.
// Returns the exit code (128 + signal when killed).
int wait_for(pid_t pid, double limit, const fs::path& log) {
  const auto t0 = Clock::now();
  for (;;) {
    int st = 0;
    const pid_t got = ::waitpid(pid, &st, WNOHANG);
    if (got == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (std::chrono::duration<double>(Clock::now() - t0).count() > limit) {
      for (const auto& [rank, p] : ranks_of(pid)) ::kill(p, SIGKILL);
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      FAIL("still running after " << limit << " s (killed); output:\n" << read_file(log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int run(const std::vector<std::string>& args, const fs::path& log, double limit = 240) {
  return wait_for(spawn(args, log), limit, log);
}

std::vector<std::string> mpirun(int n, const std::vector<std::string>& args) {
  std::vector<std::string> v{kMpirun, "--oversubscribe", "--bind-to", "none", "-np", std::to_string(n), kTrainLm};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}
std::vector<std::string> alone(const std::vector<std::string>& args) {
  std::vector<std::string> v{kTrainLm};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}
std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Two blocks of width 32, context 32, a global batch of 8, dropout 0.1 (each rank draws the masks
// of its own rows), one thread per process, the cosine's horizon fixed (resumed runs share it).
std::vector<std::string> tiny(const std::string& corpus) {
  return {"--data", corpus, "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size",
          "8", "--threads", "1", "--dropout", "0.1", "--warmup", "10", "--lr-decay-iters", "50", "--eval-iters", "2",
          "--quiet"};
}

std::vector<double> losses(const fs::path& dir) {
  std::istringstream in(read_file(dir / "train_log.csv"));
  std::string line;
  std::getline(in, line);  // header
  std::vector<double> v;
  while (std::getline(in, line)) v.push_back(std::stod(line.substr(line.find(',') + 1)));
  return v;
}

// The largest difference between two runs' step losses (their counts must agree).
double loss_gap(const fs::path& a, const fs::path& b) {
  const std::vector<double> la = losses(a), lb = losses(b);
  REQUIRE(la.size() == lb.size());
  REQUIRE_FALSE(la.empty());
  double m = 0;
  for (std::size_t i = 0; i < la.size(); ++i) m = std::max(m, std::fabs(la[i] - lb[i]));
  return m;
}

double weight_gap(const fs::path& a, const fs::path& b) {
  const StateDict wa = load_safetensors((a / "model.safetensors").string());
  const StateDict wb = load_safetensors((b / "model.safetensors").string());
  REQUIRE(wa.size() == wb.size());
  double m = 0;
  for (const auto& [k, t] : wa) {
    REQUIRE(wb.contains(k));
    m = std::max(m, tgtest::max_abs_diff(t, wb.at(k)));
  }
  return m;
}

Metadata checkpoint_meta(const fs::path& dir) {
  Metadata meta;
  load_safetensors((dir / "checkpoint.safetensors").string(), &meta);
  return meta;
}

// The lines of a log that start with `prefix`.
std::vector<std::string> lines_starting(const fs::path& log, const std::string& prefix) {
  std::istringstream in(read_file(log));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

}  // namespace

TEST_CASE("mpirun -np 2 train_lm trains what one process trains, step by step") {
  const fs::path d = scratch("equal");
  const std::string corpus = lmtest::make_corpus(d);
  for (const std::string norm : {"rmsnorm", "layernorm"}) {
    INFO(norm);
    const auto args = tiny(corpus) + std::vector<std::string>{"--norm", norm, "--steps", "50", "--eval-interval", "25"};
    const fs::path one = d / (norm + "_1"), two = d / (norm + "_2");
    REQUIRE(run(alone(args + std::vector<std::string>{"--out", one.string()}), d / "one.log") == 0);
    REQUIRE(run(mpirun(2, args + std::vector<std::string>{"--out", two.string()}), d / (norm + "_two.log")) == 0);
    CHECK(loss_gap(one, two) < 1e-5);
    CHECK(weight_gap(one, two) < 1e-5);
    // The same checkpoint state: step, both generators (dropout drew the same numbers).
    const Metadata m1 = checkpoint_meta(one), m2 = checkpoint_meta(two);
    for (const char* key : {"step", "batch_rng_offset", "rng_offset", "rng_seed"}) CHECK(m1.at(key) == m2.at(key));
    // Rank 0 alone printed: one corpus line, which counts the ranks.
    const auto corpus_lines = lines_starting(d / (norm + "_two.log"), "corpus ");
    REQUIRE(corpus_lines.size() == 1);
    CHECK(corpus_lines[0].find("1 threads per rank, 2 ranks") != std::string::npos);
  }
  CHECK(read_file(d / "one.log").find("rank") == std::string::npos);  // without mpirun: one process, as before
  fs::remove_all(d);
}

TEST_CASE("a checkpoint moves between 2 ranks and 1 process and continues to the same losses") {
  const fs::path d = scratch("resize");
  const std::string corpus = lmtest::make_corpus(d);
  const auto args = tiny(corpus) + std::vector<std::string>{"--eval-interval", "25"};
  const fs::path whole = d / "whole", a = d / "two_then_one", b = d / "one_then_two";
  REQUIRE(run(alone(args + std::vector<std::string>{"--steps", "50", "--out", whole.string()}), d / "log") == 0);
  REQUIRE(run(mpirun(2, args + std::vector<std::string>{"--steps", "25", "--out", a.string()}), d / "log") == 0);
  REQUIRE(run(alone({"--resume", a.string(), "--steps", "50", "--threads", "1", "--quiet"}), d / "log") == 0);
  REQUIRE(run(alone(args + std::vector<std::string>{"--steps", "25", "--out", b.string()}), d / "log") == 0);
  REQUIRE(run(mpirun(2, {"--resume", b.string(), "--steps", "50", "--threads", "1", "--quiet"}), d / "log") == 0);
  for (const fs::path& r : {a, b}) {
    INFO(r.filename().string() << "\n" << read_file(d / "log"));
    CHECK(losses(r).size() == 50);
    CHECK(loss_gap(r, whole) < 1e-5);
    CHECK(weight_gap(r, whole) < 1e-5);
  }
  fs::remove_all(d);
}

TEST_CASE("a rank killed with SIGKILL ends the job within 30 s, and the last checkpoint resumes in one process") {
  const fs::path d = scratch("kill");
  const std::string corpus = lmtest::make_corpus(d);
  const auto args = tiny(corpus) + std::vector<std::string>{"--steps", "1000000", "--lr-decay-iters", "2000",
                                                            "--eval-interval", "20", "--eval-iters", "1"};
  for (int victim : {1, 0}) {
    INFO("killing rank " << victim);
    const fs::path out = d / ("run" + std::to_string(victim)), log = d / ("run" + std::to_string(victim) + ".log");
    const pid_t job = spawn(mpirun(2, args + std::vector<std::string>{"--out", out.string()}), log);
    const auto t0 = Clock::now();
    while (!fs::exists(out / "checkpoint.safetensors") && std::chrono::duration<double>(Clock::now() - t0).count() < 120)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // mid-run, past the first checkpoint
    const std::map<int, pid_t> ranks = ranks_of(job);
    REQUIRE(ranks.size() == 2);
    REQUIRE(::kill(ranks.at(victim), SIGKILL) == 0);
    const auto killed = Clock::now();
    const int rc = wait_for(job, 60, log);
    const double took = std::chrono::duration<double>(Clock::now() - killed).count();
    INFO(read_file(log));
    CHECK(rc != 0);
    CHECK(took < 30);
    for (const auto& [rank, pid] : ranks) CHECK(gone_within(pid, 5));  // nothing left behind
    // mpirun names the rank that died, in one line; the ranks add nothing.
    CHECK(read_file(log).find("exited on signal 9") != std::string::npos);
    CHECK(lines_starting(log, "train_lm: error").size() <= 1);  // a rank that sees the loss first may say so
    // The last checkpoint continues in one process, 20 steps, to the losses of a run that was
    // never stopped.
    const std::int64_t at = std::stoll(checkpoint_meta(out).at("step"));
    const std::string until = std::to_string(at + 20);
    REQUIRE(run(alone({"--resume", out.string(), "--steps", until, "--threads", "1", "--quiet"}), log) == 0);
    const fs::path ref = d / ("ref" + std::to_string(victim));
    REQUIRE(run(alone(args + std::vector<std::string>{"--steps", until, "--out", ref.string()}), log) == 0);
    CHECK(losses(out).size() == static_cast<std::size_t>(at + 20));
    CHECK(loss_gap(out, ref) < 1e-5);
  }
  fs::remove_all(d);
}

TEST_CASE("an exception on one rank ends the job within 30 s with one line naming the rank") {
  const fs::path d = scratch("throw");
  const std::string corpus = lmtest::make_corpus(d);
  // Rank 0 alone writes checkpoints: a directory (not empty) where its checkpoint goes makes the
  // first save's rename throw on rank 0 only, while rank 1 goes on to the next step's reduction.
  const fs::path out = d / "run", log = d / "run.log";
  fs::create_directories(out / "checkpoint.safetensors" / "in_the_way");
  const auto t0 = Clock::now();
  const int rc = run(mpirun(2, tiny(corpus) + std::vector<std::string>{"--steps", "1000000", "--eval-interval", "10",
                                                                      "--out", out.string()}),
                     log, 60);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  INFO(read_file(log));
  CHECK(rc != 0);
  CHECK(took < 30);
  const auto errors = lines_starting(log, "train_lm: error");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].rfind("train_lm: error: rank 0: ", 0) == 0);
  CHECK(errors[0].find("to '" + (out / "checkpoint.safetensors").string() + "' failed") != std::string::npos);
  fs::remove_all(d);
}

TEST_CASE("ranks given different options, or a batch that does not split, are refused before training") {
  const fs::path d = scratch("refuse");
  const std::string corpus = lmtest::make_corpus(d);
  struct Case {
    std::vector<std::string> cmd;
    std::string says;
  };
  const auto base = tiny(corpus) + std::vector<std::string>{"--steps", "20", "--out", (d / "out").string()};
  const std::vector<std::string> rank0 = {kMpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", kTrainLm};
  const std::vector<Case> cases = {
      // mpirun's MPMD form: rank 0 and rank 1 get different command lines.
      {rank0 + base + std::vector<std::string>{"--lr", "0.001", ":", "-np", "1", kTrainLm} + base +
           std::vector<std::string>{"--lr", "0.002"},
       "train_lm: error: options: rank 1 has lr 0.002 (rank 0: 0.001)"},
      {rank0 + base + std::vector<std::string>{":", "-np", "1", kTrainLm} + base + std::vector<std::string>{"--norm", "foo"},
       "train_lm: error: rank 1: --norm"},
      {mpirun(3, base), "train_lm: error: train: --batch-size 8 does not divide by the 3 ranks"},
  };
  for (const Case& c : cases) {
    const fs::path log = d / "refused.log";
    fs::remove(log);
    const int rc = run(c.cmd, log, 60);
    INFO(read_file(log));
    CHECK(rc == 2);
    const auto errors = lines_starting(log, "train_lm: error");
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].rfind(c.says, 0) == 0);
    CHECK_FALSE(fs::exists(d / "out" / "train_log.csv"));  // nothing trained
  }
  fs::remove_all(d);
}

TEST_CASE("ranks that read different bytes at the same path are refused with one line naming the rank") {
  const fs::path d = scratch("corpus");
  // Two directories, each with its own corpus.txt: the same vocabulary, other text. Each rank
  // starts in one of them (mpirun's -wdir), so --data corpus.txt names a different file on each.
  for (const auto& [sub, seed] : {std::pair<const char*, std::uint64_t>{"a", 3}, {"b", 4}}) {
    fs::create_directories(d / sub);
    lmtest::make_corpus(d / sub, 6000, seed);
  }
  REQUIRE(lm::load_corpus((d / "a" / "corpus.txt").string(), 32).chars.vocab() ==
          lm::load_corpus((d / "b" / "corpus.txt").string(), 32).chars.vocab());
  const auto args = tiny("corpus.txt") + std::vector<std::string>{"--steps", "20", "--out", (d / "out").string()};
  const auto cmd = std::vector<std::string>{kMpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", "-wdir",
                                            (d / "a").string(), kTrainLm} +
                   args + std::vector<std::string>{":", "-np", "1", "-wdir", (d / "b").string(), kTrainLm} + args;
  const fs::path log = d / "refused.log";
  const int rc = run(cmd, log, 60);
  INFO(read_file(log));
  CHECK(rc == 2);
  const auto errors = lines_starting(log, "train_lm: error");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].rfind("train_lm: error: data: rank 1 read other bytes from 'corpus.txt' than rank 0", 0) == 0);
  CHECK_FALSE(fs::exists(d / "out" / "train_log.csv"));  // nothing trained
  fs::remove_all(d);
}

TEST_CASE("SIGTERM to one rank stops every rank at the same step, after a checkpoint there") {
  const fs::path d = scratch("sigterm");
  const std::string corpus = lmtest::make_corpus(d);
  // No checkpoint on the cadence: the one the signal asks for is the only one.
  const auto args = tiny(corpus) + std::vector<std::string>{"--steps", "1000000", "--lr-decay-iters", "2000",
                                                            "--eval-interval", "1000000"};
  const fs::path out = d / "run", log = d / "run.log";
  const pid_t job = spawn(mpirun(2, args + std::vector<std::string>{"--out", out.string()}), log);
  const auto t0 = Clock::now();
  std::error_code ec;
  while (!(fs::exists(out / "train_log.csv", ec) && fs::file_size(out / "train_log.csv", ec) > 2000) &&
         std::chrono::duration<double>(Clock::now() - t0).count() < 120)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::map<int, pid_t> ranks = ranks_of(job);
  REQUIRE(ranks.size() == 2);
  REQUIRE(::kill(ranks.at(1), SIGTERM) == 0);  // rank 1 alone is signalled; rank 0 writes
  const int rc = wait_for(job, 60, log);
  INFO(read_file(log));
  CHECK(rc != 0);
  for (const auto& [rank, pid] : ranks) CHECK(gone_within(pid, 5));
  const auto said = lines_starting(log, "interrupted at step ");
  REQUIRE(said.size() == 1);  // rank 0 says it, once
  CHECK(said[0].find("; resume with: train_lm --resume " + out.string()) != std::string::npos);
  const std::int64_t at = std::stoll(said[0].substr(20));
  CHECK(std::stoll(checkpoint_meta(out).at("step")) == at);
  CHECK(losses(out).size() == static_cast<std::size_t>(at));
  // Continued in one process for 10 steps: the losses of a run never stopped.
  const std::string until = std::to_string(at + 10);
  REQUIRE(run(alone({"--resume", out.string(), "--steps", until, "--threads", "1", "--quiet"}), log) == 0);
  const fs::path ref = d / "ref";
  REQUIRE(run(alone(args + std::vector<std::string>{"--steps", until, "--out", ref.string()}), log) == 0);
  CHECK(loss_gap(out, ref) < 1e-5);
  fs::remove_all(d);
}
