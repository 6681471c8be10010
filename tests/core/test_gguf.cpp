// GGUF: round trips of every metadata and tensor type, the byte layout against files assembled
// here from the format's description, atomic saves, and damaged files (every truncation, wrong
// counts, overflowing dims, bad alignment, and 5,000 random mutations) refused with tg::Error.
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "helpers.h"
#include "tapegrad/gguf.h"
#include "temp_dir.h"

using namespace tg;
namespace fs = std::filesystem;

using tgtest::TempDir;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Little-endian pieces of a GGUF file, assembled by hand from the format's description.
struct Bytes {
  std::string s;
  Bytes& u(std::uint64_t v, int n) {
    for (int b = 0; b < n; ++b) s += static_cast<char>((v >> (8 * b)) & 0xff);
    return *this;
  }
  Bytes& u32(std::uint64_t v) { return u(v, 4); }
  Bytes& u64(std::uint64_t v) { return u(v, 8); }
  Bytes& str(const std::string& t) {
    u64(t.size());
    s += t;
    return *this;
  }
  Bytes& raw(const std::string& t) {
    s += t;
    return *this;
  }
  Bytes& pad(std::size_t align) {
    s.append((align - s.size() % align) % align, '\0');
    return *this;
  }
  Bytes& f32(float v) { return u32(std::bit_cast<std::uint32_t>(v)); }
  Bytes& header(std::uint64_t n_tensors, std::uint64_t n_kv, std::uint32_t version = 3) {
    s += "GGUF";
    return u32(version).u64(n_tensors).u64(n_kv);
  }
  // A tensor info: name, dims in ggml order (ne[0] first), ggml type, offset.
  Bytes& info(const std::string& name, const std::vector<std::uint64_t>& ne, std::uint32_t type, std::uint64_t off) {
    str(name).u32(ne.size());
    for (auto d : ne) u64(d);
    return u32(type).u64(off);
  }
};

Tensor iota(const Shape& shape, DType dtype, double start = 0.5) {
  Tensor t = Tensor::empty(shape, float64);
  double* p = t.data<double>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = start + 0.25 * static_cast<double>(i) * (i % 2 ? -1 : 1);
  return t.to(dtype);
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

StateDict sample_tensors() {
  StateDict sd;
  sd.insert("token_embd.weight", iota({5, 3}, float32));
  sd.insert("blk.0.attn_norm.weight", iota({3}, float32, 1.0));
  sd.insert("bf", iota({2, 3, 2}, bfloat16));
  sd.insert("f64", iota({1, 2, 1, 3}, float64));
  sd.insert("ids", iota({4}, float32, 3).to(int32));
  return sd;
}

GGUFMetadata sample_metadata() {
  GGUFMetadata md;
  md.set("general.architecture", GGUFValue::of_string("llama"));
  md.set("llama.block_count", GGUFValue::of_u32(2));
  md.set("llama.rope.freq_base", GGUFValue::of_f32(10000.0f));
  md.set("some.i32", GGUFValue::of_i32(-7));
  md.set("some.u64", GGUFValue::of_u64(std::uint64_t(1) << 40));
  md.set("some.f64", GGUFValue::of_f64(0.1));
  md.set("some.bool", GGUFValue::of_bool(true));
  md.set("tokenizer.ggml.tokens", GGUFValue::strings({"a", "\xe2\x96\x81", "", "\n"}));
  md.set("tokenizer.ggml.scores", GGUFValue::f32s({0.f, -1.5f, 2.f, 0.f}));
  md.set("tokenizer.ggml.token_type", GGUFValue::i32s({1, 1, 3, 1}));
  return md;
}

#define REQUIRE_BAD(bytes, ...) REQUIRE_TG_ERROR(from_gguf_bytes(bytes), "load_gguf: ", __VA_ARGS__)

// A valid file with one (2, 3) F32 tensor "w" at offset 0 and one metadata entry; pieces are
// replaced by the damaged-file tests.
std::string small_file(std::uint32_t type = 0, std::uint64_t offset = 0, std::vector<std::uint64_t> ne = {3, 2}) {
  Bytes b;
  b.header(1, 1).str("k").u32(4).u32(9).info("w", ne, type, offset).pad(32);
  for (int i = 0; i < 6; ++i) b.f32(static_cast<float>(i));
  return b.pad(32).s;
}

}  // namespace

