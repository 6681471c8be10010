// bench_train: the training step of examples/train_lm (same model, data, optimiser and schedule),
// timed, printing one JSON line with the keys of the PyTorch reference (../shared/bench/torch_gpt.py):
//   framework, norm, threads, steps, ms_per_step_median, tokens_per_s, train_loss, val_loss, peak_rss_mb,
//   arch, autocast, params
// (and peak_tensor_mb, gradient_checkpointing, which the reference does not print; then the MFU
// and the CPU, and the kernels the step ran on: add_mfu and add_kernels below)
// and with --sample-tokens N the sampling speed of the model's generate, with and without its
// KV cache (sample_tokens_per_s, sample_uncached_tokens_per_s: N tokens after a one-token prompt).
// Under mpirun (mpirun -np N bench_train ...) the ranks train data-parallel as train_lm does, and
// rank 0 adds world_size (as the reference under --ddp) and the gradients' reduction per step
// (medians; docs/distributed.md): comm_buckets, comm_mb, comm_ms (in flight), comm_overlapped_ms
// (of it, hidden behind the backward), comm_exposed_ms (waited for after the backward), and
// allreduce_ms (one blocking all-reduce of every gradient, alone).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "kernels/isa.h"
#include "kernels/sgemm_avx512.h"
#include "kernels/sgemm_bf16.h"
#include "lm/trainer.h"
#include "mfu.h"
#include "tapegrad/anomaly.h"

// Tokens per second of GPT::generate with and without its KV cache: n tokens after a one-token
// prompt, from the run's initial weights (the speed does not depend on their values).
std::pair<double, double> sampling_speed(lm::TrainConfig c, const lm::Corpus& corpus, std::int64_t n) {
  c.model.vocab_size = corpus.vocab_size();
  tg::manual_seed(c.seed);
  tg::nn::GPT model(c.model);
  auto rate = [&](bool cache) {
    tg::Generator g(c.seed);
    const auto t0 = std::chrono::steady_clock::now();
    model.generate({corpus.train[0]}, n, 1.0, 0, &g, cache);
    return static_cast<double>(n) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  return {rate(true), rate(false)};
}

namespace {

// The command line: train_lm's model and training flags, and what to time.
struct Options {
  lm::TrainConfig c;
  std::string norm = "rmsnorm", arch = "gpt";
  std::int64_t sample_tokens = 0;
  int threads = 0;
  double bucket_kb = 1024;
  bool profile = false;
};

void add_options(CLI::App& app, Options& o) {
  lm::TrainConfig& c = o.c;
  app.add_option("--data", c.data, "UTF-8 text corpus")->capture_default_str();
  app.add_option("--norm", o.norm, "layernorm|rmsnorm|prmsnorm|batchnorm|none")
      ->check(CLI::IsMember({"layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"}))->capture_default_str();
  app.add_option("--arch", o.arch, "gpt|llama")->check(CLI::IsMember({"gpt", "llama"}))->capture_default_str();
  app.add_option("--sample-tokens", o.sample_tokens, "also time generating this many tokens, with and without the KV cache")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", c.steps, "training iterations")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--threads", o.threads, "threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--n-layer", c.model.n_layer)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-head", c.model.n_head)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-embd", c.model.n_embd)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--block-size", c.model.block_size)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", c.batch_size)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--eval-iters", c.eval_iters, "batches per split for the final loss estimate (0: skip)")->capture_default_str();
  app.add_option("--seed", c.seed)->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb, "under mpirun: gradient bucket size in KiB (tg::dist::DDPOptions)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag("--profile", o.profile, "time every op (tg::set_op_timing) and add ms per step by op to the JSON (\"ops\")");
  app.add_option("--precision", c.precision, "float32|bf16 (tg::AutocastGuard around forward and loss)")
      ->check(CLI::IsMember({"float32", "bf16"}))->capture_default_str();
  app.add_flag("--gradient-checkpointing", c.gradient_checkpointing,
               "recompute each block in the backward (nn::GPT::set_gradient_checkpointing)");
}

// Numbers rounded as the reference rounds them (3, 1 and 4 decimals), written as text so that no
// binary-to-decimal noise (1543.9850000000001) appears.
nlohmann::json num(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return nlohmann::json::parse(buf);
}

// The kernels the step ran on, chosen at run time from the CPU (or TAPEGRAD_ISA and
// TAPEGRAD_SGEMM_TILE): "isa" (kernels/isa.h), the float32 product's register tile ("sgemm_tile":
// 6x16, 14x32 or 8x48; "openblas" at portable) and the bf16 products' path ("bf16_path":
// emulated, fma, dpbf16 or amx, under --precision bf16; kernels/sgemm_bf16.h), so that a figure
// names what it measured.
void add_kernels(nlohmann::ordered_json& j, bool bf16) {
  namespace k = tg::kernels;
  const k::Isa level = k::isa();
  j["isa"] = k::isa_name(level);
  std::string tile = level >= k::Isa::avx2 ? "6x16" : "openblas";
#ifdef TG_SGEMM_AVX512
  if (level >= k::Isa::avx512) tile = k::sgemm_avx512::tile_name(k::sgemm_avx512::tile());
#endif
  j["sgemm_tile"] = tile;
  const char* paths[] = {"emulated", "fma", "dpbf16", "amx"};
  if (bf16) j["bf16_path"] = paths[static_cast<int>(k::bf16_impl::path_in_use())];
}

