#pragma once
// Shared by the tokenizer tests: temporary files, and the message of the tg::Error a call throws.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include <tapegrad/error.h>

namespace text_test {

// The message of the tg::Error that f throws; fails the test when it throws nothing or another type.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const tg::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("not a tg::Error: " << e.what());
  }
  FAIL("no error thrown");
  return "";
}

// A fresh directory, removed with its files at the end of the scope.
struct TempDir {
  std::filesystem::path dir;
  TempDir() {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() / ("tapegrad_text_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

inline std::string random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

}  // namespace text_test