TEST_CASE("GGUF round-trips every metadata type and F32, BF16, F64 and I32 tensors bit-exactly", "[gguf]") {
  const StateDict sd = sample_tensors();
  const GGUFMetadata md = sample_metadata();
  const GGUFFile back = from_gguf_bytes(to_gguf_bytes(sd, md));
  REQUIRE(back.tensors.size() == sd.size());
  auto it = back.tensors.begin();
  for (const auto& [name, t] : sd) {
    CHECK(it->first == name);  // file order is the StateDict's order
    CHECK(bit_equal(it->second, t));
    ++it;
  }
  REQUIRE(back.metadata.size() == md.size());
  CHECK(back.metadata.at("general.architecture").as_string("a") == "llama");
  CHECK(back.metadata.at("llama.block_count").type() == GGUFType::u32);
  CHECK(back.metadata.at("llama.block_count").as_uint("b") == 2);
  CHECK(back.metadata.at("llama.rope.freq_base").as_double("f") == 10000.0);
  CHECK(back.metadata.at("some.i32").as_int("i") == -7);
  CHECK(back.metadata.at("some.u64").as_uint("u") == (std::uint64_t(1) << 40));
  CHECK(back.metadata.at("some.f64").as_double("d") == 0.1);
  CHECK(back.metadata.at("some.bool").as_bool("b"));
  CHECK(back.metadata.at("tokenizer.ggml.tokens").as_strings("t") ==
        std::vector<std::string>{"a", "\xe2\x96\x81", "", "\n"});
  const GGUFValue& scores = back.metadata.at("tokenizer.ggml.scores");
  REQUIRE(scores.size() == 4);
  CHECK(scores.item(1, "s").as_double("s") == -1.5);
  CHECK(back.metadata.at("tokenizer.ggml.token_type").item(2, "t").as_int("t") == 3);
  CHECK(back.metadata.begin()->first == "general.architecture");  // file order
}

TEST_CASE("GGUF values refuse reads of another type, naming the key", "[gguf]") {
  REQUIRE_TG_ERROR(GGUFValue::of_i32(-1).as_uint("llama.block_count"), "llama.block_count", "not a non-negative");
  REQUIRE_TG_ERROR(GGUFValue::of_string("x").as_uint("k"), "k", "STRING", "not an integer");
  REQUIRE_TG_ERROR(GGUFValue::of_u32(1).as_string("k"), "UINT32", "not STRING");
  REQUIRE_TG_ERROR(GGUFValue::of_u32(1).as_bool("k"), "not BOOL");
  REQUIRE_TG_ERROR(GGUFValue::of_u64(~std::uint64_t(0)).as_int("k"), "too large");
  REQUIRE_TG_ERROR(GGUFValue::f32s({1.f}).as_strings("k"), "ARRAY of FLOAT32", "not an array of STRING");
  REQUIRE_TG_ERROR(GGUFValue::f32s({1.f}).item(1, "k"), "index 1");
  REQUIRE_TG_ERROR(GGUFValue::strings({"a"}).item(0, "k"), "not an array of numbers");
  CHECK(GGUFValue::of_i32(5).as_uint("k") == 5);
  CHECK(GGUFValue::of_u32(5).as_double("k") == 5.0);
  REQUIRE_TG_ERROR(GGUFMetadata().at("general.name"), "no metadata key 'general.name'");
  CHECK(GGUFValue().as_uint("k") == 0);  // a default value is UINT32 0, and writes as one
  GGUFMetadata md;
  md.set("a", GGUFValue());
  md.set("b", GGUFValue::of_u32(1));
  md.set("a", GGUFValue::of_string("x"));  // replaced in place
  CHECK(md.size() == 2);
  CHECK(md.begin()->first == "a");
  const GGUFFile back = from_gguf_bytes(to_gguf_bytes({}, md));
  CHECK(back.metadata.at("a").as_string("a") == "x");
  CHECK(back.metadata.at("b").as_uint("b") == 1);
}

