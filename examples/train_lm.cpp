// train_lm: train the character-level GPT on a text corpus with one norm, or every norm in turn
// (--compare), and show how they compare: live progress, metrics.csv, summary.md, a val-loss chart
// (val_loss.svg), samples and checkpoints. Defaults are the "baby GPT on a CPU" configuration of
// the PyTorch reference benchmark (../shared/bench/torch_gpt.py in the development tree).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "lm/report.h"
#include "lm/trainer.h"

namespace fs = std::filesystem;

namespace {
// Validators whose messages read as sentences ("--steps: must be >= 0, got -1").
CLI::Validator bound(const char* what, double lo, bool lo_open, double hi = INFINITY) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        try {
          std::size_t used = 0;
          v = std::stod(s, &used);
          if (used != s.size()) throw std::invalid_argument(s);
        } catch (const std::exception&) {
          return "not a number: " + s;
        }
        if (lo_open ? !(v > lo) : !(v >= lo)) return std::string("must be ") + what + ", got " + s;
        if (!(v <= hi)) return std::string("must be ") + what + ", got " + s;
        return "";
      },
      what);
}
const CLI::Validator kPositive = bound("> 0", 0, true);
const CLI::Validator kNonNegative = bound(">= 0", 0, false);
const CLI::Validator kFraction = bound("in (0, 1]", 0, true, 1);
}  // namespace

