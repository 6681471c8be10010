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
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "lm/checkpoint.h"
#include "lm/gguf_cli.h"
#include "lm/parallel.h"
#include "lm/report.h"
#include "lm/resume.h"
#include "lm/run_dir.h"
#include "lm/signals.h"
#include "lm/tokens.h"
#include "lm/trainer.h"

namespace fs = std::filesystem;

namespace {

// Everything the command line sets: the run's configuration and how to run it.
struct Options {
  lm::TrainConfig c;
  std::string arch = "gpt", norm = "rmsnorm";
  bool compare = false, quiet = false, trace = false, overwrite = false;
  int seeds = 1, threads = 0;
  std::string resume;  // a run directory to continue
  lm::GGUFOptions gguf;
  lm::TokenizerChoice tok;  // --tokenizer, --vocab-size
};

enum class Mode { train, compare, resume, trace, export_gguf };

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
        if (!std::isfinite(v)) return std::string("must be a finite number ") + what + ", got " + s;
        if (lo_open ? !(v > lo) : !(v >= lo)) return std::string("must be ") + what + ", got " + s;
        if (!(v <= hi)) return std::string("must be ") + what + ", got " + s;
        return "";
      },
      what);
}
const CLI::Validator kPositive = bound("> 0", 0, true);
const CLI::Validator kNonNegative = bound(">= 0", 0, false);
const CLI::Validator kFraction = bound("in (0, 1]", 0, true, 1);
// OpenBLAS runs at most 64 threads; more would be cut to 64 without a word.
constexpr int kMaxThreads = 64;

// An unsigned 64-bit integer written in decimal digits: no sign, no wrap-around.
const CLI::Validator kSeed(
    [](std::string& s) -> std::string {
      std::uint64_t v = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
      if (s.empty() || s[0] == '+' || ec != std::errc() || end != s.data() + s.size())
        return "must be an integer in [0, 18446744073709551615], got " + s;
      return "";
    },
    "in [0, 2^64)");

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
  app.add_option("--seed", c.seed, "random seed")->check(kSeed)->capture_default_str();
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
  app.add_option("--lr-decay-iters", c.lr_decay_iters, "step where the cosine reaches min-lr (default: --steps)")
      ->check(kNonNegative);
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay on matrices")->check(kNonNegative)->capture_default_str();
  app.add_option("--grad-clip", c.grad_clip, "clip the global gradient norm (0: off)")->check(kNonNegative)->capture_default_str();
  app.add_option("--steps", c.steps, "total training steps (also when resuming)")->check(kNonNegative)->capture_default_str();
  app.add_option("--eval-interval", c.eval_interval, "steps between evaluations and checkpoints")->check(kPositive)->capture_default_str();
  app.add_option("--eval-iters", c.eval_iters, "batches per split per evaluation")->check(kNonNegative)->capture_default_str();
  app.add_option("--threads", o.threads, "threads (default: all cores)")->check(bound("in [1, 64]", 1, false, kMaxThreads));
  app.add_option("--out", c.out, "output directory (metrics, summary, chart, samples, checkpoints); refused when it "
                                 "holds a run already (see --resume, --overwrite)");
  app.add_flag("--overwrite", o.overwrite, "with --out: delete the run DIR holds (its checkpoint, model, logs and "
                                           "report; nothing else) and start afresh");
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

// --help marks the flags a resumed run may change; any other flag given with --resume must equal
// the run's (lm/resume.h).
void mark_resume_flags(CLI::App& app) {
  for (const std::string& f : lm::flags_resume_may_change())
    if (CLI::Option* opt = app.get_option_no_throw(f)) opt->description(opt->get_description() + " [may change on --resume]");
  app.footer(
      "--resume DIR continues the run in DIR with its own configuration. Flags marked [may change on --resume] may be "
      "given to change it; any other flag given must equal the run's (each difference is listed and refused).\n"
      "SIGINT or SIGTERM: the step in progress ends, a checkpoint is written, the exit code is 130 or 143; a second "
      "signal ends the process at once, keeping the last checkpoint. One process at a time writes a run directory.");
}

// What the flags alone cannot check: combinations.
void check_combinations(const Options& o, const CLI::App& app) {
  if (!o.resume.empty() && (o.compare || o.seeds > 1))
    throw CLI::ValidationError("--resume", "continues one run; not with --compare or --seeds");
  if (!o.resume.empty() && o.overwrite) throw CLI::ValidationError("--overwrite", "starts a new run; not with --resume");
  for (const char* f : {"--tokenizer", "--vocab-size"})
    if (!o.resume.empty() && app.count(f))
      throw CLI::ValidationError(f, "not with --resume: a resumed run keeps the tokenizer it was trained with");
  if (!o.resume.empty() && app.count("--out"))
    throw CLI::ValidationError("--out", "not with --resume: a resumed run writes to its own directory");
  if (o.resume.empty() && o.c.min_lr > o.c.lr)
    throw CLI::ValidationError("--min-lr", (std::ostringstream() << o.c.min_lr << " is above --lr " << o.c.lr).str() +
                                               ": the cosine decays from --lr down to --min-lr");
  if (o.c.seed > UINT64_MAX - static_cast<std::uint64_t>(o.seeds - 1))
    throw CLI::ValidationError("--seed", "with --seeds the seeds run from --seed up, past 2^64 - 1");
}