TEST_CASE("the bytes follow the GGUF v3 layout: reversed dims, 32-byte alignment, padded tensors", "[gguf]") {
  StateDict sd;
  sd.insert("a", iota({2, 3}, float32));  // 24 bytes, padded to 32
  sd.insert("b", iota({1}, bfloat16));     // at offset 32
  GGUFMetadata md;
  md.set("general.name", GGUFValue::of_string("x"));
  md.set("n", GGUFValue::of_u32(7));
  Bytes want;
  want.header(2, 2).str("general.name").u32(8).str("x").str("n").u32(4).u32(7);
  want.info("a", {3, 2}, 0, 0).info("b", {1}, 30, 32).pad(32);
  want.raw(std::string(static_cast<const char*>(sd.at("a").raw_data()), 24)).pad(32);
  want.raw(std::string(static_cast<const char*>(sd.at("b").raw_data()), 2)).pad(32);
  CHECK(to_gguf_bytes(sd, md) == want.s);

  // A file with a 64-byte alignment, a gap between its tensors, and an array of strings reads.
  Bytes other;
  other.header(2, 2).str("general.alignment").u32(4).u32(64).str("t").u32(9).u32(8).u64(2).str("p").str("q");
  other.info("x", {2}, 0, 128).info("y", {2, 1}, 0, 0).pad(64);
  other.f32(1).f32(2).pad(64).raw(std::string(64, '\0')).f32(3).f32(4).pad(64);
  const GGUFFile f = from_gguf_bytes(other.s);
  CHECK(f.tensors.at("x").shape() == Shape{2});
  CHECK(f.tensors.at("x").to_vector<float>() == std::vector<float>{3, 4});
  CHECK(f.tensors.at("y").shape() == Shape{1, 2});
  CHECK(f.tensors.at("y").to_vector<float>() == std::vector<float>{1, 2});
  CHECK(f.metadata.at("t").as_strings("t") == std::vector<std::string>{"p", "q"});
  // The writer honours the alignment it is given.
  GGUFMetadata md64;
  md64.set("general.alignment", GGUFValue::of_u32(64));
  const std::string w = to_gguf_bytes(sd, md64);
  CHECK(w.size() % 64 == 0);
  CHECK(from_gguf_bytes(w).tensors.at("b").to_vector<float>() == sd.at("b").to_vector<float>());
}

TEST_CASE("save_gguf writes atomically and leaves nothing behind when it refuses", "[gguf]") {
  TempDir tmp;
  const std::string path = tmp.path("m.gguf");
  save_gguf(path, sample_tensors(), sample_metadata());
  CHECK(read_bytes(path) == to_gguf_bytes(sample_tensors(), sample_metadata()));
  CHECK(bit_equal(load_gguf(path).tensors.at("bf"), sample_tensors().at("bf")));
  StateDict bad = sample_tensors();
  bad.insert(std::string(64, 'n'), iota({1}, float32));
  REQUIRE_TG_ERROR(save_gguf(path, bad, {}), "save_gguf: ", "64 bytes", "1 to 63");
  CHECK(read_bytes(path) == to_gguf_bytes(sample_tensors(), sample_metadata()));  // untouched
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(tmp.dir)) files += e.is_regular_file();
  CHECK(files == 1);  // no temporary file left
  REQUIRE_TG_ERROR(save_gguf(tmp.path("no/such/dir/m.gguf"), sample_tensors(), {}), "save_gguf: ", "cannot create", ".tmp");
  REQUIRE_TG_ERROR(load_gguf(tmp.path("missing.gguf")), "load_gguf: ", "cannot open");
  REQUIRE_TG_ERROR(load_gguf(tmp.dir.string()), "not a regular file");
  // A new file takes 0644 less the umask; one replaced keeps its permission bits.
  const mode_t old_mask = ::umask(077);
  const std::string fresh = tmp.path("fresh.gguf");
  save_gguf(fresh, sample_tensors(), sample_metadata());
  save_gguf(path, sample_tensors(), sample_metadata());
  ::umask(old_mask);
  const auto rw = fs::perms::owner_read | fs::perms::owner_write;
  CHECK((fs::status(fresh).permissions() & fs::perms::all) == rw);
  CHECK((fs::status(path).permissions() & fs::perms::all) == (rw | fs::perms::group_read | fs::perms::others_read));
}

