#include "lm/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lm/checkpoint.h"
#include "tapegrad/anomaly.h"
#include "tapegrad/autocast.h"
#include "tapegrad/checkpoint.h"
#include "lm/run_dir.h"
#include "lm/signals.h"
#include "lm/gguf_cli.h"
#include "lm/tokens.h"

namespace lm {

namespace fs = std::filesystem;
using namespace tg;

double peak_rss_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return NAN;
}

void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";  // resets the peak RSS to the current RSS (Linux >= 4.0)
}

namespace {

constexpr const char* kMetricsHeader = "step,norm,train_loss,val_loss,lr,ms_per_step,tokens_per_s,train_bpb,val_bpb";
constexpr const char* kStepLogHeader = "step,loss,lr,ms";

// The configuration with the corpus's vocabulary size and the decay horizon filled in, checked.
TrainConfig checked(const TrainConfig& in, const Corpus& corpus) {
  TrainConfig cfg = in;
  cfg.model.vocab_size = corpus.vocab_size();
  cfg.tokenizer = tokenizer_kind(corpus);
  cfg.model.validate();
  if (cfg.lr_decay_iters < 0) cfg.lr_decay_iters = cfg.steps;
  if (cfg.batch_size < 1) fail("train", "batch size must be >= 1, got ", cfg.batch_size);
  if (cfg.steps < 0) fail("train", "steps must be >= 0, got ", cfg.steps);
  if (cfg.eval_interval < 1) fail("train", "eval interval must be >= 1, got ", cfg.eval_interval);
  return cfg;
}

// A generator for batches, separate from the default one (weights, dropout) and not correlated
// with it: its seed is a hash of the run's seed.
std::uint64_t batch_seed(std::uint64_t seed) { return Generator::bits(seed, 0x5eedba7c); }

// Mean loss over eval_iters batches of a split, from a generator seeded afresh every time (so
// every evaluation of a run, and of every norm, sees the same batches). In a data-parallel run
// each rank takes its slice of every batch, with rank 0's buffers, and the ranks' means average.
double estimate_loss(nn::GPT& model, const std::vector<std::int32_t>& split, const TrainConfig& c, DataParallel& par) {
  Generator g(c.seed + 1);
  NoGradGuard ng;
  par.sync_buffers();
  AutocastGuard autocast(c.precision == "bf16");  // as the reference evaluates
  model.eval();
  double s = 0;
  Tensor x, y;
  for (std::int64_t i = 0; i < c.eval_iters; ++i) {
    sample_batch(split, c.batch_size, c.model.block_size, g, x, y);
    par.take_slice(x, y);
    s += model.loss(x, y).item();
  }
  model.train();
  return par.mean(s) / static_cast<double>(c.eval_iters);
}

// Opens a CSV log for appending. A fresh run starts it with just its header. A resumed run keeps
// the rows up to the checkpoint's step, so that the rows the stopped process wrote after its last
// checkpoint are not repeated; a torn last row (a kill mid-write) is dropped too. A file that already
// holds exactly those rows is left untouched.
std::ofstream open_log(const fs::path& file, const char* header, bool resume, std::int64_t upto) {
  std::string kept = std::string(header) + "\n";
  if (resume) {
    const auto commas = std::count(header, header + std::strlen(header), ',');
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::int64_t step = 0;
      const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), step);
      if (ec == std::errc() && end != line.data() + line.size() && *end == ',' && step <= upto &&
          std::count(line.begin(), line.end(), ',') == commas)
        kept += line + "\n";
    }
  }
  write_if_changed(file.string(), kept);
  return std::ofstream(file, std::ios::app);
}

// Without clipping nothing computes the gradient norm, yet a non-finite gradient must still be
// refused before the update: the last non-finite gradient value, or 0 when all are finite.
double non_finite_gradient(const std::vector<Tensor>& params) {
  double bad = 0;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    const float* d = g.data<float>();  // the model is float32
    for (std::int64_t i = 0; i < g.numel(); ++i)
      if (!std::isfinite(d[i])) bad = d[i];
  }
  return bad;
}

