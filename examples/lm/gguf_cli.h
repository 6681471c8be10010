#pragma once
// train_lm's GGUF commands (docs/gguf.md):
//   --resume DIR --export-gguf FILE [--gguf-dtype f32|bf16]
//       the run's checkpointed weights and vocabulary as a llama.cpp model file, nothing else
//       (tg::nn::save_gguf_model: a model llama.cpp has no equivalent for is refused in one line
//       and no file is written);
//   --init-from FILE.gguf
//       a new run whose configuration (arch, norm, sizes, eps) and starting weights are the
//       file's (a model flag given with another value, --n-embd say, is refused); the corpus must
//       have the file's vocabulary: its characters, or for a BPE file (llama.cpp's gpt2
//       tokenizer) the run's tokenizer must have the file's tokens and merges.
#include <string>

#include "lm/trainer.h"

namespace CLI {
class App;
}

namespace lm {

struct GGUFOptions {
  std::string export_file;  // --export-gguf
  std::string dtype = "f32";
  std::string init_from;    // --init-from
};

void add_gguf_options(CLI::App& app, GGUFOptions& o);
// The combinations that make sense: --export-gguf with --resume only, --gguf-dtype with
// --export-gguf, --init-from without --resume. Then, for --init-from, the file's configuration
// into c.model and the file into c.init_from. Throws tg::Error with the reason, also listing the
// model flags (--arch, --norm, --n-layer, --n-head, --n-embd, --block-size) given with a
// value other than the file's.
void settle_gguf_options(const GGUFOptions& o, const CLI::App& app, bool resuming, TrainConfig& c);

// --resume DIR --export-gguf FILE. Returns a one-line summary of what was written.
std::string export_run_gguf(const std::string& run_dir, const GGUFOptions& o);

// The weights of c.init_from into a freshly built model of c.model's configuration (the
// Trainer's set-up); the corpus's vocabulary (characters, or BPE tokens and merges) must be the
// file's.
void init_from_gguf(tg::nn::GPT& model, const std::string& file, const Corpus& corpus);

}  // namespace lm