TEST_CASE("the writer refuses what ggml cannot read", "[gguf]") {
  StateDict scalar;
  scalar.insert("s", Tensor::empty(Shape{}, float32));
  REQUIRE_TG_ERROR(to_gguf_bytes(scalar, {}), "tensor 's' has 0 dims", "1 to 4");
  StateDict five;
  five.insert("f", Tensor::empty({1, 1, 1, 1, 2}, float32));
  REQUIRE_TG_ERROR(to_gguf_bytes(five, {}), "5 dims");
  GGUFMetadata md;
  md.set("general.alignment", GGUFValue::of_u32(48));
  REQUIRE_TG_ERROR(to_gguf_bytes(sample_tensors(), md), "general.alignment 48 is not a power of two");
  md.set("general.alignment", GGUFValue::of_u64(32));
  REQUIRE_TG_ERROR(to_gguf_bytes(sample_tensors(), md), "general.alignment is UINT64, not UINT32");
}

TEST_CASE("a general.alignment past the limit is refused by the reader and the writer, naming value and limit",
          "[gguf]") {
  // The writer pads the header and every tensor to the alignment: 2^31 would be 2 GiB of zeros each.
  const std::uint64_t huge = std::uint64_t{1} << 31, over = kGGUFMaxAlignment * 2;
  for (const std::uint64_t a : {huge, over}) {
    INFO("alignment " << a);
    const std::string text = "general.alignment " + std::to_string(a) + " exceeds the limit of 65536";
    REQUIRE_BAD(Bytes().header(0, 1).str("general.alignment").u32(4).u32(a).s, text.c_str());
    Bytes one;  // one tensor, its data block at the next multiple of the alignment
    one.header(1, 1).str("general.alignment").u32(4).u32(a).info("w", {1}, 0, 0);
    REQUIRE_BAD(one.s, text.c_str());
    GGUFMetadata md = sample_metadata();
    md.set("general.alignment", GGUFValue::of_u32(static_cast<std::uint32_t>(a)));
    REQUIRE_TG_ERROR(to_gguf_bytes(sample_tensors(), md), "to_gguf_bytes: ", text.c_str());
    REQUIRE_TG_ERROR(to_gguf_bytes({}, md), "to_gguf_bytes: ", text.c_str());
    TempDir tmp;
    REQUIRE_TG_ERROR(save_gguf(tmp.path("m.gguf"), sample_tensors(), md), "save_gguf: ", text.c_str());
    CHECK_FALSE(fs::exists(tmp.path("m.gguf")));
  }
  // The limit itself reads and writes.
  GGUFMetadata md = sample_metadata();
  md.set("general.alignment", GGUFValue::of_u32(static_cast<std::uint32_t>(kGGUFMaxAlignment)));
  const std::string bytes = to_gguf_bytes(sample_tensors(), md);
  CHECK(bytes.size() % kGGUFMaxAlignment == 0);
  CHECK(bit_equal(from_gguf_bytes(bytes).tensors.at("bf"), sample_tensors().at("bf")));
}

