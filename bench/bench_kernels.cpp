// bench_kernels: kernel-level timings with Google Benchmark, float32, comparable with the PyTorch
// reference ../shared/bench/torch_kernels.py.
//
//   norm/<kind>/<rows>x<C>       forward + backward of tg::rms_norm (weight), prms_norm (p = 0.0625,
//                                weight), tg::layer_norm and tg::batch_norm (channels-last, training;
//                                weight and bias) through the public ops: y = norm(x); y.backward(dy);
//                                grads cleared. bytes_per_second counts the minimum traffic of
//                                torch_kernels.py: 5 * rows * C * 4 bytes (forward reads x, writes y;
//                                backward reads x and dy, writes dx).
//   copy/memcpy/<rows>x<C>       one std::memcpy of rows * C floats between 64-byte aligned buffers (as
//                                tensor storage), counted as 2 * rows * C * 4 bytes (read + write): the
//                                bandwidth yardstick for the norms.
//   copy/memcpy_omp/<rows>x<C>   the same bytes copied by the benchmark's threads, each std::memcpy-ing
//                                one contiguous chunk (the yardstick when the norms run on several threads).
//   matmul/<name>/<shape>/<impl> the GPT's products: tg = tg::matmul under tg::NoGradGuard (x W^T as
//                                Linear calls it), kernels = tg::kernels::gemm, cblas = cblas_sgemm
//                                called directly (one call per matrix for the batched case). FLOPS is
//                                2 * M * N * K * batch per second.
//   step_products/gpt/<impl>     every weight product of one bench_train step, forward and backward,
//                                as the framework makes them (tg) or as direct cblas_sgemm calls
//                                (cblas): the floor under the step time (bm_step_products).
//   gemm_isa/<name>/<isa>        the medium GPT's weight products (n_embd 384, 16 x 128 = 2048 rows:
//                                qkv, proj, fc, fc_out, each forward x W^T and backward dx = dy W, dW =
//                                dy^T x) through tg::kernels::gemm with the float32 product of one
//                                instruction set (kernels::set_isa: avx2, avx512, where the CPU has
//                                them). FLOPS is 2 * M * N * K per second; divide by the cores' FMA
//                                peak (AVX-512: 2 pipes x 16 floats x 2 flops x clock) for the fraction.
//                                bf16 is the same products through kernels::gemm_bf16 (float32 operands
//                                rounded while packed, float32 sums), where the CPU has AVX512_BF16;
//                                avx2_fma_bf16 and avx512_fma_bf16 are gemm_bf16 on float32 fused
//                                multiply-adds at those levels (sgemm_bf16.h), on every CPU that has them.
//                                avx512 runs the CPU's own register tile; avx512_14x32 and
//                                avx512_8x48 run each of the two (kernels/sgemm_avx512.h).
//                                large_*: the same twelve products at the GPT-2-small shape (n_embd 768).
//                                blocks_*: a resident block, and C of 2048 x 3072 with K = 256 and 768.
//   peak/<kind>                  the team's multiply-add peak: fma_avx2, fma_avx512, dpbf16, amx_bf16 (peak.cpp);
//                                scripts/bench prints each gemm_isa product as a fraction of its peak.
//   attention/<shape>/<pass>     one layer's causal attention through the tiled kernels
//                                (kernels/attention.h) on a packed qkv: shape B x T x C / H (the
//                                bench_train defaults, the medium GPT, GPT-2 small), pass fwd
//                                (forward: y and lse) or bwd (backward: dqkv from qkv, y, lse, dy),
//                                float32, or fwd_bf16 / bwd_bf16 with the autocast's bf16-rounded
//                                operands. FLOPS counts the causal multiply-adds actually needed:
//                                2 products forward, 4 backward (the backward's recomputation of
//                                S is not counted), T (T + 1) / 2 scores each, 2 flops per
//                                multiply-add.
//   tape/chain/<n>               a chain of n small recorded ops (x = x * 1.0001 + 0.0001 on 4 elements,
//                                2 ops per step, then sum + backward), as torch_kernels.py's tape_case;
//                                ns_per_op = wall time of forward + backward / n.
//
// Run (Release build; scripts/bench does all of this):
//   build/release/bench/bench_kernels                          # console table
//   build/release/bench/bench_kernels --threads=2 --benchmark_filter='norm|copy'
//   build/release/bench/bench_kernels --benchmark_format=json > kernels.json
//   build/release/bench/bench_kernels --benchmark_min_time=0.1 --benchmark_repetitions=3
// Threads: --threads=N, else $TAPEGRAD_THREADS, else all cores (tg::set_num_threads).
// Unless given on the command line, --benchmark_repetitions=5 and --benchmark_report_aggregates_only=true
// are added: every case runs 5 times and mean / median / stddev / cv over those are reported (read
// the median on a busy machine). Times are wall-clock (UseRealTime): the kernels run on OpenMP threads.
// The console prints bytes_per_second with binary prefixes (G/s = 2^30 bytes/s); the JSON holds plain
// bytes/s (scripts/bench divides by 1e9, as torch_kernels.py's GBps).
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/isa.h"
#include "kernels/sgemm_avx512.h"
#include "kernels/sgemm_bf16.h"
#include "peak.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"
#include "tapegrad/random.h"
#include "tapegrad/tensor.h"
#include "tapegrad/threads.h"

