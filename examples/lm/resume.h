#pragma once
// What --resume continues: the run it names, as its checkpoint's configuration says
// (docs/reliability.md). A flag given with --resume either may change on resume (the total steps,
// the evaluation cadence, sampling, --lr with a printed note, and how the run is computed:
// threads, progress, anomaly detection, gradient checkpointing) or defines the run (the model's
// shape, the data, the batch, the seed, the rest of the schedule, the precision): those are
// refused when they differ from the run's, every difference listed in one line.
#include <functional>
#include <string>
#include <vector>

#include "lm/trainer.h"

namespace lm {

// The configuration a resume continues with: `run` (its checkpoint's), with the flags the command
// line gave (was_given("--steps")) that may change taken from `given`. Throws tg::Error listing
// each flag that defines the run and differs from it ("--n-embd 32 (the run's: 16)"). A --data
// other than the run's is taken, as an absolute path, only when the run's corpus no longer exists
// (it moved). Lines to print (a changed --lr, a moved corpus) are appended to notes.
TrainConfig resume_config(const TrainConfig& run, const TrainConfig& given,
                          const std::function<bool(const std::string&)>& was_given, std::vector<std::string>& notes);

// The flags that may change on resume, and the configuration flags that may not.
const std::vector<std::string>& flags_resume_may_change();
const std::vector<std::string>& flags_fixed_on_resume();

// The whole run in dir, for its report after a resume: every evaluation in metrics.csv, the final
// losses from its last row, the median step time over train_log.csv (leaving out the first steps,
// up to 10, at most half) and tokens/s from it; the rest (parameters, best val loss, memory,
// communication) as this process measured it in r.
RunResult whole_run(RunResult r, const std::string& dir, double tokens_per_step);

}  // namespace lm
