#pragma once
// A write that fails as on a full disk, for the tests of atomic saves: child() runs in a forked
// process whose files may not grow past `bytes`, so a write(2) beyond it fails with EFBIG ("File
// too large"; SIGXFSZ ignored). Returns child()'s exit code, or -1 when the process did not exit.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <iostream>

inline int exit_code_with_file_limit(rlim_t bytes, const std::function<int()>& child) {
  std::cout.flush();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{bytes, bytes};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    ::_exit(child());
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}
