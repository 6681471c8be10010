// train_lm: train the character-level GPT (--arch gpt) or LLaMA-style model (--arch llama) on a
// text corpus with one norm, or every norm in turn (--compare), and show how they compare: live
// progress, metrics.csv, summary.md, a val-loss chart (val_loss.svg), samples and checkpoints.
// Defaults are the "baby GPT on a CPU" configuration of the PyTorch reference benchmark
// (../shared/bench/torch_gpt.py, beside the project).
//
// main() reads the command line into Options, picks one of four modes and calls its function:
//   trace    print the tape of one training step                      trace_one_step
//   resume   continue a run from its checkpoint                         resume_run
//            (of a finished run with --sample: sample it, nothing else)  sample_finished_run
//   train    one norm (or several seeds of it)                          train_runs
//   compare  every norm in turn, same seed, data order and weights      train_runs
// then writes what the runs show (summary table, summary.md, chart)    write_report
// Under mpirun (mpirun -np N train_lm ...) the N ranks train one model on slices of each batch and
// rank 0 alone prints and writes (lm/parallel.h, docs/distributed.md).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "lm/checkpoint.h"
#include "lm/parallel.h"
#include "lm/report.h"
#include "lm/tokens.h"
#include "lm/trainer.h"

namespace fs = std::filesystem;

namespace {

// Everything the command line sets: the run's configuration and how to run it.
struct Options {
  lm::TrainConfig c;
  std::string arch = "gpt", norm = "rmsnorm";
  bool compare = false, quiet = false, trace = false;
  int seeds = 1, threads = 0;
  std::string resume;  // a run directory to continue
  lm::TokenizerChoice tok;  // --tokenizer, --vocab-size
};

enum class Mode { train, compare, resume, trace };

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

// The model's shape and the run's mode.
void add_model_options(CLI::App& app, Options& o) {
  lm::TrainConfig& c = o.c;
  app.add_option("--data", c.data, "UTF-8 text corpus (default: $TAPEGRAD_DATA or data/tinyshakespeare.txt)");
  app.add_option("--tokenizer", o.tok.spec,
                 "char, bpe (byte-level BPE trained on the training split), or a tokenizer.json / GPT-2 encoder.json")
      ->capture_default_str();
  app.add_option("--vocab-size", o.tok.vocab_size, "vocabulary of --tokenizer bpe (256 bytes + merges)")
      ->check(bound("at least 256", 256, false))
      ->capture_default_str();
  app.add_option("--arch", o.arch, "gpt (learned positions, GELU MLP, tied head) or llama (RoPE, SwiGLU, untied head)")
      ->check(CLI::IsMember({"gpt", "llama"}))
      ->capture_default_str();
  app.add_option("--norm", o.norm, "layernorm|rmsnorm|prmsnorm|batchnorm|none")
      ->check(CLI::IsMember({"layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"}))
      ->capture_default_str();
  app.add_option("--p", c.model.p, "pRMSNorm: fraction of features for the RMS, in (0, 1]")
      ->check(kFraction)
      ->capture_default_str();
  app.add_flag("--compare", o.compare, "train every norm in turn with the same seed, data order and initial weights");
  app.add_option("--seeds", o.seeds, "repeat each run over this many seeds (seed, seed+1, ...)")->check(bound("at least 1", 1, false));
  app.add_option("--seed", c.seed, "random seed")->capture_default_str();
  app.add_option("--n-layer", c.model.n_layer, "transformer blocks")->check(kPositive)->capture_default_str();
  app.add_option("--n-head", c.model.n_head, "attention heads")->check(kPositive)->capture_default_str();
  app.add_option("--n-embd", c.model.n_embd, "width")->check(kPositive)->capture_default_str();
  app.add_option("--block-size", c.model.block_size, "context length")->check(kPositive)->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "sequences per step")->check(kPositive)->capture_default_str();
  app.add_option("--dropout", c.model.dropout, "dropout probability")->check(bound("in [0, 1)", 0, false, 0.999999))->capture_default_str();
}

