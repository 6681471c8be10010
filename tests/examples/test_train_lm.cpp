// The training program's building blocks: corpus loading and its errors, exact resume, seeded
// reproducibility, checkpoints, the summary and the chart.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "helpers.h"
#include "lm/report.h"
#include "lm/trainer.h"
#include "lm_helpers.h"

namespace fs = std::filesystem;
using namespace tg;

namespace {

fs::path scratch(const std::string& name) { return lmtest::scratch("tapegrad_test", name); }

using lmtest::make_corpus;
using lmtest::tiny;

}  // namespace

TEST_CASE("the median step time is the reference's statistic: first steps left out, even counts averaged", "[lm]") {
  CHECK(std::isnan(lm::steady_median_ms({})));
  CHECK(lm::steady_median_ms({7}) == 7);
  // 4 steps: the first 2 left out, then the mean of 30 and 50 (not the larger one).
  CHECK(lm::steady_median_ms({900, 800, 50, 30}) == 40);
  CHECK(lm::steady_median_ms({900, 800, 5, 70, 30}) == 30);  // 2 left out of 5, then the middle of 3
  std::vector<double> ms(30, 1000.0);  // 10 slow first steps left out of 30, then 20 in reverse order
  for (int i = 0; i < 20; ++i) ms[static_cast<std::size_t>(10 + i)] = 20 - i;
  CHECK(lm::steady_median_ms(ms) == 10.5);
}

TEST_CASE("a run stopped at step 100 and resumed equals one run of 200 steps, bit for bit, in both archs", "[lm]") {
  const fs::path dir = scratch("resume");
  const std::string data = make_corpus(dir);
  lm::Corpus corpus = lm::load_corpus(data, 16);
  struct Case {
    nn::Arch arch;
    nn::NormKind kind;
    const char* precision;
  };
  for (auto [arch, kind, precision] : {Case{nn::Arch::gpt, nn::NormKind::rmsnorm, "float32"},
                                       Case{nn::Arch::gpt, nn::NormKind::batchnorm, "float32"},
                                       Case{nn::Arch::gpt, nn::NormKind::rmsnorm, "bf16"},
                                       Case{nn::Arch::llama, nn::NormKind::rmsnorm, "float32"},
                                       Case{nn::Arch::llama, nn::NormKind::layernorm, "bf16"}}) {
    INFO(nn::to_string(arch) << ' ' << nn::to_string(kind) << ' ' << precision);
    lm::TrainConfig c = tiny(data);
    c.model.arch = arch;
    c.model.norm = kind;
    c.precision = precision;
    c.out = (dir / "straight").string();
    lm::RunResult straight = lm::train(c, corpus);

    lm::TrainConfig first = c;
    first.out = (dir / "split").string();
    first.steps = 100;
    first.lr_decay_iters = 200;  // the same schedule as the 200-step run
    lm::RunResult a = lm::train(first, corpus);
    lm::TrainConfig second = lm::read_checkpoint_config(first.out);
    CHECK(second.steps == 100);
    CHECK(second.precision == precision);  // a resumed run keeps its precision and arch
    CHECK(second.model.arch == arch);
    second.steps = 200;
    second.out = first.out;
    second.progress = false;
    lm::RunResult b = lm::train(second, corpus, /*resume=*/true);
    CHECK(b.start_step == 100);

    REQUIRE(straight.step_loss.size() == 200);
    REQUIRE(a.step_loss.size() + b.step_loss.size() == 200);
    std::vector<double> joined = a.step_loss;
    joined.insert(joined.end(), b.step_loss.begin(), b.step_loss.end());
    CHECK(joined == straight.step_loss);
    CHECK(straight.final_val == b.final_val);
    // the final weights are identical too
    Metadata meta;
    StateDict w1 = load_safetensors((dir / "straight" / "model.safetensors").string(), &meta);
    CHECK(meta["format"] == "tapegrad-lm-model-1");
    CHECK(meta["config"].find(std::string("\"arch\":\"") + nn::to_string(arch) + "\"") != std::string::npos);
    // under the reference's names; a tied head once, as head.weight (as PyTorch's save_model)
    CHECK(w1.contains("head.weight"));
    CHECK(w1.contains("wte.weight") == (arch == nn::Arch::llama));
    CHECK(w1.contains("blocks.0.qkv.weight"));
    StateDict w2 = load_safetensors((dir / "split" / "model.safetensors").string());
    for (const auto& [k, t] : w1) CHECK(tgtest::max_abs_diff(t, w2.at(k)) == 0.0);
    // metrics.csv has every evaluation once, in order
    std::ifstream m(dir / "split" / "metrics.csv");
    std::string line;
    std::vector<std::string> steps;
    std::getline(m, line);
    while (std::getline(m, line)) steps.push_back(line.substr(0, line.find(',')));
    CHECK(steps == std::vector<std::string>{"50", "100", "150", "200"});
    fs::remove_all(dir / "straight");
    fs::remove_all(dir / "split");
  }
  fs::remove_all(dir);
}