// Parses the command line into o and checks what the flags alone cannot (the model's own
// constraints), before anything is printed or read. Returns -1 to go on, else the exit code:
// 0 after --help, 2 with the reason in `error` (lm::Job::settle_parse prints it).
int parse(CLI::App& app, Options& o, int argc, char** argv, std::string& error) {
  try {
    app.parse(argc, argv);
    check_combinations(o, app);
    o.c.model.arch = tg::nn::parse_arch(o.arch);
    tg::nn::GPTConfig check = o.c.model;
    check.vocab_size = 1;
    check.validate();
    o.c.progress = !o.quiet;
    o.c.model.norm = tg::nn::parse_norm_kind(o.norm);
    lm::settle_gguf_options(o.gguf, app, !o.resume.empty(), o.c);
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
  if (!o.gguf.export_file.empty()) return Mode::export_gguf;
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
    tg::write_file_atomic((fs::path(c.out) / "tape.dot").string(), tg::tape().to_dot());  // a failed write is an error
    std::cout << "Graphviz: " << (fs::path(c.out) / "tape.dot").string() << " (dot -Tsvg tape.dot -o tape.svg)\n";
  }
  loss.backward();
}

// The run in o.resume as it continues: its checkpoint's configuration, with what this command line
// may change (lm/resume.h); any other flag that differs is refused, every rank alike. meta: the
// checkpoint's metadata.
lm::TrainConfig resumed_config(const Options& o, const CLI::App& app, tg::Metadata& meta) {
  std::vector<std::string> notes;
  lm::TrainConfig r;
  try {
    meta = lm::read_checkpoint_meta(o.resume);
    const std::string file = (fs::path(o.resume) / "checkpoint.safetensors").string();
    const lm::TrainConfig run = lm::parse_config_json(meta["config"], file);
    r = lm::resume_config(run, o.c, [&](const std::string& flag) { return app.count(flag) > 0; }, notes);
  } catch (const tg::Error& e) {
    throw lm::JobError(e.what());  // every rank reads the same file with the same flags
  }
  r.out = o.resume;
  for (const std::string& n : notes) std::cerr << n << "\n";
  return r;
}

// True when dir's report was written after its model (the order a run ends in): model, summary,
// chart. A report from before the model (a run stopped between the two) is not complete.
bool report_complete(const fs::path& dir) {
  std::error_code ec;
  const auto model = fs::last_write_time(dir / "model.safetensors", ec);
  if (ec) return false;
  const auto summary = fs::last_write_time(dir / "summary.md", ec);
  if (ec) return false;
  const auto chart = fs::last_write_time(dir / "val_loss.svg", ec);
  return !ec && model <= summary && summary <= chart;
}

// True when the run in r.out has nothing left to do: its checkpoint (meta) is at r.steps or
// beyond, its model was written by the configuration that wrote the checkpoint, and its report
// after the model.
bool nothing_to_do(const lm::TrainConfig& r, const tg::Metadata& meta) {
  const fs::path dir(r.out);
  if (!report_complete(dir)) return false;
  tg::Metadata model;
  try {
    tg::load_safetensors((dir / "model.safetensors").string(), &model);
    // The model file names the corpus by its file name (lm::model_config_json); one written by an
    // earlier version holds the checkpoint's configuration as it is.
    return static_cast<std::int64_t>(lm::meta_u64(meta, "step", "checkpoint")) >= r.steps &&
           (model["config"] == lm::model_config_json(lm::parse_config_json(meta.at("config"), "checkpoint")) ||
            model["config"] == meta.at("config"));
  } catch (const tg::Error&) {
    return false;  // the resume itself reports what is wrong
  }
}

