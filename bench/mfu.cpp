#include "mfu.h"

#include <chrono>
#include <fstream>

#include "kernels/isa.h"
#include "tapegrad/threads.h"
#include "peak.h"

namespace bench {

double step_flops(std::int64_t params, std::int64_t layers, std::int64_t context, std::int64_t width,
                  std::int64_t tokens) {
  const double per_token = 6.0 * static_cast<double>(params) +
                           12.0 * static_cast<double>(layers) * static_cast<double>(context) * static_cast<double>(width);
  return per_token * static_cast<double>(tokens);
}

namespace {
// The best of three timed runs of about a tenth of a second each (the first also warms the clock up).
double peak_of(PeakKind k) {
  long iters = 1 << 16;
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    run_peak(k, iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = peak_flops_per_iteration(k) * static_cast<double>(iters) * tg::get_num_threads();  // every thread
    if (rep > 0) best = std::max(best, flops / s);
    if (s < 0.05) iters *= 4;
  }
  return best;
}
}  // namespace

Peak measure_peak(bool bf16) {
  using tg::kernels::Isa;
  const Isa isa = tg::kernels::isa();  // TAPEGRAD_ISA caps it
  if (bf16 && isa >= Isa::amx_bf16) return {peak_of(PeakKind::amx_bf16), "amx_bf16"};
  if (bf16 && isa >= Isa::avx512_bf16) return {peak_of(PeakKind::dpbf16), "dpbf16"};
  if (isa >= Isa::avx512) return {peak_of(PeakKind::fma_avx512), "fma_avx512"};
  if (isa >= Isa::avx2) return {peak_of(PeakKind::fma_avx2), "fma_avx2"};
  return {0, "none"};
}

namespace {
std::string cpuinfo(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    while (!k.empty() && (k.back() == ' ' || k.back() == '\t')) k.pop_back();
    if (k == key) return colon + 2 <= line.size() ? line.substr(colon + 2) : "";
  }
  return "?";
}
}  // namespace

std::string cpu_id() { return cpuinfo("vendor_id") + " " + cpuinfo("cpu family") + " " + cpuinfo("model"); }
std::string cpu_name() { return cpuinfo("model name"); }

}  // namespace bench
