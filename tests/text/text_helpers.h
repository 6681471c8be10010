#pragma once
// Shared by the tokenizer tests: temporary files, and the message of the tg::Error a call throws.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include <tapegrad/error.h>
#include "temp_dir.h"

namespace text_test {

using tgtest::TempDir;

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
