// mlp, the fused transformer MLP: the same bits as its unfused twin (linear, gelu or swiglu,
// linear) in value and every gradient, float32, float64 and under autocast, at 1, 2 and 3 threads
// and at shapes on both sides of the products' team threshold; float64 gradients against finite
// differences; the kernels' epilogues on blocks against whole passes; and the error messages.
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "helpers.h"
#include "isa_helpers.h"
#include "kernels/gemm.h"
#include "kernels/sgemm_bf16.h"
#include "tapegrad/autocast.h"
#include "tapegrad/composite.h"

using namespace tg;
using namespace tgtest;

namespace {

struct MlpCase {
  std::int64_t B, T, C, H;
  bool bias;
  const char* act;
};

// The unfused path: composite::mlp, linear, gelu or swiglu, linear.
Tensor unfused(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
               const char* act) {
  return composite::mlp(x, w1, b1, w2, b2, act);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<std::size_t>(a.numel()) * itemsize(a.dtype())) == 0;
}

// The output and the gradients of x, w1, b1, w2, b2 for one path.
// A leaf of dtype from param64's values.
Tensor leaf(const Shape& shape, std::uint64_t seed, DType dtype, double scale = 1.0) {
  return to(param64(shape, seed, scale).detach(), dtype).detach().requires_grad_();
}

std::vector<Tensor> run_path(bool fused, const MlpCase& c, DType dtype, bool bf16) {
  const std::int64_t F = std::string(c.act) == "gelu" ? c.H : c.H / 2;
  Tensor x = leaf({c.B, c.T, c.C}, 1, dtype), w1 = leaf({c.H, c.C}, 2, dtype, 0.3), w2 = leaf({c.C + 3, F}, 3, dtype, 0.3);
  Tensor b1 = c.bias ? leaf({c.H}, 4, dtype) : Tensor(), b2 = c.bias ? leaf({c.C + 3}, 5, dtype) : Tensor();
  Tensor dy = to(param64({c.B, c.T, c.C + 3}, 6).detach(), dtype);
  tape().clear();
  Tensor y;
  {
    AutocastGuard autocast(bf16);
    y = fused ? mlp(x, w1, b1, w2, b2, c.act) : unfused(x, w1, b1, w2, b2, c.act);
  }
  backward(sum(y * dy));
  std::vector<Tensor> out = {y.detach(), x.grad(), w1.grad(), w2.grad()};
  if (c.bias) {
    out.push_back(b1.grad());
    out.push_back(b2.grad());
  }
  return out;
}

}  // namespace

TEST_CASE("mlp gives its unfused twin's bits, value and gradients, float32, float64 and bf16, 1 to 3 threads", "[mlp]") {
  const int before = get_num_threads();
  const MlpCase cases[] = {{2, 3, 8, 16, true, "gelu"},      {1, 5, 7, 10, false, "swiglu"},
                           {4, 50, 64, 256, true, "gelu"},   {3, 40, 48, 192, false, "gelu"},
                           {4, 50, 64, 256, true, "swiglu"}, {2, 33, 30, 98, true, "swiglu"}};
  for (const MlpCase& c : cases)
    for (DType dtype : {float32, float64})
      for (bool bf16 : {false, true}) {
        if (bf16 && dtype == float64) continue;
        for (int threads : {1, 2, 3}) {
          set_num_threads(threads);
          INFO("B=" << c.B << " T=" << c.T << " C=" << c.C << " H=" << c.H << " " << c.act << " bias=" << c.bias
                    << " dtype=" << dtype << " bf16=" << bf16 << " threads=" << threads);
          const std::vector<Tensor> f = run_path(true, c, dtype, bf16), u = run_path(false, c, dtype, bf16);
          REQUIRE(f.size() == u.size());
          for (std::size_t i = 0; i < f.size(); ++i) {
            INFO("tensor " << i << " (y, dx, dw1, dw2, db1, db2), max |diff| " << max_abs_diff(f[i], u[i]));
            REQUIRE(same_bits(f[i], u[i]));
          }
        }
      }
  set_num_threads(before);
}