// Model FLOPs utilisation: the step's model FLOPs over its time, as a fraction of this machine's
// measured peak for the precision, and the CPU. The peak is probed on the run's threads before
// the run (`before`) and again after it, and the higher of the two counts: a host that shares its
// cores runs in slower and faster phases, and a probe in a slow one alone would read low and make
// the MFU read high. A figure above 1 all the same says so in "mfu_note".
void add_mfu(nlohmann::ordered_json& j, const Options& o, const lm::RunResult& r, const bench::Peak& before) {
  const lm::TrainConfig& c = o.c;
  const std::int64_t tokens = c.batch_size * c.model.block_size * r.world_size;
  const double flops = bench::step_flops(r.parameters, c.model.n_layer, c.model.block_size, c.model.n_embd, tokens);
  bench::Peak peak = bench::measure_peak(c.precision == "bf16");
  peak.flops = std::max(peak.flops, before.flops);
  const double mfu = peak.flops > 0 ? flops / (r.ms_per_step_median / 1e3) / (peak.flops * r.world_size) : 0;
  j["model_gflop_per_step"] = num(flops / 1e9, 3);
  j["peak_gflops"] = num(peak.flops * r.world_size / 1e9, 1);  // every rank's team
  j["peak_kind"] = peak.kind;
  j["mfu"] = num(mfu, 3);
  if (mfu > 1)
    j["mfu_note"] = "above 1: both peak probes ran slower than the training steps (the host's other work); "
                    "compare with bench_kernels' peak/* on a quiet machine";
  j["cpu"] = bench::cpu_id();
  j["cpu_name"] = bench::cpu_name();
  add_kernels(j, c.precision == "bf16");
}

// The JSON keys that torch_gpt.py prints, then tapegrad's own.
nlohmann::ordered_json result_json(const Options& o, const lm::RunResult& r, const bench::Peak& peak_before) {
  const lm::TrainConfig& c = o.c;
  nlohmann::ordered_json j;
  j["framework"] = "tapegrad-0.1.0";
  j["norm"] = o.norm;
  j["threads"] = tg::get_num_threads();
  j["steps"] = c.steps;
  j["ms_per_step_median"] = num(r.ms_per_step_median, 3);
  j["tokens_per_s"] = num(r.tokens_per_s, 1);
  if (c.eval_iters > 0) {
    j["train_loss"] = num(r.final_train, 4);
    j["val_loss"] = num(r.final_val, 4);
  }
  j["peak_rss_mb"] = num(lm::peak_rss_mb(), 1);
  j["peak_tensor_mb"] = num(r.peak_tensor_mb, 1);  // of it, tensors at their peak (no counterpart in the reference)
  j["arch"] = o.arch;
  j["autocast"] = c.precision == "bf16" ? "bf16" : "none";
  j["gradient_checkpointing"] = c.gradient_checkpointing;
  j["params"] = r.parameters;
  j["world_size"] = r.world_size;  // tokens_per_s counts the global batch, as the reference's
  add_mfu(j, o, r, peak_before);
  if (r.world_size > 1) {
    j["comm_buckets"] = r.comm.buckets;
    j["comm_mb"] = num(r.comm.bytes / 1e6, 3);
    j["comm_ms"] = num(r.comm.comm_ms, 3);
    j["comm_overlapped_ms"] = num(r.comm.overlapped_ms, 3);
    j["comm_exposed_ms"] = num(r.comm.exposed_ms, 3);
    j["allreduce_ms"] = num(lm::time_all_reduce(r.parameters, 20), 3);  // every rank takes part
  }
  return j;
}

int run(Options& o) {
  lm::TrainConfig& c = o.c;
  if (o.threads > 0) tg::set_num_threads(o.threads);
  lm::set_bucket_cap_bytes(static_cast<std::size_t>(o.bucket_kb * 1024));
  c.model.norm = tg::nn::parse_norm_kind(o.norm);
  c.model.arch = tg::nn::parse_arch(o.arch);
  c.progress = false;
  lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size);
  const bench::Peak peak_before = bench::measure_peak(c.precision == "bf16");  // see add_mfu
  tg::set_op_timing(o.profile);
  lm::RunResult r = lm::train(c, corpus);
  tg::set_op_timing(false);
  nlohmann::ordered_json j = result_json(o, r, peak_before);
  if (o.sample_tokens > 0) {
    const auto [cached, uncached] = sampling_speed(c, corpus, o.sample_tokens);
    j["sample_tokens_per_s"] = num(cached, 1);
    j["sample_uncached_tokens_per_s"] = num(uncached, 1);
  }
  if (o.profile) {  // per op: forward and backward ms per step, averaged over the run's steps
    nlohmann::ordered_json ops;
    const double per = 1e3 / static_cast<double>(c.steps);
    for (const tg::OpTime& t : tg::op_times()) ops[t.op] = {num(t.forward_s * per, 3), num(t.backward_s * per, 3)};
    j["ops"] = ops;
  }
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  lm::Job job(&argc, &argv, "bench_train");  // MPI under mpirun; then rank 0 alone prints
  Options o;
  o.c.data = "data/tinyshakespeare.txt";
  o.c.eval_interval = 1 << 30;  // evaluate once, at the end (as the reference)
  CLI::App app{"Time the train_lm training step; prints one JSON line comparable with torch_gpt.py."};
  add_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "bench_train: error: " << e.what() << "\n";
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    return job.fail(e, 2);  // under mpirun, an error of one rank alone ends the job
  }
}
