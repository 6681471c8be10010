// invariance: the paper's Table 1 and its section-4 gradient claims, measured in float64.
// Prints the measured table next to the paper's verdicts and the gradient ratios; exits 0 only
// when every cell agrees with the paper and every claim holds. --eps shows how eps > 0 bends them.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "invariance/invariance.h"

int main(int argc, char** argv) {
  inv::Setup s;
  CLI::App app{"Measure the invariance properties of BatchNorm, WeightNorm, LayerNorm, RMSNorm and pRMSNorm "
               "(Zhang & Sennrich 2019, Table 1 and section 4)."};
  app.add_option("--eps", s.eps, "the norms' epsilon (0: the paper's exact setting)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--delta", s.delta, "the re-scaling factor")->check(CLI::Range(1e-6, 1e6))->capture_default_str();
  app.add_option("--p", s.p, "pRMSNorm's fraction of features")->check(CLI::Range(1e-9, 1.0))->capture_default_str();
  app.add_option("--seed", s.seed, "random data and weights")->capture_default_str();
  app.add_option("--batch", s.N, "cases in the batch")->check(CLI::Range(2, 100000))->capture_default_str();
  app.add_option("--in", s.m, "input width")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--out", s.n, "output width (features normalised)")->check(CLI::Range(2, 100000))->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "invariance: error: " << e.what() << "\n";
    return 2;
  }

  bool all_agree = true;
  std::printf("Table 1, measured: largest relative change of norm(W x) under each transformation\n");
  std::printf("(float64, batch %lld, W %lld x %lld, delta %g, eps %g; \"inv\" when the change is below %g)\n\n",
              static_cast<long long>(s.N), static_cast<long long>(s.n), static_cast<long long>(s.m), s.delta, s.eps,
              inv::kInvariantTol);
  const char* heads[][2] = {{"weight matrix", "re-scaling"}, {"weight matrix", "re-centering"}, {"weight vector", "re-scaling"},
                            {"dataset", "re-scaling"},       {"dataset", "re-centering"},       {"single case", "re-scaling"}};
  for (int line = 0; line < 2; ++line) {
    std::printf("%-11s", "");
    for (auto& h : heads) std::printf("| %-18s", h[line]);
    std::printf("|\n");
  }
  std::printf("%s\n", std::string(11 + 6 * 20 + 1, '-').c_str());
  for (inv::Norm n : inv::all_norms()) {
    std::printf("%-11s", inv::name(n).c_str());
    for (inv::Transform t : inv::all_transforms()) {
      const inv::Cell c = inv::measure(n, t, s);
      const bool paper = inv::paper_says_invariant(n, t);
      const bool agree = paper == c.invariant;
      all_agree = all_agree && agree;
      std::printf("| %-3s %8.1e %-5s", c.invariant ? "inv" : "no", c.change, agree ? (paper ? "(yes)" : "(no)") : "(!!)");
    }
    std::printf("|\n");
  }
  std::printf("\nIn brackets: the paper's verdict; (!!) marks a disagreement.\n");

  for (bool partial : {false, true}) {
    std::printf("\nSection 4, %s (gain g, bias b, L = sum tanh(y) R), delta %g:\n", partial ? "pRMSNorm" : "RMSNorm", s.delta);
    std::printf("  %-44s %12s %12s %10s\n", "claim", "paper", "measured", "deviation");
    for (const inv::Claim& c : inv::measure_gradients(s, partial)) {
      if (partial && c.what.find("dL/d") == std::string::npos) continue;  // the RMS facts are p-independent
      const bool holds = c.deviation <= inv::kInvariantTol;
      all_agree = all_agree && holds;
      std::printf("  %-44s %12.6f %12.6f %10.1e%s\n", c.what.c_str(), c.expected, c.ratio, c.deviation, holds ? "" : "  (!!)");
    }
  }
  std::printf("\n%s\n", all_agree ? "Every cell and claim agrees with the paper."
                                   : "Some cells or claims disagree with the paper (with eps > 0 this is expected).");
  return all_agree ? 0 : 1;
}
