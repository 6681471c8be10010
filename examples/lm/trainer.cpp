#include "lm/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace lm {

namespace fs = std::filesystem;
using json = nlohmann::json;
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

constexpr const char* kFormat = "tapegrad-lm-checkpoint-1";

json config_to_json(const TrainConfig& c) {
  const auto& m = c.model;
  return json{{"data", c.data},
              {"norm", nn::to_string(m.norm)},
              {"vocab_size", m.vocab_size},
              {"block_size", m.block_size},
              {"n_layer", m.n_layer},
              {"n_head", m.n_head},
              {"n_embd", m.n_embd},
              {"dropout", m.dropout},
              {"bias", m.bias},
              {"p", m.p},
              {"eps", m.eps},
              {"batch_size", c.batch_size},
              {"steps", c.steps},
              {"lr", c.lr},
              {"min_lr", c.min_lr},
              {"warmup", c.warmup},
              {"lr_decay_iters", c.lr_decay_iters},
              {"weight_decay", c.weight_decay},
              {"beta1", c.beta1},
              {"beta2", c.beta2},
              {"grad_clip", c.grad_clip},
              {"eval_interval", c.eval_interval},
              {"eval_iters", c.eval_iters},
              {"seed", c.seed}};
}

TrainConfig config_from_json(const json& j) {
  TrainConfig c;
  c.data = j.at("data").get<std::string>();
  c.model.norm = nn::parse_norm_kind(j.at("norm").get<std::string>());
  c.model.vocab_size = j.at("vocab_size");
  c.model.block_size = j.at("block_size");
  c.model.n_layer = j.at("n_layer");
  c.model.n_head = j.at("n_head");
  c.model.n_embd = j.at("n_embd");
  c.model.dropout = j.at("dropout");
  c.model.bias = j.at("bias");
  c.model.p = j.at("p");
  c.model.eps = j.at("eps");
  c.batch_size = j.at("batch_size");
  c.steps = j.at("steps");
  c.lr = j.at("lr");
  c.min_lr = j.at("min_lr");
  c.warmup = j.at("warmup");
  c.lr_decay_iters = j.at("lr_decay_iters");
  c.weight_decay = j.at("weight_decay");
  c.beta1 = j.at("beta1");
  c.beta2 = j.at("beta2");
  c.grad_clip = j.at("grad_clip");
  c.eval_interval = j.at("eval_interval");
  c.eval_iters = j.at("eval_iters");
  c.seed = j.at("seed");
  return c;
}

// A generator for batches, separate from the default one (weights, dropout) and not correlated
// with it: its seed is a hash of the run's seed.
std::uint64_t batch_seed(std::uint64_t seed) { return Generator::bits(seed, 0x5eedba7c); }

// Mean loss over eval_iters batches of a split, from a generator seeded afresh every time (so
// every evaluation of a run, and of every norm, sees the same batches).
double estimate_loss(nn::GPT& model, const std::vector<std::int32_t>& split, const TrainConfig& c) {
  Generator g(c.seed + 1);
  NoGradGuard ng;
  model.eval();
  double s = 0;
  Tensor x, y;
  for (std::int64_t i = 0; i < c.eval_iters; ++i) {
    sample_batch(split, c.batch_size, c.model.block_size, g, x, y);
    s += model.loss(x, y).item();
  }
  model.train();
  return s / static_cast<double>(c.eval_iters);
}

void write_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail("train", "cannot write ", tmp.string());
    f << text;
    f.flush();
    if (!f) fail("train", "cannot write ", tmp.string());
  }
  fs::rename(tmp, path);
}

std::string fmt_eta(double seconds) {
  char buf[32];
  const int s = static_cast<int>(seconds + 0.5);
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", s / 3600, (s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%dm%02ds", s / 60, s % 60);
  return buf;
}

}  // namespace

namespace {
// A double in text that reads back to the same bits.
std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// Checkpoint metadata values, parsed strictly: a damaged value is a tg::Error naming the key.
const std::string& meta_value(const Metadata& meta, const std::string& key, const std::string& file) {
  auto it = meta.find(key);
  if (it == meta.end()) fail("resume", file, " has no '", key, "' entry");
  return it->second;
}
std::uint64_t meta_u64(const Metadata& meta, const std::string& key, const std::string& file) {
  const std::string& v = meta_value(meta, key, file);
  std::uint64_t out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty())
    fail("resume", file, ": '", key, "' is not an unsigned integer: '", v, "'");
  return out;
}
double meta_double(const Metadata& meta, const std::string& key, const std::string& file) {
  const std::string& v = meta_value(meta, key, file);
  char* end = nullptr;
  const double out = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size()) fail("resume", file, ": '", key, "' is not a number: '", v, "'");
  return out;  // NaN allowed: best_val before the first evaluation
}
}  // namespace

