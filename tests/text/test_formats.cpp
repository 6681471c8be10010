#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <tapegrad/text/bpe.h>
#include <tapegrad/text/byte_level.h>

#include "file_limit.h"
#include "text/text_helpers.h"

using tg::text::BpeTokenizer;
using text_test::error_of;
using json = nlohmann::json;

namespace {

BpeTokenizer small_tokenizer() {
  tg::text::BpeTrainOptions o;
  o.vocab_size = 280;
  o.special_tokens = {"<|endoftext|>"};
  return BpeTokenizer::train("The cat sat on the mat. The cat's hat, the rat's mat!\n  Άλφα βήτα 12 345\n", o);
}

// The tokenizer.json of small_tokenizer() with one edit.
std::string edited(const std::function<void(json&)>& edit) {
  json j = json::parse(small_tokenizer().to_tokenizer_json());
  edit(j);
  return j.dump();
}

const char* kSample = "the cat's mat, The RAT  sat\n\xFF Άλφα 12<|endoftext|>";

}  // namespace

TEST_CASE("tokenizer.json: save and load give the same tokenizer", "[text]") {
  const BpeTokenizer t = small_tokenizer();
  const std::string text = t.to_tokenizer_json();
  const BpeTokenizer u = BpeTokenizer::from_tokenizer_json(text);
  CHECK(u.vocab_size() == t.vocab_size());
  CHECK(u.merges() == t.merges());
  CHECK(u.added_tokens() == t.added_tokens());
  for (std::int32_t id = 0; id < t.vocab_size(); ++id) CHECK(u.token(id) == t.token(id));
  CHECK(u.encode(kSample) == t.encode(kSample));
  CHECK(u.to_tokenizer_json() == text);
  // The fields Hugging Face's tokenizers read.
  const json j = json::parse(text);
  CHECK(j["model"]["type"] == "BPE");
  CHECK(j["pre_tokenizer"]["type"] == "ByteLevel");
  CHECK(j["pre_tokenizer"]["add_prefix_space"] == false);
  CHECK(j["decoder"]["type"] == "ByteLevel");
  CHECK(j["model"]["vocab"]["Ġ"] == ' ');
  CHECK(j["model"]["vocab"]["<|endoftext|>"] == 279);
  CHECK(j["added_tokens"][0]["content"] == "<|endoftext|>");
  CHECK(j["model"]["merges"].size() == t.merges().size());
  // Merges written "left right", as older files have them, read the same.
  const std::string legacy = edited([](json& e) {
    for (json& m : e["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  });
  CHECK(BpeTokenizer::from_tokenizer_json(legacy).merges() == t.merges());
}

TEST_CASE("tokenizer.json: load() reads the file, save() writes it", "[text]") {
  text_test::TempDir tmp;
  const BpeTokenizer t = small_tokenizer();
  t.save(tmp.path("tokenizer.json"));
  CHECK(BpeTokenizer::load(tmp.path("tokenizer.json")).encode(kSample) == t.encode(kSample));
  CHECK_THAT(error_of([&] { BpeTokenizer::load(tmp.path("missing.json")); }),
             Catch::Contains("BpeTokenizer::load") && Catch::Contains("cannot open"));
  CHECK_THAT(error_of([&] { t.save(tmp.path("no/such/dir/tokenizer.json")); }), Catch::Contains("cannot write"));
  // A file name as long as the directory takes (NAME_MAX, 255 bytes on most file systems): the
  // temporary file beside it cuts the name to make room for its suffix.
  const long most = ::pathconf(tmp.dir.c_str(), _PC_NAME_MAX);
  REQUIRE(most > 20);
  const std::string longest = tmp.path(std::string(static_cast<std::size_t>(most) - 5, 't') + ".json");
  t.save(longest);
  CHECK(BpeTokenizer::load(longest).encode(kSample) == t.encode(kSample));
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(tmp.dir)) ++files;
  CHECK(files == 2);
  // Temporary names already taken (a killed save of this pid left them) are passed over, and kept.
  const std::string taken = tmp.path("taken.json") + "." + std::to_string(::getpid()) + ".";
  for (int n = 0; n < 300; ++n) {
    std::ofstream f(taken + std::to_string(n) + ".tmp");
    f << "a killed save's";
  }
  t.save(tmp.path("taken.json"));
  CHECK(BpeTokenizer::load(tmp.path("taken.json")).encode(kSample) == t.encode(kSample));
  files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(tmp.dir)) ++files;
  CHECK(files == 303);
}

TEST_CASE("tokenizer.json: a save that fails (the file size limit, as a full disk) keeps the earlier file", "[text]") {
  text_test::TempDir tmp;
  const std::string file = tmp.path("tokenizer.json");
  text_test::write_file(file, "the earlier tokenizer");
  tg::text::BpeTrainOptions o;
  o.vocab_size = 300;
  const BpeTokenizer t = BpeTokenizer::train(std::string(kSample) + " the cat sat on the mat", o);
  REQUIRE(t.to_tokenizer_json().size() > 4000);
  CHECK(exit_code_with_file_limit(1000, [&] {
          try {
            t.save(file);
            return 1;
          } catch (const tg::Error& e) {
            return std::strstr(e.what(), "BpeTokenizer::save") && std::strstr(e.what(), "File too large") ? 0 : 2;
          }
        }) == 0);
  std::ifstream in(file, std::ios::binary);
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == "the earlier tokenizer");
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp.dir)) files += e.is_regular_file();
  CHECK(files == 1);  // no temporary file left beside it
  t.save(file);
  CHECK(BpeTokenizer::load(file).encode(kSample) == t.encode(kSample));
  // The file takes 0666 less the umask, as an ofstream's would.
  const mode_t old_mask = ::umask(077);
  t.save(file);
  ::umask(old_mask);
  namespace fs = std::filesystem;
  CHECK((fs::status(file).permissions() & fs::perms::all) == (fs::perms::owner_read | fs::perms::owner_write));
}

