#pragma once
// What the training-program tests share: scratch directories, whole-file reads, a small corpus
// and the tiny model they train on.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "lm/trainer.h"
#include "tapegrad/random.h"

namespace lmtest {

// A fresh, empty directory <base>/<prefix>_<name>_<pid> (the pid keeps parallel CTest runs apart).
inline std::filesystem::path scratch(const std::string& prefix, const std::string& name,
                                     const std::filesystem::path& base = std::filesystem::temp_directory_path()) {
  const std::filesystem::path d = base / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A file's whole contents ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// A small corpus with some structure to learn: n_words deterministic pseudo-words in sentences,
// written to dir/corpus.txt; returns its path.
inline std::string make_corpus(const std::filesystem::path& dir, int n_words = 6000, std::uint64_t seed = 3) {
  const char* words[] = {"the", "norm", "of", "a", "row", "is", "its", "root", "mean", "square", "and", "gain"};
  std::ostringstream s;
  tg::Generator g(seed);
  for (int i = 0; i < n_words; ++i) s << words[g.next_int(0, 12)] << (i % 11 == 10 ? ".\n" : " ");
  const std::filesystem::path p = dir / "corpus.txt";
  std::ofstream(p, std::ios::binary) << s.str();
  return p.string();
}

// One layer, width 16, context 16, batch 4, 200 steps, dropout 0.1 (so the dropout generator's
// state matters on resume), no progress output.
inline lm::TrainConfig tiny(const std::string& data) {
  lm::TrainConfig c;
  c.data = data;
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.n_embd = 16;
  c.model.block_size = 16;
  c.model.dropout = 0.1;
  c.batch_size = 4;
  c.steps = 200;
  c.warmup = 10;
  c.eval_interval = 50;
  c.eval_iters = 2;
  c.progress = false;
  return c;
}

}  // namespace lmtest
