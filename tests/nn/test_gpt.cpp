// The GPT: parameter counts equal to the PyTorch reference, forward and backward for every norm,
// a float64 gradcheck of a tiny model, seeded initialisation, and argument checks.
#include "helpers.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("GPT parameter counts equal the PyTorch reference model's (default config)") {
  // ../shared/bench/torch_gpt.py: 4 layers, 4 heads, width 128, context 64, vocab 65, tied head, no biases
  const std::vector<std::pair<nn::NormKind, std::int64_t>> expected = {{nn::NormKind::layernorm, 805248},
                                                                       {nn::NormKind::rmsnorm, 804096},
                                                                       {nn::NormKind::prmsnorm, 804096},
                                                                       {nn::NormKind::batchnorm, 805248},
                                                                       {nn::NormKind::none, 802944}};
  for (auto [kind, count] : expected) {
    nn::GPTConfig cfg;
    cfg.norm = kind;
    nn::GPT gpt(cfg);
    INFO(nn::to_string(kind));
    CHECK(gpt.num_parameters() == count);
  }
}

TEST_CASE("GPT forward and backward run for every norm kind, reaching every parameter") {
  for (auto kind : {nn::NormKind::layernorm, nn::NormKind::rmsnorm, nn::NormKind::prmsnorm, nn::NormKind::batchnorm,
                    nn::NormKind::none}) {
    INFO(nn::to_string(kind));
    manual_seed(1);
    nn::GPTConfig cfg;
    cfg.norm = kind;
    cfg.n_layer = 2;
    cfg.block_size = 16;
    nn::GPT gpt(cfg);
    Tensor ids = randint(0, 65, {3, 16}), tgt = randint(0, 65, {3, 16});
    {
      NoGradGuard ng;
      CHECK(gpt.forward(ids).shape() == Shape{3, 16, 65});
    }
    Tensor loss = gpt.loss(ids, tgt);
    // at initialisation the prediction is near uniform: loss near ln(65) = 4.17
    CHECK(loss.item() == Approx(std::log(65.0)).margin(0.15));
    loss.backward();
    for (auto& [name, p] : gpt.named_parameters()) {
      INFO(name);
      REQUIRE(p.grad().defined());
      CHECK(std::isfinite(sum(abs(p.grad())).item()));
      CHECK(sum(abs(p.grad())).item() > 0);
    }
    CHECK(tape().size() == 0);
  }
}

TEST_CASE("a tiny float64 GPT passes gradcheck for every parameter, for every norm kind") {
  for (auto kind : {nn::NormKind::layernorm, nn::NormKind::rmsnorm, nn::NormKind::prmsnorm, nn::NormKind::batchnorm,
                    nn::NormKind::none}) {
    INFO(nn::to_string(kind));
    manual_seed(2);
    nn::GPTConfig cfg{7, 4, 1, 2, 4};
    cfg.norm = kind;
    cfg.p = 0.5;
    cfg.bias = true;
    nn::GPT gpt(cfg, float64);
    Tensor ids = from_vector<std::int32_t>({1, 2, 3, 4, 0, 6, 5, 1}, {2, 4});
    Tensor tgt = from_vector<std::int32_t>({2, 3, 4, 0, 6, 5, 1, 2}, {2, 4});
    require_gradcheck([&](auto&) { return gpt.loss(ids, tgt); }, gpt.parameters());
  }
}

TEST_CASE("GPT initialisation is seeded and follows GPT-2's scheme") {
  nn::GPTConfig cfg;
  manual_seed(7);
  nn::GPT a(cfg);
  manual_seed(7);
  nn::GPT b(cfg);
  for (auto& [n, t] : a.state_dict()) CHECK(max_abs_diff(t, b.state_dict().at(n)) == 0.0);
  // std 0.02 for weights, 0.02 / sqrt(2 * n_layer) for residual projections
  auto stdev = [](const Tensor& t) { return std::sqrt(var(t).item()); };
  CHECK(stdev(a.wte->weight) == Approx(0.02).epsilon(0.05));
  CHECK(stdev(a.blocks->operator[](0).attn->qkv->weight) == Approx(0.02).epsilon(0.05));
  CHECK(stdev(a.blocks->operator[](0).attn->proj->weight) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  CHECK(stdev(a.blocks->operator[](3).mlp->fc_out->weight) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  auto* ln = dynamic_cast<nn::RMSNorm*>(a.ln_f.get());
  REQUIRE(ln);
  for (double g : ln->weight.to_vector<double>()) CHECK(g == 1.0);
}

TEST_CASE("GPT argument errors") {
  nn::GPTConfig cfg;
  cfg.n_head = 3;
  REQUIRE_TG_ERROR(nn::GPT{cfg}, "GPTConfig", "n_embd 128", "n_head 3");
  nn::GPTConfig ok;
  ok.block_size = 8;
  ok.n_layer = 1;
  nn::GPT gpt(ok);
  REQUIRE_TG_ERROR(gpt.forward(zeros({2, 9}, int32)), "GPT", "sequence length 9", "block_size 8");
  REQUIRE_TG_ERROR(gpt.forward(zeros({2, 4})), "GPT", "int32");
  REQUIRE_TG_ERROR(gpt.forward(full({1, 2}, 65, int32)), "embedding", "id 65");
  REQUIRE_TG_ERROR(gpt.loss(zeros({2, 4}, int32), zeros({2, 3}, int32)), "GPT", "targets");
}
