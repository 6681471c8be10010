#pragma once
// The train_lm checkpoint file: one safetensors file holding the model's tensors ("model." + name),
// the optimiser's ("optim." + name), and as metadata everything else a resumed run needs to
// continue bit for bit: the step, the configuration (JSON), the vocabulary, the states of both
// generators and the best val loss so far. Every value read back is checked; a damaged one is a
// tg::Error that names the file and the key.
#include <cstdint>
#include <optional>
#include <string>

#include "lm/trainer.h"

namespace lm {

inline constexpr const char* kCheckpointFormat = "tapegrad-lm-checkpoint-1";
// model.safetensors: the final weights under the reference model's state-dict names.
inline constexpr const char* kModelFormat = "tapegrad-lm-model-1";

// What a checkpoint file holds, as read.
struct Checkpoint {
  std::string file;
  tg::StateDict tensors;
  tg::Metadata meta;
};

// Reads dir/checkpoint.safetensors and holds its tensors against the model configuration (vocabulary,
// context, width, number of blocks), so that a damaged configuration (n_layer 4294967296, n_embd 1e9)
// is refused before anything is allocated for it. Given the corpus, first refuses one other than the
// checkpoint's (check_corpus), saying so (not as a tensor's shape).
Checkpoint read_checkpoint(const std::string& dir, const tg::nn::GPTConfig& model, const Corpus* corpus = nullptr);

// The metadata of dir/checkpoint.safetensors, checked to be a train_lm checkpoint's (tg::Error
// naming the file otherwise, or when there is none).
tg::Metadata read_checkpoint_meta(const std::string& dir);

// What a checkpoint records of its run's corpus, beside the vocabulary. Checkpoints of earlier
// versions lack both entries; a resume of one does without them.
//   corpus_fnv1a64: fnv1a64 of the corpus file's bytes (decimal), so that a resume refuses a file
//                   with other bytes, whatever its vocabulary;
//   first_token:    the first token id of the training split (decimal), where a sample without
//                   --prompt starts (Trainer::sample), so that sampling a finished run reads no corpus.
inline constexpr const char* kCorpusHashKey = "corpus_fnv1a64";
inline constexpr const char* kFirstTokenKey = "first_token";

// Refuses (tg::Error, saying so and naming the path read) a corpus whose vocabulary is not the one
// in a checkpoint's metadata, or whose bytes are not those the metadata records.
void check_corpus(const tg::Metadata& meta, const std::string& file, const Corpus& corpus);

// The first token of the run's training split as its checkpoint records it, checked against the
// vocabulary (tg::Error naming the file and the key otherwise); nothing when it is not recorded.
std::optional<std::int32_t> recorded_first_token(const tg::Metadata& meta, const std::string& file,
                                                 std::int64_t vocab_size);

// The model's state dict as the PyTorch reference's safetensors save_model writes it: every
// parameter and buffer under its own name, a tied head (gpt) once, as head.weight (save_model keeps
// the first of a shared tensor's names in sorted order: head.weight before wte.weight).
tg::StateDict export_state_dict(const tg::nn::GPT& model);

// The configuration as JSON text (what a checkpoint's "config" metadata entry holds), and back (a
// tg::Error naming `file` when the text is not a configuration).
std::string config_json(const TrainConfig& c);
// The configuration as model.safetensors holds it: the corpus by its file name alone. The
// checkpoint, which a resume reads, keeps the whole path; the file a user shares has no use for it
// and would give it away.
std::string model_config_json(const TrainConfig& c);
TrainConfig parse_config_json(const std::string& text, const std::string& file);

// Metadata values, parsed strictly: a missing or damaged value is a tg::Error naming the key.
std::uint64_t meta_u64(const tg::Metadata& meta, const std::string& key, const std::string& file);
double meta_double(const tg::Metadata& meta, const std::string& key, const std::string& file);

// A double in text that reads back to the same bits.
std::string exact(double v);

}  // namespace lm
