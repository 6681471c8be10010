#include "lm/resume.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace lm {

namespace fs = std::filesystem;

namespace {

// A number as the shortest text that reads back to it (0.001, not 0.0010000000000000000208).
std::string shortest(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

// A flag that defines the run, and its value in a configuration.
struct Fixed {
  const char* flag;
  std::string (*value)(const TrainConfig&);
};

const Fixed kFixed[] = {
    {"--arch", [](const TrainConfig& c) { return tg::nn::to_string(c.model.arch); }},
    {"--norm", [](const TrainConfig& c) { return tg::nn::to_string(c.model.norm); }},
    {"--p", [](const TrainConfig& c) { return shortest(c.model.p); }},
    {"--n-layer", [](const TrainConfig& c) { return std::to_string(c.model.n_layer); }},
    {"--n-head", [](const TrainConfig& c) { return std::to_string(c.model.n_head); }},
    {"--n-embd", [](const TrainConfig& c) { return std::to_string(c.model.n_embd); }},
    {"--block-size", [](const TrainConfig& c) { return std::to_string(c.model.block_size); }},
    {"--dropout", [](const TrainConfig& c) { return shortest(c.model.dropout); }},
    {"--batch-size", [](const TrainConfig& c) { return std::to_string(c.batch_size); }},
    {"--seed", [](const TrainConfig& c) { return std::to_string(c.seed); }},
    {"--min-lr", [](const TrainConfig& c) { return shortest(c.min_lr); }},
    {"--warmup", [](const TrainConfig& c) { return std::to_string(c.warmup); }},
    {"--lr-decay-iters", [](const TrainConfig& c) { return std::to_string(c.lr_decay_iters); }},
    {"--weight-decay", [](const TrainConfig& c) { return shortest(c.weight_decay); }},
    {"--grad-clip", [](const TrainConfig& c) { return shortest(c.grad_clip); }},
    {"--precision", [](const TrainConfig& c) { return c.precision; }},
};

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
}

// --data: the run's corpus, or (when that file is gone) the same corpus at its new path.
void take_data(TrainConfig& r, const TrainConfig& given, std::vector<std::string>& diffs,
               std::vector<std::string>& notes) {
  if (same_file(given.data, r.data)) return;
  std::error_code ec;
  if (fs::exists(r.data, ec)) {
    diffs.push_back("--data " + given.data + " (the run's: " + r.data + ")");
    return;
  }
  notes.push_back("note: the run's corpus '" + r.data + "' is gone; continuing on '" + given.data +
                  "', which must hold the same text");
  r.data = absolute_corpus_path(given.data);  // recorded as a new run records its corpus
}

// --lr: a new peak from this step on, the schedule's shape kept; never below the run's --min-lr.
void take_lr(TrainConfig& r, const TrainConfig& given, std::vector<std::string>& notes) {
  if (given.lr == r.lr) return;
  if (given.lr < r.min_lr)
    tg::fail("--lr", shortest(given.lr), " is below the run's --min-lr ", shortest(r.min_lr),
             ": the cosine decays from --lr down to --min-lr");
  notes.push_back("note: --lr " + shortest(given.lr) + " replaces the run's " + shortest(r.lr) +
                  " from here on (the schedule keeps its warmup and horizon)");
  r.lr = given.lr;
}

}  // namespace

const std::vector<std::string>& flags_resume_may_change() {
  static const std::vector<std::string> f = {"--steps",  "--eval-interval", "--eval-iters", "--lr",
                                             "--sample", "--prompt",        "--temperature", "--top-k",
                                             "--threads", "--quiet",        "--detect-anomaly",
                                             "--gradient-checkpointing"};
  return f;
}

const std::vector<std::string>& flags_fixed_on_resume() {
  static const std::vector<std::string> f = [] {
    std::vector<std::string> v{"--data"};
    for (const Fixed& x : kFixed) v.push_back(x.flag);
    return v;
  }();
  return f;
}

TrainConfig resume_config(const TrainConfig& run, const TrainConfig& given,
                          const std::function<bool(const std::string&)>& was_given, std::vector<std::string>& notes) {
  TrainConfig r = run;
  std::vector<std::string> diffs;
  if (was_given("--data")) take_data(r, given, diffs, notes);
  for (const Fixed& f : kFixed)
    if (was_given(f.flag) && f.value(given) != f.value(run))
      diffs.push_back(std::string(f.flag) + " " + f.value(given) + " (the run's: " + f.value(run) + ")");
  if (!diffs.empty()) {
    std::string list;
    for (const std::string& d : diffs) list += (list.empty() ? "" : ", ") + d;
    tg::fail("--resume", "continues the run as it was started; these flags differ from it: ", list,
             ". Leave them out to continue it, or start a new run with --out");
  }
  if (was_given("--lr")) take_lr(r, given, notes);
  if (was_given("--steps")) r.steps = given.steps;
  if (was_given("--eval-interval")) r.eval_interval = given.eval_interval;
  if (was_given("--eval-iters")) r.eval_iters = given.eval_iters;
  r.sample = given.sample;
  r.prompt = given.prompt;
  r.temperature = given.temperature;
  r.top_k = given.top_k;
  r.progress = given.progress;
  r.detect_anomaly = given.detect_anomaly;
  r.gradient_checkpointing = given.gradient_checkpointing;
  return r;
}

namespace {

// The rows of a CSV file after its header, split at commas.
std::vector<std::vector<std::string>> csv_rows(const fs::path& file) {
  std::ifstream in(file);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::istringstream s(line);
    for (std::string cell; std::getline(s, cell, ',');) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

double number(const std::string& s) {
  double v = NAN;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// The median of the step times of a train_log.csv (ms, its 4th column), leaving out the first
// steps as the trainer does (steady_median_ms).
double median_step_ms(const fs::path& file) {
  std::vector<double> ms;
  for (const auto& row : csv_rows(file))
    if (row.size() == 4)
      if (const double v = number(row[3]); std::isfinite(v)) ms.push_back(v);  // a cell that does not parse is left out
  return steady_median_ms(std::move(ms));
}

}  // namespace

RunResult whole_run(RunResult r, const std::string& dir, double tokens_per_step) {
  r.evals.clear();
  for (const auto& row : csv_rows(fs::path(dir) / "metrics.csv")) {
    if (row.size() != 9) continue;  // a torn row
    std::int64_t step = 0;
    std::from_chars(row[0].data(), row[0].data() + row[0].size(), step);
    r.evals.push_back({step, number(row[2]), number(row[3]), number(row[4]), number(row[5]), number(row[6]),
                       number(row[7]), number(row[8])});
  }
  if (!r.evals.empty()) {
    r.final_train = r.evals.back().train_loss;
    r.final_val = r.evals.back().val_loss;
  }
  r.ms_per_step_median = median_step_ms(fs::path(dir) / "train_log.csv");
  r.tokens_per_s = tokens_per_step / r.ms_per_step_median * 1e3;
  return r;
}

}  // namespace lm
