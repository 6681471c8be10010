#include <tapegrad/text/bpe.h>
#include <tapegrad/text/byte_level.h>

#include "merge.h"
#include "pretokenize.h"
#include "text/text_helpers.h"

using tg::text::BpeTokenizer;
using tg::text::BpeTrainOptions;
using text_test::error_of;

namespace {

std::vector<std::string> chunks_of(std::string_view text) {
  tg::text::detail::PreTokenizer p(text);
  std::vector<std::string> out;
  std::string_view c;
  while (p.next(c)) out.emplace_back(c);
  return out;
}

BpeTokenizer train(std::string_view corpus, std::int64_t vocab_size, std::vector<std::string> specials = {}) {
  BpeTrainOptions o;
  o.vocab_size = vocab_size;
  o.special_tokens = std::move(specials);
  return BpeTokenizer::train(corpus, o);
}

using Merges = std::vector<std::pair<std::int32_t, std::int32_t>>;

}  // namespace

TEST_CASE("byte-level map: printable bytes stand for themselves, the other 68 take U+0100 on", "[text]") {
  CHECK(tg::text::byte_to_unicode('!') == U'!');
  CHECK(tg::text::byte_to_unicode('~') == U'~');
  CHECK(tg::text::byte_to_unicode(0xE9) == U'é');
  CHECK(tg::text::byte_to_unicode(0) == 0x100);
  CHECK(tg::text::byte_to_unicode(' ') == 0x120);   // 'Ġ'
  CHECK(tg::text::byte_to_unicode('\n') == 0x10A);  // 'Ċ'
  CHECK(tg::text::byte_to_unicode(0x7F) == 0x121);
  CHECK(tg::text::byte_to_unicode(0xA0) == 0x142);
  CHECK(tg::text::byte_to_unicode(0xAD) == 0x143);
  CHECK(tg::text::to_byte_level(" the\n") == "Ġthe\xC4\x8A");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  std::string back;
  REQUIRE(tg::text::from_byte_level(tg::text::to_byte_level(all), back));
  CHECK(back == all);
  CHECK_FALSE(tg::text::from_byte_level("a b", back));         // U+0020 is not in the map
  CHECK_FALSE(tg::text::from_byte_level("\xC5\x84", back));    // U+0144, one past the last
  CHECK_FALSE(tg::text::from_byte_level("\xFF", back));        // not UTF-8
}

TEST_CASE("pre-tokenization: GPT-2's chunks, worked by hand", "[text]") {
  // "  123": the first space is left alone (\s+(?!\S) backs off one), the second joins the number.
  CHECK(chunks_of("Hello world's  123 !!\n\n x") ==
        std::vector<std::string>{"Hello", " world", "'s", " ", " 123", " !!", "\n\n", " x"});
  CHECK(chunks_of("I'll we've THEY'RE") == std::vector<std::string>{"I", "'ll", " we", "'ve", " THEY", "'", "RE"});
  CHECK(chunks_of("hi   ") == std::vector<std::string>{"hi", "   "});
  // "\r\n\t" then a letter: \s+(?!\S) backs off to "\r\n"; the tab alone is \s+ (only a space
  // joins the word after it).
  CHECK(chunks_of("a\r\n\tb") == std::vector<std::string>{"a", "\r\n", "\t", "b"});
  CHECK(chunks_of("Ωμέγα 東京 x²") == std::vector<std::string>{"Ωμέγα", " 東京", " x", "²"});
  CHECK(chunks_of("").empty());
}

TEST_CASE("pre-tokenization: bytes that are not UTF-8 form chunks of their own, and chunks cover the text", "[text]") {
  CHECK(chunks_of("ab\xFF\xFE" "cd") == std::vector<std::string>{"ab", "\xFF\xFE", "cd"});
  CHECK(chunks_of("a \xC3") == std::vector<std::string>{"a", " ", "\xC3"});
  CHECK(chunks_of("\xE2\x82x") == std::vector<std::string>{"\xE2\x82", "x"});  // a truncated sequence
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) {
    std::string text = text_test::random_bytes(rng, 1 + static_cast<std::size_t>(i) * 3);
    if (i % 2) text += " plain words 12 and\tspaces  ";
    std::string joined;
    for (const std::string& c : chunks_of(text)) {
      CHECK_FALSE(c.empty());
      joined += c;
    }
    CHECK(joined == text);
  }
}

TEST_CASE("pre-tokenization: long runs split as the pattern says, without exhausting the JIT stack", "[text]") {
  const std::string spaces(200000, ' '), letters(200000, 'a');
  CHECK(chunks_of(spaces + "x") == std::vector<std::string>{spaces.substr(1), " x"});
  CHECK(chunks_of(letters) == std::vector<std::string>{letters});
}

TEST_CASE("training: the merges of a short string, worked by hand", "[text]") {
  // "aaabdaaabac" is one chunk. Counts: aa 4 (overlapping), ab 2, others 1. Merge (a, a) -> 256,
  // left to right: aa a b d aa a b a c. Now (aa, a) and (a, b) both count 2: the smaller left id
  // wins, (a, b) -> 257: aa ab d aa ab a c. Then (aa, ab) -> 258 (count 2).
  const BpeTokenizer t = train("aaabdaaabac", 259);
  CHECK(t.merges() == Merges{{'a', 'a'}, {'a', 'b'}, {256, 257}});
  CHECK(t.token(258) == "aaab");
  CHECK(t.encode("aaabdaaabac") == std::vector<std::int32_t>{258, 'd', 258, 'a', 'c'});
  // Encoding applies merges by rank: in "aab" (a, a) has rank 0 and (a, b) rank 1, so aa + b.
  CHECK(t.encode("aab") == std::vector<std::int32_t>{256, 'b'});
  // All counts 1 next: ties go to the smallest left id, (a, c) then (d, aaab), ...
  const BpeTokenizer more = train("aaabdaaabac", 263);
  CHECK(more.merges() == Merges{{'a', 'a'}, {'a', 'b'}, {256, 257}, {'a', 'c'}, {'d', 258}, {258, 260}, {261, 259}});
  CHECK(more.encode("aaabdaaabac") == std::vector<std::int32_t>{262});
  // Nothing left to merge: training stops below the vocabulary size asked for.
  CHECK(train("aaabdaaabac", 1000).vocab_size() == 263);
}