namespace {

using i64 = std::int64_t;

// ---------------------------------------------------------------- norms

enum class Norm { rms, prms, layer, batch };

const char* norm_name(Norm k) {
  switch (k) {
    case Norm::rms: return "rmsnorm";
    case Norm::prms: return "prmsnorm";
    case Norm::layer: return "layernorm";
    case Norm::batch: return "batchnorm";
  }
  return "?";
}

void bm_norm(benchmark::State& state, Norm kind, i64 rows, i64 C) {
  tg::manual_seed(1234);
  tg::Tensor x = tg::randn({rows, C});
  x.requires_grad_();
  tg::Tensor w = tg::ones({C});
  w.requires_grad_();
  // RMSNorm carries a gain only (as the reference's RMSNorm); LayerNorm and BatchNorm a bias too.
  const bool has_bias = kind == Norm::layer || kind == Norm::batch;
  tg::Tensor b;
  if (has_bias) {
    b = tg::zeros({C});
    b.requires_grad_();
  }
  const tg::Tensor dy = tg::randn({rows, C});
  auto forward = [&]() -> tg::Tensor {
    switch (kind) {
      case Norm::rms: return tg::rms_norm(x, w, tg::Tensor(), 1e-5, 1.0);
      case Norm::prms: return tg::rms_norm(x, w, tg::Tensor(), 1e-5, 0.0625);
      case Norm::layer: return tg::layer_norm(x, w, b, 1e-5);
      case Norm::batch:
        return tg::batch_norm(x, tg::Tensor(), tg::Tensor(), w, b, /*training=*/true, 0.1, 1e-5,
                              /*channels_last=*/true);
    }
    return {};
  };
  for (auto _ : state) {
    {
      tg::Tensor y = forward();
      y.backward(dy);
    }
    benchmark::DoNotOptimize(x.grad().raw_data());
    x.zero_grad();
    w.zero_grad();
    if (has_bias) b.zero_grad();
  }
  state.SetBytesProcessed(state.iterations() * 5 * rows * C * static_cast<i64>(sizeof(float)));
}

// A 64-byte aligned float buffer, as tensor storage is. (Alignment matters for the yardstick:
// glibc's memcpy on this class of CPU (rep movsb, AMD Zen 3) runs an order of magnitude slower when
// the destination is 16 bytes off a cache line, which is what malloc returns for large blocks.)
struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t n, float v)
      : p(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64))) {
    if (!p) throw std::bad_alloc();
    std::fill(p, p + n, v);  // touched: no page faults inside the timed loop
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  float* data() const { return p; }
  float* p;
};