// Continues the run in r.out; returns its result for the whole run (every evaluation in its
// metrics.csv), or nothing when this process changed no file of a finished run.
std::vector<lm::RunResult> resume_run(const lm::TrainConfig& r, const tg::Metadata& meta) {
  lm::RunLock lock;
  lm::on_rank0([&] { lock = lm::RunLock(r.out); });
  // Runs of earlier versions may record a relative path: it is read from this working directory.
  if (!fs::path(r.data).is_absolute())
    lm::on_rank0([&] {
      std::cerr << "note: the run names its corpus by a relative path; reading it from this working directory: "
                << lm::shown_path(r.data) << "\n";
    });
  std::error_code ec;
  if (!fs::exists(r.data, ec))
    tg::fail("resume", "the run's corpus ", lm::shown_path(r.data),
             " does not exist; if it moved, give --data with its new path");
  lm::Corpus corpus = lm::load_corpus(r.data, r.model.block_size, lm::run_tokenizer(r.tokenizer, r.out));
  lm::agree_on_corpus(corpus.path, corpus.content_hash);  // then every rank checks the same corpus
  try {
    lm::check_corpus(meta, (fs::path(r.out) / "checkpoint.safetensors").string(), corpus);
  } catch (const tg::Error& e) {
    throw lm::JobError(e.what());
  }
  std::cerr << "resuming " << r.out << " (" << tg::nn::to_string(r.model.norm) << ") up to step " << r.steps << "\n";
  lm::RunResult res = lm::train(r, corpus, true);
  if (res.step_loss.empty() && !res.model_written && report_complete(r.out)) return {};
  return {lm::whole_run(res, r.out, static_cast<double>(r.batch_size * r.model.block_size))};
}

// The prompt of a sample from the finished run r.out, in the tokens of its checkpoint ck (vocab):
// --prompt, else the first token of the run's training split, as the run's own samples.txt starts
// (lm::Trainer::sample): as the checkpoint records it, else (a checkpoint of an earlier version)
// from the corpus.
std::vector<std::int32_t> sample_prompt(const lm::TrainConfig& r, const lm::Checkpoint& ck, const lm::Corpus& vocab) {
  if (!r.prompt.empty()) return vocab.encode(r.prompt);
  if (const auto first = lm::recorded_first_token(ck.meta, ck.file, vocab.vocab_size())) return {*first};
  lm::Corpus chars;
  try {
    chars = lm::load_corpus(r.data, r.model.block_size);
  } catch (const tg::Error& e) {
    tg::fail("--sample", "without --prompt a sample starts from the first character of the run's corpus, which "
             "cannot be read (", e.what(), "); give --prompt, or --data with the corpus's new path");
  }
  // A BPE token may span several characters: the split is encoded as the run encoded it.
  const std::vector<std::int32_t> first =
      vocab.encode(vocab.bpe ? chars.decode(chars.train) : chars.decode({chars.train.front()}));
  return {first.front()};
}

// Samples from the finished run r.out without training or writing anything: its checkpoint's
// weights, configuration and vocabulary; the prompt, then --sample characters, on stdout. False
// when the run is not finished (it then resumes).
bool sample_finished_run(const lm::TrainConfig& r) {
  lm::Checkpoint ck = lm::read_checkpoint(r.out, r.model);
  if (static_cast<std::int64_t>(lm::meta_u64(ck.meta, "step", ck.file)) < r.steps) return false;
  const lm::Corpus vocab = lm::vocabulary_only(ck.meta["vocab"]);
  const std::vector<std::int32_t> prompt = sample_prompt(r, ck, vocab);
  if (prompt.empty()) tg::fail("prompt", "is empty");
  tg::nn::GPT model(r.model);
  tg::StateDict weights;
  for (const auto& [k, t] : ck.tensors)
    if (k.rfind("model.", 0) == 0) weights.insert(k.substr(6), t);
  model.load_state_dict(weights);
  tg::Generator g(r.seed + 2);
  const auto ids = model.generate(prompt, r.sample, r.temperature, r.top_k, &g);
  if (lm::job_rank() == 0) std::cout << vocab.decode(prompt) << vocab.decode(ids) << std::endl;
  return true;
}

void write_report(const Options& o, const lm::TrainConfig& settings, const fs::path& top,
                  const std::vector<lm::RunResult>& runs);

// Trains each norm of kinds over o.seeds seeds, in turn, on the same corpus, and writes the report.
// With several runs each has its own directory under --out: <norm>/ with --compare, seed<N>/ with
// --seeds. The directory stays locked until the report is written: a process stopped while it
// writes a report file leaves a temporary file, which the next lock of the directory removes.
void train_runs(const Options& o, const std::vector<tg::nn::NormKind>& kinds) {
  const lm::TrainConfig& c = o.c;
  lm::RunLock lock;  // the whole directory, for every run under it
  if (!c.out.empty()) lm::on_rank0([&] { lock = lm::claim_new_run(c.out, o.overwrite); });
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
  write_report(o, c, c.out, runs);
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
  std::ostringstream all;
  all << "step,norm,seed,train_loss,val_loss,lr,ms_per_step,tokens_per_s,train_bpb,val_bpb\n";
  for (const auto& r : runs)
    for (const auto& e : r.evals)
      all << e.step << ',' << r.norm << ',' << r.seed << ',' << e.train_loss << ',' << e.val_loss << ',' << e.lr << ','
          << e.ms_per_step << ',' << e.tokens_per_s << ',' << e.train_bpb << ',' << e.val_bpb << '\n';
  lm::write_if_changed(file.string(), all.str());
}