// Re-runs one step's forward and backward in anomaly mode and returns its report: the first op on
// the tape whose output or gradient holds a NaN or Inf, with its shapes.
std::string locate_anomaly(nn::GPT& model, const Tensor& x, const Tensor& y) {
  DetectAnomalyGuard anomaly(true);
  try {
    Tensor loss = model.loss(x, y);
    loss.backward();
  } catch (const Error& e) {
    tape().clear();
    for (auto& p : model.parameters()) p.zero_grad();
    return e.what();
  }
  tape().clear();
  for (auto& p : model.parameters()) p.zero_grad();
  return "anomaly mode found no NaN or Inf when re-running the step";
}

std::string fmt_eta(double seconds) {
  char buf[32];
  const int s = static_cast<int>(seconds + 0.5);
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", s / 3600, (s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%dm%02ds", s / 60, s % 60);
  return buf;
}

}  // namespace

// ---- set up or resume ----

Trainer::Trainer(const TrainConfig& cfg, const Corpus& corpus, bool resume)
    : cfg_(checked(cfg, corpus)),
      corpus_(corpus),
      resume_(resume),
      norm_(nn::to_string(cfg_.model.norm)),
      schedule_(cfg_.lr, cfg_.min_lr, cfg_.warmup, cfg_.lr_decay_iters),
      batch_gen_(batch_seed(cfg_.seed)) {
  agree_on_corpus(corpus_.path, corpus_.content_hash);  // ranks that read other bytes stop here
  Checkpoint ck;
  if (resume_) ck = read_checkpoint(cfg_.out, cfg_.model, &corpus_);  // checked before anything is built
  DataParallel::only_rank0_writes(cfg_);
  if (!cfg_.out.empty()) lock_ = RunLock(cfg_.out);  // creates the directory; one writer at a time
  build_model();
  if (!resume_ && !cfg_.init_from.empty()) init_from_gguf(*model_, cfg_.init_from, corpus_);
  if (!resume_) save_tokenizer(corpus_, cfg_.out);  // tokenizer.json of a BPE run (a resume reads it)
  if (resume_) restore(ck);
  par_ = std::make_unique<DataParallel>(*model_, cfg_, step_, batch_gen_);  // refuses ranks that differ
  // A new run records its corpus by its absolute path, so that a resume from another working
  // directory reads the same file. After the ranks agree: theirs may resolve it differently
  // (another machine), and only rank 0 writes it. A resumed run keeps the path it has.
  if (!resume_) cfg_.data = absolute_corpus_path(cfg_.data);
  r_.start_step = step_;
  open_logs();
  tty_ = cfg_.progress && isatty(STDERR_FILENO);
  tokens_per_step_ = static_cast<double>(cfg_.batch_size * cfg_.model.block_size);
  reset_peak_rss();
  reset_peak_memory_stats();
}

Trainer::~Trainer() = default;

