// dump_logits MODEL IDS OUT: the logits a trained model (a train_lm run's model.safetensors, with
// its configuration) gives for one sequence of token ids ("3,1,4"), written as OUT (safetensors,
// "logits" (1, T, V) float32). check_pytorch_load.py compares them with PyTorch's.
#include <iostream>
#include <sstream>

#include "lm/checkpoint.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: dump_logits MODEL.safetensors IDS OUT.safetensors\n";
    return 2;
  }
  try {
    tg::Metadata meta;
    tg::StateDict sd = tg::load_safetensors(argv[1], &meta);
    const tg::nn::GPTConfig cfg = lm::parse_config_json(meta["config"], argv[1]).model;
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