TEST_CASE("sizes read from a crafted file are held to the bytes that remain before anything is allocated",
          "[gguf]") {
  constexpr std::uint64_t kHuge = std::uint64_t{1} << 62;
  // Counts: every entry and info takes some bytes, so a count is bounded by what remains.
  REQUIRE_BAD(Bytes().header(0, kHuge).s, "metadata count 4611686018427387904 cannot fit in the 0 bytes");
  REQUIRE_BAD(Bytes().header(kHuge, 0).s, "tensor count 4611686018427387904 cannot fit in the 0 bytes");
  // Lengths of a key, a string value, an array (of numbers and of strings), a tensor name.
  REQUIRE_BAD(Bytes().header(0, 1).u64(kHuge).raw(std::string(8, 'k')).s,
              "metadata key 0 (4611686018427387904 bytes) needs 4611686018427387904 bytes");
  REQUIRE_BAD(Bytes().header(0, 1).str("llama.context_length").u32(8).u64(kHuge).raw("abcd").s,
              "metadata 'llama.context_length' (4611686018427387904 bytes) needs", "only 4 remain");
  REQUIRE_BAD(Bytes().header(0, 1).str("tokenizer.ggml.scores").u32(9).u32(6).u64(kHuge).raw(std::string(8, '\0')).s,
              "metadata 'tokenizer.ggml.scores': array of 4611686018427387904 FLOAT32 cannot fit in the 8 bytes");
  REQUIRE_BAD(Bytes().header(0, 1).str("tokenizer.ggml.tokens").u32(9).u32(8).u64(kHuge).str("a").s,
              "metadata 'tokenizer.ggml.tokens': array of 4611686018427387904 STRING cannot fit in the 9 bytes");
  REQUIRE_BAD(Bytes().header(1, 0).u64(kHuge).raw(std::string(40, 'n')).s,
              "tensor info 0's name (4611686018427387904 bytes) needs");
  // A tensor's dims: its bytes must lie inside the data block.
  REQUIRE_BAD(small_file(0, 0, {std::uint64_t{1} << 31, std::uint64_t{1} << 20}),
              "tensor 'w': bytes [0, 0 + 9007199254740992) lie outside the data block of 32 bytes");
  // A large scalar is kept as a value: sizing anything by it is the reader of the key's to check.
  const GGUFFile f = from_gguf_bytes(Bytes().header(0, 1).str("llama.context_length").u32(10).u64(kHuge).s);
  CHECK(f.metadata.at("llama.context_length").as_uint("llama.context_length") == kHuge);
}

TEST_CASE("every truncation of a valid GGUF file is refused", "[gguf]") {
  const std::string good = to_gguf_bytes(sample_tensors(), sample_metadata());
  REQUIRE_NOTHROW(from_gguf_bytes(good));
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    INFO("cut at " << cut << " of " << good.size());
    REQUIRE_TG_ERROR(from_gguf_bytes(good.substr(0, cut)), "load_gguf: ");
  }
  REQUIRE_BAD(good.substr(0, 10), "shorter than the 24-byte GGUF header");
  REQUIRE_BAD(good.substr(0, 60), "metadata count 10 cannot fit in the 36 bytes that remain");
  REQUIRE_BAD(good.substr(0, 200), "truncated: metadata");
  REQUIRE_BAD(good.substr(0, good.size() - 1), "truncated: the data block holds", "padding ends at");
  REQUIRE_BAD(good.substr(0, good.size() - 17), "outside the data block", "truncated file");
}