// The optimiser and schedule, evaluation, output, sampling and diagnostics.
void add_training_options(CLI::App& app, Options& o) {
  lm::TrainConfig& c = o.c;
  app.add_option("--lr", c.lr, "peak learning rate")->check(kNonNegative)->capture_default_str();
  app.add_option("--min-lr", c.min_lr, "final learning rate of the cosine decay")->check(kNonNegative)->capture_default_str();
  app.add_option("--warmup", c.warmup, "linear warmup steps")->check(kNonNegative)->capture_default_str();
  app.add_option("--lr-decay-iters", c.lr_decay_iters, "step where the cosine reaches min-lr (default: --steps)");
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay on matrices")->check(kNonNegative)->capture_default_str();
  app.add_option("--grad-clip", c.grad_clip, "clip the global gradient norm (0: off)")->check(kNonNegative)->capture_default_str();
  app.add_option("--steps", c.steps, "total training steps (also when resuming)")->check(kNonNegative)->capture_default_str();
  app.add_option("--eval-interval", c.eval_interval, "steps between evaluations and checkpoints")->check(kPositive)->capture_default_str();
  app.add_option("--eval-iters", c.eval_iters, "batches per split per evaluation")->check(kNonNegative)->capture_default_str();
  app.add_option("--threads", o.threads, "threads (default: all cores)")->check(bound("at least 1", 1, false));
  app.add_option("--out", c.out, "output directory (metrics, summary, chart, samples, checkpoints)");
  app.add_option("--resume", o.resume, "continue the run whose checkpoint is in DIR (written by an earlier --out DIR)");
  app.add_option("--sample", c.sample,
                 "characters to generate after training (with --resume of a finished run: without training, on stdout)")
      ->check(kNonNegative);
  app.add_option("--prompt", c.prompt, "text the sample starts from (default: the corpus's first character)");
  app.add_option("--temperature", c.temperature, "sampling temperature")->check(kPositive)->capture_default_str();
  app.add_option("--top-k", c.top_k, "sample among the k most likely characters (0: all)")->check(kNonNegative)->capture_default_str();
  app.add_option("--precision", c.precision,
                 "bf16: matrix products with bfloat16 operands and float32 sums (tg::AutocastGuard); weights, "
                 "gradients, optimizer state and everything else stay float32")
      ->check(CLI::IsMember({"float32", "bf16"}))->capture_default_str();
  app.add_flag("--gradient-checkpointing", c.gradient_checkpointing,
               "recompute each block's activations in the backward instead of keeping them from the forward: "
               "the same numbers, less memory, 25-40% more time per step (docs/performance.md)");
  app.add_flag("--quiet", o.quiet, "no progress output");
  app.add_flag("--detect-anomaly", c.detect_anomaly,
               "check every op's outputs and gradients for NaN/Inf and stop at the first, naming the op (slow; "
               "without it a non-finite loss or gradient norm still stops the run, and that step is re-run in this mode "
               "to name the op)");
  app.add_flag("--trace", o.trace, "print the tape of one training step (ops, shapes, bytes saved) and exit; "
                                   "with --out also write it as Graphviz DOT (tape.dot)");
}

// Parses the command line into o and checks what the flags alone cannot (the model's own
// constraints), before anything is printed or read. Returns -1 to go on, else the exit code:
// 0 after --help, 2 with the reason in `error` (lm::Job::settle_parse prints it).
int parse(CLI::App& app, Options& o, int argc, char** argv, std::string& error) {
  try {
    app.parse(argc, argv);
    if (!o.resume.empty() && (o.compare || o.seeds > 1))
      throw CLI::ValidationError("--resume", "continues one run; not with --compare or --seeds");
    o.c.model.arch = tg::nn::parse_arch(o.arch);
    tg::nn::GPTConfig check = o.c.model;
    check.vocab_size = 1;
    check.validate();
    o.c.progress = !o.quiet;
    o.c.model.norm = tg::nn::parse_norm_kind(o.norm);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    error = e.what();
    return 2;
  } catch (const tg::Error& e) {
    error = e.what();
    return 2;
  }
  return -1;
}

// What every rank of a data-parallel job must be given alike: the configuration and the mode.
std::string options_text(const Options& o) {
  return lm::with_keys(lm::config_json(o.c), {{"out", o.c.out}, {"resume", o.resume}, {"compare", o.compare ? "1" : "0"},
                                              {"seeds", std::to_string(o.seeds)}, {"trace", o.trace ? "1" : "0"},
                                              {"tokenizer", o.tok.spec + " " + std::to_string(o.tok.vocab_size)}});
}

Mode pick_mode(const Options& o) {
  if (o.trace) return Mode::trace;
  if (!o.resume.empty()) return Mode::resume;
  return o.compare ? Mode::compare : Mode::train;
}

// Builds the model, records the forward pass of one batch on the tape, prints the tape (and with
// --out writes it as Graphviz DOT), then runs the backward pass.
void trace_one_step(const Options& o) {
  if (lm::job_size() > 1) lm::fail_job("trace", "prints the tape of one process: run it without mpirun");
  lm::TrainConfig c = o.c;
  lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size, o.tok);
  c.model.vocab_size = corpus.vocab_size();
  tg::manual_seed(c.seed);
  tg::nn::GPT model(c.model);
  tg::Generator g(c.seed);
  tg::Tensor x, y;
  lm::sample_batch(corpus.train, c.batch_size, c.model.block_size, g, x, y);
  tg::Tensor loss = model.loss(x, y);
  std::cout << "One training step of the " << o.norm << " " << o.arch << " model (batch " << c.batch_size << ", context "
            << c.model.block_size << ", width " << c.model.n_embd << "), as recorded on the tape:\n";
  tg::tape().print(std::cout);
  if (!c.out.empty()) {
    fs::create_directories(c.out);
    std::ofstream(fs::path(c.out) / "tape.dot") << tg::tape().to_dot();
    std::cout << "Graphviz: " << (fs::path(c.out) / "tape.dot").string() << " (dot -Tsvg tape.dot -o tape.svg)\n";
  }
  loss.backward();
}