TEST_CASE("tokenizer.json: damaged files are refused with the field named", "[text]") {
  const std::string good = small_tokenizer().to_tokenizer_json();
  auto error = [](const std::string& text) { return error_of([&] { BpeTokenizer::from_tokenizer_json(text); }); };
  CHECK_THAT(error(good.substr(0, good.size() / 2)), Catch::Contains("not valid JSON (truncated or damaged?)"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["merges"][3] = {"Ġ", "zzqq"}; })),
             Catch::Contains("model.merges[3]: 'zzqq' is not in model.vocab"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["vocab"]["Ġ"] = 5; })),
             Catch::Contains("model.vocab") && Catch::Contains("id 5 is given to both"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["vocab"].erase("Ċ"); })),
             Catch::Contains("model.vocab") && Catch::Contains("without gaps"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["vocab"]["a b"] = 280; })),
             Catch::Contains("model.vocab: 'a b' (id 280) is not byte-level text"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["vocab"]["Ġ"] = -1; })),
             Catch::Contains("model.vocab['Ġ']: -1 is not a token id"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["vocab"]["Ġ"] = "x"; })), Catch::Contains("is not a token id"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["merges"][0] = "Ġt"; })),
             Catch::Contains("model.merges[0]: 'Ġt' is not two tokens separated by one space"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["merges"][0] = {"a", 1}; })),
             Catch::Contains("model.merges[0]") && Catch::Contains("is neither"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["merges"].push_back({"Ġ", "!"}); })),
             Catch::Contains("makes 'Ġ!', which is not in model.vocab"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["merges"].push_back(j["model"]["merges"][0]); })),
             Catch::Contains("is merged twice"));
  CHECK_THAT(error(edited([](json& j) { j["model"].erase("merges"); })), Catch::Contains("model.merges: missing"));
  CHECK_THAT(error(edited([](json& j) { j["model"].erase("vocab"); })), Catch::Contains("model.vocab: missing"));
  CHECK_THAT(error(edited([](json& j) { j.erase("model"); })), Catch::Contains("model: missing"));
  CHECK_THAT(error("[1, 2]"), Catch::Contains("not a JSON object"));
}

