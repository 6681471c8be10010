// The files a BpeTokenizer reads and writes.
//
// Hugging Face tokenizer.json (the format of the tokenizers library, serialized by its Rust core):
//   {"version": "1.0", "added_tokens": [{"id", "content", "single_word", "lstrip", "rstrip",
//    "normalized", "special"}], "normalizer": null,
//    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true, ...},
//    "post_processor": null, "decoder": {"type": "ByteLevel", ...},
//    "model": {"type": "BPE", "vocab": {token: id}, "merges": [[left, right], ...], ...}}
// Tokens are written in GPT-2's byte-level alphabet (tapegrad/text/byte_level.h); merges are pairs
// of vocabulary entries in rank order, as arrays (the "left right" strings of older files are read
// too). Added tokens appear in the vocabulary under their content.
//
// GPT-2's released files: encoder.json is {token: id} in the same alphabet, vocab.bpe a line
// "#version: 0.2" then one merge "left right" per line, by rank. "<|endoftext|>" is its special token.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "model.h"
#include "tapegrad/error.h"
#include "tapegrad/text/byte_level.h"

namespace tg::text {

namespace {

using json = nlohmann::json;
constexpr const char* kFromJson = "BpeTokenizer::from_tokenizer_json";
constexpr const char* kFromGpt2 = "BpeTokenizer::from_gpt2";

json parse(const char* fn, std::string_view what, std::string_view text) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail(fn, what, " is not valid JSON (truncated or damaged?): ", e.what());
  }
}

// A vocabulary read from {token: id} and the added tokens: each id's bytes, and each name's id.
struct Vocab {
  std::vector<std::string> tokens;
  std::unordered_map<std::string, std::int32_t> ids;  // by the name the file uses
};

// A JSON value for an error message, cut to a readable length.
std::string brief(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

std::int32_t read_id(const char* fn, const std::string& field, const json& v) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() >= INT32_MAX)
    fail(fn, field, ": ", brief(v), " is not a token id (an integer in [0, 2^31 - 1))");
  return static_cast<std::int32_t>(v.get<std::int64_t>());
}

// Ids must run 0..N-1 without gaps or repeats (N = vocabulary entries + added tokens not in it),
// which also bounds every allocation by the size of the file.
Vocab read_vocab(const char* fn, const json& vocab, const std::string& field, const std::vector<AddedToken>& added) {
  if (!vocab.is_object()) fail(fn, field, ": missing or not an object of token: id");
  std::unordered_map<std::string, std::int32_t> added_ids;
  for (const AddedToken& a : added) added_ids.emplace(a.content, a.id);
  std::vector<std::pair<std::int32_t, std::string>> entries;  // (id, name)
  Vocab v;
  for (const auto& [name, id_json] : vocab.items()) {
    const std::int32_t id = read_id(fn, field + "['" + name + "']", id_json);
    const auto a = added_ids.find(name);
    if (a != added_ids.end() && a->second != id)
      fail(fn, field, ": '", name, "' has id ", id, " but added_tokens gives it id ", a->second);
    entries.emplace_back(id, name);
    v.ids.emplace(name, id);
  }
  for (const AddedToken& a : added)
    if (v.ids.emplace(a.content, a.id).second) entries.emplace_back(a.id, a.content);
  const std::size_t n = entries.size();
  std::vector<const std::string*> names(n, nullptr);
  for (const auto& [id, name] : entries) {
    if (static_cast<std::size_t>(id) >= n)
      fail(fn, field, ": '", name, "' has id ", id, ", outside 0..", n - 1, " (", n, " tokens; ids must run from 0 without gaps)");
    if (names[static_cast<std::size_t>(id)])
      fail(fn, field, ": id ", id, " is given to both '", *names[static_cast<std::size_t>(id)], "' and '", name, "'");
    names[static_cast<std::size_t>(id)] = &name;
  }
  v.tokens.resize(n);
  for (std::size_t id = 0; id < n; ++id) {
    const std::string& name = *names[id];
    if (added_ids.count(name)) {
      v.tokens[id] = name;
    } else if (!from_byte_level(name, v.tokens[id]) || name.empty()) {
      fail(fn, field, ": '", name, "' (id ", id, ") is not byte-level text: GPT-2's byte map has no such character");
    }
  }
  return v;
}

std::pair<std::int32_t, std::int32_t> merge_ids(const char* fn, const Vocab& v, const std::string& left,
                                                const std::string& right, const std::string& field,
                                                const std::string& vocab_field) {
  const auto l = v.ids.find(left), r = v.ids.find(right);
  if (l == v.ids.end()) fail(fn, field, ": '", left, "' is not in ", vocab_field);
  if (r == v.ids.end()) fail(fn, field, ": '", right, "' is not in ", vocab_field);
  return {l->second, r->second};
}

