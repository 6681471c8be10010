// bench_train: the training step of examples/train_lm (same model, data, optimiser and schedule),
// timed, printing one JSON line with the keys of the PyTorch reference (../shared/bench/torch_gpt.py):
//   framework, norm, threads, steps, ms_per_step_median, tokens_per_s, train_loss, val_loss, peak_rss_mb,
//   arch, autocast
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "lm/trainer.h"

int main(int argc, char** argv) {
  lm::TrainConfig c;
  std::string norm = "rmsnorm";
  int threads = 0;
  c.data = "data/tinyshakespeare.txt";
  c.eval_interval = 1 << 30;  // evaluate once, at the end (as the reference)
  CLI::App app{"Time the train_lm training step; prints one JSON line comparable with torch_gpt.py."};
  app.add_option("--data", c.data, "UTF-8 text corpus")->capture_default_str();
  app.add_option("--norm", norm, "layernorm|rmsnorm|prmsnorm|batchnorm|none")
      ->check(CLI::IsMember({"layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"}))->capture_default_str();
  app.add_option("--steps", c.steps, "training iterations")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--threads", threads, "threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--n-layer", c.model.n_layer)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-head", c.model.n_head)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--n-embd", c.model.n_embd)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--block-size", c.model.block_size)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", c.batch_size)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--eval-iters", c.eval_iters, "batches per split for the final loss estimate (0: skip)")->capture_default_str();
  app.add_option("--seed", c.seed)->capture_default_str();
  bool profile = false;
  app.add_flag("--profile", profile, "time every op (tg::set_op_timing) and add ms per step by op to the JSON (\"ops\")");
  app.add_option("--precision", c.precision, "float32|bf16 (tg::AutocastGuard around forward and loss)")
      ->check(CLI::IsMember({"float32", "bf16"}))->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "bench_train: error: " << e.what() << "\n";
    return 2;
  }
  try {
    if (threads > 0) tg::set_num_threads(threads);
    c.model.norm = tg::nn::parse_norm_kind(norm);
    c.progress = false;
    lm::Corpus corpus = lm::load_corpus(c.data, c.model.block_size);
    tg::set_op_timing(profile);
    lm::RunResult r = lm::train(c, corpus);
    tg::set_op_timing(false);
    // Numbers rounded as the reference rounds them (3, 1 and 4 decimals), written as text so
    // that no binary-to-decimal noise (1543.9850000000001) appears.
    auto num = [](double v, int decimals) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
      return nlohmann::json::parse(buf);
    };
    nlohmann::ordered_json j;
    j["framework"] = "tapegrad-0.1.0";
    j["norm"] = norm;
    j["threads"] = tg::get_num_threads();
    j["steps"] = c.steps;
    j["ms_per_step_median"] = num(r.ms_per_step_median, 3);
    j["tokens_per_s"] = num(r.tokens_per_s, 1);
    if (c.eval_iters > 0) {
      j["train_loss"] = num(r.final_train, 4);
      j["val_loss"] = num(r.final_val, 4);
    }
    j["peak_rss_mb"] = num(lm::peak_rss_mb(), 1);
    j["arch"] = "gpt";
    j["autocast"] = c.precision == "bf16" ? "bf16" : "none";
    if (profile) {  // per op: forward and backward ms per step, averaged over the run's steps
      nlohmann::ordered_json ops;
      const double per = 1e3 / static_cast<double>(c.steps);
      for (const tg::OpTime& t : tg::op_times()) ops[t.op] = {num(t.forward_s * per, 3), num(t.backward_s * per, 3)};
      j["ops"] = ops;
    }
    std::cout << j.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_train: error: " << e.what() << "\n";
    return 2;
  }
}