TEST_CASE("mlp gives its unfused twin's bits under every instruction set the CPU has", "[mlp]") {
  using kernels::Isa;
  const int before = get_num_threads();
  set_num_threads(2);
  const MlpCase cases[] = {{4, 50, 64, 256, true, "gelu"}, {2, 33, 30, 98, true, "swiglu"}};
  each_isa({Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}, [&](Isa) {
    for (const MlpCase& c : cases)
      for (bool bf16 : {false, true}) {
        INFO(c.act << " bf16=" << bf16);
        const std::vector<Tensor> f = run_path(true, c, float32, bf16), u = run_path(false, c, float32, bf16);
        for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(same_bits(f[i], u[i]));
      }
  });
  set_num_threads(before);
}

TEST_CASE("mlp's float64 gradients agree with finite differences, gelu and swiglu, with and without biases",
          "[mlp]") {
  for (const char* act : {"gelu", "swiglu"})
    for (bool bias : {true, false}) {
      INFO(act << " bias=" << bias);
      const std::int64_t H = 6, F = std::string(act) == "gelu" ? H : H / 2;
      std::vector<Tensor> in = {param64({2, 3, 4}, 11), param64({H, 4}, 12, 0.5), param64({5, F}, 13, 0.5)};
      if (bias) {
        in.push_back(param64({H}, 14));
        in.push_back(param64({5}, 15));
      }
      require_gradcheck(
          [act, bias](const std::vector<Tensor>& t) {
            return mlp(t[0], t[1], bias ? t[3] : Tensor(), t[2], bias ? t[4] : Tensor(), act);
          },
          in);
    }
}

TEST_CASE("mlp: an epilogue covers every element of C exactly once, on every path of the products, every ISA", "[mlp]") {
  // Counts calls per element of C through the float32 and bf16 products, alone and as a pair,
  // with the team and without, K = 0 and alpha = 0 included; rows epilogues see whole rows.
  struct Count {
    std::vector<int> hits;
    std::int64_t N;
    std::atomic<bool> whole_rows{true};
    static void run(const void* ctx, std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
      auto& k = *const_cast<Count*>(static_cast<const Count*>(ctx));
      if (c0 != 0 || c1 != k.N) k.whole_rows = false;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) {
#pragma omp atomic
          ++k.hits[static_cast<std::size_t>(r * k.N + c)];
        }
    }
  };
  const int before = get_num_threads();
  using kernels::Isa;
  using Shape3 = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  each_isa({Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}, [&](Isa) {
    for (int threads : {1, 2, 3})
      for (auto [M, N, K] : {Shape3{300, 200, 64}, Shape3{5, 7, 3}, Shape3{64, 64, 0}, Shape3{1, 4096, 768}})
        for (float alpha : {1.0f, 0.0f})
          for (bool rows : {false, true}) {
            set_num_threads(threads);
            INFO("threads=" << threads << " M=" << M << " N=" << N << " K=" << K << " alpha=" << alpha
                            << " rows=" << rows);
            const std::size_t k1 = static_cast<std::size_t>(std::max<std::int64_t>(K, 1));
            std::vector<float> A(static_cast<std::size_t>(M) * k1, 0.5f), B(static_cast<std::size_t>(N) * k1, 0.25f);
            std::vector<float> C1(static_cast<std::size_t>(M * N)), C2 = C1;
            Count a{std::vector<int>(C1.size()), N}, b{std::vector<int>(C1.size()), N};
            const kernels::Epilogue ea{&Count::run, &a, rows}, eb{&Count::run, &b, rows};
            const kernels::Gemm<float> p{false, true, M, N, K, alpha, A.data(), K, B.data(), K, 0.0f, C1.data(), N, ea};
            const kernels::Gemm<float> q{false, true, M, N, K, alpha, A.data(), K, B.data(), K, 0.0f, C2.data(), N, eb};
            auto bf = [&](float* C, const kernels::Epilogue& e) {
              return kernels::GemmBf16{false, true, M, N, K, alpha, kernels::Bf16Operand(A.data(), K),
                                       kernels::Bf16Operand(B.data(), K), 0.0f, C, N, e};
            };
            kernels::gemm(p);
            kernels::gemm_bf16(bf(C1.data(), ea));
            kernels::gemm_pair(p, q);
            kernels::gemm_bf16_pair(bf(C1.data(), ea), bf(C2.data(), eb));
            for (int h : a.hits) REQUIRE(h == 4);
            for (int h : b.hits) REQUIRE(h == 2);
            if (rows) REQUIRE((a.whole_rows && b.whole_rows));
          }
  });
  set_num_threads(before);
}

