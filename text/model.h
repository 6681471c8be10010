#pragma once
// The immutable state of a BpeTokenizer, built once by make_model from the tokens' bytes, the
// merges and the added tokens, after checks that name the field of the file they came from.
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "merge.h"
#include "tapegrad/text/bpe.h"

namespace tg::text::detail {

struct BpeModel {
  std::string bytes;                    // every token's bytes, concatenated in id order
  std::vector<std::size_t> offsets;     // token id is bytes[offsets[id], offsets[id + 1])
  std::array<std::int32_t, 256> byte_ids{};  // the token of each single byte
  MergeTable table;                     // (left, right) -> rank, merged id
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;  // by rank
  std::vector<AddedToken> added;        // longest content first (the matching order)

  std::int64_t size() const { return static_cast<std::int64_t>(offsets.size()) - 1; }
  std::string_view token(std::int32_t id) const {
    const auto i = static_cast<std::size_t>(id);
    return std::string_view(bytes).substr(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

// Where the parts come from, for error messages: the function and the fields of the file.
struct ModelSource {
  const char* function;     // e.g. "BpeTokenizer::from_tokenizer_json"
  std::string vocab_field;  // e.g. "model.vocab"
  std::string merges_field;  // e.g. "model.merges"
};

// tokens[id] holds each token's bytes (an added token's content at its id), and every id in
// [0, tokens.size()) is used once. Checks that the 256 single bytes are tokens and that each merge
// (left, right) names a token whose bytes are left's then right's, and no pair twice.
std::shared_ptr<const BpeModel> make_model(const ModelSource& source, const std::vector<std::string>& tokens,
                                           const std::vector<std::pair<std::int32_t, std::int32_t>>& merges,
                                           std::vector<AddedToken> added);

}  // namespace tg::text::detail