// Where summary.md says every step is logged.
std::string step_log_name(const Options& o) {
  std::string name = "train_log.csv";
  if (o.seeds > 1) name = "seed<N>/" + name;
  if (o.compare) name = "<norm>/" + name;
  return name;
}

// The summary table on stdout; in the run directory top also summary.md, the val-loss chart and,
// for several runs, the combined metrics.csv (each file rewritten only when its text changed).
void write_report(const Options& o, const lm::TrainConfig& settings, const fs::path& top,
                  const std::vector<lm::RunResult>& runs) {
  if (lm::job_rank() != 0) return;  // rank 0 writes for the job
  std::cout << "\n" << lm::summary_table(runs);
  if (top.empty()) return;
  fs::create_directories(top);
  lm::write_if_changed((top / "summary.md").string(),
                       lm::summary_markdown(runs, settings_line(settings), step_log_name(o)));
  const std::string arch = runs.empty() ? o.arch : runs.front().arch;
  lm::write_if_changed((top / "val_loss.svg").string(),
                       lm::val_loss_svg(runs, "Validation loss by normalisation (" + arch + ")"));
  lm::write_if_changed((top / "val_bpb.svg").string(),
                       lm::val_loss_svg(runs, "Validation bits per byte by normalisation (" + arch + ")", true));
  if (o.compare || o.seeds > 1) write_combined_metrics(top / "metrics.csv", runs);
  std::cout << "\nsummary: " << (top / "summary.md").string() << "\nchart:   " << (top / "val_loss.svg").string() << "\n";
}

// --resume: sample a finished run, leave one with nothing to do as it is, or continue it.
void resume(const Options& o, const CLI::App& app) {
  tg::Metadata meta;
  const lm::TrainConfig r = resumed_config(o, app, meta);
  if (r.sample > 0 && sample_finished_run(r)) return;
  // Locked through the report, as train_runs; and also when there is nothing to do, so that a
  // temporary file left by a process stopped while it wrote the finished run's report goes.
  lm::RunLock lock;
  lm::on_rank0([&] { lock = lm::RunLock(r.out); });
  if (nothing_to_do(r, meta)) {
    std::cerr << "the run in " << r.out << " is finished (step " << r.steps
              << " reached): nothing to do; --steps N continues it, --sample N samples it\n";
    return;
  }
  const std::vector<lm::RunResult> runs = resume_run(r, meta);
  if (!runs.empty()) write_report(o, r, r.out, runs);
}

// Runs the chosen mode. Errors propagate to main.
void run(Mode mode, const Options& o, const CLI::App& app) {
  using tg::nn::NormKind;
  if (o.threads > 0) tg::set_num_threads(o.threads);
  switch (mode) {
    case Mode::trace: trace_one_step(o); return;
    case Mode::export_gguf: std::cerr << lm::export_run_gguf(o.resume, o.gguf) << "\n"; return;
    case Mode::resume: resume(o, app); return;
    case Mode::train: train_runs(o, {o.c.model.norm}); return;
    case Mode::compare:
      train_runs(o, {NormKind::layernorm, NormKind::rmsnorm, NormKind::prmsnorm, NormKind::batchnorm, NormKind::none});
      return;
  }
}

// The line a run stopped by SIGINT or SIGTERM ends with (rank 0), and its exit code.
int report_interrupted(const lm::Interrupted& e) {
  if (lm::job_rank() == 0) {
    if (isatty(STDERR_FILENO)) std::cerr << "\n";  // ends the progress line
    if (e.dir().empty()) std::cerr << "interrupted at step " << e.step() << "; nothing saved (no --out)" << std::endl;
    else std::cerr << "interrupted at step " << e.step() << "; resume with: train_lm --resume " << e.dir() << std::endl;
  }
  return e.exit_code();
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
  lm::add_gguf_options(app, o.gguf);
  mark_resume_flags(app);
  std::string error;
  if (const int rc = job.settle_parse(parse(app, o, argc, argv, error), error); rc >= 0) return rc;

  lm::StopOnSignal stop;  // SIGINT, SIGTERM: a checkpoint at the end of the step, then lm::Interrupted
  try {
    lm::agree("options", options_text(o));  // ranks given different command lines stop here
    run(pick_mode(o), o, app);
    return 0;
  } catch (const lm::Interrupted& e) {
    return report_interrupted(e);
  } catch (const tg::Error& e) {
    return job.fail(e, 2);  // under mpirun, an error of one rank alone ends the job
  } catch (const std::exception& e) {
    return job.fail(e, 1);
  }
}