// Continues the run in o.resume with its own configuration; only the total steps, the corpus
// path, progress, anomaly detection, gradient checkpointing and sampling come from this command
// line.
lm::RunResult resume_run(const Options& o, const CLI::App& app) {
  lm::TrainConfig r = lm::read_checkpoint_config(o.resume);
  if (app.count("--steps")) r.steps = o.c.steps;
  if (app.count("--data")) r.data = o.c.data;
  r.out = o.resume;
  r.progress = o.c.progress;
  r.detect_anomaly = o.c.detect_anomaly;
  r.gradient_checkpointing = o.c.gradient_checkpointing;
  r.sample = o.c.sample;
  r.prompt = o.c.prompt;
  r.temperature = o.c.temperature;
  r.top_k = o.c.top_k;
  lm::Corpus corpus = lm::load_corpus(r.data, r.model.block_size, lm::run_tokenizer(r.tokenizer, o.resume));
  std::cerr << "resuming " << o.resume << " (" << tg::nn::to_string(r.model.norm) << ") up to step " << r.steps << "\n";
  return lm::train(r, corpus, true);
}

// Samples from the finished run in o.resume without training or writing anything: its
// checkpoint's weights, configuration and vocabulary; the prompt, then --sample characters, on
// stdout. False when the run is not finished (it then resumes).
bool sample_finished_run(const Options& o, const CLI::App& app) {
  lm::TrainConfig r = lm::read_checkpoint_config(o.resume);
  if (app.count("--steps")) r.steps = o.c.steps;
  lm::Checkpoint ck = lm::read_checkpoint(o.resume, r.model);
  if (static_cast<std::int64_t>(lm::meta_u64(ck.meta, "step", ck.file)) < r.steps) return false;
  const lm::Corpus vocab = lm::vocabulary_only(ck.meta["vocab"]);
  const std::vector<std::int32_t> prompt = vocab.encode(o.c.prompt.empty() ? "\n" : o.c.prompt);
  if (prompt.empty()) tg::fail("prompt", "is empty");
  tg::nn::GPT model(r.model);
  tg::StateDict weights;
  for (const auto& [k, t] : ck.tensors)
    if (k.rfind("model.", 0) == 0) weights.insert(k.substr(6), t);
  model.load_state_dict(weights);
  tg::Generator g(r.seed + 2);
  const auto ids = model.generate(prompt, o.c.sample, o.c.temperature, o.c.top_k, &g);
  if (lm::job_rank() == 0) std::cout << vocab.decode(prompt) << vocab.decode(ids) << std::endl;
  return true;
}

// Trains each norm of kinds over o.seeds seeds, in turn, on the same corpus. With several runs
// each has its own directory under --out: <norm>/ with --compare, seed<N>/ with --seeds.
std::vector<lm::RunResult> train_runs(const Options& o, const std::vector<tg::nn::NormKind>& kinds) {
  const lm::TrainConfig& c = o.c;
  lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size, o.tok);
  std::cerr << "corpus " << c.data << ": " << corpus.train.size() + corpus.val.size() << " tokens (" << lm::tokenizer_kind(corpus) << "), vocabulary "
            << corpus.vocab_size() << "; " << tg::get_num_threads() << " threads"
            << (lm::job_size() > 1 ? " per rank, " + std::to_string(lm::job_size()) + " ranks" : "") << "\n";
  std::vector<lm::RunResult> runs;
  for (auto kind : kinds)
    for (int s = 0; s < o.seeds; ++s) {
      lm::TrainConfig rc = c;
      rc.model.norm = kind;
      rc.seed = c.seed + static_cast<std::uint64_t>(s);
      if (!c.out.empty()) {
        fs::path d = fs::path(c.out);
        if (o.compare || o.seeds > 1) d /= tg::nn::to_string(kind);
        if (o.seeds > 1) d /= "seed" + std::to_string(rc.seed);
        rc.out = d.string();
      }
      runs.push_back(lm::train(rc, corpus, false));
      if (!c.sample || o.quiet) continue;
      std::cerr << "--- sample (" << runs.back().norm << ") ---\n" << runs.back().sample_text << "\n---\n";
    }
  return runs;
}

