// dump_logits MODEL IDS OUT: the logits a trained model (a train_lm run's model.safetensors, with
// its configuration) gives for one sequence of token ids ("3,1,4"), written as OUT (safetensors,
// "logits" (1, T, V) float32). check_pytorch_load.py compares them with PyTorch's.
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tapegrad/tapegrad.h>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: dump_logits MODEL.safetensors IDS OUT.safetensors\n";
    return 2;
  }
  try {
    tg::Metadata meta;
    tg::StateDict sd = tg::load_safetensors(argv[1], &meta);
    const auto j = nlohmann::json::parse(meta.at("config"));
    tg::nn::GPTConfig cfg;
    cfg.arch = tg::nn::parse_arch(j.at("arch").get<std::string>());
    cfg.norm = tg::nn::parse_norm_kind(j.at("norm").get<std::string>());
    cfg.vocab_size = j.at("vocab_size");
    cfg.block_size = j.at("block_size");
    cfg.n_layer = j.at("n_layer");
    cfg.n_head = j.at("n_head");
    cfg.n_embd = j.at("n_embd");
    cfg.p = j.at("p");
    cfg.eps = j.at("eps");
    tg::nn::GPT model(cfg);
    tg::nn::upgrade_state_dict(sd, cfg.arch);  // the tied head is stored as head.weight
    model.load_state_dict(sd);
    model.eval();
    std::vector<std::int32_t> ids;
    std::stringstream in(argv[2]);
    for (std::string tok; std::getline(in, tok, ',');) ids.push_back(std::stoi(tok));
    tg::NoGradGuard ng;
    tg::StateDict out;
    out.insert("logits", model.forward(tg::from_vector(ids, {1, static_cast<std::int64_t>(ids.size())})));
    tg::save_safetensors(argv[3], out);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "dump_logits: error: " << e.what() << "\n";
    return 1;
  }
}