TEST_CASE("linear with its own input as the residual: x + x w^T, the add's bits and gradients", "[mlp]") {
  const Tensor w0 = param64({24, 24}, 2, 0.3).detach(), dy = param64({40, 24}, 6).detach();
  auto run = [&](bool fused) {
    Tensor x = param64({40, 24}, 1), w = w0.clone().requires_grad_();
    tape().clear();
    Tensor y = fused ? linear(x, w, Tensor(), x) : x + linear(x, w);
    backward(sum(y * dy));
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad()};
  };
  const std::vector<Tensor> f = run(true), u = run(false);
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(same_bits(f[i], u[i]));
}

TEST_CASE("mlp names the op and the shapes when its arguments do not fit", "[mlp]") {
  const Tensor x = param64({2, 4}, 1), w1 = param64({6, 4}, 2), w2 = param64({3, 6}, 3);
  REQUIRE_TG_ERROR(mlp(x, w1, Tensor(), w2, Tensor(), "relu"), "mlp", "\"gelu\" or \"swiglu\"", "relu");
  REQUIRE_TG_ERROR(mlp(x, param64({6, 5}, 2), Tensor(), w2, Tensor()), "mlp", "(2, 4)", "(6, 5)");
  REQUIRE_TG_ERROR(mlp(x, w1, Tensor(), w2, Tensor(), "swiglu"), "mlp", "w2 (out, 3)", "(3, 6)");
  REQUIRE_TG_ERROR(mlp(x, param64({5, 4}, 2), Tensor(), param64({3, 2}, 3), Tensor(), "swiglu"), "mlp", "even",
                   "(5, 4)");
  REQUIRE_TG_ERROR(mlp(x, w1, param64({5}, 4), w2, Tensor()), "mlp", "b1 (6,)", "(5,)");
  REQUIRE_TG_ERROR(mlp(x, w1, Tensor(), w2, param64({4}, 4)), "mlp", "b2 (3,)", "(4,)");
  REQUIRE_TG_ERROR(mlp(x, to(w1, float32), Tensor(), w2, Tensor()), "mlp");
}

TEST_CASE("mlp with empty shapes gives the unfused ops' results", "[mlp]") {
  for (auto [rows, C, H] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 4, 6}, {3, 0, 6}, {3, 4, 0}}) {
    INFO("rows=" << rows << " C=" << C << " H=" << H);
    Tensor x = param64({rows, C}, 1).requires_grad_(), w1 = param64({H, C}, 2).requires_grad_();
    Tensor w2 = param64({5, H}, 3).requires_grad_(), b2 = param64({5}, 4).requires_grad_();
    Tensor y = mlp(x, w1, Tensor(), w2, b2);
    Tensor want = linear(gelu(linear(x.detach(), w1.detach())), w2.detach(), b2.detach());
    REQUIRE(y.shape() == want.shape());
    REQUIRE(max_abs_diff(y, want) == 0.0);
    backward(sum(y));
    REQUIRE(b2.grad().defined());
    REQUIRE(max(abs(b2.grad() - static_cast<double>(rows))).item() == 0.0);
  }
}