TEST_CASE("a damaged header, counts or metadata are refused with the field named", "[gguf]") {
  REQUIRE_NOTHROW(from_gguf_bytes(small_file()));
  std::string m = small_file();
  m[0] = 'X';
  REQUIRE_BAD(m, "not a GGUF file");
  REQUIRE_BAD(Bytes().header(0, 0, 2).s, "GGUF version 2 is not supported");
  REQUIRE_BAD(Bytes().header(0, std::uint64_t(1) << 60).s, "metadata count 1152921504606846976 cannot fit");
  REQUIRE_BAD(Bytes().header(~std::uint64_t(0), 0).s, "tensor count", "cannot fit");
  // Wrong counts: one more entry than the file holds.
  REQUIRE_BAD(Bytes().header(0, 2).str("k").u32(4).u32(1).s, "metadata count 2 cannot fit in the 17 bytes that remain");
  REQUIRE_BAD(Bytes().header(0, 2).str("k").u32(4).u32(1).u64(1000).raw("abc").s,
              "truncated: metadata key 1 (1000 bytes) needs 1000 bytes");
  std::string more = small_file();
  more[8] = 2;  // tensor count 2: the second info would start in the padding
  REQUIRE_TG_ERROR(from_gguf_bytes(more), "load_gguf: ", "tensor info 1");
  REQUIRE_BAD(Bytes().header(0, 1).u64(std::uint64_t(1) << 62).raw(std::string(16, 'x')).s,
              "truncated: metadata key 0 (4611686018427387904 bytes)");
  REQUIRE_BAD(Bytes().header(0, 1).str("").u32(4).u32(1).s, "metadata key 0 is empty");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(13).u32(1).s, "metadata 'k': unknown value type 13");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(7).u(2, 1).s, "metadata 'k': BOOL byte is 2");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(8).u64(1000).raw("abc").s, "metadata 'k'", "truncated");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(9).u32(9).u64(1).s, "arrays of arrays");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(9).u32(10).u64(std::uint64_t(1) << 61).raw(std::string(8, '\0')).s,
              "array of 2305843009213693952 UINT64 cannot fit");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(9).u32(8).u64(std::uint64_t(1) << 40).s, "array of", "STRING cannot fit");
  REQUIRE_BAD(Bytes().header(0, 1).str("k").u32(9).u32(7).u64(2).u(1, 1).u(5, 1).s, "BOOL element is 5");
  REQUIRE_BAD(Bytes().header(0, 2).str("k").u32(4).u32(1).str("k").u32(4).u32(2).s, "duplicate metadata key 'k'");
  REQUIRE_BAD(Bytes().header(0, 1).str("general.alignment").u32(4).u32(0).s, "general.alignment 0 is not a power of two");
  REQUIRE_BAD(Bytes().header(0, 1).str("general.alignment").u32(8).str("32").s, "general.alignment is STRING");
}

TEST_CASE("damaged tensor infos are refused: dims, types, names, offsets, alignment", "[gguf]") {
  REQUIRE_BAD(small_file(0, 0, {}), "tensor 'w': n_dims is 0");
  REQUIRE_BAD(small_file(0, 0, {1, 1, 1, 1, 6}), "tensor 'w': n_dims is 5");
  REQUIRE_BAD(small_file(0, 0, {std::uint64_t(1) << 32, std::uint64_t(1) << 32}), "overflow");
  REQUIRE_BAD(small_file(0, 0, {~std::uint64_t(0)}), "overflow");
  REQUIRE_BAD(small_file(0, 0, {std::uint64_t(1) << 62, 1}), "byte size", "overflows");
  REQUIRE_BAD(small_file(0, 0, {std::uint64_t(1) << 40, 2}), "outside the data block");
  REQUIRE_BAD(small_file(1), "ggml type F16 is not supported");
  REQUIRE_BAD(small_file(2), "ggml type Q4_0 is not supported");
  REQUIRE_BAD(small_file(99), "unknown ggml type 99");
  REQUIRE_BAD(small_file(0, 4), "offset 4 is not a multiple of the alignment 32");
  REQUIRE_BAD(small_file(0, 32), "outside the data block");
  REQUIRE_BAD(small_file(0, ~std::uint64_t(0) - 31), "outside the data block");
  // Names: empty, longer than ggml's 63 bytes, duplicated.
  Bytes empty_name;
  empty_name.header(1, 0).info("", {1}, 0, 0).pad(32).f32(1);
  REQUIRE_BAD(empty_name.s, "tensor info 0: name of 0 bytes");
  Bytes long_name;
  long_name.header(1, 0).info(std::string(64, 'x'), {1}, 0, 0).pad(32).f32(1);
  REQUIRE_BAD(long_name.s, "name of 64 bytes");
  Bytes dup;
  dup.header(2, 0).info("w", {1}, 0, 0).info("w", {1}, 0, 32).pad(32).f32(1).pad(32).f32(2);
  REQUIRE_BAD(dup.s, "duplicate tensor name 'w'");
  Bytes overlap;
  overlap.header(2, 0).info("a", {8}, 0, 0).info("b", {1}, 0, 32).pad(32).raw(std::string(64, '\0'));
  REQUIRE_NOTHROW(from_gguf_bytes(overlap.s));
  overlap.s[overlap.s.find('a') + 1 + 4] = 9;  // a's ne[0]: 8 -> 9 elements, 36 bytes, past b's offset 32
  REQUIRE_BAD(overlap.s, "tensor 'b' at offset 32 overlaps tensor 'a'");
  // A data block that should start past the file's end.
  Bytes no_data;
  no_data.header(1, 0).info("w", {0}, 0, 0);
  REQUIRE_BAD(no_data.s, "the data block starts at", "past the end");
  // A 64-byte alignment makes offset 32 misaligned.
  Bytes a64;
  a64.header(1, 1).str("general.alignment").u32(4).u32(64).info("w", {1}, 0, 32).pad(64).raw(std::string(64, '\0'));
  REQUIRE_BAD(a64.s, "offset 32 is not a multiple of the alignment 64");
}

