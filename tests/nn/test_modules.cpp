// Module mechanics (registration, dotted names, train/eval, state dicts) and every layer's
// forward, initialisation and float64 gradcheck.
#include <sstream>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {
// Gradcheck of a module: its input (when float) and every parameter, in float64.
void require_module_gradcheck(nn::UnaryModule& m, const Tensor& x) {
  std::vector<Tensor> in{x};
  for (auto& p : m.parameters()) in.push_back(p);
  require_gradcheck([&m](const std::vector<Tensor>& v) { return m.forward(v[0]); }, in);
}
}  // namespace

TEST_CASE("Linear: shapes, PyTorch's initialisation bounds, bias option, errors") {
  manual_seed(1);
  nn::Linear lin(16, 8);
  CHECK(lin.weight.shape() == Shape{8, 16});
  CHECK(lin.bias.shape() == Shape{8});
  const double bound = 1.0 / 4.0;
  CHECK(max(abs(lin.weight)).item() <= bound);
  CHECK(max(abs(lin.bias)).item() <= bound);
  CHECK(max(abs(lin.weight)).item() > 0.8 * bound);
  Tensor x = randn({3, 5, 16});
  CHECK(lin(x).shape() == Shape{3, 5, 8});
  CHECK(lin(randn({16})).shape() == Shape{8});
  // y = x W^T + b
  Tensor y = lin(x), ref = matmul(x, lin.weight.detach().transpose(0, 1)) + lin.bias.detach();
  CHECK(max_abs_diff(y, ref) < 1e-5);
  nn::Linear nb(4, 2, false);
  CHECK_FALSE(nb.bias.defined());
  CHECK(nb.num_parameters() == 8);
  REQUIRE_TG_ERROR(lin(randn({2, 15})), "Linear", "(..., 16)", "(2, 15)");
  REQUIRE_TG_ERROR(nn::Linear(0, 3), "Linear", "in_features");
  REQUIRE_TG_ERROR(nn::Linear(2, 3, true, int32), "Linear", "int32");
}

TEST_CASE("every layer passes a float64 gradcheck for its input and parameters") {
  manual_seed(2);
  {
    nn::Linear m(4, 3, true, float64);
    require_module_gradcheck(m, param64({2, 4}, 1));
  }
  {
    nn::LayerNorm m(5, 1e-5, true, true, float64);
    normal_(m.weight, 1.0, 0.3);
    normal_(m.bias, 0.0, 0.3);
    require_module_gradcheck(m, param64({3, 5}, 2));
  }
  {
    nn::RMSNorm m(6, 1e-5, true, true, 0.5, float64);
    normal_(m.weight, 1.0, 0.3);
    require_module_gradcheck(m, param64({3, 6}, 3));
  }
  {
    nn::BatchNorm1d m(4, 1e-5, 0.0, true, true, false, float64);  // momentum 0: stats fixed across evaluations
    normal_(m.weight, 1.0, 0.3);
    require_module_gradcheck(m, param64({5, 4}, 4));
    m.eval();
    require_module_gradcheck(m, param64({5, 4}, 5));
  }
  {
    nn::WeightNorm m(3, 4, true, float64);
    require_module_gradcheck(m, param64({2, 3}, 6));
  }
  {
    nn::MLP m(4, 8, true, 0.0, float64);
    require_module_gradcheck(m, param64({2, 3, 4}, 7));
  }
  {
    nn::CausalSelfAttention m(6, 2, true, 0.0, float64);
    require_module_gradcheck(m, param64({2, 3, 6}, 8));
  }
  {
    nn::GPTConfig cfg;
    cfg.n_embd = 4;
    cfg.n_head = 2;
    cfg.norm = nn::NormKind::layernorm;
    nn::Block m(cfg, float64);
    require_module_gradcheck(m, param64({2, 3, 4}, 9));
  }
  {
    nn::Embedding m(5, 3, float64);
    Tensor ids = from_vector<std::int32_t>({0, 4, 4, 2}, {2, 2});
    require_gradcheck([&](auto&) { return m(ids); }, {m.weight});
  }
}