TEST_CASE("a residual added in linear's and mlp's epilogue gives the add's bits, value and gradients", "[mlp]") {
  const int before = get_num_threads();
  for (DType dtype : {float32, float64})
    for (bool bf16 : {false, true})
      for (bool bias : {false, true})
        for (bool res_grad : {true, false})
          for (int threads : {1, 2}) {
            if (bf16 && dtype == float64) continue;
            set_num_threads(threads);
            INFO("dtype=" << dtype << " bf16=" << bf16 << " bias=" << bias << " residual grad=" << res_grad
                          << " threads=" << threads);
            auto run = [&](bool fused, bool use_mlp) {
              Tensor x = leaf({3, 70, 40}, 1, dtype), w1 = leaf({96, 40}, 2, dtype, 0.3);
              Tensor w2 = leaf({40, 96}, 3, dtype, 0.3), b1 = bias ? leaf({96}, 4, dtype) : Tensor();
              Tensor b2 = bias ? leaf({40}, 5, dtype) : Tensor(), wl = leaf({40, 40}, 8, dtype, 0.3);
              Tensor r = to(param64({3, 70, 40}, 7).detach(), dtype).detach();
              if (res_grad) r.requires_grad_();
              const Tensor dy = to(param64({3, 70, 40}, 6).detach(), dtype);
              tape().clear();
              Tensor y;
              {
                AutocastGuard autocast(bf16);
                if (use_mlp) y = fused ? mlp(x, w1, b1, w2, b2, "gelu", r) : composite::mlp(x, w1, b1, w2, b2, "gelu", r);
                else y = fused ? linear(x, wl, b2, r) : r + linear(x, wl, b2);
              }
              backward(sum(y * dy));
              return std::vector<Tensor>{y.detach(), x.grad(), use_mlp ? w1.grad() : wl.grad(),
                                         b2.defined() ? b2.grad() : Tensor(), res_grad ? r.grad() : Tensor()};
            };
            for (bool use_mlp : {false, true}) {
              const std::vector<Tensor> f = run(true, use_mlp), u = run(false, use_mlp);
              for (std::size_t i = 0; i < f.size(); ++i) {
                INFO((use_mlp ? "mlp" : "linear") << " tensor " << i << " (y, dx, dw, db2, dres)");
                REQUIRE(same_bits(f[i], u[i]));
              }
            }
          }
  set_num_threads(before);
  const Tensor x = param64({2, 4}, 1), w = param64({3, 4}, 2);
  REQUIRE_TG_ERROR(linear(x, w, Tensor(), param64({2, 4}, 3)), "linear", "residual (2, 3)", "(2, 4)");
  REQUIRE_TG_ERROR(mlp(x, param64({6, 4}, 2), Tensor(), param64({2, 6}, 4), Tensor(), "gelu", param64({3, 2}, 3)),
                   "mlp", "residual (2, 2)", "(3, 2)");
}

TEST_CASE("mlp's backward writes h over the saved pre only when no later backward can read pre", "[mlp]") {
  // With the tape kept (keep_tape, PyTorch's retain_graph) a second backward reads pre again, so
  // the first makes h in a buffer of its own; otherwise h goes over pre (Node::reusable_saved), and
  // the backward's peak of tensor memory is up to one (rows, F) buffer lower (narrow x and y, so
  // that the buffers of width F make the peak). Either way, the same bits.
  const MlpCase c{4, 50, 8, 512, true, "gelu"};
  const std::int64_t rows = c.B * c.T, F = c.H;
  for (DType dtype : {float32, float64}) {
    INFO("dtype=" << dtype);
    Tensor x = leaf({c.B, c.T, c.C}, 1, dtype), w1 = leaf({c.H, c.C}, 2, dtype, 0.3), w2 = leaf({c.C, F}, 3, dtype, 0.3);
    Tensor b1 = leaf({c.H}, 4, dtype), b2 = leaf({c.C}, 5, dtype);
    const Tensor dy = to(param64({c.B, c.T, c.C}, 6).detach(), dtype);
    const auto grads = [&] { return std::vector<Tensor>{x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()}; };
    const auto clear = [&] {
      for (Tensor* t : {&x, &w1, &b1, &w2, &b2}) t->zero_grad();
    };
    // The peak of tensor memory above what was in use when the backward began.
    const auto backward_peak = [](const Tensor& y, const Tensor& g, bool keep) {
      const std::size_t before = memory_allocated();
      reset_peak_memory_stats();
      y.backward(g, keep);
      return max_memory_allocated() - before;
    };
    tape().clear();
    Tensor y = mlp(x, w1, b1, w2, b2, c.act);
    const std::size_t kept_peak = backward_peak(y, dy, true);
    const std::vector<Tensor> first = grads();
    clear();
    const std::size_t last_peak = backward_peak(y, dy, false);  // the same graph, walked a second time
    const std::vector<Tensor> second = grads();
    clear();
    tape().clear();
    Tensor y2 = mlp(x, w1, b1, w2, b2, c.act);
    const std::size_t fresh_peak = backward_peak(y2, dy, false);
    const std::vector<Tensor> third = grads();
    for (std::size_t i = 0; i < first.size(); ++i) {
      INFO("gradient " << i << " (x, w1, b1, w2, b2)");
      REQUIRE(same_bits(first[i], second[i]));
      REQUIRE(same_bits(first[i], third[i]));
    }
    const std::size_t h_bytes = static_cast<std::size_t>(rows * F) * itemsize(dtype);
    INFO("peak with the tape kept " << kept_peak << " bytes, freed " << last_peak << ", fresh " << fresh_peak);
    CHECK(last_peak == fresh_peak);
    CHECK(kept_peak > last_peak + h_bytes * 9 / 10);
    CHECK(kept_peak <= last_peak + h_bytes);
    clear();
  }
}

