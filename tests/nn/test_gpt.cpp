// The GPT in both archs (gpt, llama): parameter counts and state-dict names equal to the PyTorch
// reference's, forward and backward for every norm, a float64 gradcheck of a tiny model, seeded
// initialisation, argument checks, the rename of earlier names on load, and sampling with the KV
// cache against sampling without it.
#include <cmath>
#include <cstring>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {
const nn::NormKind kAllNorms[] = {nn::NormKind::layernorm, nn::NormKind::rmsnorm, nn::NormKind::prmsnorm,
                                  nn::NormKind::batchnorm, nn::NormKind::none};
const nn::Arch kArchs[] = {nn::Arch::gpt, nn::Arch::llama};
}  // namespace

TEST_CASE("GPT parameter counts equal the PyTorch reference model's (default config)") {
  // ../shared/bench/torch_gpt.py: 4 layers, 4 heads, width 128, context 64, vocab 65, no biases;
  // gpt has a tied head, llama an untied one and a SwiGLU MLP of hidden size 352
  const std::vector<std::pair<nn::NormKind, std::int64_t>> gpt = {{nn::NormKind::layernorm, 805248},
                                                                  {nn::NormKind::rmsnorm, 804096},
                                                                  {nn::NormKind::prmsnorm, 804096},
                                                                  {nn::NormKind::batchnorm, 805248},
                                                                  {nn::NormKind::none, 802944}};
  const std::vector<std::pair<nn::NormKind, std::int64_t>> llama = {{nn::NormKind::layernorm, 821760},
                                                                    {nn::NormKind::rmsnorm, 820608},
                                                                    {nn::NormKind::prmsnorm, 820608},
                                                                    {nn::NormKind::batchnorm, 821760},
                                                                    {nn::NormKind::none, 819456}};
  for (const auto& [arch, expected] : {std::pair{nn::Arch::gpt, gpt}, std::pair{nn::Arch::llama, llama}})
    for (auto [kind, count] : expected) {
      nn::GPTConfig cfg;
      cfg.arch = arch;
      cfg.norm = kind;
      nn::GPT model(cfg);
      INFO(nn::to_string(arch) << " " << nn::to_string(kind));
      CHECK(model.num_parameters() == count);
    }
  nn::GPTConfig cfg;
  cfg.arch = nn::Arch::llama;
  CHECK(cfg.ffn_hidden() == 352);
  cfg.n_embd = 384;
  CHECK(cfg.ffn_hidden() == 1024);
}

TEST_CASE("state-dict names and shapes are the reference model's, in both archs") {
  // torch_gpt.py's docstring lists them for n_layer = 1 (V = 65, C = 128, block_size 64, ffn 352)
  const std::vector<std::pair<std::string, Shape>> gpt = {
      {"wte.weight", {65, 128}},          {"wpe.weight", {64, 128}},         {"blocks.0.ln1.weight", {128}},
      {"blocks.0.qkv.weight", {384, 128}}, {"blocks.0.proj.weight", {128, 128}}, {"blocks.0.ln2.weight", {128}},
      {"blocks.0.fc.weight", {512, 128}},  {"blocks.0.fc_out.weight", {128, 512}}, {"ln_f.weight", {128}}};
  const std::vector<std::pair<std::string, Shape>> llama = {
      {"wte.weight", {65, 128}},           {"blocks.0.ln1.weight", {128}},         {"blocks.0.qkv.weight", {384, 128}},
      {"blocks.0.proj.weight", {128, 128}}, {"blocks.0.ln2.weight", {128}},         {"blocks.0.gate_up.weight", {704, 128}},
      {"blocks.0.down.weight", {128, 352}}, {"ln_f.weight", {128}},                 {"head.weight", {65, 128}}};
  for (const auto& [arch, expected] : {std::pair{nn::Arch::gpt, gpt}, std::pair{nn::Arch::llama, llama}}) {
    nn::GPTConfig cfg;
    cfg.arch = arch;
    cfg.n_layer = 1;
    nn::GPT model(cfg);
    const StateDict sd = model.state_dict();
    REQUIRE(sd.size() == expected.size());
    std::size_t i = 0;
    for (const auto& [name, t] : sd) {
      INFO(nn::to_string(arch) << " " << name);
      CHECK(name == expected[i].first);
      CHECK(t.shape() == expected[i].second);
      ++i;
    }
  }
}

