#include "lm/checkpoint.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace lm {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace tg;

namespace {

json config_to_json(const TrainConfig& c) {
  const auto& m = c.model;
  return json{{"data", c.data},
              {"arch", nn::to_string(m.arch)},
              {"norm", nn::to_string(m.norm)},
              {"vocab_size", m.vocab_size},
              {"block_size", m.block_size},
              {"n_layer", m.n_layer},
              {"n_head", m.n_head},
              {"n_embd", m.n_embd},
              {"dropout", m.dropout},
              {"bias", m.bias},
              {"p", m.p},
              {"eps", m.eps},
              {"batch_size", c.batch_size},
              {"steps", c.steps},
              {"lr", c.lr},
              {"min_lr", c.min_lr},
              {"warmup", c.warmup},
              {"lr_decay_iters", c.lr_decay_iters},
              {"weight_decay", c.weight_decay},
              {"beta1", c.beta1},
              {"beta2", c.beta2},
              {"grad_clip", c.grad_clip},
              {"eval_interval", c.eval_interval},
              {"eval_iters", c.eval_iters},
              {"seed", c.seed},
              {"precision", c.precision},
              {"tokenizer", c.tokenizer}};
}

TrainConfig config_from_json(const json& j) {
  TrainConfig c;
  c.data = j.at("data").get<std::string>();
  c.model.arch = nn::parse_arch(j.value("arch", std::string("gpt")));  // absent before the llama arch
  c.model.norm = nn::parse_norm_kind(j.at("norm").get<std::string>());
  c.model.vocab_size = j.at("vocab_size");
  c.model.block_size = j.at("block_size");
  c.model.n_layer = j.at("n_layer");
  c.model.n_head = j.at("n_head");
  c.model.n_embd = j.at("n_embd");
  c.model.dropout = j.at("dropout");
  c.model.bias = j.at("bias");
  c.model.p = j.at("p");
  c.model.eps = j.at("eps");
  c.batch_size = j.at("batch_size");
  c.steps = j.at("steps");
  c.lr = j.at("lr");
  c.min_lr = j.at("min_lr");
  c.warmup = j.at("warmup");
  c.lr_decay_iters = j.at("lr_decay_iters");
  c.weight_decay = j.at("weight_decay");
  c.beta1 = j.at("beta1");
  c.beta2 = j.at("beta2");
  c.grad_clip = j.at("grad_clip");
  c.eval_interval = j.at("eval_interval");
  c.eval_iters = j.at("eval_iters");
  c.seed = j.at("seed");
  c.precision = j.value("precision", std::string("float32"));  // absent from checkpoints of float32-only versions
  if (c.precision != "float32" && c.precision != "bf16") fail("resume", "unknown precision '", c.precision, "'");
  c.tokenizer = j.value("tokenizer", std::string("char"));  // absent from checkpoints of character-only versions
  return c;
}

const std::string& meta_value(const Metadata& meta, const std::string& key, const std::string& file) {
  auto it = meta.find(key);
  if (it == meta.end()) fail("resume", file, " has no '", key, "' entry");
  return it->second;
}

}  // namespace

std::string config_json(const TrainConfig& c) { return config_to_json(c).dump(); }

std::string model_config_json(const TrainConfig& c) {
  TrainConfig shown = c;
  shown.data = fs::path(c.data).filename().string();
  return config_json(shown);
}

StateDict export_state_dict(const nn::GPT& model) {
  StateDict out;
  const bool tied = !model.head;
  for (const auto& [k, t] : model.state_dict()) out.insert(tied && k == "wte.weight" ? "head.weight" : k, t);
  return out;
}

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::uint64_t meta_u64(const Metadata& meta, const std::string& key, const std::string& file) {
  const std::string& v = meta_value(meta, key, file);
  std::uint64_t out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty())
    fail("resume", file, ": '", key, "' is not an unsigned integer: '", v, "'");
  return out;
}

double meta_double(const Metadata& meta, const std::string& key, const std::string& file) {
  const std::string& v = meta_value(meta, key, file);
  char* end = nullptr;
  const double out = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size()) fail("resume", file, ": '", key, "' is not a number: '", v, "'");
  return out;  // NaN allowed: best_val before the first evaluation
}

