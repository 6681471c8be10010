#pragma once
// Model FLOPs utilisation for bench_train: the FLOPs a training step needs (PaLM's count), this
// machine's measured multiply-add peak for the step's precision, and the CPU's identity.
#include <cstdint>
#include <string>

namespace bench {

// A step's model FLOPs: 6 N per token for the forward and backward products over the N
// parameters, plus attention's 12 L T C per token (QK^T and PV, forward and backward), over the
// step's tokens (batch x context x ranks).
double step_flops(std::int64_t params, std::int64_t layers, std::int64_t context, std::int64_t width,
                  std::int64_t tokens);

// The measured peak (FLOP/s) of the OpenMP team for float32 products (vfmadd231ps at the widest
// width the run's ISA uses) or bf16 products (vdpbf16ps where the ISA has it), and its name.
struct Peak {
  double flops = 0;
  std::string kind;
};
Peak measure_peak(bool bf16);

// "vendor family model", from /proc/cpuinfo (e.g. "AuthenticAMD 25 17"), and the model name.
std::string cpu_id();
std::string cpu_name();

}  // namespace bench
