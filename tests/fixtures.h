#pragma once
// Reading the PyTorch fixtures of tests/fixtures (made by the make_*_fixtures.py scripts there).
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "helpers.h"

namespace tgtest {

// The parsed tests/fixtures/<name>, read once.
inline const nlohmann::json& fixture(const std::string& name) {
  static std::map<std::string, nlohmann::json> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const std::string path = std::string(TAPEGRAD_FIXTURES) + "/" + name;
  std::ifstream in(path);
  if (!in) FAIL("cannot open " << path << " (regenerate it with the make_*_fixtures.py script beside it)");
  return cache.emplace(name, nlohmann::json::parse(in)).first->second;
}

// {"shape": [...], "data": [...]} as a float64 tensor (a leaf, no grad).
inline tg::Tensor from_json(const nlohmann::json& j) {
  const std::vector<std::int64_t> shape = j.at("shape").get<std::vector<std::int64_t>>();
  const std::vector<double> data = j.at("data").get<std::vector<double>>();
  return tg::from_vector<double>(data, tg::Shape(shape));
}

// Records the largest difference seen per label; printed at exit when TAPEGRAD_PARITY_REPORT is set.
inline void note_parity(const std::string& what, double diff) {
  struct Report {
    std::map<std::string, double> worst;
    ~Report() {
      if (!std::getenv("TAPEGRAD_PARITY_REPORT")) return;
      double all = 0;
      for (const auto& [k, v] : worst) {
        std::cout << "  max |diff| " << k << ": " << v << '\n';
        all = std::max(all, v);
      }
      std::cout << "  max |diff| overall: " << all << '\n';
    }
  };
  static Report r;
  double& w = r.worst[what];
  w = std::max(w, diff);
}

}  // namespace tgtest