Metadata read_checkpoint_meta(const std::string& dir) {
  Metadata meta;
  const fs::path ck = fs::path(dir) / "checkpoint.safetensors";
  if (!fs::exists(ck)) fail("resume", "no checkpoint in '", dir, "' (expected ", ck.string(), ")");
  load_safetensors(ck.string(), &meta);
  if (meta["format"] != kCheckpointFormat) fail("resume", ck.string(), " is not a train_lm checkpoint");
  return meta;
}

TrainConfig read_checkpoint_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "checkpoint.safetensors").string();
  return parse_config_json(meta_value(read_checkpoint_meta(dir), "config", file), file);
}

TrainConfig parse_config_json(const std::string& text, const std::string& file) {
  try {
    return config_from_json(json::parse(text));
  } catch (const json::exception& e) {
    fail("resume", "bad config in ", file, ": ", e.what());
  }
}

void check_corpus(const Metadata& meta, const std::string& file, const Corpus& corpus) {
  const auto it = meta.find("vocab");
  if (it == meta.end()) fail("resume", file, " has no 'vocab' entry");
  if (it->second != corpus.vocab_utf8()) {
    std::string theirs = "?";
    try {
      theirs = std::to_string(vocabulary_only(it->second).vocab_size());
    } catch (const Error&) {  // a damaged entry: the count stays unknown
    }
    fail("resume", "the corpus ", shown_path(corpus.path), " has another vocabulary (", corpus.vocab_size(),
         " characters) than the run's checkpoint ", file, " (", theirs,
         " characters): a run continues on the corpus it started with");
  }
  // A BPE run's vocabulary comes from its own tokenizer.json, and two texts may share their
  // characters: only the bytes tell the run's corpus from another file.
  if (!meta.count(kCorpusHashKey)) return;
  const std::uint64_t theirs = meta_u64(meta, kCorpusHashKey, file);
  if (theirs == corpus.content_hash) return;
  char mine[24], recorded[24];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(corpus.content_hash));
  std::snprintf(recorded, sizeof recorded, "%016llx", static_cast<unsigned long long>(theirs));
  fail("resume", "the corpus ", shown_path(corpus.path),
       " is not the one the run was trained on: its bytes differ (FNV-1a ", mine, "; the run's checkpoint ", file,
       " records ", recorded, "): a run continues on the corpus it started with");
}

std::optional<std::int32_t> recorded_first_token(const Metadata& meta, const std::string& file,
                                                 std::int64_t vocab_size) {
  if (!meta.count(kFirstTokenKey)) return std::nullopt;
  const std::uint64_t id = meta_u64(meta, kFirstTokenKey, file);
  if (id >= static_cast<std::uint64_t>(vocab_size))
    fail("resume", file, ": '", kFirstTokenKey, "' ", id, " is outside the vocabulary of ", vocab_size, " tokens");
  return static_cast<std::int32_t>(id);
}

Checkpoint read_checkpoint(const std::string& dir, const nn::GPTConfig& model, const Corpus* corpus) {
  Checkpoint ck;
  ck.file = (fs::path(dir) / "checkpoint.safetensors").string();
  ck.tensors = load_safetensors(ck.file, &ck.meta);
  if (corpus) check_corpus(ck.meta, ck.file, *corpus);
  nn::upgrade_state_dict(ck.tensors, model.arch, "model.");  // the names of earlier versions
  auto expect = [&](const std::string& key, const Shape& shape) {
    if (!ck.tensors.contains(key)) fail("resume", ck.file, " has no tensor '", key, "'");
    if (!(ck.tensors.at(key).shape() == shape))
      fail("resume", ck.file, ": '", key, "' is ", ck.tensors.at(key).shape(), " but the config asks for ", shape);
  };
  expect("model.wte.weight", Shape{model.vocab_size, model.n_embd});
  if (model.arch == nn::Arch::gpt) expect("model.wpe.weight", Shape{model.block_size, model.n_embd});
  else expect("model.head.weight", Shape{model.vocab_size, model.n_embd});
  const std::string last = "model.blocks." + std::to_string(model.n_layer - 1) + ".qkv.weight";
  expect(last, Shape{3 * model.n_embd, model.n_embd});
  if (ck.tensors.contains("model.blocks." + std::to_string(model.n_layer) + ".qkv.weight"))
    fail("resume", ck.file, " has more blocks than the config's n_layer ", model.n_layer);
  return ck;
}

}  // namespace lm