TEST_CASE("training: merges stay within chunks, counts weigh repeated chunks, results are deterministic", "[text]") {
  // Chunks "ab", " ab" twice, " xy": (a, b) counts 3, (" ", a) 2.
  const BpeTokenizer t = train("ab ab ab xy", 257);
  CHECK(t.merges() == Merges{{'a', 'b'}});
  // " the" thrice: (" ", t), (t, h), (h, e) count 3 each; the smallest left id, " ", goes first.
  // Then (" t", h) and (h, e) tie at 3 and h (104) < " t" (256): "he", then " t" + "he".
  const BpeTokenizer u = train(" the cat the hat the", 259);
  CHECK(u.token(256) == " t");
  CHECK(u.token(257) == "he");
  CHECK(u.token(258) == " the");
  const std::string corpus = "It was the best of times, it was the worst of times; 1234 1234 ok.\n";
  const BpeTokenizer a = train(corpus, 300), b = train(corpus, 300);
  CHECK(a.merges() == b.merges());
  CHECK(a.to_tokenizer_json() == b.to_tokenizer_json());
}

TEST_CASE("training: special tokens take the last ids and are matched whole", "[text]") {
  const BpeTokenizer t = train("hello world hello world", 262, {"<|endoftext|>", "<pad>"});
  CHECK(t.vocab_size() == 262);
  CHECK(t.token(260) == "<|endoftext|>");
  CHECK(t.token(261) == "<pad>");
  const std::vector<std::int32_t> ids = t.encode("hello<|endoftext|><pad>world");
  REQUIRE(ids.size() >= 3);
  CHECK(std::count(ids.begin(), ids.end(), 260) == 1);
  CHECK(std::count(ids.begin(), ids.end(), 261) == 1);
  CHECK(t.decode(ids) == "hello<|endoftext|><pad>world");
  CHECK_THAT(error_of([] { train("x", 256, {"<s>"}); }), Catch::Contains("vocab_size 256 must be in [256 + 1"));
  CHECK_THAT(error_of([] { train("x", 300, {"<s>", "<s>"}); }), Catch::Contains("'<s>' is given twice"));
}

TEST_CASE("encoding: any bytes round-trip, invalid UTF-8 included", "[text]") {
  const BpeTokenizer bytes_only;
  const BpeTokenizer t = train("the quick brown fox jumps over the lazy dog; \xFF\xFE the end  \n\n", 300);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100; ++i) {
    std::string s = text_test::random_bytes(rng, static_cast<std::size_t>(i) * 7);
    if (i % 3 == 0) s = "the lazy fox " + s + " over the dog\n";
    CHECK(t.decode(t.encode(s)) == s);
    CHECK(bytes_only.decode(bytes_only.encode(s)) == s);
    CHECK(bytes_only.encode(s).size() == s.size());
  }
  const std::string runs = std::string(5000, ' ') + std::string(5000, 'e') + "\xC3\xA9\xC3" + std::string(3000, '\xFF');
  CHECK(t.decode(t.encode(runs)) == runs);
  CHECK(t.encode("").empty());
  const std::vector<std::int32_t> bad = {5, static_cast<std::int32_t>(t.vocab_size())};
  CHECK_THAT(error_of([&] { t.decode(bad); }),
             Catch::Contains("id " + std::to_string(t.vocab_size()) + " is outside the vocabulary [0, " +
                             std::to_string(t.vocab_size()) + ")"));
}

TEST_CASE("encoding: the scan and the heap paths give the same merges", "[text]") {
  // A random merge table over the tokens 0 and 1: merge k joins two earlier tokens into 2 + k.
  std::mt19937_64 rng(3);
  tg::text::detail::MergeTable table;
  std::int32_t next = 2;
  for (std::int32_t rank = 0; rank < 60; ++rank) {
    std::uniform_int_distribution<std::int32_t> pick(0, next - 1);
    if (table.insert(pick(rng), pick(rng), rank, next)) ++next;
  }
  tg::text::detail::MergeScratch scratch;
  for (std::size_t n = 1; n < 400; n += 7) {
    std::vector<std::int32_t> a(n);
    std::uniform_int_distribution<std::int32_t> bit(0, 1);
    for (auto& s : a) s = bit(rng);
    std::vector<std::int32_t> b = a;
    a.resize(tg::text::detail::apply_merges_scan(table, a.data(), n, scratch));
    b.resize(tg::text::detail::apply_merges_heap(table, b.data(), n, scratch));
    CHECK(a == b);
    CHECK(a.size() < n + 1);
  }
  // The heap path on a long chunk: 'e' * 4096 with (e, e) and (ee, ee) merges is 1024 "eeee".
  const BpeTokenizer t = train("eeee\neeee\neeee", 258);
  REQUIRE(t.token(257) == "eeee");
  CHECK(t.encode(std::string(4096, 'e')) == std::vector<std::int32_t>(1024, 257));
}
