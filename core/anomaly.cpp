// Anomaly mode (a NaN or Inf stops the forward or backward at the op that made it) and op timing
// (seconds per op name, for benchmarks): both run from the hook after each record and around each
// backward step, and cost nothing while off.
#include "tape_internal.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <unordered_map>

#include "dispatch.h"
#include "tapegrad/anomaly.h"

namespace tg {

using detail::t_anomaly;

namespace detail {

void check_anomaly_outputs(const char* op, std::size_t index, const Node& node, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in);

namespace {
// Op timing (set_op_timing): per op name (static strings, so the pointer is the key), this thread.
using Clock = std::chrono::steady_clock;
thread_local constinit bool t_timing = false;
thread_local Clock::time_point t_mark;
thread_local std::unordered_map<const char*, OpTime> t_times;

void time_forward(const char* op) {
  const auto now = Clock::now();
  OpTime& t = t_times[op];
  t.forward_s += std::chrono::duration<double>(now - t_mark).count();
  ++t.calls;
  t_mark = now;
}
}  // namespace

void after_record(Node& node, const Tensor* const* outputs, std::size_t n_out, const Tensor* const* inputs,
                  std::size_t n_in) {
  if (t_anomaly) check_anomaly_outputs(node.name(), tape().size() - 1, node, outputs, n_out, inputs, n_in);
  if (t_timing) time_forward(node.name());
}

// Runs node's backward, timed when op timing is on.
void run_backward_timed(Node& n) {
  if (!t_timing) return TapeAccess::run(n);
  const auto t0 = Clock::now();
  TapeAccess::run(n);
  t_times[n.name()].backward_s += std::chrono::duration<double>(Clock::now() - t0).count();
  t_mark = Clock::now();
}

}  // namespace detail

// ---- anomaly mode ----

namespace {

// Index of the first NaN or Inf in t, or -1 (float tensors only; integers are always finite).
std::int64_t first_nonfinite(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return -1;
  return detail::dispatch_float("anomaly", t.dtype(), [&](auto z) -> std::int64_t {
    using T = decltype(z);
    const T* p = t.data<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return i;
    return -1;
  });
}

std::string describe(const Tensor& t, std::int64_t i) {
  std::ostringstream s;
  // Read directly: an op here would be recorded and checked in turn.
  const double v = detail::dispatch_float("anomaly", t.dtype(), [&](auto z) {
    using T = decltype(z);
    return static_cast<double>(t.data<T>()[i]);
  });
  s << (std::isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf") << " at flat index " << i << " of " << t.dtype() << ' '
    << t.shape();
  return s.str();
}

std::string shapes_of(const Node& n) {
  std::ostringstream s;
  s << '(';
  for (std::size_t k = 0; k < n.inputs().size(); ++k) s << (k ? ", " : "") << n.input_shape(k);
  s << ") -> (";
  for (std::size_t k = 0; k < n.outputs().size(); ++k) s << (k ? ", " : "") << n.outputs()[k]->shape;
  s << ')';
  return s.str();
}
}  // namespace

void set_detect_anomaly(bool on) {
  t_anomaly = on;
  detail::t_record_hook = t_anomaly || detail::t_timing;
}
bool is_anomaly_enabled() { return t_anomaly; }

void set_op_timing(bool on) {
  detail::t_timing = on;
  detail::t_record_hook = t_anomaly || detail::t_timing;
  detail::t_mark = detail::Clock::now();
}
void op_timing_mark() {
  if (detail::t_timing) detail::t_mark = detail::Clock::now();
}
void reset_op_times() { detail::t_times.clear(); }
std::vector<OpTime> op_times() {
  std::unordered_map<std::string, OpTime> by_name;  // one op name may sit at several addresses
  for (const auto& [op, t] : detail::t_times) {
    OpTime& m = by_name[op];
    m.op = op;
    m.forward_s += t.forward_s;
    m.backward_s += t.backward_s;
    m.calls += t.calls;
  }
  std::vector<OpTime> v;
  for (auto& [name, t] : by_name) v.push_back(t);
  std::sort(v.begin(), v.end(), [](const OpTime& a, const OpTime& b) {
    return a.forward_s + a.backward_s > b.forward_s + b.backward_s;
  });
  return v;
}
DetectAnomalyGuard::DetectAnomalyGuard(bool on) : prev_(t_anomaly) { set_detect_anomaly(on); }
DetectAnomalyGuard::~DetectAnomalyGuard() { set_detect_anomaly(prev_); }

namespace detail {

namespace {
std::atomic<bool> g_retain_grad_used{false};
}  // namespace
void note_retain_grad() { g_retain_grad_used.store(true, std::memory_order_relaxed); }
bool retain_grad_used() { return g_retain_grad_used.load(std::memory_order_relaxed); }

void check_anomaly_outputs(const char* op, std::size_t index, const Node& n, const Tensor* const* outputs,
                           std::size_t n_out, const Tensor* const* inputs, std::size_t n_in) {
  for (std::size_t k = 0; k < n_out; ++k) {
    const std::int64_t at = first_nonfinite(*outputs[k]);
    if (at < 0) continue;
    std::ostringstream why;
    bool input_bad = false;
    for (std::size_t j = 0; j < n_in; ++j) {
      const std::int64_t ja = first_nonfinite(*inputs[j]);
      if (ja >= 0) {
        why << "; input " << j << " already had " << describe(*inputs[j], ja);
        input_bad = true;
      }
    }
    fail("anomaly", "forward of op '", op, "' (tape node ", index, ", shapes ", shapes_of(n), ") produced ",
         describe(*outputs[k], at), " in output ", k, input_bad ? why.str() : std::string("; its inputs were all finite"));
  }
}

void check_anomaly_backward(const Node& n, std::size_t index) {
  const auto ins = n.inputs();
  const auto outs = n.outputs();
  for (std::size_t k = 0; k < ins.size(); ++k) {
    if (!ins[k]) continue;
    const Tensor& g = ins[k]->grad.get();
    const std::int64_t at = first_nonfinite(g);
    if (at < 0) continue;
    std::ostringstream up;
    bool up_bad = false;
    for (std::size_t j = 0; j < outs.size(); ++j) {
      const Tensor& dy = outs[j]->grad.get();
      const std::int64_t ja = first_nonfinite(dy);
      if (ja >= 0) {
        up << "; the upstream gradient of output " << j << " already had " << describe(dy, ja);
        up_bad = true;
      }
    }
    fail("anomaly", "backward of op '", n.name(), "' (tape node ", index, ", shapes ", shapes_of(n), ") produced ",
         describe(g, at), " in the gradient of input ", k,
         up_bad ? up.str() : std::string("; the upstream gradient was finite"));
  }
}

}  // namespace detail

}  // namespace tg