TEST_CASE("under autocast mlp rounds pre to bf16 and keeps it so", "[mlp]") {
  // As PyTorch's autocast, whose linear returns bf16: the activation reads pre rounded to bf16, and
  // the node keeps those bits in 2 bytes an element (kernels/mlp.h). The unfused twin's bits are
  // checked above; here, that the rounding is there at all, and the bytes kept.
  const MlpCase c{2, 30, 8, 64, true, "gelu"};
  for (const char* act : {"gelu", "swiglu"}) {
    INFO(act);
    const std::int64_t rows = c.B * c.T, F = std::string(act) == "gelu" ? c.H : c.H / 2;
    Tensor x = leaf({c.B, c.T, c.C}, 1, float32), w1 = leaf({c.H, c.C}, 2, float32, 0.3);
    Tensor w2 = leaf({c.C, F}, 3, float32, 0.3), b1 = leaf({c.H}, 4, float32), b2 = leaf({c.C}, 5, float32);
    tape().clear();
    const std::size_t before = tape().bytes_saved();
    Tensor y = mlp(x, w1, b1, w2, b2, act);
    const std::size_t float_bytes = tape().bytes_saved() - before;
    tape().clear();
    Tensor y16, unrounded;
    std::size_t bf16_bytes = 0;
    {
      AutocastGuard autocast;
      y16 = mlp(x, w1, b1, w2, b2, act);
      bf16_bytes = tape().bytes_saved() - before;
      const Tensor pre = linear(x, w1, b1);
      unrounded = linear(std::string(act) == "gelu" ? gelu(pre) : swiglu(pre), w2, b2).detach();
    }
    tape().clear();
    // x: float -> its bf16 copy; pre: float -> bf16; the weights float32 either way.
    CHECK(bf16_bytes == float_bytes - static_cast<std::size_t>(rows * (c.C + c.H)) * 2);
    CHECK_FALSE(same_bits(y16.detach(), unrounded));
    CHECK(max_abs_diff(y16.detach(), unrounded) < 0.05);
  }
}

TEST_CASE("under autocast mlp gives its twin's bits with x, w1 and b1 frozen, and without recording", "[mlp]") {
  // The backward without dpre to make (h from the saved bf16 pre in a pass of its own), and the
  // forward that keeps nothing: the paths the training step does not take.
  for (const char* act : {"gelu", "swiglu"}) {
    INFO(act);
    const MlpCase c{2, 30, 8, 64, true, act};
    const std::int64_t F = std::string(act) == "gelu" ? c.H : c.H / 2;
    const Tensor x = leaf({c.B, c.T, c.C}, 1, float32).detach(), w1 = leaf({c.H, c.C}, 2, float32, 0.3).detach();
    const Tensor b1 = leaf({c.H}, 4, float32).detach(), dy = param64({c.B, c.T, c.C}, 6).detach().to(float32);
    std::vector<Tensor> got[2];
    for (bool fused : {true, false}) {
      Tensor w2 = leaf({c.C, F}, 3, float32, 0.3), b2 = leaf({c.C}, 5, float32);
      tape().clear();
      Tensor y, y_unrecorded;
      {
        AutocastGuard autocast;
        y = fused ? mlp(x, w1, b1, w2, b2, act) : composite::mlp(x, w1, b1, w2, b2, act);
        NoGradGuard ng;
        y_unrecorded = fused ? mlp(x, w1, b1, w2, b2, act) : composite::mlp(x, w1, b1, w2, b2, act);
      }
      // NaN in the memory the backward's bf16 h (rows x F) is made in next, so that an element the
      // backward fails to write shows (the allocator hands a freed block of that size out again).
      (void)full({c.B * c.T * F / 2}, std::nan(""), float32);
      backward(sum(y * dy));
      got[fused ? 0 : 1] = {y.detach(), y_unrecorded, w2.grad(), b2.grad()};
    }
    for (std::size_t i = 0; i < got[0].size(); ++i) {
      INFO("tensor " << i << " (y, y without recording, dw2, db2)");
      REQUIRE(same_bits(got[0][i], got[1][i]));
    }
    REQUIRE(same_bits(got[0][0], got[0][1]));
  }
}
