#pragma once
// Debugging and measuring the tape: anomaly mode (the first NaN or Inf names its op) and op timing.
#include <cstdint>
#include <string>
#include <vector>

namespace tg {

// ---- anomaly mode (PyTorch's torch.autograd.set_detect_anomaly) ----
// When on (for this thread), every recorded op checks its outputs and every backward step the
// gradients it wrote, and the first NaN or Inf throws tg::Error naming the op, its tape index and
// its input and output shapes, and whether its inputs were already non-finite. Costs a pass over
// every output and gradient: a debugging aid, off by default. Ops run under NoGradGuard are not
// recorded and so not checked. A backward stopped this way leaves the gradients part-accumulated.
void set_detect_anomaly(bool on);
bool is_anomaly_enabled();
class DetectAnomalyGuard {
 public:
  explicit DetectAnomalyGuard(bool on = true);
  ~DetectAnomalyGuard();
  DetectAnomalyGuard(const DetectAnomalyGuard&) = delete;
  DetectAnomalyGuard& operator=(const DetectAnomalyGuard&) = delete;

 private:
  bool prev_;
};

// ---- op timing, for benchmarks ----
// When on (for this thread), the tape times every recorded op: its forward as the time from the
// previous record (or from op_timing_mark()) to its own, which covers the op's checks, its output's
// allocation and its kernel; its backward as the time of its backward step. op_times() sums them
// by op name, largest total first. Costs a clock read per op; off by default.
struct OpTime {
  std::string op;
  double forward_s = 0, backward_s = 0;
  std::int64_t calls = 0;
};
void set_op_timing(bool on);
void op_timing_mark();  // the next op's forward starts now (call before a forward pass)
std::vector<OpTime> op_times();
void reset_op_times();

}  // namespace tg