TEST_CASE("GPT forward and backward run for every norm kind in both archs, reaching every parameter") {
  for (auto arch : kArchs)
  for (auto kind : kAllNorms) {
    INFO(nn::to_string(arch) << " " << nn::to_string(kind));
    manual_seed(1);
    nn::GPTConfig cfg;
    cfg.arch = arch;
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

TEST_CASE("a tiny float64 GPT passes gradcheck for every parameter, for every norm kind in both archs") {
  for (auto arch : kArchs)
  for (auto kind : kAllNorms) {
    INFO(nn::to_string(arch) << " " << nn::to_string(kind));
    manual_seed(2);
    nn::GPTConfig cfg{arch, 7, 4, 1, 2, 4};  // llama: head size 2, RoPE on one pair per head
    cfg.norm = kind;
    cfg.p = 0.5;
    cfg.bias = arch == nn::Arch::gpt;  // llama has no biases
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
  CHECK(stdev(a.blocks->operator[](0).qkv->weight) == Approx(0.02).epsilon(0.05));
  CHECK(stdev(a.blocks->operator[](0).proj->weight) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  CHECK(stdev(a.blocks->operator[](3).fc_out->weight) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  cfg.arch = nn::Arch::llama;
  manual_seed(7);
  nn::GPT l(cfg);
  CHECK(stdev(l.blocks->operator[](0).gate_up->weight) == Approx(0.02).epsilon(0.05));
  CHECK(stdev(l.blocks->operator[](3).down->weight) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  CHECK(stdev(l.head->weight) == Approx(0.02).epsilon(0.05));
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
  nn::GPTConfig llama;
  llama.arch = nn::Arch::llama;
  llama.n_embd = 12;  // head size 3: RoPE pairs dimensions
  REQUIRE_TG_ERROR(nn::GPT{llama}, "GPTConfig", "even head size", "12", "n_head 4");
  llama.n_embd = 16;
  llama.bias = true;
  REQUIRE_TG_ERROR(nn::GPT{llama}, "GPTConfig", "llama has no biases");
  REQUIRE_TG_ERROR(nn::parse_arch("bert"), "unknown arch 'bert'", "gpt or llama");
}

TEST_CASE("state dicts of earlier versions and PyTorch's save_model load after upgrade_state_dict") {
  manual_seed(3);
  nn::GPTConfig cfg{nn::Arch::gpt, 11, 8, 2, 2, 8};
  nn::GPT a(cfg);
  // earlier tapegrad names (blocks.i.attn.qkv, blocks.i.mlp.fc), and the tied weight as head.weight
  NoGradGuard ng;  // the copies are data, not graph
  StateDict old;
  for (const auto& [k, t] : a.state_dict()) {
    std::string name = k;
    for (auto [from, to] : {std::pair{".qkv.", ".attn.qkv."}, std::pair{".proj.", ".attn.proj."},
                            std::pair{".fc.", ".mlp.fc."}, std::pair{".fc_out.", ".mlp.fc_out."}})
      if (auto at = name.find(from); at != std::string::npos) name.replace(at, std::strlen(from), to);
    if (name == "wte.weight") name = "head.weight";
    old.insert("model." + name, t.clone());
  }
  CHECK(old.contains("model.blocks.1.mlp.fc_out.weight"));
  CHECK(nn::upgrade_state_dict(old, nn::Arch::gpt, "model.") == 1 + 4 * 2);
  StateDict sd;
  for (const auto& [k, t] : old) sd.insert(k.substr(6), t);
  manual_seed(4);
  nn::GPT b(cfg);
  b.load_state_dict(sd);  // strict: every key known, none missing
  for (const auto& [k, t] : a.state_dict()) CHECK(max_abs_diff(t, b.state_dict().at(k)) == 0.0);
  // a llama's untied head keeps its name
  StateDict l;
  l.insert("head.weight", zeros({11, 8}));
  CHECK(nn::upgrade_state_dict(l, nn::Arch::llama) == 0);
  CHECK(l.contains("head.weight"));
}

TEST_CASE("sampling with the KV cache picks the tokens sampling without it picks, in both archs") {
  tape().clear();
  for (auto arch : kArchs) {
    INFO(nn::to_string(arch));
    manual_seed(5);
    nn::GPTConfig cfg{arch, 13, 24, 2, 2, 16};
    nn::GPT model(cfg);
    // logits position by position: a prompt of 5, then one token at a time, against the full forward
    const std::vector<std::int32_t> seq = {1, 5, 2, 8, 3, 12, 0, 7, 7, 4, 9, 2, 11, 6, 1, 3, 10, 5, 2, 8};
    nn::KVCache cache;
    Tensor full;
    {
      NoGradGuard ng;
      full = model.forward(from_vector(seq, {1, 20}));
    }
    Tensor first = model.forward_cached({seq.begin(), seq.begin() + 5}, cache);
    CHECK(cache.len == 5);
    CHECK(max_abs_diff(first, slice(full, 1, 0, 5)) < 1e-5);
    for (std::size_t t = 5; t < seq.size(); ++t) {
      Tensor one = model.forward_cached({seq[t]}, cache);
      INFO("position " << t);
      CHECK(max_abs_diff(one, slice(full, 1, static_cast<std::int64_t>(t), static_cast<std::int64_t>(t) + 1)) < 1e-5);
    }
    // the tokens: within the window (3 + 21 = 24 positions), the same with and without the cache
    Generator g1(9), g2(9);
    const auto cached = model.generate({4, 1, 7}, 21, 0.9, 0, &g1, true);
    const auto uncached = model.generate({4, 1, 7}, 21, 0.9, 0, &g2, false);
    CHECK(cached == uncached);
    CHECK(tape().size() == 0);  // sampling records nothing
  }
}

TEST_CASE("generate refuses logits without a softmax, naming the token, and keeps the training mode") {
  // NaN weights give NaN logits: every sampling probability is NaN (torch.multinomial refuses
  // them), which would otherwise be read as a draw of the last token.
  manual_seed(7);
  nn::GPTConfig cfg{nn::Arch::gpt, 5, 8, 1, 2, 16};
  nn::GPT model(cfg);
  {
    NoGradGuard ng;
    model.ln_f->parameters()[0].copy_(full({16}, std::nan("")));
  }
  CHECK(model.is_training());
  for (bool cache : {true, false}) {
    INFO("use_cache " << cache);
    REQUIRE_TG_ERROR(model.generate({1, 2}, 3, 1.0, 0, nullptr, cache), "generate", "logits of token 0", "nan");
    CHECK(model.is_training());  // restored although generate threw
  }
  {
    NoGradGuard ng;
    model.ln_f->parameters()[0].copy_(full({16}, HUGE_VAL));  // +inf and -inf logits
  }
  REQUIRE_TG_ERROR(model.generate({1, 2}, 3), "generate", "logits of token 0");
}

TEST_CASE("a KVCache not made for the model is refused before anything is written") {
  // Another model's tables are narrower: the new keys would be written past their end.
  manual_seed(8);
  nn::GPTConfig cfg{nn::Arch::gpt, 5, 8, 1, 2, 16};
  nn::GPT model(cfg);
  nn::GPTConfig narrow = cfg;
  narrow.n_embd = 8;
  nn::KVCache other = nn::GPT(narrow).start_cache();
  REQUIRE_TG_ERROR(model.forward_cached({1, 2, 3, 4, 1, 2, 3, 4}, other), "generate", "(8, 8) float32",
                   "(8, 16) float32", "start_cache");
  CHECK(other.len == 0);
  nn::GPTConfig deeper = cfg;
  deeper.n_layer = 2;
  nn::KVCache two = nn::GPT(deeper).start_cache();
  REQUIRE_TG_ERROR(model.forward_cached({1}, two), "generate", "2 key and 2 value tables", "1 blocks");
  nn::KVCache bad = model.start_cache();
  bad.len = -3;
  REQUIRE_TG_ERROR(model.forward_cached({1}, bad), "generate", "len and start", "-3");
  // A block's own check: tables of another width, or rows past the capacity
  Tensor k = zeros({8, 8}), v = zeros({8, 8});
  REQUIRE_TG_ERROR((*model.blocks)[0].forward_cached(zeros({1, 2, 16}), k, v, 0, 0), "Block.forward_cached",
                   "(capacity, 16)", "(8, 8) float32");
  Tensor k16 = zeros({8, 16}), v16 = zeros({8, 16});
  REQUIRE_TG_ERROR((*model.blocks)[0].forward_cached(zeros({1, 2, 16}), k16, v16, 7, 7), "Block.forward_cached",
                   "cannot add 2 positions at row 7");
  nn::KVCache over = model.start_cache();
  over.len = 9;
  REQUIRE_TG_ERROR(over.drop_oldest(), "KVCache", "len 9 of capacity 8");
}

TEST_CASE("llama generation slides its cache past block_size, equal to the cropped window's logits") {
  // RoPE makes q_i . k_j depend on i - j only, so with one block the cached keys of a sliding
  // window give the logits of the window recomputed from position 0 (up to rounding). (With more
  // blocks a cached position's deeper keys also carry what it attended to before it left the
  // window, as in sliding-window attention, so the two differ by more than rounding.)
  manual_seed(6);
  nn::GPTConfig cfg{nn::Arch::llama, 13, 8, 1, 2, 16};
  nn::GPT model(cfg);
  std::vector<std::int32_t> seq = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3};
  nn::KVCache cache;
  model.forward_cached({seq.begin(), seq.begin() + 8}, cache);
  for (std::size_t t = 8; t < seq.size(); ++t) {
    cache.drop_oldest();  // what generate does when the cache is full
    CHECK((cache.len == 7 && cache.start == static_cast<std::int64_t>(t) - 7));
    Tensor one = model.forward_cached({seq[t]}, cache);
    Tensor window;
    {
      NoGradGuard ng;
      window = model.forward(from_vector(std::vector<std::int32_t>(seq.begin() + static_cast<std::ptrdiff_t>(t) - 7,
                                                                   seq.begin() + static_cast<std::ptrdiff_t>(t) + 1),
                                         {1, 8}));
    }
    INFO("position " << t);
    CHECK(max_abs_diff(one, slice(window, 1, 7, 8)) < 1e-4);
  }
  Generator g(1);
  const auto long_run = model.generate({2, 3}, 30, 1.0, 0, &g);  // 32 positions through an 8-wide window
  CHECK(long_run.size() == 30);
  for (std::int32_t t : long_run) CHECK((t >= 0 && t < 13));
}

TEST_CASE("gradient checkpointing leaves a GPT's loss and gradients the same bits, float32 and bf16, with dropout") {
  // Two models from one seed, one with every block checkpointed; the same batch and dropout seed.
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    return a.defined() && b.defined() && a.shape() == b.shape() && a.dtype() == b.dtype() &&
           std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
  };
  Generator data(10);
  const Tensor ids = randint(0, 13, {3, 8}, &data), tgt = randint(0, 13, {3, 8}, &data);
  for (auto arch : kArchs)
    for (auto kind : {nn::NormKind::rmsnorm, nn::NormKind::layernorm, nn::NormKind::batchnorm})
      for (bool bf16 : {false, true})
        for (double p : {0.0, 0.2}) {
          INFO(nn::to_string(arch) << " " << nn::to_string(kind) << (bf16 ? " bf16" : " float32") << " dropout " << p);
          nn::GPTConfig cfg{arch, 13, 8, 3, 2, 16};
          cfg.norm = kind;
          cfg.dropout = p;
          manual_seed(8);
          nn::GPT plain(cfg);
          manual_seed(8);
          nn::GPT ck(cfg);
          ck.set_gradient_checkpointing(true);
          CHECK(ck.gradient_checkpointing());
          std::size_t flagged = 0;  // the blocks that checkpoint: all of them
          for (auto& b : *ck.blocks) flagged += b->gradient_checkpointing();
          CHECK(flagged == ck.blocks->size());
          auto step = [&](nn::GPT& model) {
            manual_seed(99);
            tape().clear();
            Tensor loss;
            {
              AutocastGuard cast(bf16);
              loss = model.loss(ids, tgt);
            }
            std::size_t checkpoints = 0;
            for (std::size_t i = 0; i < tape().size(); ++i)
              checkpoints += tape()[i].name() == std::string("checkpoint") && !tape()[i].freed();
            loss.backward();
            return std::tuple{loss.detach(), checkpoints, default_generator().offset()};
          };
          const auto [loss_plain, n_plain, end_plain] = step(plain);
          const auto [loss_ck, n_ck, end_ck] = step(ck);
          CHECK(n_plain == 0);
          CHECK(n_ck == flagged);  // one node per checkpointed block
          CHECK(same_bits(loss_ck, loss_plain));
          CHECK(end_ck == end_plain);
          const auto pa = plain.named_parameters(), pb = ck.named_parameters();
          REQUIRE(pa.size() == pb.size());
          for (std::size_t i = 0; i < pa.size(); ++i) {
            INFO(pa[i].first);
            CHECK(same_bits(pb[i].second.grad(), pa[i].second.grad()));
          }
          const auto ba = plain.named_buffers(), bb = ck.named_buffers();  // BatchNorm's running statistics
          REQUIRE(ba.size() == bb.size());
          for (std::size_t i = 0; i < ba.size(); ++i) {
            INFO(ba[i].first);
            CHECK(same_bits(bb[i].second, ba[i].second));
          }
        }
  // Without recording (evaluation, generation) a checkpointed model is the plain forward.
  manual_seed(8);
  nn::GPT model(nn::GPTConfig{nn::Arch::llama, 13, 8, 2, 2, 16});
  model.set_gradient_checkpointing(true);
  NoGradGuard ng;
  const Tensor with = model.forward(ids);
  model.set_gradient_checkpointing(false);
  CHECK_FALSE(model.gradient_checkpointing());
  CHECK(same_bits(with, model.forward(ids)));
}