// The settings line of summary.md.
std::string settings_line(const lm::TrainConfig& s0) {
  std::ostringstream settings;
  settings << "Settings: arch " << tg::nn::to_string(s0.model.arch) << ", " << s0.model.n_layer << " layers, " << s0.model.n_head << " heads, width " << s0.model.n_embd
           << ", context " << s0.model.block_size << ", batch " << s0.batch_size << ", " << s0.steps
           << " steps, AdamW lr " << s0.lr << " -> " << s0.min_lr << " (warmup " << s0.warmup << "), weight decay "
           << s0.weight_decay << ", grad clip " << s0.grad_clip << ", seed " << s0.seed << ", " << tg::get_num_threads()
           << " threads; corpus `" << fs::path(s0.data).filename().string() << "`.";
  return settings.str();
}

// The metrics of every run in one file, with a seed column (several runs only).
void write_combined_metrics(const fs::path& file, const std::vector<lm::RunResult>& runs) {
  std::ofstream all(file);
  all << "step,norm,seed,train_loss,val_loss,lr,ms_per_step,tokens_per_s,train_bpb,val_bpb\n";
  for (const auto& r : runs)
    for (const auto& e : r.evals)
      all << e.step << ',' << r.norm << ',' << r.seed << ',' << e.train_loss << ',' << e.val_loss << ',' << e.lr << ','
          << e.ms_per_step << ',' << e.tokens_per_s << ',' << e.train_bpb << ',' << e.val_bpb << '\n';
}

// The summary table on stdout; with an output directory also summary.md, the val-loss chart and,
// for several runs, the combined metrics.csv.
void write_report(const Options& o, const std::vector<lm::RunResult>& runs) {
  if (lm::job_rank() != 0) return;  // rank 0 writes for the job
  std::cout << "\n" << lm::summary_table(runs);
  const fs::path top = o.resume.empty() ? fs::path(o.c.out) : fs::path(o.resume);
  if (top.empty()) return;
  fs::create_directories(top);
  std::ofstream(top / "summary.md") << lm::summary_markdown(runs, settings_line(o.c));
  const std::string arch = runs.empty() ? o.arch : runs.front().arch;
  std::ofstream(top / "val_loss.svg") << lm::val_loss_svg(runs, "Validation loss by normalisation (" + arch + ")");
  std::ofstream(top / "val_bpb.svg") << lm::val_loss_svg(runs, "Validation bits per byte by normalisation (" + arch + ")", true);
  if (o.compare || o.seeds > 1) write_combined_metrics(top / "metrics.csv", runs);
  std::cout << "\nsummary: " << (top / "summary.md").string() << "\nchart:   " << (top / "val_loss.svg").string() << "\n";
}

// Runs the chosen mode. Errors propagate to main.
void run(Mode mode, const Options& o, const CLI::App& app) {
  using tg::nn::NormKind;
  if (o.threads > 0) tg::set_num_threads(o.threads);
  std::vector<lm::RunResult> runs;
  switch (mode) {
    case Mode::trace: trace_one_step(o); return;
    case Mode::resume:
      if (o.c.sample > 0 && sample_finished_run(o, app)) return;
      runs.push_back(resume_run(o, app));
      break;
    case Mode::train: runs = train_runs(o, {o.c.model.norm}); break;
    case Mode::compare:
      runs = train_runs(o, {NormKind::layernorm, NormKind::rmsnorm, NormKind::prmsnorm, NormKind::batchnorm,
                            NormKind::none});
      break;
  }
  write_report(o, runs);
}

}  // namespace

int main(int argc, char** argv) {
  lm::Job job(&argc, &argv, "train_lm");  // MPI under mpirun; then rank 0 alone prints
  Options o;
  const char* env_data = std::getenv("TAPEGRAD_DATA");
  o.c.data = env_data ? env_data : "data/tinyshakespeare.txt";
  o.c.model.block_size = 64;

  CLI::App app{"Train a character-level GPT and compare normalisation layers (LayerNorm, RMSNorm, pRMSNorm, "
               "BatchNorm, none)."};
  // A repeated option takes its last value, so wrappers (scripts/demo) can be overridden.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_model_options(app, o);
  add_training_options(app, o);
  std::string error;
  if (const int rc = job.settle_parse(parse(app, o, argc, argv, error), error); rc >= 0) return rc;

  try {
    lm::agree("options", options_text(o));  // ranks given different command lines stop here
    run(pick_mode(o), o, app);
    return 0;
  } catch (const tg::Error& e) {
    return job.fail(e, 2);  // under mpirun, an error of one rank alone ends the job
  } catch (const std::exception& e) {
    return job.fail(e, 1);
  }
}