TEST_CASE("5,000 randomly mutated GGUF files load or raise tg::Error, never crash", "[gguf]") {
  const std::string good = to_gguf_bytes(sample_tensors(), sample_metadata());
  std::size_t data_size = 0;  // the data block: each tensor padded to 32 bytes
  for (const auto& [name, t] : sample_tensors()) data_size += (t.nbytes() + 31) / 32 * 32;
  const std::size_t header_end = good.size() - data_size;
  REQUIRE(from_gguf_bytes(good).tensors.size() == 5);
  std::mt19937_64 rng(31);
  std::uniform_int_distribution<std::size_t> any_pos(0, good.size() - 1), header_pos(0, header_end - 1);
  std::uniform_int_distribution<int> byte(0, 255), nflips(1, 4), coin(0, 3);
  // Small values that keep counts, lengths and types plausible, so mutations reach later checks.
  const unsigned char plausible[] = {0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 26, 30, 31, 32, 63, 64, 0xff};
  std::uniform_int_distribution<std::size_t> pick(0, sizeof plausible - 1);
  int ok = 0, rejected = 0;
  TempDir tmp;
  for (int iter = 0; iter < 5000; ++iter) {
    std::string m = good;
    for (int f = nflips(rng); f > 0; --f) {
      const int c = coin(rng);
      const std::size_t pos = c == 0 ? any_pos(rng) : header_pos(rng);
      m[pos] = static_cast<char>(c == 3 ? plausible[pick(rng)] : byte(rng));
    }
    if (iter % 9 == 0) m.resize(any_pos(rng));
    INFO("iteration " << iter);
    try {
      GGUFFile f;
      if (iter % 25 == 0) {
        write_bytes(tmp.path("f.gguf"), m);
        f = load_gguf(tmp.path("f.gguf"));
      } else {
        f = from_gguf_bytes(m);
      }
      std::uint64_t bytes = 0;  // a file that loads holds its tensors within its size
      for (const auto& [name, t] : f.tensors) bytes += t.nbytes();
      CHECK(bytes <= m.size());
      ++ok;
    } catch (const Error& e) {
      CHECK(std::string(e.what()).rfind("load_gguf: ", 0) == 0);
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("unexpected exception type: " << e.what());
    }
  }
  CHECK(ok + rejected == 5000);
  CHECK(ok > 0);        // flips in the data block (and some in values) still load
  CHECK(rejected > 0);  // damage to the structure is caught
}
