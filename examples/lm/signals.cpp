#include "lm/signals.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace lm {

namespace {

volatile sig_atomic_t g_signal = 0;
struct sigaction g_old_int, g_old_term;

// Async-signal-safe: a flag the first time, an immediate end by the signal the second time.
void on_signal(int sig) {
  if (g_signal == 0) {
    g_signal = sig;
    return;
  }
  const char msg[] = "\nsecond signal: stopping at once; the last checkpoint is kept\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

StopOnSignal::StopOnSignal() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // reads, writes and waits go on after the first signal
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

StopOnSignal::~StopOnSignal() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
}

int stop_signal() { return g_signal; }
void clear_stop_signal() { g_signal = 0; }

Interrupted::Interrupted(int signal, std::int64_t step, std::string dir)
    : std::runtime_error(std::string("interrupted at step ") + std::to_string(step)),
      signal_(signal),
      step_(step),
      dir_(std::move(dir)) {}

}  // namespace lm