int main(int argc, char** argv) {
  lm::TrainConfig c;
  std::string norm = "rmsnorm";
  bool compare = false;
  int seeds = 1, threads = 0;
  std::string resume;
  const char* env_data = std::getenv("TAPEGRAD_DATA");
  c.data = env_data ? env_data : "data/tinyshakespeare.txt";
  c.model.block_size = 64;

  CLI::App app{"Train a character-level GPT and compare normalisation layers (LayerNorm, RMSNorm, pRMSNorm, "
               "BatchNorm, none)."};
  // A repeated option takes its last value, so wrappers (scripts/demo) can be overridden.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", c.data, "UTF-8 text corpus (default: $TAPEGRAD_DATA or data/tinyshakespeare.txt)");
  app.add_option("--norm", norm, "layernorm|rmsnorm|prmsnorm|batchnorm|none")
      ->check(CLI::IsMember({"layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"}))
      ->capture_default_str();
  app.add_option("--p", c.model.p, "pRMSNorm: fraction of features for the RMS, in (0, 1]")
      ->check(kFraction)
      ->capture_default_str();
  app.add_flag("--compare", compare, "train every norm in turn with the same seed, data order and initial weights");
  app.add_option("--seeds", seeds, "repeat each run over this many seeds (seed, seed+1, ...)")->check(bound("at least 1", 1, false));
  app.add_option("--seed", c.seed, "random seed")->capture_default_str();
  app.add_option("--n-layer", c.model.n_layer, "transformer blocks")->check(kPositive)->capture_default_str();
  app.add_option("--n-head", c.model.n_head, "attention heads")->check(kPositive)->capture_default_str();
  app.add_option("--n-embd", c.model.n_embd, "width")->check(kPositive)->capture_default_str();
  app.add_option("--block-size", c.model.block_size, "context length")->check(kPositive)->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "sequences per step")->check(kPositive)->capture_default_str();
  app.add_option("--dropout", c.model.dropout, "dropout probability")->check(bound("in [0, 1)", 0, false, 0.999999))->capture_default_str();
  app.add_option("--lr", c.lr, "peak learning rate")->check(kNonNegative)->capture_default_str();
  app.add_option("--min-lr", c.min_lr, "final learning rate of the cosine decay")->check(kNonNegative)->capture_default_str();
  app.add_option("--warmup", c.warmup, "linear warmup steps")->check(kNonNegative)->capture_default_str();
  app.add_option("--lr-decay-iters", c.lr_decay_iters, "step where the cosine reaches min-lr (default: --steps)");
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay on matrices")->check(kNonNegative)->capture_default_str();
  app.add_option("--grad-clip", c.grad_clip, "clip the global gradient norm (0: off)")->check(kNonNegative)->capture_default_str();
  app.add_option("--steps", c.steps, "total training steps (also when resuming)")->check(kNonNegative)->capture_default_str();
  app.add_option("--eval-interval", c.eval_interval, "steps between evaluations and checkpoints")->check(kPositive)->capture_default_str();
  app.add_option("--eval-iters", c.eval_iters, "batches per split per evaluation")->check(kNonNegative)->capture_default_str();
  app.add_option("--threads", threads, "threads (default: all cores)")->check(bound("at least 1", 1, false));
  app.add_option("--out", c.out, "output directory (metrics, summary, chart, samples, checkpoints)");
  app.add_option("--resume", resume, "continue the run whose checkpoint is in DIR (written by an earlier --out DIR)");
  app.add_option("--sample", c.sample, "characters to generate after training")->check(kNonNegative);
  app.add_option("--temperature", c.temperature, "sampling temperature")->check(kPositive)->capture_default_str();
  app.add_option("--top-k", c.top_k, "sample among the k most likely characters (0: all)")->check(kNonNegative)->capture_default_str();
  bool quiet = false, trace = false;
  app.add_flag("--quiet", quiet, "no progress output");
  app.add_flag("--detect-anomaly", c.detect_anomaly,
               "check every op's outputs and gradients for NaN/Inf and stop at the first, naming the op (slow; "
               "without it a non-finite loss or gradient norm still stops the run, and that step is re-run in this mode "
               "to name the op)");
  app.add_flag("--trace", trace, "print the tape of one training step (ops, shapes, bytes saved) and exit; "
                                 "with --out also write it as Graphviz DOT (tape.dot)");

  try {
    app.parse(argc, argv);
    if (!resume.empty() && (compare || seeds > 1)) throw CLI::ValidationError("--resume", "continues one run; not with --compare or --seeds");
    // The model's own constraints, before anything is printed or read.
    tg::nn::GPTConfig check = c.model;
    check.vocab_size = 1;
    check.validate();
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "train_lm: error: " << e.what() << "\n";
    return 2;
  } catch (const tg::Error& e) {
    std::cerr << "train_lm: error: " << e.what() << "\n";
    return 2;
  }

  try {
    if (threads > 0) tg::set_num_threads(threads);
    c.progress = !quiet;
    c.model.norm = tg::nn::parse_norm_kind(norm);
    std::vector<lm::RunResult> runs;

    if (trace) {
      lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size);
      c.model.vocab_size = corpus.vocab_size();
      tg::manual_seed(c.seed);
      tg::nn::GPT model(c.model);
      tg::Generator g(c.seed);
      tg::Tensor x, y;
      lm::sample_batch(corpus.train, c.batch_size, c.model.block_size, g, x, y);
      tg::Tensor loss = model.loss(x, y);
      std::cout << "One training step of the " << norm << " GPT (batch " << c.batch_size << ", context "
                << c.model.block_size << ", width " << c.model.n_embd << "), as recorded on the tape:\n";
      tg::tape().print(std::cout);
      if (!c.out.empty()) {
        fs::create_directories(c.out);
        std::ofstream(fs::path(c.out) / "tape.dot") << tg::tape().to_dot();
        std::cout << "Graphviz: " << (fs::path(c.out) / "tape.dot").string() << " (dot -Tsvg tape.dot -o tape.svg)\n";
      }
      loss.backward();
      return 0;
    }
    if (!resume.empty()) {
      // The run's own configuration; only the total steps (and threads) come from this command line.
      lm::TrainConfig r = lm::read_checkpoint_config(resume);
      if (app.count("--steps")) r.steps = c.steps;
      if (app.count("--data")) r.data = c.data;
      r.out = resume;
      r.progress = c.progress;
      r.detect_anomaly = c.detect_anomaly;
      r.sample = c.sample;
      r.temperature = c.temperature;
      r.top_k = c.top_k;
      lm::Corpus corpus = lm::load_corpus(r.data, r.model.block_size);
      std::cerr << "resuming " << resume << " (" << tg::nn::to_string(r.model.norm) << ") up to step " << r.steps << "\n";
      runs.push_back(lm::train(r, corpus, true));
    } else {
      lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size);
      std::vector<tg::nn::NormKind> kinds;
      if (compare)
        kinds = {tg::nn::NormKind::layernorm, tg::nn::NormKind::rmsnorm, tg::nn::NormKind::prmsnorm,
                 tg::nn::NormKind::batchnorm, tg::nn::NormKind::none};
      else
        kinds = {c.model.norm};
      std::cerr << "corpus " << c.data << ": " << corpus.train.size() + corpus.val.size() << " characters, vocabulary "
                << corpus.vocab_size() << "; " << tg::get_num_threads() << " threads\n";
      for (auto kind : kinds)
        for (int s = 0; s < seeds; ++s) {
          lm::TrainConfig rc = c;
          rc.model.norm = kind;
          rc.seed = c.seed + static_cast<std::uint64_t>(s);
          if (!c.out.empty()) {
            fs::path d = fs::path(c.out);
            if (compare || seeds > 1) d /= tg::nn::to_string(kind);
            if (seeds > 1) d /= "seed" + std::to_string(rc.seed);
            rc.out = d.string();
          }
          runs.push_back(lm::train(rc, corpus, false));
          if (!c.sample || quiet) continue;
          std::cerr << "--- sample (" << runs.back().norm << ") ---\n" << runs.back().sample_text << "\n---\n";
        }
    }

    std::ostringstream settings;
    const lm::TrainConfig& s0 = c;
    settings << "Settings: " << s0.model.n_layer << " layers, " << s0.model.n_head << " heads, width " << s0.model.n_embd
             << ", context " << s0.model.block_size << ", batch " << s0.batch_size << ", " << s0.steps
             << " steps, AdamW lr " << s0.lr << " -> " << s0.min_lr << " (warmup " << s0.warmup << "), weight decay "
             << s0.weight_decay << ", grad clip " << s0.grad_clip << ", seed " << s0.seed << ", " << tg::get_num_threads()
             << " threads; corpus `" << fs::path(s0.data).filename().string() << "`.";
    std::cout << "\n" << lm::summary_table(runs);
    const fs::path top = resume.empty() ? fs::path(c.out) : fs::path(resume);
    if (!top.empty()) {
      fs::create_directories(top);
      std::ofstream(top / "summary.md") << lm::summary_markdown(runs, settings.str());
      std::ofstream(top / "val_loss.svg") << lm::val_loss_svg(runs, "Validation loss by normalisation");
      if (compare || seeds > 1) {
        std::ofstream all(top / "metrics.csv");
        all << "step,norm,seed,train_loss,val_loss,lr,ms_per_step,tokens_per_s\n";
        for (const auto& r : runs)
          for (const auto& e : r.evals)
            all << e.step << ',' << r.norm << ',' << r.seed << ',' << e.train_loss << ',' << e.val_loss << ',' << e.lr << ','
                << e.ms_per_step << ',' << e.tokens_per_s << '\n';
      }
      std::cout << "\nsummary: " << (top / "summary.md").string() << "\nchart:   " << (top / "val_loss.svg").string() << "\n";
    }
    return 0;
  } catch (const tg::Error& e) {
    std::cerr << "train_lm: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_lm: error: " << e.what() << "\n";
    return 1;
  }
}