void bm_memcpy(benchmark::State& state, i64 rows, i64 C, bool parallel) {
  const std::size_t n = static_cast<std::size_t>(rows * C);
  AlignedBuffer src(n, 1.0f), dst(n, 0.0f);
  const int nt = parallel ? tg::get_num_threads() : 1;
  for (auto _ : state) {
    if (parallel) {
#pragma omp parallel for schedule(static) num_threads(nt)
      for (int t = 0; t < nt; ++t) {
        // chunk bounds on cache lines (16 floats), for the reason given at AlignedBuffer
        auto bound = [&](int k) {
          return std::min(n, (n * static_cast<std::size_t>(k) / static_cast<std::size_t>(nt) + 15) / 16 * 16);
        };
        const std::size_t lo = bound(t), hi = bound(t + 1);
        std::memcpy(dst.data() + lo, src.data() + lo, (hi - lo) * sizeof(float));
      }
    } else {
      std::memcpy(dst.data(), src.data(), n * sizeof(float));
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * rows * C * static_cast<i64>(sizeof(float)));
}

// ---------------------------------------------------------------- matmul

// C (batch, M, N) = A (batch, M, K) @ B (batch, N, K)^T when trans_b (B stored (N, K), Linear's
// weight layout), or A @ B with B (batch, K, N). batch = 0 means plain 2-D operands.
struct MatmulCase {
  const char* name;
  i64 batch, M, N, K;
  bool trans_b;
};

enum class Impl { tg, kernels, cblas };

// C = op(A) op(B) (beta = 0) as one direct cblas_sgemm call, row-major: the yardstick.
void sgemm_direct(bool ta, bool tb, i64 M, i64 N, i64 K, const float* A, i64 lda, const float* B, i64 ldb, float* C,
                  i64 ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(M),
              static_cast<blasint>(N), static_cast<blasint>(K), 1.0f, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), 0.0f, C, static_cast<blasint>(ldc));
}

void set_flops(benchmark::State& state, const MatmulCase& c) {
  const double flops = 2.0 * static_cast<double>(c.M * c.N * c.K) * static_cast<double>(c.batch > 0 ? c.batch : 1);
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

void bm_matmul(benchmark::State& state, MatmulCase c, Impl impl) {
  tg::manual_seed(4321);
  const i64 nb = c.batch > 0 ? c.batch : 1;
  tg::Shape sa = c.batch > 0 ? tg::Shape{c.batch, c.M, c.K} : tg::Shape{c.M, c.K};
  tg::Shape sb = c.trans_b ? (c.batch > 0 ? tg::Shape{c.batch, c.N, c.K} : tg::Shape{c.N, c.K})
                           : (c.batch > 0 ? tg::Shape{c.batch, c.K, c.N} : tg::Shape{c.K, c.N});
  const tg::Tensor a = tg::randn(sa), b = tg::randn(sb);
  const float* A = a.data<float>();
  const float* B = b.data<float>();
  const i64 ldb = c.trans_b ? c.K : c.N;
  std::vector<float> out(static_cast<std::size_t>(nb * c.M * c.N));
  switch (impl) {
    case Impl::tg: {
      tg::NoGradGuard no_grad;
      for (auto _ : state) {
        tg::Tensor y = tg::matmul(a, b, false, c.trans_b);
        benchmark::DoNotOptimize(y.raw_data());
      }
      break;
    }
    case Impl::kernels:
      for (auto _ : state) {
        for (i64 i = 0; i < nb; ++i)
          tg::kernels::gemm<float>(false, c.trans_b, c.M, c.N, c.K, 1.0f, A + i * c.M * c.K, c.K, B + i * c.N * c.K,
                                   ldb, 0.0f, out.data() + i * c.M * c.N, c.N);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
      }
      break;
    case Impl::cblas:
      for (auto _ : state) {
        for (i64 i = 0; i < nb; ++i)
          sgemm_direct(false, c.trans_b, c.M, c.N, c.K, A + i * c.M * c.K, c.K, B + i * c.N * c.K, ldb,
                       out.data() + i * c.M * c.N, c.N);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
      }
      break;
  }
  set_flops(state, c);
}

// One product C = op(A) op(B) (beta = 0) through kernels::gemm with the given instruction set's
// float32 product; the level in use is restored after.
struct ProductCase {
  const char* name;
  bool ta, tb;
  i64 M, N, K;
};
// tile: the AVX-512 product's register tile, "" for the CPU's own (kernels/sgemm_avx512.h).
void bm_gemm_isa(benchmark::State& state, ProductCase c, tg::kernels::Isa level, bool bf16, std::string tile) {
  tg::manual_seed(4321);
#ifdef TG_SGEMM_AVX512
  namespace s5 = tg::kernels::sgemm_avx512;
  const std::optional<s5::TileShape> tile_before = s5::tile_set();
  if (!tile.empty()) s5::set_tile(s5::parse_tile(tile.c_str()));
#else
  (void)tile;
#endif
  const tg::Tensor a = tg::randn(c.ta ? tg::Shape{c.K, c.M} : tg::Shape{c.M, c.K});
  const tg::Tensor b = tg::randn(c.tb ? tg::Shape{c.N, c.K} : tg::Shape{c.K, c.N});
  std::vector<float> out(static_cast<std::size_t>(c.M * c.N));
  const tg::kernels::Isa before = tg::kernels::isa();
  tg::kernels::set_isa(level);
  for (auto _ : state) {
    if (bf16)
      tg::kernels::gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, 1.0f, a.data<float>(), a.size(1), b.data<float>(), b.size(1),
                             0.0f, out.data(), c.N);
    else
      tg::kernels::gemm<float>(c.ta, c.tb, c.M, c.N, c.K, 1.0f, a.data<float>(), a.size(1), b.data<float>(),
                               b.size(1), 0.0f, out.data(), c.N);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tg::kernels::set_isa(before);
#ifdef TG_SGEMM_AVX512
  s5::set_tile(tile_before);
#endif
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * static_cast<double>(c.M * c.N * c.K), benchmark::Counter::kIsIterationInvariantRate);
}

