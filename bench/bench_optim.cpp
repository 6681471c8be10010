// bench_optim: the optimizer's share of a training step at the GPT-2-small shape, printing one JSON
// line per case:
//   optim/clip+step        tg::optim::clip_grad_norm(params, max_norm), then AdamW::step(): a read
//                          pass for the norm, a pass scaling every gradient, a pass updating p, m, v
//   optim/clip_and_step    AdamW::clip_and_step(max_norm): the norm's read pass, then one pass that
//                          scales each gradient in registers, writes it back and updates p, m, v
//
// The parameters are the transformer blocks of GPT-2 small (12 layers, width 768, no embeddings):
// per layer qkv (2304, 768), proj (768, 768), fc (3072, 768), fc_out (768, 3072), two norm weights
// (768) and fc's bias (3072): 84 float32 tensors, 84,989,952 parameters (--layers, --embd scale
// them). Gradients are N(0, 1) draws, so their norm (about 9200) is far above max_norm (1) and the
// clipping takes effect in every step. Before every timed step the gradients are restored from a
// copy (untimed), since the clipped step scales them in place. Memory: p, g, the copy of g, m and
// v, 1.7 GB at the default shape.
//
// Keys: case, threads, params, tensors, iters, ms_median, ms_min (per step), gb_per_s (the bytes
// the case must move, read + written, per second of the median: clip+step reads g for the norm,
// reads and writes g to scale it, reads g, p, m, v and writes p, m, v: 11 values per parameter;
// clip_and_step reads g, then reads g, p, m, v and writes them: 9). Each case has its own
// optimizer over the same parameters (their values drift by a few learning rates, which does not
// change the work).
//
// Run (Release build):
//   build/release/bench/bench_optim --threads 1 --iters 5
//   build/release/bench/bench_optim --threads 2 --iters 5
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tapegrad/ops.h"
#include "tapegrad/optim.h"
#include "tapegrad/random.h"
#include "tapegrad/threads.h"

namespace {

using tg::Tensor;

struct Options {
  int threads = 1, iters = 5, layers = 12;
  std::int64_t embd = 768;
  double max_norm = 1.0;
};

// The blocks' parameters, each with a gradient, and a copy of every gradient to restore it from.
struct Params {
  std::vector<Tensor> p, saved_grad;
  std::int64_t numel = 0;
};

Params make_params(const Options& o) {
  const std::int64_t C = o.embd;
  const std::vector<tg::Shape> layer = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}, {C}, {C}, {4 * C}};
  Params r;
  tg::manual_seed(1);
  for (int l = 0; l < o.layers; ++l)
    for (const auto& s : layer) {
      Tensor p = tg::randn(s) * 0.02;
      p.requires_grad_();
      Tensor g = tg::randn(s);
      tg::sum(p * g).backward();  // p.grad() = g
      r.p.push_back(p);
      r.saved_grad.push_back(g);
      r.numel += p.numel();
    }
  return r;
}

void restore_grads(Params& ps) {
  for (std::size_t i = 0; i < ps.p.size(); ++i)
    std::memcpy(ps.p[i].grad().data<float>(), ps.saved_grad[i].data<float>(),
                static_cast<std::size_t>(ps.p[i].numel()) * sizeof(float));
}

// Times `step` o.iters times (after one untimed warm-up step that creates the optimizer state) and
// prints the JSON line.
void run_case(const std::string& name, double values_per_param, Params& ps, const Options& o,
              const std::function<void()>& step) {
  restore_grads(ps);
  step();
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) {
    restore_grads(ps);
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  nlohmann::ordered_json j;
  j["case"] = name;
  j["threads"] = tg::get_num_threads();
  j["params"] = ps.numel;
  j["tensors"] = ps.p.size();
  j["iters"] = o.iters;
  j["ms_median"] = med;
  j["ms_min"] = ms.front();
  j["gb_per_s"] = values_per_param * 4.0 * static_cast<double>(ps.numel) / (med * 1e6);
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_optim: AdamW with gradient clipping at the GPT-2-small shape"};
  Options o;
  app.add_option("--threads", o.threads, "threads")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--iters", o.iters, "timed steps per case")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::Range(1, 96))->capture_default_str();
  app.add_option("--embd", o.embd, "width")->check(CLI::Range(8, 8192))->capture_default_str();
  app.add_option("--max-norm", o.max_norm, "clip_grad_norm's max_norm")->check(CLI::PositiveNumber)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  tg::set_num_threads(o.threads);
  Params ps = make_params(o);
  {
    tg::optim::AdamW opt(ps.p, 6e-4, 0.9, 0.95, 1e-8, 0.1);
    run_case("optim/clip+step", 11, ps, o, [&] {
      tg::optim::clip_grad_norm(ps.p, o.max_norm);
      opt.step();
    });
  }
  tg::optim::AdamW opt(ps.p, 6e-4, 0.9, 0.95, 1e-8, 0.1);
  run_case("optim/clip_and_step", 9, ps, o, [&] { opt.clip_and_step(o.max_norm); });
  return 0;
}
