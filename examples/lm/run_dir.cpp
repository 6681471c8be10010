#include "lm/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

namespace lm {

namespace fs = std::filesystem;

namespace {

// What a train_lm run writes into its directory.
constexpr const char* kRunFiles[] = {"checkpoint.safetensors", "model.safetensors", "metrics.csv", "train_log.csv",
                                     "summary.md",             "val_loss.svg",      "val_bpb.svg", "samples.txt"};

bool is_run_file(const std::string& name) {
  for (const char* f : kRunFiles)
    if (name == f) return true;
  return false;
}

// A temporary file of a run file: "<file>.<pid>.<n>.tmp" (tg::write_file_atomic's and
// tg::save_safetensors' own), or "<file>.tmp", "<file>.<pid>.tmp" or "<file>.<pid>" (those of
// earlier versions); or of a BPE run's tokenizer.json (which --overwrite keeps: a new run may be
// given it with --tokenizer), only as "tokenizer.json.<pid>[.<n>].tmp".
bool is_run_temp(const std::string& name) {
  const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
  std::string stem = tmp ? name.substr(0, name.size() - 4) : name;
  // Strips a trailing ".<digits>", returning whether there was one.
  const auto strip_number = [&stem] {
    const auto dot = stem.rfind('.');
    if (dot == std::string::npos || dot + 1 == stem.size() ||
        stem.find_first_not_of("0123456789", dot + 1) != std::string::npos)
      return false;
    stem.resize(dot);
    return true;
  };
  int numbers = 0;  // "<pid>" and "<n>" with .tmp, "<pid>" without
  while (numbers < (tmp ? 2 : 1) && strip_number()) ++numbers;
  if (!tmp && numbers == 0) return false;
  return is_run_file(stem) || (stem == "tokenizer.json" && tmp && numbers > 0);
}

// Every regular file in dir and up to two directory levels below it (<norm>/seed<N>/).
template <class F>
void for_each_file(const fs::path& dir, F&& f) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it.depth() >= 2) it.disable_recursion_pending();
    if (it->is_regular_file(ec)) f(it->path());
  }
}

std::string errno_text(int e) { return std::strerror(e); }

// The locks this process holds: canonical directory -> (descriptor, holders).
struct Held {
  int fd = -1, holders = 0;
  pid_t owner = 0;  // a child made by fork() inherits the map, not the lock
};
std::mutex g_mutex;
std::map<std::string, Held> g_held;

int open_and_lock(const fs::path& dir) {
  const fs::path file = dir / kLockFile;
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) tg::fail("run directory", "cannot open '", file.string(), "': ", errno_text(errno));
  int rc = 0;
  while ((rc = ::flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (rc == 0) return fd;
  const int e = errno;
  ::close(fd);
  if (e == EWOULDBLOCK)
    tg::fail("run directory", "'", dir.string(), "' is in use by another train_lm process (it holds ", file.string(),
             "); wait for that run to end, or stop it, before starting another in the same directory");
  tg::fail("run directory", "cannot lock '", file.string(), "': ", errno_text(e));
}

void remove_stale_temps(const fs::path& dir) {
  std::vector<fs::path> stale;
  for_each_file(dir, [&](const fs::path& p) {
    if (is_run_temp(p.filename().string())) stale.push_back(p);
  });
  std::error_code ec;
  for (const fs::path& p : stale) fs::remove(p, ec);
}

}  // namespace

std::string run_file_in(const std::string& dir) {
  std::string found;
  for_each_file(dir, [&](const fs::path& p) {
    // a checkpoint first, else a model: logs alone (a run stopped before its first checkpoint)
    // hold nothing a resume could continue
    const bool ck = p.filename() == "checkpoint.safetensors", model = p.filename() == "model.safetensors";
    if ((ck && found.find("checkpoint.safetensors") == std::string::npos) || (model && found.empty()))
      found = fs::relative(p, dir).string();
  });
  return found;
}

RunLock::RunLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) tg::fail("run directory", "cannot create '", dir, "': ", ec.message());
  const std::string key = fs::canonical(dir).string();
  std::lock_guard<std::mutex> guard(g_mutex);
  Held& h = g_held[key];
  if (h.holders == 0 || h.owner != ::getpid()) {
    try {
      h = Held{open_and_lock(key), 0, ::getpid()};
    } catch (...) {
      g_held.erase(key);
      throw;
    }
    remove_stale_temps(key);
  }
  ++h.holders;
  key_ = key;
}

RunLock::~RunLock() { release(); }

RunLock::RunLock(RunLock&& other) noexcept : key_(std::move(other.key_)) { other.key_.clear(); }

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    release();
    key_ = std::move(other.key_);
    other.key_.clear();
  }
  return *this;
}

void RunLock::release() {
  if (key_.empty()) return;
  std::lock_guard<std::mutex> guard(g_mutex);
  auto it = g_held.find(key_);
  if (it != g_held.end() && --it->second.holders == 0) {
    ::close(it->second.fd);  // closing the descriptor releases the flock
    g_held.erase(it);
  }
  key_.clear();
}

RunLock claim_new_run(const std::string& dir, bool overwrite) {
  RunLock lock(dir);
  const std::string found = run_file_in(dir);
  if (found.empty()) return lock;
  if (!overwrite)
    tg::fail("--out", "'", dir, "' already holds a run (", found, "); continue it with --resume ", dir,
             ", or start afresh in it, deleting that run, with --overwrite");
  std::vector<fs::path> files;
  for_each_file(dir, [&](const fs::path& p) {
    if (is_run_file(p.filename().string())) files.push_back(p);
  });
  for (const fs::path& p : files) {
    std::error_code ec;
    fs::remove(p, ec);
    if (ec) tg::fail("--overwrite", "cannot remove '", p.string(), "': ", ec.message());
  }
  return lock;
}

bool write_if_changed(const std::string& path, const std::string& bytes) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec) && fs::file_size(path, ec) == bytes.size()) {
    std::ifstream f(path, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    if (s.str() == bytes) return false;
  }
  tg::write_file_atomic(path, bytes);
  return true;
}

}  // namespace lm