// The team's multiply-add peak for one instruction (peak.cpp).
void bm_peak(benchmark::State& state, bench::PeakKind k) {
  constexpr long kIters = 1 << 20;
  for (auto _ : state) benchmark::DoNotOptimize(bench::run_peak(k, kIters));
  state.counters["FLOPS"] = benchmark::Counter(bench::peak_flops_per_iteration(k) * kIters * tg::get_num_threads(),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// The weight products of one training step of bench_train's GPT: per layer the Linears qkv, proj,
// fc and fc_out, and the head (a matmul with the tied embedding): the forward products as
// tg::linear / tg::matmul compute them, the backward ones (dx = dy W and dW = dy^T x) through
// kernels::gemm_pair as Linear's backward does (the head's two one after the other, as matmul's).
// "cblas" makes the same products as direct cblas_sgemm calls, threaded by OpenBLAS. Attention's
// per-head products (about 8% of the step's multiply-adds: 151 M against 1,830 M) are left out.
// The time is a floor under the training step: what it would take if nothing else cost anything.
void bm_step_products(benchmark::State& state, bool direct) {
  struct Lin {
    i64 in, out, layers;
    bool paired;  // a Linear (gemm_pair), or the tied head (two gemm calls)
  };
  const i64 rows = 768;
  const Lin lins[] = {{128, 384, 4, true}, {128, 128, 4, true}, {128, 512, 4, true}, {512, 128, 4, true},
                      {128, 65, 1, false}};
  struct Bufs {
    std::vector<float> x, w, y, dy, dx, dw;
  };
  std::vector<Bufs> bufs;
  double flops = 0;
  tg::Generator gen(77);
  auto fill = [&](i64 n) {
    const tg::Tensor t = tg::randn({n}, tg::float32, &gen);
    return std::vector<float>(t.data<float>(), t.data<float>() + n);
  };
  for (const Lin& l : lins)
    for (i64 k = 0; k < l.layers; ++k) {
      bufs.push_back({fill(rows * l.in), fill(l.out * l.in), fill(rows * l.out), fill(rows * l.out), fill(rows * l.in),
                      fill(l.out * l.in)});
      flops += 3 * 2.0 * static_cast<double>(rows * l.in * l.out);
    }
  for (auto _ : state) {
    std::size_t b = 0;
    for (const Lin& l : lins)  // forward, layer by layer
      for (i64 k = 0; k < l.layers; ++k, ++b) {
        Bufs& u = bufs[b];
        if (direct) sgemm_direct(false, true, rows, l.out, l.in, u.x.data(), l.in, u.w.data(), l.in, u.y.data(), l.out);
        else tg::kernels::gemm<float>(false, true, rows, l.out, l.in, 1.0f, u.x.data(), l.in, u.w.data(), l.in, 0.0f,
                                      u.y.data(), l.out);
      }
    b = 0;
    for (const Lin& l : lins)  // backward
      for (i64 k = 0; k < l.layers; ++k, ++b) {
        Bufs& u = bufs[b];
        const tg::kernels::Gemm<float> px{false, false, rows, l.in, l.out, 1.0f, u.dy.data(), l.out, u.w.data(), l.in,
                                          0.0f, u.dx.data(), l.in};
        const tg::kernels::Gemm<float> pw{true, false, l.out, l.in, rows, 1.0f, u.dy.data(), l.out, u.x.data(), l.in,
                                          0.0f, u.dw.data(), l.in};
        if (direct) {
          sgemm_direct(px.ta, px.tb, px.M, px.N, px.K, px.A, px.lda, px.B, px.ldb, px.C, px.ldc);
          sgemm_direct(pw.ta, pw.tb, pw.M, pw.N, pw.K, pw.A, pw.lda, pw.B, pw.ldb, pw.C, pw.ldc);
        } else if (l.paired) {
          tg::kernels::gemm_pair(px, pw);
        } else {
          tg::kernels::gemm(px);
          tg::kernels::gemm(pw);
        }
      }
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// ---------------------------------------------------------------- tape

void bm_tape(benchmark::State& state, i64 n_ops) {
  double total_ns = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    {
      tg::Tensor x = tg::ones({4});
      x.requires_grad_();
      tg::Tensor y = x;
      for (i64 i = 0; i < n_ops / 2; ++i) y = y * 1.0001 + 0.0001;
      y.sum().backward();
      benchmark::DoNotOptimize(x.grad().raw_data());
    }
    total_ns += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  }
  state.counters["ns_per_op"] = total_ns / (static_cast<double>(state.iterations()) * static_cast<double>(n_ops));
  state.counters["ops"] = static_cast<double>(n_ops);
}

// ---------------------------------------------------------------- main

std::string shape_str(i64 r, i64 c) { return std::to_string(r) + "x" + std::to_string(c); }

bool has_flag(int argc, char** argv, std::string_view prefix) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]).substr(0, prefix.size()) == prefix) return true;
  return false;
}