// The GPT from the run's seed, so that every norm starts from the same weights where their
// parameters coincide, and AdamW with weight decay on matrices only (as the reference).
void Trainer::build_model() {
  manual_seed(cfg_.seed);  // weights and dropout
  model_ = std::make_unique<nn::GPT>(cfg_.model);
  model_->set_gradient_checkpointing(cfg_.gradient_checkpointing);
  std::vector<Tensor> decay, no_decay;
  for (auto& [name, p] : model_->named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<optim::ParamGroup> groups{{decay, cfg_.lr, cfg_.weight_decay}};
  if (!no_decay.empty()) groups.push_back({no_decay, cfg_.lr, 0.0});
  opt_ = std::make_unique<optim::AdamW>(groups, cfg_.lr, cfg_.beta1, cfg_.beta2, 1e-8, cfg_.weight_decay);
  params_ = model_->parameters();
  r_.arch = nn::to_string(cfg_.model.arch);
  r_.norm = norm_;
  r_.tokenizer = cfg_.tokenizer;
  r_.seed = cfg_.seed;
  r_.parameters = model_->num_parameters();
}

// Puts the checkpoint's state into the freshly built model, optimiser and generators; then the
// next step draws the same batch and the same dropout masks as the uninterrupted run would.
void Trainer::restore(Checkpoint& ck) {
  Metadata& meta = ck.meta;
  if (meta["format"] != kCheckpointFormat) fail("resume", ck.file, " is not a train_lm checkpoint");
  StateDict msd, osd;
  for (const auto& [k, t] : ck.tensors) {  // model names already upgraded by read_checkpoint
    if (k.rfind("model.", 0) == 0) msd.insert(k.substr(6), t);
    else if (k.rfind("optim.", 0) == 0) osd.insert(k.substr(6), t);
  }
  model_->load_state_dict(msd);
  opt_->load_state_dict(osd);
  msd = StateDict();
  osd = StateDict();
  const std::uint64_t step = meta_u64(meta, "step", ck.file);
  if (step > (std::uint64_t(1) << 62)) fail("resume", ck.file, ": step ", step, " is out of range");
  step_ = static_cast<std::int64_t>(step);
  batch_gen_.set_state(meta_u64(meta, "batch_rng_seed", ck.file), meta_u64(meta, "batch_rng_offset", ck.file));
  default_generator().set_state(meta_u64(meta, "rng_seed", ck.file), meta_u64(meta, "rng_offset", ck.file));
  r_.best_val = meta_double(meta, "best_val", ck.file);
  ck.tensors = StateDict();  // copied into the model and the optimiser: not kept for the whole run
}

void Trainer::open_logs() {
  if (cfg_.out.empty()) return;
  metrics_ = open_log(fs::path(cfg_.out) / "metrics.csv", kMetricsHeader, resume_, step_);
  steplog_ = open_log(fs::path(cfg_.out) / "train_log.csv", kStepLogHeader, resume_, step_);
  steplog_.precision(9);  // losses to about 1e-8: runs compare step by step (e.g. at different world sizes)
}

// ---- one training step ----

double Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  lr_ = schedule_(step_);
  opt_->set_lr(lr_);
  sample_batch(corpus_.train, cfg_.batch_size, cfg_.model.block_size, batch_gen_, x_, y_);
  par_->take_slice(x_, y_);  // this rank's rows of the global batch
  opt_->zero_grad();  // the gradients are dropped before the forward, not kept through it
  Tensor loss;
  double gnorm = 0;
  {
    DetectAnomalyGuard anomaly(cfg_.detect_anomaly);
    {
      AutocastGuard autocast(cfg_.precision == "bf16");  // the backward follows what the forward recorded
      DataParallel::ForwardScope shard = par_->forward_scope();
      op_timing_mark();  // with op timing on (bench_train --profile), the forward starts here
      loss = model_->loss(x_, y_);
    }
    loss_ = par_->mean(loss.item());  // the global batch's loss, on every rank
    if (std::isfinite(loss_)) {
      loss.backward();
      par_->finish_gradients();  // averaged over the ranks
      // With clipping, the norm, the clipping and AdamW's update in one call, which leaves the
      // weights untouched when the norm is not finite; without it, the check, then step() below.
      gnorm = cfg_.grad_clip > 0 ? opt_->clip_and_step(cfg_.grad_clip) : non_finite_gradient(params_);
    }
  }
  if (!std::isfinite(loss_) || !std::isfinite(gnorm)) {
    // Stop before the optimiser step can spread the NaN into the weights; the checkpoint on disk
    // is the last good state. Re-running this step's batch in anomaly mode names the op that
    // first produced a NaN or Inf (its forward, or its backward when only the gradients blew up).
    loss = Tensor();
    tape().clear();
    DataParallel::Local local(*par_);  // the re-run stays on this rank
    const std::string what = std::isfinite(loss_) ? "the gradient norm became " + std::to_string(gnorm)
                                                  : "the loss became " + std::to_string(loss_);
    fail_job("train", norm_, ": ", what, " at step ", step_ + 1, " (", locate_anomaly(*model_, x_, y_),
         "); the last checkpoint", cfg_.out.empty() ? std::string(" (none: no --out)") : " in '" + cfg_.out + "'",
         " is kept");
  }
  if (cfg_.grad_clip <= 0) opt_->step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  times_.push_back(ms);
  r_.step_loss.push_back(loss_);
  ++step_;
  if (steplog_.is_open()) steplog_ << step_ << ',' << loss_ << ',' << lr_ << ',' << ms << '\n';
  return loss_;
}

