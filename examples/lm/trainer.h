#pragma once
// Training of the character-level GPT: one run = one norm and one seed, with periodic
// evaluation, metrics, atomic checkpoints and exact resume. Shared by examples/train_lm and
// bench/bench_train so that both time the same step.
#include <cstdint>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "lm/corpus.h"

namespace lm {

struct TrainConfig {
  std::string data;
  tg::nn::GPTConfig model;        // vocab_size is set from the corpus
  std::int64_t batch_size = 12;
  std::int64_t steps = 2000;      // total, also when resuming
  double lr = 1e-3, min_lr = 1e-4;
  std::int64_t warmup = 100;
  std::int64_t lr_decay_iters = -1;  // -1: = steps
  double weight_decay = 0.1;      // on matrices only
  double beta1 = 0.9, beta2 = 0.99;
  double grad_clip = 1.0;         // 0: off
  std::int64_t eval_interval = 200;
  std::int64_t eval_iters = 20;   // batches per split per evaluation (0: none)
  std::uint64_t seed = 1337;
  std::string out;                // run directory ("" = nothing written)
  bool checkpoints = true;
  std::int64_t sample = 0;        // characters generated after training
  double temperature = 0.8;
  std::int64_t top_k = 40;
  bool progress = true;           // a live line on a terminal, log lines otherwise
  bool detect_anomaly = false;    // check every op's outputs and gradients for NaN/Inf (slow)
};

struct EvalPoint {
  std::int64_t step;
  double train_loss, val_loss, lr, ms_per_step, tokens_per_s;
};

struct RunResult {
  std::string norm;
  std::uint64_t seed = 0;
  std::int64_t parameters = 0;
  std::vector<EvalPoint> evals;
  std::vector<double> step_loss;  // training loss at every step of this process
  double ms_per_step_median = 0, tokens_per_s = 0, peak_rss_mb = 0;
  double final_train = NAN, final_val = NAN, best_val = NAN;
  std::string sample_text;
  std::int64_t start_step = 0;
};

// Trains from scratch, or resumes from cfg.out's checkpoint when resume is true. Throws tg::Error
// on bad configuration, data or checkpoint.
RunResult train(const TrainConfig& cfg, const Corpus& corpus, bool resume = false);

// The configuration stored in a run directory's checkpoint (for --resume).
TrainConfig read_checkpoint_config(const std::string& dir);

// Resident-set high-water mark of this process in MiB, and a reset of it (Linux clear_refs).
double peak_rss_mb();
void reset_peak_rss();

}  // namespace lm
