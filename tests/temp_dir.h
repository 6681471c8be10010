#pragma once
// A fresh directory under the system temp dir, named by the prefix, this process and a counter,
// removed with its contents at scope exit.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>

namespace tgtest {

struct TempDir {
  std::filesystem::path dir;
  explicit TempDir(const std::string& prefix = "tapegrad_test_") {
    static std::atomic<int> counter{0};
    dir = std::filesystem::temp_directory_path() /
          (prefix + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

}  // namespace tgtest