TEST_CASE("named_parameters uses PyTorch's dotted names in registration order") {
  manual_seed(3);
  nn::GPTConfig cfg;
  cfg.n_layer = 2;
  cfg.norm = nn::NormKind::layernorm;
  nn::GPT gpt(cfg);
  std::vector<std::string> names;
  for (auto& [n, _] : gpt.named_parameters()) names.push_back(n);
  REQUIRE(names.size() == 2 + 2 * 8 + 2);
  CHECK(names[0] == "wte.weight");
  CHECK(names[1] == "wpe.weight");
  CHECK(names[2] == "blocks.0.ln1.weight");
  CHECK(names[3] == "blocks.0.ln1.bias");
  CHECK(names[4] == "blocks.0.qkv.weight");
  CHECK(names[5] == "blocks.0.proj.weight");
  CHECK(names[8] == "blocks.0.fc.weight");
  CHECK(names[9] == "blocks.0.fc_out.weight");
  CHECK(names.back() == "ln_f.bias");
  CHECK(gpt.blocks->operator[](1).qkv->weight.name() == "blocks.1.qkv.weight");
}

TEST_CASE("train and eval propagate to children, zero_grad clears every gradient") {
  nn::MLP mlp(4, 8, true, 0.5);
  CHECK(mlp.is_training());
  CHECK(mlp.drop->is_training());
  mlp.eval();
  CHECK_FALSE(mlp.drop->is_training());
  Tensor x = randn({3, 4});
  CHECK(max_abs_diff(mlp(x), mlp(x)) == 0.0);  // dropout off in eval
  mlp.train();
  sum(mlp(x)).backward();
  for (auto& p : mlp.parameters()) CHECK(p.grad().defined());
  mlp.zero_grad();
  for (auto& p : mlp.parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("state_dict holds parameters and buffers, load_state_dict copies values in") {
  manual_seed(4);
  nn::BatchNorm1d a(3), b(3);
  normal_(a.weight);
  a(randn({8, 3}));  // updates running stats
  StateDict sd = a.state_dict();
  CHECK(sd.size() == 5);
  CHECK(sd.contains("weight"));
  CHECK(sd.contains("running_var"));
  CHECK(sd.contains("num_batches_tracked"));
  Tensor keep = b.weight;  // a handle held elsewhere (e.g. by an optimizer) stays valid
  b.load_state_dict(sd);
  CHECK(max_abs_diff(b.weight, a.weight) == 0.0);
  CHECK(keep.shares_storage(b.weight));
  CHECK(max_abs_diff(b.running_mean, a.running_mean) == 0.0);
  CHECK(b.num_batches_tracked.item() == 1.0);
}

TEST_CASE("load_state_dict is an in-place write: a graph recorded before the load refuses its backward") {
  // The forward used the old weight; its saved copy of it would be read with the loaded values.
  manual_seed(5);
  nn::Linear lin(3, 2, /*bias=*/false, float64);
  Tensor x = ones({1, 3}, float64).requires_grad_();
  Tensor y = sum(lin(x));
  StateDict sd;
  sd.insert("weight", zeros({2, 3}, float64));
  lin.load_state_dict(sd);
  REQUIRE_TG_ERROR(y.backward(), "backward", "'linear'", "modified in place");
  CHECK_FALSE(x.grad().defined());
  tape().clear();
  // a forward after the load differentiates through the loaded values
  sum(lin(x)).backward();
  for (std::int64_t j = 0; j < 3; ++j) CHECK(x.grad().at({0, j}) == 0.0);
}

TEST_CASE("load_state_dict names every missing, unexpected and mismatched key and changes nothing") {
  nn::Linear lin(3, 2);
  Tensor before = lin.weight.clone();
  StateDict sd;
  sd.insert("weight", zeros({3, 2}));
  sd.insert("extra", zeros({1}));
  try {
    lin.load_state_dict(sd);
    FAIL("expected tg::Error");
  } catch (const Error& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(m.find("load_state_dict") != std::string::npos);
    CHECK(m.find("missing keys: bias") != std::string::npos);
    CHECK(m.find("unexpected keys: extra") != std::string::npos);
    CHECK(m.find("weight: checkpoint float32 (3, 2), model float32 (2, 3)") != std::string::npos);
  }
  CHECK(max_abs_diff(lin.weight, before) == 0.0);
  // non-strict: missing and unexpected are fine, a shape mismatch is not
  StateDict partial;
  partial.insert("weight", ones({2, 3}));
  partial.insert("extra", zeros({1}));
  lin.load_state_dict(partial, /*strict=*/false);
  CHECK(lin.weight.at({1, 2}) == 1.0);
  StateDict wrong_dtype;
  wrong_dtype.insert("weight", ones({2, 3}, float64));
  REQUIRE_TG_ERROR(lin.load_state_dict(wrong_dtype, false), "load_state_dict", "float64");
}

TEST_CASE("BatchNorm1d tracks running statistics with PyTorch's rule and uses them in eval") {
  nn::BatchNorm1d bn(2, 1e-5, 0.1, true, true, false, float64);
  Tensor x = tensor({1, 10, 3, 20, 5, 30, 7, 40}, {4, 2}, float64);
  bn(x);
  // batch mean (4, 25); unbiased variance (20/3, 500/3)
  CHECK(bn.running_mean.at({0}) == Approx(0.4));
  CHECK(bn.running_mean.at({1}) == Approx(2.5));
  CHECK(bn.running_var.at({0}) == Approx(0.9 + 0.1 * 20.0 / 3.0));
  CHECK(bn.running_var.at({1}) == Approx(0.9 + 0.1 * 500.0 / 3.0));
  bn.eval();
  Tensor y = bn(x);
  CHECK(y.at({0, 0}) == Approx((1 - 0.4) / std::sqrt(0.9 + 0.1 * 20.0 / 3.0 + 1e-5)));
  CHECK(bn.num_batches_tracked.item() == 1.0);  // eval does not count
  // channels-last (B, T, C) equals (B*T, C)
  nn::BatchNorm1d cl(3, 1e-5, 0.1, true, true, true, float64);
  nn::BatchNorm1d flat(3, 1e-5, 0.1, true, true, false, float64);
  Tensor h = param64({2, 4, 3}, 5).detach();
  CHECK(max_abs_diff(cl(h).reshape({8, 3}), flat(h.reshape({8, 3}))) < 1e-14);
  REQUIRE_TG_ERROR(bn(zeros({4, 3}, float64)), "BatchNorm1d", "C = 2", "(4, 3)");
}

TEST_CASE("WeightNorm over a Linear starts as the same function and keeps w = g v / |v|") {
  manual_seed(6);
  nn::Linear lin(5, 3, true, float64);
  nn::WeightNorm wn(lin);
  Tensor x = param64({4, 5}, 1).detach();
  CHECK(max_abs_diff(wn(x), lin(x)) < 1e-12);
  // rescaling v changes nothing: only its direction matters
  Tensor v = wn.weight_v;
  for (std::int64_t i = 0; i < v.numel(); ++i) v.data<double>()[i] *= 3.0;
  CHECK(max_abs_diff(wn(x), lin(x)) < 1e-12);
  std::vector<std::string> names;
  for (auto& [n, _] : wn.named_parameters()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"weight_g", "weight_v", "bias"});
}

TEST_CASE("modules print like PyTorch") {
  nn::MLP mlp(4, 16);
  std::ostringstream s;
  s << mlp;
  CHECK(s.str() == "MLP(\n  (fc): Linear(in_features=4, out_features=16, bias=false)\n  (gelu): GELU(approximate='none')\n"
                   "  (fc_out): Linear(in_features=16, out_features=4, bias=false)\n  (drop): Dropout(p=0)\n)");
  std::ostringstream r;
  r << nn::RMSNorm(16, 1e-5, true, false, 0.0625);
  CHECK(r.str() == "pRMSNorm((16,), eps=1e-05, p=0.0625 (k=1))");
}

TEST_CASE("module constructor and registration errors") {
  REQUIRE_TG_ERROR(nn::LayerNorm(0), "LayerNorm", "positive");
  REQUIRE_TG_ERROR(nn::RMSNorm(4, 1e-5, true, false, 0.0), "RMSNorm", "p must be in (0, 1]");
  REQUIRE_TG_ERROR(nn::BatchNorm1d(4, 1e-5, 2.0), "BatchNorm1d", "momentum");
  REQUIRE_TG_ERROR(nn::Dropout(1.5), "Dropout", "[0, 1]");
  REQUIRE_TG_ERROR(nn::GELU("fast"), "GELU", "fast");
  REQUIRE_TG_ERROR(nn::parse_norm_kind("groupnorm"), "norm", "groupnorm", "layernorm");
  nn::Linear lin(2, 2);
  REQUIRE_TG_ERROR(lin.register_parameter("weight", zeros({1})), "register_parameter", "already");
  REQUIRE_TG_ERROR(lin.register_buffer("a.b", zeros({1})), "register_buffer", "'a.b'");
}