int parse_threads(const char* s) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 1 || v > 1024) {
    std::fprintf(stderr, "bench_kernels: bad thread count '%s' (want 1..1024)\n", s);
    std::exit(2);
  }
  return static_cast<int>(v);
}


// Our own flag first (--threads=N or --threads N), removed from argv before Google Benchmark sees
// it, then Google Benchmark's defaults that the command line may override: 5 repetitions,
// aggregates only. Sets the thread count; returns the arguments for benchmark::Initialize.
std::vector<char*> parse_args(int argc, char** argv) {
  int threads = 0;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view a(argv[i]);
    if (i > 0 && a.substr(0, 10) == "--threads=") {
      threads = parse_threads(argv[i] + 10);
    } else if (i > 0 && a == "--threads" && i + 1 < argc) {
      threads = parse_threads(argv[++i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  if (threads == 0) {
    if (const char* e = std::getenv("TAPEGRAD_THREADS"); e && *e) threads = parse_threads(e);
  }
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  tg::set_num_threads(threads);
  static char reps[] = "--benchmark_repetitions=5";
  static char aggr[] = "--benchmark_report_aggregates_only=true";
  if (!has_flag(argc, argv, "--benchmark_repetitions")) args.insert(args.begin() + 1, reps);
  if (!has_flag(argc, argv, "--benchmark_report_aggregates_only") &&
      !has_flag(argc, argv, "--benchmark_display_aggregates_only"))
    args.insert(args.begin() + 1, aggr);
  return args;
}

void register_norms() {
  const std::pair<i64, i64> norm_shapes[] = {{768, 128}, {8192, 768}, {4096, 4096}};
  for (auto [rows, C] : norm_shapes) {
    const std::string s = shape_str(rows, C);
    benchmark::RegisterBenchmark(("copy/memcpy/" + s).c_str(), bm_memcpy, rows, C, false)
        ->UseRealTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("copy/memcpy_omp/" + s).c_str(), bm_memcpy, rows, C, true)
        ->UseRealTime()->Unit(benchmark::kMicrosecond);
    for (Norm k : {Norm::rms, Norm::prms, Norm::layer, Norm::batch})
      benchmark::RegisterBenchmark(("norm/" + std::string(norm_name(k)) + "/" + s).c_str(), bm_norm, k, rows, C)
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
  }
}

// The GPT of bench_train (n_embd 128, n_head 4, block 64, batch 12, vocab 65): B*T = 768 rows.
void register_matmuls() {
  const MatmulCase mm[] = {
      {"qkv", 0, 768, 384, 128, true},      // x (768,128) W^T, W (384,128)
      {"proj", 0, 768, 128, 128, true},     // (768,128) W^T, W (128,128)
      {"fc", 0, 768, 512, 128, true},       // (768,128) W^T, W (512,128)
      {"fc_out", 0, 768, 128, 512, true},   // (768,512) W^T, W (128,512)
      {"head", 0, 768, 65, 128, true},      // (768,128) E^T, E (65,128) tied embedding
      {"att_qk", 48, 64, 64, 32, true},     // q (48,64,32) @ k (48,64,32)^T
      {"att_v", 48, 64, 32, 64, false},     // att (48,64,64) @ v (48,64,32)
  };
  for (const MatmulCase& c : mm) {
    std::string s = (c.batch > 0 ? std::to_string(c.batch) + "x" : "") + shape_str(c.M, c.K) + "@" +
                    (c.batch > 0 ? std::to_string(c.batch) + "x" : "") +
                    (c.trans_b ? shape_str(c.N, c.K) + "T" : shape_str(c.K, c.N));
    const std::pair<Impl, const char*> impls[] = {{Impl::tg, "tg"}, {Impl::kernels, "kernels"}, {Impl::cblas, "cblas"}};
    for (auto [impl, iname] : impls)
      benchmark::RegisterBenchmark(("matmul/" + std::string(c.name) + "/" + s + "/" + iname).c_str(), bm_matmul, c, impl)
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
  }
}

// The medium GPT (n_embd 384, batch 16 x block 128 = 2048 rows): each Linear's three products,
// through each instruction set's product; and the peaks they are measured against.
void register_medium_products() {
  const ProductCase medium[] = {
      {"qkv_fwd", false, true, 2048, 1152, 384},   {"qkv_dx", false, false, 2048, 384, 1152},
      {"qkv_dw", true, false, 1152, 384, 2048},    {"proj_fwd", false, true, 2048, 384, 384},
      {"proj_dx", false, false, 2048, 384, 384},   {"proj_dw", true, false, 384, 384, 2048},
      {"fc_fwd", false, true, 2048, 1536, 384},    {"fc_dx", false, false, 2048, 384, 1536},
      {"fc_dw", true, false, 1536, 384, 2048},     {"fc_out_fwd", false, true, 2048, 384, 1536},
      {"fc_out_dx", false, false, 2048, 1536, 384}, {"fc_out_dw", true, false, 384, 1536, 2048},
      // The GPT-2-small shape (n_embd 768, batch 8 x block 256 = 2048 rows).
      {"large_qkv_fwd", false, true, 2048, 2304, 768},   {"large_qkv_dx", false, false, 2048, 768, 2304},
      {"large_qkv_dw", true, false, 2304, 768, 2048},    {"large_proj_fwd", false, true, 2048, 768, 768},
      {"large_proj_dx", false, false, 2048, 768, 768},   {"large_proj_dw", true, false, 768, 768, 2048},
      {"large_fc_fwd", false, true, 2048, 3072, 768},    {"large_fc_dx", false, false, 2048, 768, 3072},
      {"large_fc_dw", true, false, 3072, 768, 2048},     {"large_fc_out_fwd", false, true, 2048, 768, 3072},
      {"large_fc_out_dx", false, false, 2048, 3072, 768}, {"large_fc_out_dw", true, false, 768, 3072, 2048},
      // Where a product loses its peak (docs/performance.md): one row block by one column panel
      // of B for the 14 x 32 tile (for 8 x 48, 17 tiles and a 4-row edge by a 32-column edge
      // panel), both resident in cache; then a 2048 x 3072 C at K = 256 and at K = 768.
      {"blocks_resident", false, false, 140, 32, 256}, {"blocks_k256", false, false, 2048, 3072, 256},
      {"blocks_k768", false, false, 2048, 3072, 768},
  };
  using tg::kernels::Isa;
  // avx512 runs the CPU's own tile; avx512_14x32 and avx512_8x48 each tile (kernels/sgemm_avx512.h).
  const std::tuple<Isa, bool, const char*, const char*> levels[] = {{Isa::avx2, false, "avx2", ""},
                                                                     {Isa::avx512, false, "avx512", ""},
                                                                     {Isa::avx512, false, "avx512_", "14x32"},
                                                                     {Isa::avx512, false, "avx512_", "8x48"},
                                                                     {Isa::avx2, true, "avx2_fma_bf16", ""},
                                                                     {Isa::avx512, true, "avx512_fma_bf16", ""},
                                                                     {Isa::avx512_bf16, true, "avx512_bf16", ""},
                                                                     {Isa::amx_bf16, true, "amx_bf16", ""}};
  for (auto [level, bf16, name, tile] : levels)
    if (tg::kernels::cpu_supports(level))
      for (const ProductCase& c : medium)
        benchmark::RegisterBenchmark(("gemm_isa/" + std::string(c.name) + "/" + name + tile).c_str(), bm_gemm_isa, c,
                                     level, bf16, std::string(tile))
            ->UseRealTime()->MinTime(0.1)->Unit(benchmark::kMicrosecond);
  const std::pair<bench::PeakKind, Isa> peaks[] = {{bench::PeakKind::fma_avx2, Isa::avx2},
                                                   {bench::PeakKind::fma_avx512, Isa::avx512},
                                                   {bench::PeakKind::dpbf16, Isa::avx512_bf16},
                                                   {bench::PeakKind::amx_bf16, Isa::amx_bf16}};
  const char* names[] = {"peak/fma_avx2", "peak/fma_avx512", "peak/dpbf16", "peak/amx_bf16"};
  for (int i = 0; i < 4; ++i)
    if (tg::kernels::cpu_supports(peaks[i].second))
      benchmark::RegisterBenchmark(names[i], bm_peak, peaks[i].first)->UseRealTime()->Unit(benchmark::kMicrosecond);
}

// ---------------------------------------------------------------- attention

struct AttentionCase {
  const char* name;
  i64 B, T, C, H;
};

void bm_attention(benchmark::State& state, AttentionCase c, bool backward, bool bf16) {
  const tg::kernels::AttnDims d{c.B, c.T, c.C, c.H, 1.0 / std::sqrt(static_cast<double>(c.C / c.H)), true, bf16};
  tg::manual_seed(99);
  const tg::Tensor qkv = tg::randn({c.B, c.T, 3 * c.C}), dy = tg::randn({c.B, c.T, c.C});
  std::vector<float> y(static_cast<std::size_t>(c.B * c.T * c.C)), lse(static_cast<std::size_t>(c.B * c.H * c.T));
  std::vector<float> dqkv(static_cast<std::size_t>(qkv.numel()));
  tg::kernels::flash_attention_forward(qkv.data<float>(), y.data(), lse.data(), d);
  for (auto _ : state) {
    if (backward)
      tg::kernels::flash_attention_backward(qkv.data<float>(), y.data(), lse.data(), dy.data<float>(), dqkv.data(), d);
    else tg::kernels::flash_attention_forward(qkv.data<float>(), y.data(), lse.data(), d);
    benchmark::ClobberMemory();
  }
  const double mads = static_cast<double>(c.B * c.H * c.T * (c.T + 1) / 2 * (c.C / c.H)) * (backward ? 4 : 2);
  state.counters["FLOPS"] = benchmark::Counter(2 * mads, benchmark::Counter::kIsIterationInvariantRate);
}

void register_attention() {
  const AttentionCase cases[] = {{"default", 12, 64, 128, 4}, {"medium", 16, 128, 384, 6}, {"gpt2", 8, 256, 768, 12}};
  for (const AttentionCase& c : cases) {
    const std::string s = std::string(c.name) + "/" + std::to_string(c.B) + "x" + std::to_string(c.T) + "x" +
                          std::to_string(c.C) + "h" + std::to_string(c.H) + "/";
    for (bool bf16 : {false, true})
      for (bool bwd : {false, true})
        benchmark::RegisterBenchmark(("attention/" + s + (bwd ? "bwd" : "fwd") + (bf16 ? "_bf16" : "")).c_str(),
                                     bm_attention, c, bwd, bf16)
            ->UseRealTime()->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = parse_args(argc, argv);
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::AddCustomContext("tapegrad_threads", std::to_string(tg::get_num_threads()));
  register_norms();
  register_matmuls();
  register_medium_products();
  register_attention();
  benchmark::RegisterBenchmark("step_products/gpt/tg", bm_step_products, false)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_products/gpt/cblas", bm_step_products, true)->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("tape/chain/100000", bm_tape, i64{100000})->UseRealTime()->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
