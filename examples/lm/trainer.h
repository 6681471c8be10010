#pragma once
// Training of the character-level GPT: one run = one norm and one seed, with periodic
// evaluation, metrics, atomic checkpoints and exact resume. Shared by examples/train_lm and
// bench/bench_train so that both time the same step.
//
// A run is a Trainer taken through its steps:
//
//   Trainer t(cfg, corpus, resume);   // set up: a fresh model, or the checkpoint's state
//   while (!t.done()) {
//     t.train_step();                  // one batch: forward, backward, NaN guard, AdamW update
//     t.report_progress();             // the live line (terminal only)
//     if (!t.eval_due()) continue;
//     if (cfg.eval_iters > 0) t.report_metrics(t.evaluate());  // losses -> metrics.csv
//     t.checkpoint();                  // everything needed to continue, written atomically
//   }                                  // (a SIGINT/SIGTERM: a checkpoint, then lm::Interrupted)
//   t.finish();                        // median step time, peak memory, final losses
//   t.sample();                        // some generated text
//   t.save_model();                    // the final weights
//   RunResult r = t.result();
//
// lm::train() does exactly this.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "lm/corpus.h"
#include "lm/parallel.h"
#include "tapegrad/memory.h"
#include "lm/run_dir.h"

namespace lm {

struct Checkpoint;  // lm/checkpoint.h

struct TrainConfig {
  std::string data;
  tg::nn::GPTConfig model;        // vocab_size is set from the corpus
  std::string tokenizer = "char"; // "char" or "bpe": set from the corpus (lm/tokens.h)
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
  std::string prompt;             // the sample's start ("" = the corpus's first character)
  double temperature = 0.8;
  std::int64_t top_k = 40;
  bool progress = true;           // a live line on a terminal, log lines otherwise
  bool detect_anomaly = false;    // check every op's outputs and gradients for NaN/Inf (slow)
  std::string precision = "float32";  // "bf16": forward and loss under tg::AutocastGuard
  // Recompute each block in the backward (nn::GPT::set_gradient_checkpointing): less memory, the
  // same numbers. How a run is computed, not what it computes: not in the saved run's config.
  bool gradient_checkpointing = false;
  std::string init_from;          // a GGUF whose weights start a new run (--init-from; lm/gguf_cli.h)
};

struct EvalPoint {
  std::int64_t step;
  double train_loss, val_loss, lr, ms_per_step, tokens_per_s;
  double train_bpb = NAN, val_bpb = NAN;  // the losses in bits per byte (lm/tokens.h)
};

struct RunResult {
  std::string arch, norm;
  std::string tokenizer = "char";  // TrainConfig::tokenizer
  std::uint64_t seed = 0;
  std::int64_t parameters = 0;
  std::vector<EvalPoint> evals;
  std::vector<double> step_loss;  // training loss at every step of this process
  double ms_per_step_median = 0, tokens_per_s = 0, peak_rss_mb = 0;
  double peak_tensor_mb = 0;      // tg::max_memory_allocated() over the run, MiB (within peak_rss_mb)
  double final_train = NAN, final_val = NAN, best_val = NAN;
  std::string sample_text;
  std::int64_t start_step = 0;
  int world_size = 1;             // ranks of a data-parallel run (mpirun -np N; lm/parallel.h)
  CommSummary comm;               // its gradient communication per step (zeros in one process)
  bool model_written = false;     // model.safetensors written (false: it held these bytes already)
};

// One training run, step by step. Every step throws tg::Error on bad configuration, data or
// checkpoint, and train_step() on a loss or gradient that is not finite.
class Trainer {
 public:
  // Set up or resume. Checks the configuration; on resume reads cfg.out's checkpoint and holds its
  // tensors against the configuration before building anything. Seeds the default generator with
  // cfg.seed, builds the GPT and AdamW (weight decay on matrices only), then on resume restores the
  // weights, the optimiser's moments, both generators and the best val loss. Opens metrics.csv and
  // train_log.csv, keeping on resume only their rows up to the checkpoint's step.
  Trainer(const TrainConfig& cfg, const Corpus& corpus, bool resume = false);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  bool done() const { return step_ >= cfg_.steps; }
  std::int64_t step() const { return step_; }  // steps done, those before a resume included

