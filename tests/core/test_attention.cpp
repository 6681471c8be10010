// scaled_causal_softmax and the fused causal attention (core/ops/attention.cpp) against their
// composite twins and finite differences, and the attention kernels with and without the saved
// probabilities.
#include <cmath>

#include "helpers.h"
#include "kernels/attention.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("fused scaled causal softmax equals its composite twin") {
  Tensor a1 = param64({2, 3, 5, 5}, 4, 3.0), a2 = a1.detach().clone().requires_grad_();
  Tensor s1 = scaled_causal_softmax(a1, 0.7), s2 = composite::scaled_causal_softmax(a2, 0.7);
  CHECK(max_abs_diff(s1, s2) < 1e-12);
  Tensor ds = param64({2, 3, 5, 5}, 5).detach();
  s1.backward(ds);
  s2.backward(ds);
  CHECK(max_abs_diff(a1.grad(), a2.grad()) < 1e-12);
  CHECK(s1.at({0, 0, 0, 0}) == 1.0);  // the first query sees only itself
  CHECK(s1.at({1, 2, 1, 4}) == 0.0);  // masked future
}

TEST_CASE("scaled causal softmax: gradcheck and argument errors") {
  require_gradcheck([](auto& in) { return scaled_causal_softmax(in[0], 0.5); }, {param64({2, 4, 4}, 15)});
  REQUIRE_TG_ERROR(scaled_causal_softmax(zeros({2, 3}), 1.0), "scaled_causal_softmax", "(2, 3)");
}

TEST_CASE("fused causal attention equals the composite (split, permute, matmul, masked softmax)") {
  for (auto [B, T, C, H] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>{2, 5, 6, 2},
                            {1, 1, 4, 1}, {3, 7, 12, 3}, {2, 16, 32, 4}, {1, 37, 8, 2}, {2, 70, 24, 1}}) {
    // T = 37 and 70: rows of every length up to T, so each vectorised loop of the softmax row
    // (blocks of 8 and 16 plus the remainders) runs with every remainder.
    INFO("B " << B << " T " << T << " C " << C << " H " << H);
    Tensor a = param64({B, T, 3 * C}, static_cast<std::uint64_t>(B * 100 + T)), b = a.detach().clone().requires_grad_();
    Tensor y1 = causal_attention(a, H), y2 = composite::causal_attention(b, H);
    CHECK(max_abs_diff(y1, y2) < 1e-12);
    Tensor dy = param64({B, T, C}, 9).detach();
    y1.backward(dy);
    y2.backward(dy);
    CHECK(max_abs_diff(a.grad(), b.grad()) < 1e-12);
    // qkv's gradient already holds another path's part when the attention's backward runs (the
    // sum is recorded later, so it runs first): the attention's part is added to it, not written
    // over it.
    Tensor a2 = a.detach().clone().requires_grad_(), b2 = a.detach().clone().requires_grad_();
    Tensor z1 = (causal_attention(a2, H) * dy).sum() + (a2 * a2).sum();
    Tensor z2 = (composite::causal_attention(b2, H) * dy).sum() + (b2 * b2).sum();
    z1.backward();
    z2.backward();
    CHECK(max_abs_diff(a2.grad(), b2.grad()) < 1e-12);
  }
  require_gradcheck([](auto& in) { return causal_attention(in[0], 2); }, {param64({2, 4, 12}, 3)});
  // float32 agrees with float64 to float precision
  Tensor x = param64({2, 8, 24}, 4).detach();
  CHECK(max_abs_diff(causal_attention(x.to(float32), 4).to(float64), causal_attention(x, 4)) < 1e-5);
  REQUIRE_TG_ERROR(causal_attention(zeros({2, 3, 10}), 2), "causal_attention", "(2, 3, 10)");
  REQUIRE_TG_ERROR(causal_attention(zeros({2, 3, 12}), 3), "causal_attention", "n_head 3");
}

TEST_CASE("attention without saved probabilities recomputes them: the same bits forward and backward") {
  // P = null (a checkpointed segment's recomputation, or no recording): the forward keeps each
  // head's probabilities in a scratch block and the backward recomputes them by the same code.
  for (auto [B, T, C, H] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>{2, 5, 6, 2},
                            {3, 37, 12, 3}, {2, 70, 24, 4}}) {
    INFO("B " << B << " T " << T << " C " << C << " H " << H);
    const std::vector<float> qkv = param64({B, T, 3 * C}, 11).to(float32).to_vector<float>();
    const std::vector<float> dy = param64({B, T, C}, 12).to(float32).to_vector<float>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(C / H));
    std::vector<float> y1(static_cast<std::size_t>(B * T * C)), y2(y1.size()), P(static_cast<std::size_t>(B * H * T * T));
    kernels::attention_forward(qkv.data(), y1.data(), P.data(), B, T, C, H, scale);
    kernels::attention_forward(qkv.data(), y2.data(), static_cast<float*>(nullptr), B, T, C, H, scale);
    CHECK(y1 == y2);
    std::vector<float> d1(qkv.size(), 0.5f), d2(qkv.size(), -1.0f);  // written over, whatever they held
    kernels::attention_backward(qkv.data(), P.data(), dy.data(), d1.data(), B, T, C, H, scale);
    kernels::attention_backward(qkv.data(), static_cast<const float*>(nullptr), dy.data(), d2.data(), B, T, C, H, scale);
    CHECK(d1 == d2);
  }
}