TEST_CASE("the same seed gives the same losses, every norm starts from the same weights", "[lm]") {
  const fs::path dir = scratch("seed");
  const std::string data = make_corpus(dir);
  lm::Corpus corpus = lm::load_corpus(data, 16);
  lm::TrainConfig c = tiny(data);
  c.steps = 30;
  c.model.dropout = 0;
  lm::RunResult r1 = lm::train(c, corpus), r2 = lm::train(c, corpus);
  CHECK(r1.step_loss == r2.step_loss);
  c.seed = 7;
  CHECK(lm::train(c, corpus).step_loss != r1.step_loss);
  // LayerNorm and RMSNorm with unit gains start as nearly the same function: same first-step loss
  // to about 1e-3 (they differ only by the mean subtraction), same data order.
  c.seed = 1337;
  c.steps = 1;
  c.model.norm = nn::NormKind::layernorm;
  const double ln = lm::train(c, corpus).step_loss[0];
  c.model.norm = nn::NormKind::rmsnorm;
  const double rms = lm::train(c, corpus).step_loss[0];
  CHECK(std::fabs(ln - rms) < 0.05);
  fs::remove_all(dir);
}

TEST_CASE("corpus errors are one clear sentence", "[lm]") {
  const fs::path dir = scratch("corpus");
  REQUIRE_TG_ERROR(lm::load_corpus((dir / "missing.txt").string(), 16), "data", "cannot open");
  std::ofstream(dir / "empty.txt").close();
  REQUIRE_TG_ERROR(lm::load_corpus((dir / "empty.txt").string(), 16), "data", "empty");
  {
    std::ofstream f(dir / "bin.dat", std::ios::binary);
    f << std::string("ab\0cd", 5);
  }
  REQUIRE_TG_ERROR(lm::load_corpus((dir / "bin.dat").string(), 16), "data", "binary");
  std::ofstream(dir / "latin1.txt") << "caf\xe9 au lait, " << std::string(400, 'x');
  REQUIRE_TG_ERROR(lm::load_corpus((dir / "latin1.txt").string(), 16), "data", "UTF-8");
  std::ofstream(dir / "short.txt") << "too short";
  REQUIRE_TG_ERROR(lm::load_corpus((dir / "short.txt").string(), 16), "data", "9 characters", "180");
  // UTF-8 text is read by code point
  std::ofstream(dir / "utf8.txt") << std::string(300, 'a') << "\xc3\xa9\xe2\x82\xac" << std::string(300, 'b');
  lm::Corpus c = lm::load_corpus((dir / "utf8.txt").string(), 16);
  CHECK(c.vocab_size() == 4);
  CHECK(c.train.size() + c.val.size() == 602);
  CHECK(c.decode({2, 3}) == "\xc3\xa9\xe2\x82\xac");
  fs::remove_all(dir);
}

TEST_CASE("checkpoints are complete files: a resume from a damaged one is refused", "[lm]") {
  const fs::path dir = scratch("ckpt");
  const std::string data = make_corpus(dir);
  lm::Corpus corpus = lm::load_corpus(data, 16);
  lm::TrainConfig c = tiny(data);
  c.steps = 20;
  c.eval_interval = 10;
  c.out = (dir / "run").string();
  lm::train(c, corpus);
  const fs::path ck = dir / "run" / "checkpoint.safetensors";
  REQUIRE(fs::exists(ck));
  CHECK_FALSE(fs::exists(dir / "run" / "checkpoint.safetensors.tmp"));
  fs::resize_file(ck, fs::file_size(ck) / 2);
  lm::TrainConfig r = c;
  r.steps = 30;
  CHECK_THROWS_AS(lm::train(r, corpus, true), Error);
  REQUIRE_TG_ERROR(lm::read_checkpoint_config((dir / "nothing").string()), "resume", "no checkpoint");
  fs::remove_all(dir);
}