TEST_CASE("tokenizer.json: other model types and pipelines are refused by name", "[text]") {
  auto error = [](const std::string& text) { return error_of([&] { BpeTokenizer::from_tokenizer_json(text); }); };
  CHECK_THAT(error(edited([](json& j) { j["model"]["type"] = "WordPiece"; })),
             Catch::Contains("model.type: \"WordPiece\" is not supported"));
  CHECK_THAT(error(edited([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; })),
             Catch::Contains("pre_tokenizer:") && Catch::Contains("need type ByteLevel"));
  CHECK_THAT(error(edited([](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; })),
             Catch::Contains("pre_tokenizer.add_prefix_space: true is not supported"));
  CHECK_THAT(error(edited([](json& j) { j["normalizer"] = {{"type", "NFC"}}; })), Catch::Contains("normalizer:"));
  CHECK_THAT(error(edited([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; })), Catch::Contains("decoder:"));
  CHECK_THAT(error(edited([](json& j) { j["model"]["byte_fallback"] = true; })), Catch::Contains("model.byte_fallback"));
  CHECK_THAT(error(edited([](json& j) { j["added_tokens"][0]["lstrip"] = true; })),
             Catch::Contains("added_tokens[0].lstrip: true is not supported"));
  CHECK_THAT(error(edited([](json& j) { j["added_tokens"][0]["id"] = 7; })),
             Catch::Contains("'<|endoftext|>' has id 279 but added_tokens gives it id 7"));
}

TEST_CASE("GPT-2's encoder.json + vocab.bpe: merges by line, <|endoftext|> special", "[text]") {
  json encoder = json::object();
  for (int b = 0; b < 256; ++b) encoder[tg::text::to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  encoder["Ġt"] = 256;
  encoder["he"] = 257;
  encoder["Ġthe"] = 258;
  encoder["<|endoftext|>"] = 259;
  const std::string bpe = "#version: 0.2\nĠ t\nh e\nĠt he\n";
  const BpeTokenizer t = BpeTokenizer::from_gpt2(encoder.dump(), bpe);
  CHECK(t.vocab_size() == 260);
  CHECK(t.encode(" the<|endoftext|>he") == std::vector<std::int32_t>{258, 259, 257});
  CHECK(t.decode(std::vector<std::int32_t>{258, 259}) == " the<|endoftext|>");
  text_test::TempDir tmp;
  text_test::write_file(tmp.path("encoder.json"), encoder.dump());
  text_test::write_file(tmp.path("vocab.bpe"), bpe);
  CHECK(BpeTokenizer::load(tmp.path("encoder.json")).merges() == t.merges());
  CHECK_THAT(error_of([&] { BpeTokenizer::from_gpt2(encoder.dump(), "#version: 0.2\nĠ t\nĠ qq\n"); }),
             Catch::Contains("vocab.bpe line 3: 'qq' is not in encoder.json"));
  encoder["x"] = 259;
  CHECK_THAT(error_of([&] { BpeTokenizer::from_gpt2(encoder.dump(), bpe); }),
             Catch::Contains("encoder.json: id 259 is given to both '<|endoftext|>' and 'x'"));
}

TEST_CASE("random byte flips of a valid tokenizer.json load or raise tg::Error, never crash", "[text]") {
  const std::string good = small_tokenizer().to_tokenizer_json();
  std::mt19937_64 rng(20240611);
  std::uniform_int_distribution<std::size_t> any_pos(0, good.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255), nflips(1, 4), coin(0, 3);
  // Characters that keep JSON plausible, so that mutations reach the validation past the parser.
  const std::string jsonish = "0123456789-[]{},:\" .eEĠ";
  std::uniform_int_distribution<std::size_t> pick(0, jsonish.size() - 1);
  int ok = 0, rejected = 0;
  const std::string text = "the cat's hat \xFF\xFE sat 12 Άλφα<|endoftext|>\n";
  for (int iter = 0; iter < 1500; ++iter) {
    std::string m = good;
    const int k = nflips(rng);
    for (int f = 0; f < k; ++f) m[any_pos(rng)] = static_cast<char>(coin(rng) == 0 ? byte(rng) : jsonish[pick(rng)]);
    if (iter % 7 == 0) m.resize(any_pos(rng));  // sometimes truncated too
    INFO("iteration " << iter);
    try {
      const BpeTokenizer t = BpeTokenizer::from_tokenizer_json(m);
      // A file that loads is a working tokenizer: any bytes round-trip.
      CHECK(t.decode(t.encode(text)) == text);
      ++ok;
    } catch (const tg::Error& e) {
      CHECK(std::string(e.what()).rfind("BpeTokenizer::from_tokenizer_json: ", 0) == 0);
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("unexpected exception type: " << e.what());
    }
  }
  CHECK(ok + rejected == 1500);
  CHECK(ok > 0);
  CHECK(rejected > 0);
}