// ---- evaluate and checkpoint ----

bool Trainer::eval_due() const { return step_ % cfg_.eval_interval == 0 || step_ == cfg_.steps; }

EvalPoint Trainer::evaluate() {
  const double med = median_ms();
  EvalPoint e{step_,
              estimate_loss(*model_, corpus_.train, cfg_, *par_),
              estimate_loss(*model_, corpus_.val, cfg_, *par_),
              lr_,
              med,
              tokens_per_step_ / med * 1e3};
  e.train_bpb = bits_per_byte(e.train_loss, corpus_, false);
  e.val_bpb = bits_per_byte(e.val_loss, corpus_, true);
  return e;
}

void Trainer::checkpoint() {
  if (cfg_.out.empty() || !cfg_.checkpoints) return;
  // The logs reach the disk before the checkpoint that vouches for their rows.
  metrics_.flush();
  steplog_.flush();
  StateDict all;
  for (const auto& [k, t] : model_->state_dict()) all.insert("model." + k, t);
  for (const auto& [k, t] : opt_->state_dict()) all.insert("optim." + k, t);
  Metadata meta{{"format", kCheckpointFormat},
                {"step", std::to_string(step_)},
                {"config", config_json(cfg_)},
                {"vocab", corpus_.vocab_utf8()},
                {"batch_rng_seed", std::to_string(batch_gen_.seed())},
                {"batch_rng_offset", std::to_string(batch_gen_.offset())},
                {"rng_seed", std::to_string(default_generator().seed())},
                {"rng_offset", std::to_string(default_generator().offset())},
                {"best_val", exact(r_.best_val)},
                {kCorpusHashKey, std::to_string(corpus_.content_hash)}};
  if (!corpus_.train.empty()) meta[kFirstTokenKey] = std::to_string(corpus_.train.front());
  // whole or not at all: a temporary file of its own, fsync, rename (tg::save_safetensors)
  save_safetensors((fs::path(cfg_.out) / "checkpoint.safetensors").string(), all, meta);
}

int Trainer::stop_requested() const { return par_->agree_stop(stop_signal()); }

// ---- report ----

// Linear in the values (the progress line asks every 10 steps): nth_element puts the upper middle
// value at h and only smaller or equal ones before it, whose largest is the lower middle.
double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  const auto h = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), h, v.end());
  return v.size() % 2 ? *h : (*std::max_element(v.begin(), h) + *h) / 2;
}

// The first steps are left out while caches and the allocator warm up.
double steady_median_ms(std::vector<double> ms) {
  ms.erase(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(10, ms.size() / 2)));
  return median(std::move(ms));
}

double Trainer::median_ms() const { return steady_median_ms(times_); }

void Trainer::report_progress() {
  if (!tty_ || !((step_ - 1) % 10 == 0 || eval_due())) return;
  const double med = median_ms();
  std::fprintf(stderr, "\r  %-9s step %5lld/%lld | loss %.4f | lr %.2e | %6.0f tok/s | ETA %s   ", norm_.c_str(),
               static_cast<long long>(step_), static_cast<long long>(cfg_.steps), loss_, lr_,
               tokens_per_step_ / med * 1e3, fmt_eta(med * 1e-3 * static_cast<double>(cfg_.steps - step_)).c_str());
  std::fflush(stderr);
}

