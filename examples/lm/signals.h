#pragma once
// SIGINT and SIGTERM stop a run cleanly (docs/reliability.md): the first one is noted, the run
// finishes the step it is in, writes a checkpoint and ends with lm::Interrupted, which the program
// reports ("interrupted at step N; resume with: train_lm --resume DIR") before exiting with
// 128 + the signal (130, 143). A second signal ends the process at once, by that signal; the
// last checkpoint written stays as it is. Under mpirun the ranks agree every step on whether any
// of them was signalled (lm::DataParallel::agree_stop), so they all stop at the same step.
#include <cstdint>
#include <stdexcept>
#include <string>

namespace lm {

// Installs the handlers for as long as it lives; the previous ones come back after.
class StopOnSignal {
 public:
  StopOnSignal();
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
};

// The first SIGINT or SIGTERM received while a StopOnSignal lived (0: none).
int stop_signal();
// Forgets a received signal (a program that carries on, or a test).
void clear_stop_signal();

// A run stopped by a signal after its checkpoint at `step` (in `dir`; "" without --out).
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, std::int64_t step, std::string dir);
  int signal() const { return signal_; }
  std::int64_t step() const { return step_; }
  const std::string& dir() const { return dir_; }
  // The exit code of a process ended by this signal: 128 + its number.
  int exit_code() const { return 128 + signal_; }

 private:
  int signal_;
  std::int64_t step_;
  std::string dir_;
};

}  // namespace lm
