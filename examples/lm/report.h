#pragma once
// What a comparison shows: the summary table (Markdown and terminal), the val-loss chart (SVG),
// and the combined metrics file.
#include <string>
#include <vector>

#include "lm/trainer.h"

namespace lm {

// Mean and sample standard deviation (0 for one value; NaN values are skipped).
std::pair<double, double> mean_sd(const std::vector<double>& v);

// One row per norm (runs of several seeds pooled): the table as Markdown.
std::string summary_table(const std::vector<RunResult>& runs);
// summary.md: the table, the settings, the reading notes (BatchNorm's statistics, seeds); step_log
// names where every step is logged, relative to summary.md.
std::string summary_markdown(const std::vector<RunResult>& runs, const std::string& settings,
                             const std::string& step_log = "<norm>/train_log.csv");
// An SVG line chart of val loss (or, with bits_per_byte, val bits per byte) against step, one
// curve per norm (mean over seeds), with axes, ticks, grid and a legend.
std::string val_loss_svg(const std::vector<RunResult>& runs, const std::string& title, bool bits_per_byte = false);

}  // namespace lm