TEST_CASE("a run that diverges stops with the op that made the first NaN or Inf and keeps its last checkpoint",
          "[lm]") {
  const fs::path dir = scratch("diverge");
  const std::string data = make_corpus(dir);
  lm::Corpus corpus = lm::load_corpus(data, 16);
  lm::TrainConfig c = tiny(data);
  c.model.dropout = 0;
  c.steps = 400;
  c.warmup = 0;
  c.eval_interval = 1;  // a checkpoint after every step
  c.eval_iters = 1;
  c.grad_clip = 1.0;
  c.out = (dir / "run").string();
  // Adam moves every weight by about lr per step: with lr = 100 the attention scores overflow
  // float32 on the second step (exp(inf - inf) in the softmax).
  c.lr = c.min_lr = 100;
  std::string msg;
  try {
    lm::train(c, corpus);
  } catch (const Error& e) {
    msg = e.what();
  }
  INFO(msg);
  REQUIRE_FALSE(msg.empty());
  CHECK((msg.find("the loss became") != std::string::npos || msg.find("the gradient norm became") != std::string::npos));
  CHECK(msg.find("(anomaly: ") != std::string::npos);
  CHECK(msg.find(" of op '") != std::string::npos);
  CHECK(msg.find("is kept") != std::string::npos);
  // The checkpoint on disk is from before the failure and holds only finite numbers.
  const fs::path ck = dir / "run" / "checkpoint.safetensors";
  REQUIRE(fs::exists(ck));
  for (const auto& [name, t] : load_safetensors(ck.string())) {
    if (!is_floating(t.dtype())) continue;
    const std::vector<double> v = t.to_vector<double>();
    INFO(name);
    CHECK(std::all_of(v.begin(), v.end(), [](double d) { return std::isfinite(d); }));
  }
  CHECK(tape().live() == 0);
  fs::remove_all(dir);
}

TEST_CASE("the summary and the chart show every norm", "[lm]") {
  std::vector<lm::RunResult> runs;
  for (const char* n : {"layernorm", "rmsnorm"})
    for (int s = 0; s < 2; ++s) {
      lm::RunResult r;
      r.arch = "llama";
      r.norm = n;
      r.seed = static_cast<std::uint64_t>(s);
      r.parameters = 100;
      for (int k = 1; k <= 3; ++k) r.evals.push_back({k * 100, 3.0 - 0.3 * k, 3.1 - 0.3 * k - 0.1 * s, 1e-3, 10, 1000});
      r.final_val = r.evals.back().val_loss;
      r.best_val = r.final_val;
      r.final_train = r.evals.back().train_loss;
      runs.push_back(r);
    }
  const std::string table = lm::summary_table(runs);
  CHECK(table.find("| llama | layernorm | 100 | 2 | 2.1500 ± 0.0707 |") != std::string::npos);
  CHECK(table.find("| rmsnorm |") != std::string::npos);
  const std::string md = lm::summary_markdown(runs, "Settings: test.");
  CHECK(md.find("BatchNorm is not comparable") != std::string::npos);
  CHECK(md.find("# Norm comparison: character-level LLaMA-style transformer (llama)") == 0);
  const std::string svg = lm::val_loss_svg(runs, "Validation loss");
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(std::count(svg.begin(), svg.end(), '\n') > 20);
  CHECK(svg.find("<polyline") != std::string::npos);
  CHECK(svg.find(">layernorm</text>") != std::string::npos);
  CHECK(svg.find(">rmsnorm</text>") != std::string::npos);
  CHECK(svg.find("training step") != std::string::npos);
  auto [m, sd] = lm::mean_sd({1.0, 2.0, 3.0});
  CHECK(m == 2.0);
  CHECK(sd == 1.0);
}

TEST_CASE("gradient checkpointing gives the same step losses, bit for bit, in both archs, float32 and bf16", "[lm]") {
  const fs::path dir = scratch("checkpointing");
  const std::string data = make_corpus(dir);
  lm::Corpus corpus = lm::load_corpus(data, 16);
  for (auto arch : {nn::Arch::gpt, nn::Arch::llama})
    for (const char* precision : {"float32", "bf16"}) {
      INFO(nn::to_string(arch) << ' ' << precision);
      lm::TrainConfig c = tiny(data);
      c.model.arch = arch;
      c.model.n_layer = 2;  // dropout 0.1 (tiny's): the recomputation draws the forward's masks
      c.precision = precision;
      c.steps = 12;
      c.eval_interval = 6;
      c.eval_iters = 1;
      // Op timing (which leaves the numbers alone) counts the checkpoint nodes recorded.
      auto checkpoint_nodes = [] {
        for (const OpTime& t : op_times())
          if (t.op == "checkpoint") return t.calls;
        return std::int64_t{0};
      };
      set_op_timing(true);
      reset_op_times();
      const lm::RunResult plain = lm::train(c, corpus);
      const std::int64_t plain_nodes = checkpoint_nodes();
      c.gradient_checkpointing = true;
      reset_op_times();
      const lm::RunResult ck = lm::train(c, corpus);
      const std::int64_t ck_nodes = checkpoint_nodes();
      set_op_timing(false);
      CHECK(plain_nodes == 0);
      CHECK(ck_nodes == c.model.n_layer * c.steps);  // one per block per step (evaluation records none)
      REQUIRE(plain.step_loss.size() == 12);
      CHECK(ck.step_loss == plain.step_loss);
      CHECK(ck.final_val == plain.final_val);
      CHECK(ck.final_train == plain.final_train);
    }
  fs::remove_all(dir);
}