void Trainer::report_metrics(const EvalPoint& e) {
  r_.evals.push_back(e);
  if (!(e.val_loss >= r_.best_val)) r_.best_val = e.val_loss;  // also when best_val is NaN
  if (metrics_.is_open()) {
    metrics_ << e.step << ',' << norm_ << ',' << e.train_loss << ',' << e.val_loss << ',' << e.lr << ','
             << e.ms_per_step << ',' << e.tokens_per_s << ',' << e.train_bpb << ',' << e.val_bpb << '\n';
    metrics_.flush();
    steplog_.flush();
  }
  if (cfg_.progress && !tty_)
    std::fprintf(stderr, "  %-9s step %5lld/%lld | train %.4f | val %.4f | %.1f ms/step\n", norm_.c_str(),
                 static_cast<long long>(e.step), static_cast<long long>(cfg_.steps), e.train_loss, e.val_loss,
                 e.ms_per_step);
}

// ---- the end of the run: summary numbers, sample, final weights ----

void Trainer::finish() {
  if (tty_) std::fprintf(stderr, "\n");  // ends the progress line
  r_.ms_per_step_median = median_ms();
  r_.tokens_per_s = tokens_per_step_ / r_.ms_per_step_median * 1e3;
  r_.peak_rss_mb = peak_rss_mb();
  r_.peak_tensor_mb = static_cast<double>(max_memory_allocated()) / (1 << 20);
  r_.world_size = job_size();
  r_.comm = par_->comm_summary();
  if (!r_.evals.empty()) {
    r_.final_train = r_.evals.back().train_loss;
    r_.final_val = r_.evals.back().val_loss;
  }
}

void Trainer::sample() {
  if (cfg_.sample <= 0) return;
  Generator g(cfg_.seed + 2);
  const std::vector<std::int32_t> prompt =
      cfg_.prompt.empty() ? std::vector<std::int32_t>{corpus_.train[0]} : corpus_.encode(cfg_.prompt);
  auto ids = model_->generate(prompt, cfg_.sample, cfg_.temperature, cfg_.top_k, &g);
  r_.sample_text = corpus_.decode(prompt) + corpus_.decode(ids);
  if (cfg_.out.empty()) return;
  // The first line names the weights the text was drawn from: a resume that does not sample
  // leaves the file as it is, and it still says which step it shows.
  std::ostringstream head;
  head << "step " << step_ << " (temperature " << cfg_.temperature << ", top-k "
       << (cfg_.top_k > 0 ? std::to_string(cfg_.top_k) : std::string("0: all")) << ")\n";
  write_if_changed((fs::path(cfg_.out) / "samples.txt").string(), head.str() + r_.sample_text + "\n");
}

void Trainer::save_model() {
  if (cfg_.out.empty()) return;
  const Metadata meta{{"format", kModelFormat},
                      {"config", model_config_json(cfg_)},
                      {"vocab", corpus_.vocab_utf8()},
                      {"tokenizer", corpus_.bpe ? "tokenizer.json" : "char"}};
  r_.model_written = write_if_changed((fs::path(cfg_.out) / "model.safetensors").string(),
                                      to_safetensors_bytes(export_state_dict(*model_), meta));
}

// ---- the whole run ----

// A SIGINT or SIGTERM (lm/signals.h) ends the step in progress, then the run after a checkpoint:
// the evaluation and checkpoint due at that step, or a checkpoint alone. At the last step the run
// finishes instead: its final checkpoint is written already.
RunResult train(const TrainConfig& cfg, const Corpus& corpus, bool resume) {
  Trainer t(cfg, corpus, resume);
  // A new run of 0 steps still leaves its step-0 checkpoint, so that its directory resumes like
  // any other (a resumed run has its checkpoint already, and a finished one is left untouched).
  if (!resume && t.done()) t.checkpoint();
  while (!t.done()) {
    t.train_step();
    t.report_progress();
    const int stop = t.stop_requested();
    if (t.eval_due()) {
      if (cfg.eval_iters > 0) t.report_metrics(t.evaluate());
      t.checkpoint();
    } else if (stop) {
      t.checkpoint();
    }
    if (stop && !t.done()) throw Interrupted(stop, t.step(), cfg.checkpoints ? t.out() : std::string());
  }
  t.finish();
  t.sample();
  t.save_model();  // unchanged bytes (a finished run resumed) leave the file untouched
  return t.result();
}

}  // namespace lm
