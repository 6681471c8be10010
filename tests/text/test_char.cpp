#include <tapegrad/text/char_tokenizer.h>
#include <tapegrad/text/utf8.h>

#include "text/text_helpers.h"

using tg::text::CharTokenizer;
using text_test::error_of;

TEST_CASE("CharTokenizer: the sorted distinct characters, ids are their indices", "[text]") {
  const CharTokenizer t = CharTokenizer::from_text("banana é€😀");
  const std::vector<char32_t> expected = {U' ', U'a', U'b', U'n', U'é', U'€', U'😀'};
  CHECK(t.vocab() == expected);
  CHECK(t.vocab_size() == 7);
  CHECK(t.encode("nab é") == std::vector<std::int32_t>{3, 1, 2, 0, 4});
  const std::vector<std::int32_t> ids = {6, 5, 0, 2};
  CHECK(t.decode(ids) == "😀€ b");
  CHECK(CharTokenizer::from_vocab_utf8(t.vocab_utf8()).vocab() == t.vocab());
}

TEST_CASE("CharTokenizer: unknown characters, bad ids and bad vocabularies are errors", "[text]") {
  const CharTokenizer t = CharTokenizer::from_text("abc");
  const std::string unknown = error_of([&] { t.encode("abd"); });
  CHECK_THAT(unknown, Catch::Contains("CharTokenizer::encode") && Catch::Contains("'d' (U+0064)") &&
                          Catch::Contains("vocabulary of 3 characters"));
  CHECK_THAT(error_of([&] { t.encode("a\xFF"); }), Catch::Contains("not valid UTF-8"));
  const std::vector<std::int32_t> bad = {0, 3};
  CHECK_THAT(error_of([&] { t.decode(bad); }), Catch::Contains("id 3 is outside the vocabulary [0, 3)"));
  CHECK_THAT(error_of([] { CharTokenizer::from_vocab_utf8("ba"); }), Catch::Contains("not sorted and distinct"));
  CHECK_THAT(error_of([] { CharTokenizer::from_vocab_utf8("aa"); }), Catch::Contains("not sorted and distinct"));
  CHECK_THAT(error_of([] { CharTokenizer::from_text("\xC0\x80"); }), Catch::Contains("not valid UTF-8"));
}

TEST_CASE("UTF-8: scalar values round-trip, and overlong forms, surrogates and truncation are refused", "[text]") {
  for (char32_t c : {U'\0', U'A', U'\u07FF', U'\u0800', U'\uFFFD', U'\U00010000', U'\U0010FFFF'}) {
    std::vector<char32_t> out;
    REQUIRE(tg::text::decode_utf8(tg::text::encode_utf8(c), out));
    CHECK(out == std::vector<char32_t>{c});
  }
  CHECK(tg::text::encode_utf8(U'€') == "\xE2\x82\xAC");
  std::vector<char32_t> out;
  for (const char* bad : {"\xC0\xAF", "\xE0\x80\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xE2\x82", "\x80", "\xFF"})
    CHECK_FALSE(tg::text::decode_utf8(bad, out));
  CHECK_THAT(error_of([] { tg::text::encode_utf8(0xD800); }), Catch::Contains("U+D800 is not a Unicode scalar value"));
  CHECK(tg::text::utf8_sequence_length("a\xE2\x82\xAC", 1) == 3);
  CHECK(tg::text::utf8_sequence_length("\xE2\x82", 0) == 0);
}
