#pragma once
// A run directory belongs to its run (docs/reliability.md):
//   - a fresh run refuses a directory that already holds a run, unless asked to replace it;
//   - while a process writes a directory it holds an exclusive lock on DIR/.train_lm.lock
//     (flock(2)), so a second process is refused with one line instead of interleaving its files;
//   - every file is written through a temporary file of its own (<name>.<pid>.<n>.tmp,
//     tg::write_file_atomic), fsync'ed, then renamed over the name, so a crash or a second writer never leaves a torn
//     file under a run's name. Temporary files a killed process left are removed by the next
//     process that takes the lock.
#include <string>

#include <tapegrad/tapegrad.h>

namespace lm {

// The name of the lock file inside a run directory.
inline constexpr const char* kLockFile = ".train_lm.lock";

// The checkpoint (else the model) of a run that dir (or a <norm>/ or seed<N>/ directory below it)
// holds, as a path relative to dir; "" when it holds none (also when dir does not exist). Logs
// alone, of a run stopped before its first checkpoint, are not a run: a new run replaces them.
std::string run_file_in(const std::string& dir);

// An exclusive lock on a run directory for as long as the object lives. Locks of one process
// on one directory share the lock (the program and its trainer may both take it).
class RunLock {
 public:
  RunLock() = default;
  // Creates dir when needed and takes the lock, or throws tg::Error naming the directory when
  // another process holds it. Then removes the temporary files a killed process left.
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  bool held() const { return !key_.empty(); }

 private:
  void release();
  std::string key_;  // the directory's canonical path
};

// Takes dir for a new run: locks it, then refuses (tg::Error naming --resume and --overwrite)
// when it holds a run; with overwrite, removes that run's files (and nothing else) instead.
RunLock claim_new_run(const std::string& dir, bool overwrite);

// tg::write_file_atomic(path, bytes), unless path already holds exactly these bytes: then nothing
// is touched. Returns whether it wrote.
bool write_if_changed(const std::string& path, const std::string& bytes);

}  // namespace lm