// "left right" (exactly one space: byte-level text has no spaces) or ["left", "right"].
void split_merge(const char* fn, const json& m, const std::string& field, std::string& left, std::string& right) {
  if (m.is_string()) {
    const std::string& s = m.get_ref<const std::string&>();
    const std::size_t sp = s.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() || s.find(' ', sp + 1) != std::string::npos)
      fail(fn, field, ": '", s, "' is not two tokens separated by one space");
    left = s.substr(0, sp);
    right = s.substr(sp + 1);
  } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    left = m[0].get<std::string>();
    right = m[1].get<std::string>();
  } else {
    fail(fn, field, ": ", brief(m), " is neither \"left right\" nor [\"left\", \"right\"]");
  }
}

}  // namespace

namespace {

const json* member(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// A field that must be absent, null, or equal to `expected` (the only value this reader supports).
void require_value(const char* fn, const json& obj, const std::string& prefix, const char* key, const json& expected,
                   bool null_ok) {
  const json* v = member(obj, key);
  if (!v || (null_ok && v->is_null()) || *v == expected) return;
  fail(fn, prefix, key, ": ", brief(*v), " is not supported (need ", expected.dump(), null_ok ? " or null" : "", ")");
}

// The pipeline around the model must be GPT-2's: no normalizer, a ByteLevel pre-tokenizer with
// GPT-2's pattern and no added prefix space, a ByteLevel (or no) decoder and post-processor.
void check_pipeline(const json& root) {
  const json* norm = member(root, "normalizer");
  if (norm && !norm->is_null()) fail(kFromJson, "normalizer: ", brief(*norm), " is not supported (need null)");
  const json* pre = member(root, "pre_tokenizer");
  if (!pre || !pre->is_object() || member(*pre, "type") == nullptr || (*pre)["type"] != "ByteLevel")
    fail(kFromJson, "pre_tokenizer: ", pre ? brief(*pre) : "missing", " is not supported (need type ByteLevel)");
  require_value(kFromJson, *pre, "pre_tokenizer.", "add_prefix_space", false, false);
  require_value(kFromJson, *pre, "pre_tokenizer.", "use_regex", true, false);
  for (const char* key : {"decoder", "post_processor"}) {
    const json* d = member(root, key);
    if (d && !d->is_null() && (!d->is_object() || member(*d, "type") == nullptr || (*d)["type"] != "ByteLevel"))
      fail(kFromJson, key, ": ", brief(*d), " is not supported (need type ByteLevel or null)");
  }
}

void check_model_options(const json& model) {
  if (member(model, "type") == nullptr || model["type"] != "BPE")
    fail(kFromJson, "model.type: ", member(model, "type") ? brief(model["type"]) : "missing", " is not supported (need \"BPE\")");
  require_value(kFromJson, model, "model.", "dropout", nullptr, true);
  require_value(kFromJson, model, "model.", "continuing_subword_prefix", "", true);
  require_value(kFromJson, model, "model.", "end_of_word_suffix", "", true);
  require_value(kFromJson, model, "model.", "byte_fallback", false, false);
  require_value(kFromJson, model, "model.", "ignore_merges", false, false);
}

std::vector<AddedToken> read_added(const json& root) {
  std::vector<AddedToken> added;
  const json* list = member(root, "added_tokens");
  if (!list || list->is_null()) return added;
  if (!list->is_array()) fail(kFromJson, "added_tokens: ", brief(*list), " is not an array");
  for (std::size_t i = 0; i < list->size(); ++i) {
    const json& a = (*list)[i];
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object()) fail(kFromJson, field, ": ", brief(a), " is not an object");
    const json* content = member(a, "content");
    if (!content || !content->is_string() || content->get_ref<const std::string&>().empty())
      fail(kFromJson, field, ".content: missing or not a non-empty string");
    const json* id = member(a, "id");
    if (!id) fail(kFromJson, field, ".id: missing");
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      require_value(kFromJson, a, field + ".", flag, false, false);
    added.push_back({read_id(kFromJson, field + ".id", *id), content->get<std::string>()});
  }
  return added;
}

std::vector<std::pair<std::int32_t, std::int32_t>> read_merges(const json& model, const Vocab& v) {
  const json* list = member(model, "merges");
  if (!list || !list->is_array()) fail(kFromJson, "model.merges: missing or not an array");
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  merges.reserve(list->size());
  std::string left, right;
  for (std::size_t r = 0; r < list->size(); ++r) {
    const std::string field = "model.merges[" + std::to_string(r) + "]";
    split_merge(kFromJson, (*list)[r], field, left, right);
    merges.push_back(merge_ids(kFromJson, v, left, right, field, "model.vocab"));
  }
  return merges;
}

BpeTokenizer tokenizer_from_json(const json& root) {
  if (!root.is_object()) fail(kFromJson, "the file is not a JSON object");
  check_pipeline(root);
  const json* model = member(root, "model");
  if (!model || !model->is_object()) fail(kFromJson, "model: missing or not an object");
  check_model_options(*model);
  const std::vector<AddedToken> added = read_added(root);
  const json* vocab = member(*model, "vocab");
  const Vocab v = read_vocab(kFromJson, vocab ? *vocab : json(), "model.vocab", added);
  const auto merges = read_merges(*model, v);
  return BpeTokenizer(detail::make_model({kFromJson, "model.vocab", "model.merges"}, v.tokens, merges, added));
}

BpeTokenizer tokenizer_from_gpt2(const json& encoder, std::string_view vocab_bpe) {
  std::vector<AddedToken> added;
  if (encoder.is_object() && member(encoder, "<|endoftext|>"))
    added.push_back({read_id(kFromGpt2, "encoder.json['<|endoftext|>']", encoder["<|endoftext|>"]), "<|endoftext|>"});
  const Vocab v = read_vocab(kFromGpt2, encoder, "encoder.json", added);
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  std::size_t line_no = 0, start = 0;
  std::string left, right;
  while (start < vocab_bpe.size()) {
    std::size_t end = vocab_bpe.find('\n', start);
    if (end == std::string_view::npos) end = vocab_bpe.size();
    std::string_view line = vocab_bpe.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const std::string field = "vocab.bpe line " + std::to_string(line_no);
    split_merge(kFromGpt2, json(std::string(line)), field, left, right);
    merges.push_back(merge_ids(kFromGpt2, v, left, right, field, "encoder.json"));
  }
  return BpeTokenizer(detail::make_model({kFromGpt2, "encoder.json", "vocab.bpe"}, v.tokens, merges, added));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("BpeTokenizer::load", "cannot open '", path, "'");
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace

BpeTokenizer BpeTokenizer::from_tokenizer_json(std::string_view text) {
  return tokenizer_from_json(parse(kFromJson, "the file", text));
}

BpeTokenizer BpeTokenizer::from_gpt2(std::string_view encoder_json, std::string_view vocab_bpe) {
  return tokenizer_from_gpt2(parse(kFromGpt2, "encoder.json", encoder_json), vocab_bpe);
}

// A JSON object whose "model" is an object is a tokenizer.json; otherwise, with vocab.bpe beside
// it, GPT-2's encoder.json (whose values are ids: "model" is one of its words).
BpeTokenizer BpeTokenizer::load(const std::string& path) {
  const std::string text = read_file(path);
  const json root = parse("BpeTokenizer::load", "'" + path + "'", text);
  const std::filesystem::path bpe = std::filesystem::path(path).parent_path() / "vocab.bpe";
  try {
    const json* model = root.is_object() ? member(root, "model") : nullptr;
    if (root.is_object() && (!model || !model->is_object()) && std::filesystem::exists(bpe))
      return tokenizer_from_gpt2(root, read_file(bpe.string()));
    return tokenizer_from_json(root);
  } catch (const Error& e) {
    fail("BpeTokenizer::load", "'", path, "': ", e.what());
  }
}

namespace {

// A JSON string literal (quotes and escapes); tg::Error when s is not UTF-8.
std::string json_string(const std::string& s) {
  try {
    return json(s).dump();
  } catch (const json::exception&) {
    fail("BpeTokenizer::to_tokenizer_json", "the added token '", s, "' is not valid UTF-8");
  }
}

// Each id's name in the file: its byte-level text, or an added token's content.
std::vector<std::string> token_names(const BpeTokenizer& t) {
  std::vector<std::string> names(static_cast<std::size_t>(t.vocab_size()));
  for (const AddedToken& a : t.added_tokens()) names[static_cast<std::size_t>(a.id)] = a.content;
  std::unordered_map<std::string, std::int32_t> seen;
  for (std::int32_t id = 0; id < t.vocab_size(); ++id) {
    std::string& name = names[static_cast<std::size_t>(id)];
    if (name.empty()) name = to_byte_level(t.token(id));
    const auto [it, fresh] = seen.emplace(name, id);
    if (!fresh) fail("BpeTokenizer::to_tokenizer_json", "ids ", it->second, " and ", id, " would both be written '", name, "'");
  }
  return names;
}

constexpr const char* kByteLevel =
    R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";

}  // namespace

// Written by hand rather than through an ordered JSON object, whose lookups are linear: the
// vocabulary in id order, one entry per line, as the tokenizers library writes it.
std::string BpeTokenizer::to_tokenizer_json() const {
  const std::vector<std::string> names = token_names(*this);
  std::vector<AddedToken> added = m_->added;
  std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  std::string s = "{\n \"version\": \"1.0\",\n \"truncation\": null,\n \"padding\": null,\n \"added_tokens\": [";
  for (std::size_t i = 0; i < added.size(); ++i)
    s += std::string(i ? "," : "") + "\n  {\"id\": " + std::to_string(added[i].id) + ", \"content\": " + json_string(added[i].content) +
         ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}";
  s += added.empty() ? "],\n" : "\n ],\n";
  s += " \"normalizer\": null,\n \"pre_tokenizer\": " + std::string(kByteLevel) + ",\n \"post_processor\": null,\n";
  s += " \"decoder\": " + std::string(kByteLevel) + ",\n";
  s += " \"model\": {\n  \"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null,\n"
       "  \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n"
       "  \"vocab\": {";
  for (std::size_t id = 0; id < names.size(); ++id)
    s += std::string(id ? "," : "") + "\n   " + json_string(names[id]) + ": " + std::to_string(id);
  s += "\n  },\n  \"merges\": [";
  for (std::size_t r = 0; r < m_->merges.size(); ++r) {
    const auto [l, rt] = m_->merges[r];
    s += std::string(r ? "," : "") + "\n   [" + json_string(names[static_cast<std::size_t>(l)]) + ", " +
         json_string(names[static_cast<std::size_t>(rt)]) + "]";
  }
  s += m_->merges.empty() ? "]\n }\n}\n" : "\n  ]\n }\n}\n";
  return s;
}

namespace {
// path + suffix, with path's file name cut (at a UTF-8 character's start) where the two would pass
// the longest name its directory takes (NAME_MAX: 255 bytes on most file systems), so that a
// valid path near that length still has a temporary file beside it. The same cut as the core's
// atomic_temp_name (core/atomic_file.cpp), written again because this library links no core (its
// CMakeLists.txt): a change to one goes to the other.
std::string temp_name(const std::string& path, const std::string& suffix) {
  const std::size_t slash = path.rfind('/');
  const std::size_t start = slash == std::string::npos ? 0 : slash + 1;
  const std::string dir = start == 0 ? "." : start == 1 ? "/" : path.substr(0, start - 1);
  const long most = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const std::size_t limit = most > 0 ? static_cast<std::size_t>(most) : 255;
  std::size_t keep = path.size() - start;
  if (keep + suffix.size() > limit) {
    keep = limit > suffix.size() ? limit - suffix.size() : 1;
    while (keep > 1 && (static_cast<unsigned char>(path[start + keep]) & 0xC0) == 0x80) --keep;
  }
  return path.substr(0, start + keep) + suffix;
}
}  // namespace

// Through a temporary file beside path, fsync'ed, renamed over it, then the directory fsync'ed:
// a write that fails (a full disk) or a process killed mid-write leaves an earlier file at path as
// it was, and a completed save survives a power cut. The file is created 0666 less the umask, as
// an ofstream's would be; its name (pid and a count) is this save's alone. (The text library links
// no tapegrad core, so it writes its own file, as save_safetensors and save_gguf write theirs.)
void BpeTokenizer::save(const std::string& path) const {
  constexpr const char* fn = "BpeTokenizer::save";
  static std::atomic<unsigned> saves{0};
  const std::string text = to_tokenizer_json();
  // A name taken (by a killed process of the same pid, or another writer whose long name was cut
  // to the same start) moves on to the next count.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 1000; ++attempt) {
    std::string suffix = ".";  // appended piece by piece: GCC 12 warns (-Wrestrict) wrongly on "." + std::string
    suffix += std::to_string(::getpid()) + "." + std::to_string(saves++) + ".tmp";
    tmp = temp_name(path, suffix);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) fail(fn, "cannot write '", path, "': no temporary file beside it: ", std::strerror(errno));
  try {
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(fn, "writing '", tmp, "' failed: ", n < 0 ? std::strerror(errno) : "no progress");
      done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd) != 0) fail(fn, "fsync of '", tmp, "' failed: ", std::strerror(errno));
    const int f = fd;
    fd = -1;
    if (::close(f) != 0) fail(fn, "close of '", tmp, "' failed: ", std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(fn, "rename of '", tmp, "' to '", path, "' failed: ", std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int d = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d >= 0) {  // the rename is on disk once the directory is (a directory that cannot be opened: best effort)
    ::fsync(d);
    ::close(d);
  }
}

}  // namespace tg::text