  // One training step: the scheduled learning rate, a random batch, forward, backward, gradient
  // clipping, then AdamW. A loss or gradient that is not finite stops the run before the update
  // (the weights and the checkpoint stay good), naming the op that produced it. Returns the loss.
  double train_step();

  // True after the step that ends an evaluation interval, and after the last step.
  bool eval_due() const;
  // The mean loss on eval_iters fixed batches of each split (the same batches every time, for
  // every norm), with dropout off and BatchNorm on its running statistics.
  EvalPoint evaluate();
  // Writes the weights, the optimiser state, both generators' states, the configuration and the
  // vocabulary to checkpoint.safetensors (temporary file, fsync, rename), after the logs whose
  // rows it vouches for. Nothing without an output directory or with checkpoints off.
  void checkpoint();

  // The signal that stops the run after this step (lm/signals.h), agreed by every rank of the job;
  // 0: go on. Every rank calls it once per step.
  int stop_requested() const;
  // The run directory this process writes ("" on ranks other than 0, or without one).
  const std::string& out() const { return cfg_.out; }

  // The live progress line (step, loss, lr, tokens/s, ETA), on a terminal only: redrawn every 10
  // steps and at every evaluation.
  void report_progress();
  // Records an evaluation: the best val loss, a metrics.csv row, and a log line when stderr is
  // not a terminal.
  void report_metrics(const EvalPoint& e);

  // Ends the training loop: closes the progress line, takes the median step time, tokens/s, peak
  // memory and the final losses.
  void finish();
  // Generates cfg.sample characters after cfg.prompt from the trained model (its own generator, so
  // sampling does not disturb training) into the result, the prompt first, and into samples.txt
  // after a first line naming the step, the temperature and top-k ("step 2000 (temperature 0.8,
  // top-k 40)"). A run that does not sample leaves samples.txt as it is.
  void sample();
  // The final weights in model.safetensors, under the reference model's names (PyTorch loads them
  // as they are: docs/pytorch.md), with a format tag, the configuration and the vocabulary.
  void save_model();
  const RunResult& result() const { return r_; }

 private:
  void build_model();
  void restore(Checkpoint& ck);
  void open_logs();
  double median_ms() const;

  TrainConfig cfg_;
  RunLock lock_;                     // on the run directory, while this process writes it
  const Corpus& corpus_;
  bool resume_;
  std::string norm_;
  // Built in the constructor's body: after the checkpoint is checked and the seed is set.
  std::unique_ptr<tg::nn::GPT> model_;
  std::unique_ptr<tg::optim::AdamW> opt_;
  std::unique_ptr<DataParallel> par_;  // this rank's replica (a world of one without mpirun)
  tg::optim::WarmupCosineLR schedule_;
  std::vector<tg::Tensor> params_;
  tg::Generator batch_gen_;
  tg::Tensor x_, y_;                 // the current batch
  std::ofstream metrics_, steplog_;  // metrics.csv (every evaluation), train_log.csv (every step)
  std::int64_t step_ = 0;
  double lr_ = NAN, loss_ = NAN;     // of the last step
  std::vector<double> times_;        // ms of every step of this process
  double tokens_per_step_ = 0;
  bool tty_ = false;
  RunResult r_;
};

// Trains from scratch, or resumes from cfg.out's checkpoint when resume is true: a Trainer taken
// through its steps in order. Throws tg::Error on bad configuration, data or checkpoint, and
// lm::Interrupted after the checkpoint a SIGINT or SIGTERM asked for (while an lm::StopOnSignal
// lives). A finished run resumed without new steps leaves every file as it is.
RunResult train(const TrainConfig& cfg, const Corpus& corpus, bool resume = false);

// The configuration stored in a run directory's checkpoint (for --resume).
TrainConfig read_checkpoint_config(const std::string& dir);

// The median as Python's statistics.median takes it: the middle value, or the mean of the two
// middle values of an even count. NaN for no values. Every median a run reports is this one.
double median(std::vector<double> v);
// The median step time of a run's step times (ms, in order): the first steps left out (up to 10,
// at most half), then median(), so that a run's figure and the PyTorch reference's (torch_gpt.py)
// are the same statistic. NaN for no steps.
double steady_median_ms(std::vector<double> ms);

// Resident-set high-water mark of this process in MiB, and a reset of it (Linux clear_refs).
double peak_rss_mb();
void reset_peak_rss();

}  // namespace lm
