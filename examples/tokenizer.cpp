// tokenizer: train a byte-level BPE tokenizer on a corpus, encode text to ids, decode ids to text.
//   tokenizer train  --data FILE --vocab-size N --out tokenizer.json [--special TOKEN ...]
//   tokenizer encode --model M [--input FILE]   ids on one line, space-separated (stdin by default)
//   tokenizer decode --model M [--input FILE]   ids read from FILE or stdin, bytes written to stdout
// --model takes a Hugging Face tokenizer.json (written by train, or by the tokenizers library), or
// GPT-2's encoder.json with its vocab.bpe beside it. docs/tokenizer.md explains the algorithm.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <tapegrad/error.h>
#include <tapegrad/text/bpe.h>

namespace {

using Clock = std::chrono::steady_clock;

std::string read_input(const std::string& path) {
  if (path.empty() || path == "-") {
    std::ostringstream s;
    s << std::cin.rdbuf();
    return s.str();
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) tg::fail("tokenizer", "cannot open '", path, "'");
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// One stderr line every two seconds of a long run, then a summary line.
void train(const std::string& data, std::int64_t vocab_size, const std::vector<std::string>& specials,
           const std::string& out, bool quiet) {
  const std::string corpus = read_input(data);
  if (corpus.empty()) tg::fail("tokenizer train", "'", data, "' is empty");
  tg::text::BpeTrainOptions o;
  o.vocab_size = vocab_size;
  o.special_tokens = specials;
  const auto start = Clock::now();
  auto last = start;
  if (!quiet)
    o.progress = [&](const tg::text::BpeTrainProgress& p) {
      const auto now = Clock::now();
      if (now - last < std::chrono::seconds(2)) return;
      last = now;
      std::cerr << "merges " << p.merges_done << "/" << p.merges_total << ", last pair seen " << p.pair_count
                << " times, " << std::chrono::duration<double>(now - start).count() << " s" << std::endl;
    };
  const tg::text::BpeTokenizer t = tg::text::BpeTokenizer::train(corpus, o);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  t.save(out);
  if (!quiet)
    std::cerr << "trained " << t.vocab_size() << " tokens (" << t.merges().size() << " merges) on " << corpus.size()
              << " bytes in " << seconds << " s; wrote " << out << std::endl;
}

void encode(const std::string& model, const std::string& input) {
  const tg::text::BpeTokenizer t = tg::text::BpeTokenizer::load(model);
  const std::vector<std::int32_t> ids = t.encode(read_input(input));
  std::string line;
  line.reserve(ids.size() * 6);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::cout << line << '\n';
}

void decode(const std::string& model, const std::string& input) {
  const tg::text::BpeTokenizer t = tg::text::BpeTokenizer::load(model);
  std::istringstream in(read_input(input));
  std::vector<std::int32_t> ids;
  std::string word;
  while (in >> word) {
    std::size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || v < 0 || v >= t.vocab_size())
      tg::fail("tokenizer decode", "'", word, "' is not a token id of this model (0..", t.vocab_size() - 1, ")");
    ids.push_back(static_cast<std::int32_t>(v));
  }
  const std::string bytes = t.decode(ids);
  std::cout.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Byte-level BPE tokenizer: train on a corpus, encode, decode (GPT-2's scheme, Hugging Face's format)."};
  app.require_subcommand(1);
  std::string data, out, model, input;
  std::int64_t vocab_size = 1024;
  std::vector<std::string> specials;
  bool quiet = false;
  CLI::App* tr = app.add_subcommand("train", "learn merges from a corpus and write tokenizer.json");
  tr->add_option("--data", data, "the corpus (any bytes; UTF-8 text is what the pattern splits)")->required();
  tr->add_option("--vocab-size", vocab_size, "tokens in all: 256 bytes + merges + special tokens")
      ->check(CLI::Range(std::int64_t{256}, std::int64_t{1} << 30))->capture_default_str();
  tr->add_option("--out", out, "where to write the tokenizer.json")->required();
  tr->add_option("--special", specials, "a special token, e.g. <|endoftext|> (repeatable; takes the last ids)");
  tr->add_flag("--quiet", quiet, "no progress lines");
  CLI::App* en = app.add_subcommand("encode", "print the token ids of a text on one line");
  CLI::App* de = app.add_subcommand("decode", "write the bytes of token ids");
  for (CLI::App* sub : {en, de}) {
    sub->add_option("--model", model, "tokenizer.json, or GPT-2's encoder.json with vocab.bpe beside it")->required();
    sub->add_option("--input", input, "read from this file (default: stdin)");
  }
  CLI11_PARSE(app, argc, argv);
  try {
    if (tr->parsed()) train(data, vocab_size, specials, out, quiet);
    if (en->parsed()) encode(model, input);
    if (de->parsed()) decode(model, input);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tokenizer: " << e.what() << std::endl;
    return 2;
  }
}
