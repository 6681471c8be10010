#include "lm/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

namespace lm {

std::pair<double, double> mean_sd(const std::vector<double>& v) {
  double s = 0, n = 0;
  for (double x : v)
    if (std::isfinite(x)) { s += x; n += 1; }
  if (n == 0) return {NAN, NAN};
  const double m = s / n;
  double q = 0;
  for (double x : v)
    if (std::isfinite(x)) q += (x - m) * (x - m);
  return {m, n > 1 ? std::sqrt(q / (n - 1)) : 0.0};
}

namespace {

// Runs grouped by norm, in first-seen order.
std::vector<std::pair<std::string, std::vector<const RunResult*>>> by_norm(const std::vector<RunResult>& runs) {
  std::vector<std::pair<std::string, std::vector<const RunResult*>>> out;
  for (const auto& r : runs) {
    auto it = std::find_if(out.begin(), out.end(), [&](auto& p) { return p.first == r.norm; });
    if (it == out.end()) out.push_back({r.norm, {&r}});
    else it->second.push_back(&r);
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string loss_cell(const std::vector<double>& v) {
  auto [m, sd] = mean_sd(v);
  if (!std::isfinite(m)) return "n/a";
  return v.size() > 1 ? fmt("%.4f", m) + " ± " + fmt("%.4f", sd) : fmt("%.4f", m);
}

}  // namespace

std::string summary_table(const std::vector<RunResult>& runs) {
  std::ostringstream s;
  s << "| arch | norm | params | seeds | final val loss | best val loss | final train loss | ms/step | tokens/s | peak RSS MiB "
       "| final val bits/byte |\n"
    << "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& [norm, rs] : by_norm(runs)) {
    std::vector<double> fv, bv, ft, ms, tps, mem, bpb;
    for (const RunResult* r : rs) {
      bpb.push_back(r->evals.empty() ? NAN : r->evals.back().val_bpb);
      fv.push_back(r->final_val);
      bv.push_back(r->best_val);
      ft.push_back(r->final_train);
      ms.push_back(r->ms_per_step_median);
      tps.push_back(r->tokens_per_s);
      mem.push_back(r->peak_rss_mb);
    }
    s << "| " << rs.front()->arch << " | " << norm << " | " << rs.front()->parameters << " | " << rs.size() << " | " << loss_cell(fv) << " | "
      << loss_cell(bv) << " | " << loss_cell(ft) << " | " << fmt("%.1f", mean_sd(ms).first) << " | "
      << fmt("%.0f", mean_sd(tps).first) << " | " << fmt("%.0f", mean_sd(mem).first) << " | " << loss_cell(bpb) << " |\n";
  }
  return s.str();
}

std::string summary_markdown(const std::vector<RunResult>& runs, const std::string& settings,
                             const std::string& step_log) {
  std::ostringstream s;
  const std::string arch = runs.empty() ? "gpt" : runs.front().arch;
  const bool bpe = !runs.empty() && runs.front().tokenizer == "bpe";
  s << "# Norm comparison: " << (bpe ? "byte-level BPE" : "character-level") << " " << (arch == "llama" ? "LLaMA-style transformer (llama)" : "GPT (gpt)")
    << "\n\n" << settings << "\n\n" << summary_table(runs) << "\n";
  s << "Charts of the validation loss: `val_loss.svg`, in bits per byte: `val_bpb.svg`. Every evaluation: "
       "`metrics.csv`; every step: `" << step_log << "`.\n\n"
    << "## Reading this table\n\n"
    << "- Losses are mean cross-entropy in nats per " << (bpe ? "BPE token" : "character")
    << ", estimated on the same fixed batches for every "
       "norm; ms/step is the median step time after the first steps (up to 10, at most half; the two middle "
       "steps of an even count averaged, as the PyTorch reference takes it), and tokens/s follows from it.\n"
    << "- Bits per byte (`val_bpb`, `train_bpb` in metrics.csv) is the loss x tokens / bytes / ln 2 of the split: "
       "the bits needed per byte of UTF-8 text. Unlike nats per token it compares runs with different "
       "tokenizers (characters, BPE of any vocabulary size) on the same text.\n"
    << "- With one seed a difference of a few hundredths of a nat between norms is within run-to-run noise; "
       "`--seeds N` repeats every norm and reports mean ± standard deviation.\n"
    << "- **BatchNorm is not comparable row for row.** In training it normalises each channel with statistics "
       "taken over the whole batch and every time step, so a causal model's prediction at position t depends on "
       "tokens after t in the batch: its training loss can be optimistic. It evaluates with running statistics "
       "instead (as PyTorch's eval mode), so its train and val losses are measured differently from the row "
       "norms', whose output for a position depends on that position's activations only.\n"
    << "- pRMSNorm estimates the RMS from the first k = ceil(n p) features only; `none` has no normalisation "
       "at all (the paper's Transformer failed to train without it; at this depth it usually trains, worse).\n";
  if (arch == "llama")
    s << "- In the llama arch every norm sits where LLaMA has RMSNorm (before attention, before the MLP, before "
         "the head); LayerNorm and BatchNorm carry a bias there, which LLaMA's RMSNorm has not, so their "
         "parameter counts are larger. RoPE, SwiGLU and the untied head are the same for every norm.\n";
  return s.str();
}

namespace {
// One curve of the chart: a norm's validation figure (mean over seeds) at each evaluated step.
struct Curve {
  std::string name;
  std::vector<std::pair<double, double>> pts;
};

// The curves, and the ranges they span: steps up to xmax, values in [ymin, ymax].
std::vector<Curve> chart_curves(const std::vector<RunResult>& runs, bool bits_per_byte, double& xmax, double& ymin,
                                double& ymax) {
  std::vector<Curve> curves;
  xmax = 1, ymin = INFINITY, ymax = -INFINITY;
  for (const auto& [norm, rs] : by_norm(runs)) {
    Curve c{norm, {}};
    std::map<std::int64_t, std::vector<double>> at;
    for (const RunResult* r : rs)
      for (const auto& e : r->evals) at[e.step].push_back(bits_per_byte ? e.val_bpb : e.val_loss);
    for (const auto& [step, v] : at) {
      const double m = mean_sd(v).first;
      if (!std::isfinite(m)) continue;
      c.pts.push_back({static_cast<double>(step), m});
      xmax = std::max(xmax, static_cast<double>(step));
      ymin = std::min(ymin, m);
      ymax = std::max(ymax, m);
    }
    curves.push_back(c);
  }
  if (!std::isfinite(ymin)) ymin = 0, ymax = 1;
  return curves;
}

// A tick step of 2, 5 or 10 times a power of ten, about span / n; the y range rounded out to it.
double nice_tick(double span, double n) {
  const double raw = span / n, mag = std::pow(10, std::floor(std::log10(raw)));
  return raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
}
}  // namespace

std::string val_loss_svg(const std::vector<RunResult>& runs, const std::string& title, bool bits_per_byte) {
  const double W = 820, H = 500, L = 70, R = 170, T = 50, B = 60;  // plot area margins
  double xmax, ymin, ymax;
  const std::vector<Curve> curves = chart_curves(runs, bits_per_byte, xmax, ymin, ymax);
  const double tick = nice_tick(std::max(ymax - ymin, 1e-3), 6);
  ymin = std::floor(ymin / tick) * tick;
  ymax = std::ceil(ymax / tick) * tick;
  if (ymax <= ymin) ymax = ymin + tick;
  const double pw = W - L - R, ph = H - T - B;
  auto X = [&](double x) { return L + x / xmax * pw; };
  auto Y = [&](double y) { return T + (ymax - y) / (ymax - ymin) * ph; };
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#7f7f7f", "#ff7f0e", "#17becf", "#8c564b"};

  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W << ' '
    << H << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"13\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << L + pw / 2 << "\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">" << title << "</text>\n";
  // grid and y ticks
  for (double y = ymin; y <= ymax + tick / 2; y += tick) {
    s << "<line x1=\"" << L << "\" x2=\"" << L + pw << "\" y1=\"" << Y(y) << "\" y2=\"" << Y(y)
      << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << L - 8 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">"
      << fmt(tick < 0.1 ? "%.2f" : "%.1f", y) << "</text>\n";
  }
  // x ticks
  const double xt = nice_tick(xmax, 5);
  for (double x = 0; x <= xmax + xt / 2; x += xt) {
    if (x > xmax) break;
    s << "<line x1=\"" << X(x) << "\" x2=\"" << X(x) << "\" y1=\"" << T << "\" y2=\"" << T + ph
      << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << X(x) << "\" y=\"" << T + ph + 20 << "\" text-anchor=\"middle\">"
      << fmt("%.0f", x) << "</text>\n";
  }
  // axes and labels
  s << "<line x1=\"" << L << "\" x2=\"" << L << "\" y1=\"" << T << "\" y2=\"" << T + ph << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << L << "\" x2=\"" << L + pw << "\" y1=\"" << T + ph << "\" y2=\"" << T + ph << "\" stroke=\"black\"/>\n"
    << "<text x=\"" << L + pw / 2 << "\" y=\"" << H - 15 << "\" text-anchor=\"middle\">training step</text>\n"
    << "<text transform=\"translate(20," << T + ph / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
    << (bits_per_byte ? "validation bits per byte"
                      : runs.empty() || runs.front().tokenizer == "char" ? "validation loss (nats/char)"
                                                                          : "validation loss (nats/token)")
    << "</text>\n";
  // curves and legend
  for (std::size_t i = 0; i < curves.size(); ++i) {
    const char* col = colors[i % 8];
    s << "<polyline fill=\"none\" stroke=\"" << col << "\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : curves[i].pts) s << X(x) << ',' << Y(y) << ' ';
    s << "\"/>\n";
    for (const auto& [x, y] : curves[i].pts) s << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"2.5\" fill=\"" << col << "\"/>\n";
    const double ly = T + 10 + 22 * static_cast<double>(i);
    s << "<line x1=\"" << L + pw + 20 << "\" x2=\"" << L + pw + 48 << "\" y1=\"" << ly << "\" y2=\"" << ly << "\" stroke=\""
      << col << "\" stroke-width=\"3\"/>\n<text x=\"" << L + pw + 56 << "\" y=\"" << ly + 4 << "\">" << curves[i].name
      << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace lm