TrainConfig read_checkpoint_config(const std::string& dir) {
  Metadata meta;
  const fs::path ck = fs::path(dir) / "checkpoint.safetensors";
  if (!fs::exists(ck)) fail("resume", "no checkpoint in '", dir, "' (expected ", ck.string(), ")");
  load_safetensors(ck.string(), &meta);
  if (meta["format"] != kFormat) fail("resume", ck.string(), " is not a train_lm checkpoint");
  const std::string& text = meta_value(meta, "config", ck.string());
  try {
    return config_from_json(json::parse(text));
  } catch (const json::exception& e) {
    fail("resume", "bad config in ", ck.string(), ": ", e.what());
  }
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

RunResult train(const TrainConfig& cfg_in, const Corpus& corpus, bool resume) {
  TrainConfig cfg = cfg_in;
  cfg.model.vocab_size = corpus.vocab_size();
  cfg.model.validate();
  if (cfg.lr_decay_iters < 0) cfg.lr_decay_iters = cfg.steps;
  if (cfg.batch_size < 1) fail("train", "batch size must be >= 1, got ", cfg.batch_size);
  if (cfg.steps < 0) fail("train", "steps must be >= 0, got ", cfg.steps);
  if (cfg.eval_interval < 1) fail("train", "eval interval must be >= 1, got ", cfg.eval_interval);
  const std::string norm = nn::to_string(cfg.model.norm);

  // On resume, read the checkpoint first and hold the configuration against its tensors before
  // building anything: a damaged config (n_layer 4294967296, n_embd 1e9) must be refused, not
  // allocated.
  Metadata ck_meta;
  StateDict ck_all;
  if (resume) {
    ck_all = load_safetensors((fs::path(cfg.out) / "checkpoint.safetensors").string(), &ck_meta);
    const std::string file = (fs::path(cfg.out) / "checkpoint.safetensors").string();
    auto expect = [&](const std::string& key, const Shape& shape) {
      if (!ck_all.contains(key)) fail("resume", file, " has no tensor '", key, "'");
      if (!(ck_all.at(key).shape() == shape))
        fail("resume", file, ": '", key, "' is ", ck_all.at(key).shape(), " but the config asks for ", shape);
    };
    expect("model.wte.weight", Shape{cfg.model.vocab_size, cfg.model.n_embd});
    expect("model.wpe.weight", Shape{cfg.model.block_size, cfg.model.n_embd});
    const std::string last = "model.blocks." + std::to_string(cfg.model.n_layer - 1) + ".attn.qkv.weight";
    expect(last, Shape{3 * cfg.model.n_embd, cfg.model.n_embd});
    if (ck_all.contains("model.blocks." + std::to_string(cfg.model.n_layer) + ".attn.qkv.weight"))
      fail("resume", file, " has more blocks than the config's n_layer ", cfg.model.n_layer);
  }

  manual_seed(cfg.seed);  // weights and dropout
  nn::GPT model(cfg.model);
  std::vector<Tensor> decay, no_decay;  // weight decay on matrices only, as the reference
  for (auto& [n, p] : model.named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<optim::ParamGroup> groups{{decay, cfg.lr, cfg.weight_decay}};
  if (!no_decay.empty()) groups.push_back({no_decay, cfg.lr, 0.0});
  optim::AdamW opt(groups, cfg.lr, cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay);
  // The reference's schedule as it is, also for runs shorter than the warmup (which then warm up
  // for all their steps, as torch_gpt.py does).
  optim::WarmupCosineLR schedule(cfg.lr, cfg.min_lr, cfg.warmup, cfg.lr_decay_iters);
  Generator batch_gen(batch_seed(cfg.seed));

  RunResult r;
  r.norm = norm;
  r.seed = cfg.seed;
  r.parameters = model.num_parameters();
  const fs::path dir = cfg.out;
  const fs::path ckpt = dir / "checkpoint.safetensors";
  std::int64_t start = 0;
  if (!cfg.out.empty()) fs::create_directories(dir);

  if (resume) {
    Metadata& meta = ck_meta;
    StateDict& all = ck_all;
    if (meta["format"] != kFormat) fail("resume", ckpt.string(), " is not a train_lm checkpoint");
    if (meta["vocab"] != corpus.vocab_utf8()) fail("resume", "the corpus '", corpus.path, "' has a different vocabulary from the checkpoint's");
    StateDict msd, osd;
    for (const auto& [k, t] : all) {
      if (k.rfind("model.", 0) == 0) msd.insert(k.substr(6), t);
      else if (k.rfind("optim.", 0) == 0) osd.insert(k.substr(6), t);
    }
    model.load_state_dict(msd);
    opt.load_state_dict(osd);
    msd = StateDict();
    osd = StateDict();
    const std::string file = ckpt.string();
    const std::uint64_t step = meta_u64(meta, "step", file);
    if (step > (std::uint64_t(1) << 62)) fail("resume", file, ": step ", step, " is out of range");
    start = static_cast<std::int64_t>(step);
    batch_gen.set_state(meta_u64(meta, "batch_rng_seed", file), meta_u64(meta, "batch_rng_offset", file));
    default_generator().set_state(meta_u64(meta, "rng_seed", file), meta_u64(meta, "rng_offset", file));
    r.best_val = meta_double(meta, "best_val", file);
    all = StateDict();  // copied into the model and the optimiser: not kept for the whole run
  }
  r.start_step = start;

  // metrics.csv and train_log.csv: on resume keep the rows up to the checkpoint's step.
  auto reopen = [&](const char* name, const char* header) {
    std::string kept = std::string(header) + "\n";
    if (resume) {
      std::ifstream in(dir / name);
      std::string line;
      std::getline(in, line);
      while (std::getline(in, line)) {
        // Rows up to the checkpoint's step; a torn last row (a kill mid-write) is dropped.
        std::int64_t step = 0;
        const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), step);
        if (ec == std::errc() && end != line.data() + line.size() && *end == ',' && step <= start &&
            std::count(line.begin(), line.end(), ',') == std::count(header, header + std::strlen(header), ','))
          kept += line + "\n";
      }
    }
    write_atomic(dir / name, kept);
    return std::ofstream(dir / name, std::ios::app);
  };
  std::ofstream metrics, steplog;
  if (!cfg.out.empty()) {
    metrics = reopen("metrics.csv", "step,norm,train_loss,val_loss,lr,ms_per_step,tokens_per_s");
    steplog = reopen("train_log.csv", "step,loss,lr,ms");
  }

  auto save_checkpoint = [&](std::int64_t step) {
    if (cfg.out.empty() || !cfg.checkpoints) return;
    // The logs reach the disk before the checkpoint that vouches for their rows.
    metrics.flush();
    steplog.flush();
    StateDict all;
    for (const auto& [k, t] : model.state_dict()) all.insert("model." + k, t);
    for (const auto& [k, t] : opt.state_dict()) all.insert("optim." + k, t);
    Metadata meta{{"format", kFormat},
                  {"step", std::to_string(step)},
                  {"config", config_to_json(cfg).dump()},
                  {"vocab", corpus.vocab_utf8()},
                  {"batch_rng_seed", std::to_string(batch_gen.seed())},
                  {"batch_rng_offset", std::to_string(batch_gen.offset())},
                  {"rng_seed", std::to_string(default_generator().seed())},
                  {"rng_offset", std::to_string(default_generator().offset())},
                  {"best_val", exact(r.best_val)}};
    save_safetensors(ckpt.string(), all, meta);  // temporary file, fsync, rename
  };

  const bool tty = cfg.progress && isatty(STDERR_FILENO);
  std::vector<double> times;
  const double tokens_per_step = static_cast<double>(cfg.batch_size * cfg.model.block_size);
  reset_peak_rss();
  auto median_ms = [&times]() {
    if (times.empty()) return std::nan("");
    std::vector<double> s(times.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(10, times.size() / 2)), times.end());
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
    return s[s.size() / 2];
  };

  const std::vector<Tensor> params = model.parameters();
  Tensor x, y;
  for (std::int64_t it = start; it < cfg.steps; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = schedule(it);
    opt.set_lr(lr);
    sample_batch(corpus.train, cfg.batch_size, cfg.model.block_size, batch_gen, x, y);
    Tensor loss;
    double lv = NAN, gnorm = 0;
    {
      DetectAnomalyGuard anomaly(cfg.detect_anomaly);
      loss = model.loss(x, y);
      lv = loss.item();
      if (std::isfinite(lv)) {
        opt.zero_grad();
        loss.backward();
        if (cfg.grad_clip > 0) {
          gnorm = optim::clip_grad_norm(params, cfg.grad_clip);
        } else {  // no clipping: still refuse a non-finite gradient before the step
          for (const Tensor& p : params) {
            const Tensor g = p.grad();
            if (!g.defined()) continue;
            const float* d = g.data<float>();  // the model is float32
            for (std::int64_t i = 0; i < g.numel(); ++i)
              if (!std::isfinite(d[i])) gnorm = d[i];
          }
        }
      }
    }
    if (!std::isfinite(lv) || !std::isfinite(gnorm)) {
      // Stop before the optimiser step can spread the NaN into the weights; the checkpoint on disk
      // is the last good state. Re-running this step's batch in anomaly mode names the op that
      // first produced a NaN or Inf (its forward, or its backward when only the gradients blew up).
      loss = Tensor();
      tape().clear();
      const std::string what = std::isfinite(lv) ? "the gradient norm became " + std::to_string(gnorm)
                                                  : "the loss became " + std::to_string(lv);
      fail("train", norm, ": ", what, " at step ", it + 1, " (", locate_anomaly(model, x, y), "); the last checkpoint",
           cfg.out.empty() ? std::string(" (none: no --out)") : " in '" + cfg.out + "'", " is kept");
    }
    opt.step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    times.push_back(ms);
    r.step_loss.push_back(lv);
    if (steplog.is_open()) steplog << it + 1 << ',' << lv << ',' << lr << ',' << ms << '\n';

    const bool eval_now = (it + 1) % cfg.eval_interval == 0 || it + 1 == cfg.steps;
    if (tty && (it % 10 == 0 || eval_now)) {
      const double med = median_ms();
      std::fprintf(stderr, "\r  %-9s step %5lld/%lld | loss %.4f | lr %.2e | %6.0f tok/s | ETA %s   ", norm.c_str(),
                   static_cast<long long>(it + 1), static_cast<long long>(cfg.steps), lv, lr, tokens_per_step / med * 1e3,
                   fmt_eta(med * 1e-3 * static_cast<double>(cfg.steps - it - 1)).c_str());
      std::fflush(stderr);
    }
    if (eval_now && cfg.eval_iters > 0) {
      EvalPoint e{it + 1, estimate_loss(model, corpus.train, cfg), estimate_loss(model, corpus.val, cfg), lr, median_ms(),
                  tokens_per_step / median_ms() * 1e3};
      r.evals.push_back(e);
      if (!(e.val_loss >= r.best_val)) r.best_val = e.val_loss;
      if (metrics.is_open()) {
        metrics << e.step << ',' << norm << ',' << e.train_loss << ',' << e.val_loss << ',' << e.lr << ',' << e.ms_per_step
                << ',' << e.tokens_per_s << '\n';
        metrics.flush();
        steplog.flush();
      }
      if (cfg.progress && !tty)
        std::fprintf(stderr, "  %-9s step %5lld/%lld | train %.4f | val %.4f | %.1f ms/step\n", norm.c_str(),
                     static_cast<long long>(e.step), static_cast<long long>(cfg.steps), e.train_loss, e.val_loss,
                     e.ms_per_step);
      save_checkpoint(it + 1);
    } else if (eval_now) {
      save_checkpoint(it + 1);
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  r.ms_per_step_median = median_ms();
  r.tokens_per_s = tokens_per_step / r.ms_per_step_median * 1e3;
  r.peak_rss_mb = peak_rss_mb();
  if (!r.evals.empty()) {
    r.final_train = r.evals.back().train_loss;
    r.final_val = r.evals.back().val_loss;
  }
  if (cfg.sample > 0) {
    Generator g(cfg.seed + 2);
    auto ids = model.generate({corpus.train[0]}, cfg.sample, cfg.temperature, cfg.top_k, &g);
    r.sample_text = corpus.decode(ids);
    if (!cfg.out.empty()) write_atomic(dir / "samples.txt", r.sample_text + "\n");
  }
  if (!cfg.out.empty()) save_safetensors((dir / "model.safetensors").string(), model.state_dict(),
                                         {{"config", config_to_json(cfg).dump()}, {"vocab", corpus.vocab_utf8()}});
  return r;
}

}  // namespace lm
