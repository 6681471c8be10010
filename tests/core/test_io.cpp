// State dicts and safetensors: round trips, the published byte format (checked by an independent
// reader written here), atomic saves, and validation of malformed files.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "atomic_file.h"
#include "helpers.h"
#include "temp_dir.h"

using namespace tg;
using namespace tgtest;
namespace fs = std::filesystem;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  REQUIRE(f.good());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

std::string u64_le(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from a header text and a data block (the header length is computed).
std::string craft(const std::string& json, const std::string& data = "") { return u64_le(json.size()) + json + data; }

template <class T>
std::string le_bytes(const std::vector<T>& v) {
  std::string s;
  for (T x : v) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &x, sizeof(T));
    for (std::size_t b = 0; b < sizeof(T); ++b) s.push_back(static_cast<char>((bits >> (8 * b)) & 0xff));
  }
  return s;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return false;
  if (a.dtype() != b.dtype() || !(a.shape() == b.shape()) || a.nbytes() != b.nbytes()) return false;
  return a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

double f64_from_bits(std::uint64_t bits) { return std::bit_cast<double>(bits); }
float f32_from_bits(std::uint32_t bits) { return std::bit_cast<float>(bits); }

// Every dtype and the awkward shapes, with values whose bits must survive exactly (NaN payloads,
// negative zero, infinities, subnormals, integer extremes).
StateDict sample_dict() {
  StateDict sd;
  Generator g(1234);
  sd.insert("layer.weight", randn({3, 4}, float32, &g));
  Tensor d = Tensor::empty({6}, float64);
  double* pd = d.data<double>();
  pd[0] = f64_from_bits(0x7ff8000000000123ULL);  // NaN with a payload
  pd[1] = -0.0;
  pd[2] = std::numeric_limits<double>::infinity();
  pd[3] = std::numeric_limits<double>::denorm_min();
  pd[4] = 1.0 / 3.0;
  pd[5] = -1e308;
  sd.insert("bias64", d);
  sd.insert("ids", from_vector<std::int32_t>({INT_MIN, -1, 0, 1, INT_MAX, 42}, {2, 3}));
  sd.insert("scalar", tensor({3.25}, Shape{}, float32));
  sd.insert("empty64", zeros({0, 3}, float64));
  sd.insert("empty_i", zeros({0}, int32));
  Tensor cube = randn({2, 3, 4}, float32, &g);
  cube.data<float>()[0] = f32_from_bits(0x7fc00abcU);
  cube.data<float>()[1] = std::numeric_limits<float>::denorm_min();
  sd.insert("cube", cube);
  sd.insert("scalar64", tensor({-2.5}, Shape{}, float64));
  return sd;
}

// The reference writer's data order: F64, then F32, then I32, by name within a dtype.
const std::vector<std::string> kSampleLayoutOrder = {"bias64",       "empty64", "scalar64", "cube",
                                                     "layer.weight", "scalar",  "empty_i",  "ids"};

// Loading must fail with a tg::Error starting "load_safetensors: " and containing every fragment,
// both from memory and from a file.
void require_bad(const std::string& bytes, std::initializer_list<const char*> fragments) {
  TempDir tmp;
  const std::string path = tmp.path("bad.safetensors");
  write_bytes(path, bytes);
  for (int from_file = 0; from_file < 2; ++from_file) {
    INFO((from_file ? "load_safetensors" : "from_safetensors_bytes"));
    bool thrown = false;
    std::string msg;
    try {
      if (from_file)
        (void)load_safetensors(path);
      else
        (void)from_safetensors_bytes(bytes);
    } catch (const Error& e) {
      thrown = true;
      msg = e.what();
    }
    INFO("message: " << msg);
    REQUIRE(thrown);
    CHECK(msg.rfind("load_safetensors: ", 0) == 0);
    if (from_file) CHECK(msg.find(path) != std::string::npos);
    for (const char* f : fragments) CHECK(msg.find(f) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("StateDict keeps insertion order, replaces in place and reports missing keys", "[io]") {
  StateDict sd;
  CHECK(sd.empty());
  sd.insert("b", zeros({2}));
  sd.insert("a", ones({3}));
  sd.insert("c", full({1}, 5.0));
  REQUIRE(sd.size() == 3);
  sd.insert("a", full({4}, 7.0, float64));  // replace keeps the position
  REQUIRE(sd.size() == 3);
  std::vector<std::string> names;
  for (const auto& [name, t] : sd) names.push_back(name);
  CHECK(names == std::vector<std::string>{"b", "a", "c"});
  CHECK(sd.at("a").dtype() == float64);
  CHECK(sd.at("a").shape() == Shape{4});
  CHECK(sd.at("a").at({0}) == 7.0);
  REQUIRE(sd.find("c") != nullptr);
  CHECK(sd.find("c")->item() == 5.0);
  CHECK(sd.find("zz") == nullptr);
  CHECK(sd.contains("b"));
  CHECK_FALSE(sd.contains("zz"));
  CHECK_FALSE(sd.empty());
  REQUIRE_TG_ERROR(sd.at("x"), "state_dict: no key 'x'");
}

TEST_CASE("save and load round-trip every dtype and shape bit-exactly, with metadata", "[io]") {
  TempDir tmp;
  const std::string path = tmp.path("model.safetensors");
  const StateDict sd = sample_dict();
  const Metadata meta = {{"format", "pt"}, {"step", "1200"}, {"note", "ünïcödé \"quoted\"\n"}};
  save_safetensors(path, sd, meta);
  CHECK(fs::exists(path));
  std::vector<std::string> files;  // the file alone: its temporary file is gone
  for (const auto& e : fs::directory_iterator(tmp.dir)) files.push_back(e.path().filename().string());
  CHECK(files == std::vector<std::string>{"model.safetensors"});

  Metadata got_meta = {{"stale", "entry"}};
  const StateDict back = load_safetensors(path, &got_meta);
  CHECK(got_meta == meta);
  REQUIRE(back.size() == sd.size());
  for (const auto& [name, t] : sd) {
    INFO("tensor " << name);
    const Tensor* b = back.find(name);
    REQUIRE(b != nullptr);
    CHECK(b->dtype() == t.dtype());
    CHECK(b->shape() == t.shape());
    CHECK(bit_equal(*b, t));
    CHECK_FALSE(b->shares_storage(t));
  }
  // A loaded dict lists tensors in data-offset order, which is the reference writer's layout.
  std::vector<std::string> order;
  for (const auto& [name, t] : back) order.push_back(name);
  CHECK(order == kSampleLayoutOrder);
  CHECK(back.at("scalar").dim() == 0);
  CHECK(back.at("scalar").item() == 3.25);
  CHECK(back.at("empty64").shape() == Shape{0, 3});
  CHECK(back.at("ids").at({0, 0}) == INT_MIN);

  // The same bytes in memory, and loading them gives the same tensors.
  const std::string bytes = to_safetensors_bytes(sd, meta);
  CHECK(bytes == read_bytes(path));
  Metadata mem_meta;
  const StateDict mem = from_safetensors_bytes(bytes, &mem_meta);
  CHECK(mem_meta == meta);
  for (const auto& [name, t] : sd) CHECK(bit_equal(mem.at(name), t));

  // No metadata: the header has no "__metadata__" and loading clears the caller's map.
  save_safetensors(path, sd);
  CHECK(read_bytes(path).find("__metadata__") == std::string::npos);
  Metadata none = {{"stale", "entry"}};
  const StateDict again = load_safetensors(path, &none);
  CHECK(none.empty());
  CHECK(again.size() == sd.size());

  // Saving twice gives identical bytes (deterministic layout), regardless of insertion order.
  StateDict reversed;
  std::vector<StateDict::Item> items(sd.begin(), sd.end());
  for (auto it = items.rbegin(); it != items.rend(); ++it) reversed.insert(it->first, it->second);
  CHECK(to_safetensors_bytes(reversed, meta) == bytes);

  // An empty dict is a valid file.
  const StateDict empty = from_safetensors_bytes(to_safetensors_bytes(StateDict{}));
  CHECK(empty.empty());
}

TEST_CASE("the bytes match the published safetensors format (reference writer's output)", "[io]") {
  // What huggingface safetensors' save() writes for {"a": float32 [1, 2], "b": int32 scalar 7}
  // with metadata {"format": "pt"}: metadata first, compact JSON, space padding to 8 bytes.
  StateDict sd;
  sd.insert("b", from_vector<std::int32_t>({7}, Shape{}));
  sd.insert("a", tensor({1.0, 2.0}, {2}, float32));
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I32","shape":[],"data_offsets":[8,12]}})";
  std::string padded = json;
  while ((8 + padded.size()) % 8) padded.push_back(' ');
  const std::string expected = u64_le(padded.size()) + padded + le_bytes<float>({1.0f, 2.0f}) +
                               le_bytes<std::int32_t>({7});
  CHECK(to_safetensors_bytes(sd, {{"format", "pt"}}) == expected);
  // And a file produced that way (e.g. by Python) loads.
  const StateDict back = from_safetensors_bytes(expected);
  CHECK(back.at("a").to_vector<double>() == std::vector<double>{1.0, 2.0});
  CHECK(back.at("b").dtype() == int32);
  CHECK(back.at("b").item() == 7.0);

  // The cases of the reference implementation's own serialization tests (safetensors/src/tensor.rs).
  const std::string data = le_bytes<float>({0, 1, 2, 3, 4, 5});
  StateDict one;
  one.insert("attn.0", tensor({0, 1, 2, 3, 4, 5}, {1, 2, 3}, float32));
  CHECK(to_safetensors_bytes(one) ==
        u64_le(64) + R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})" + data);
  StateDict aligned;
  aligned.insert("attn0", tensor({0, 1, 2, 3, 4, 5}, {1, 1, 2, 3}, float32));
  CHECK(to_safetensors_bytes(aligned) ==
        u64_le(72) + R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + "       " + data);
  CHECK(to_safetensors_bytes(StateDict{}) == u64_le(8) + "{}      ");
  CHECK(to_safetensors_bytes(StateDict{}, {{"framework", "pt"}}) ==
        u64_le(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

TEST_CASE("an independent reader of the published format sees the same values", "[io]") {
  const StateDict sd = sample_dict();
  const Metadata meta = {{"framework", "tapegrad"}};
  const std::string bytes = to_safetensors_bytes(sd, meta);
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  REQUIRE(bytes.size() >= 8);

  // 8-byte little-endian header length, parsed by hand.
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(u[i]) << (8 * i);
  REQUIRE(n <= bytes.size() - 8);
  CHECK((8 + n) % 8 == 0);  // the data block starts 8-aligned
  const std::string header = bytes.substr(8, n);
  const std::string json_text = header.substr(0, header.find_last_not_of(' ') + 1);
  CHECK(header.size() - json_text.size() < 8);  // only padding spaces follow the JSON
  CHECK(json_text.find('\n') == std::string::npos);
  CHECK(json_text.rfind(R"({"__metadata__":)", 0) == 0);
  const nlohmann::json j = nlohmann::json::parse(header);
  REQUIRE(j.is_object());
  CHECK(j["__metadata__"] == nlohmann::json({{"framework", "tapegrad"}}));
  const std::uint64_t data_start = 8 + n;
  const std::uint64_t data_size = bytes.size() - data_start;

  struct Seen {
    std::uint64_t begin, end;
    std::string name;
  };
  std::vector<Seen> seen;
  for (const auto& [name, e] : j.items()) {
    if (name == "__metadata__") continue;
    INFO("tensor " << name);
    REQUIRE(e.is_object());
    CHECK(e.size() == 3);
    const Tensor& t = sd.at(name);
    const std::string dtype = e.at("dtype").get<std::string>();
    const std::size_t item = dtype == "F64" ? 8 : 4;
    CHECK(dtype == (t.dtype() == float64 ? "F64" : t.dtype() == float32 ? "F32" : "I32"));
    std::vector<std::int64_t> shape = e.at("shape").get<std::vector<std::int64_t>>();
    CHECK(shape == t.shape().vec());
    const auto offs = e.at("data_offsets").get<std::vector<std::uint64_t>>();
    REQUIRE(offs.size() == 2);
    REQUIRE(offs[0] <= offs[1]);
    REQUIRE(offs[1] <= data_size);
    std::uint64_t numel = 1;
    for (auto d : shape) numel *= static_cast<std::uint64_t>(d);
    REQUIRE(offs[1] - offs[0] == numel * item);
    seen.push_back({offs[0], offs[1], name});
    // Decode the elements from little-endian bytes, independent of the host's byte order.
    for (std::uint64_t i = 0; i < numel; ++i) {
      std::uint64_t bits = 0;
      for (std::size_t b = 0; b < item; ++b)
        bits |= static_cast<std::uint64_t>(u[data_start + offs[0] + i * item + b]) << (8 * b);
      if (dtype == "F32") {
        const float v = f32_from_bits(static_cast<std::uint32_t>(bits)), want = t.data<float>()[i];
        CHECK(std::memcmp(&v, &want, 4) == 0);
      } else if (dtype == "F64") {
        const double v = f64_from_bits(bits), want = t.data<double>()[i];
        CHECK(std::memcmp(&v, &want, 8) == 0);
      } else {
        const auto v = static_cast<std::int32_t>(static_cast<std::uint32_t>(bits));
        CHECK(v == t.data<std::int32_t>()[i]);
      }
    }
  }
  CHECK(seen.size() == sd.size());
  // The tensors tile the data block in the reference order (dtype alignment, then name).
  std::stable_sort(seen.begin(), seen.end(), [](const Seen& a, const Seen& b) { return a.begin < b.begin; });
  std::uint64_t pos = 0;
  std::vector<std::string> order;
  for (const Seen& s : seen) {
    CHECK(s.begin == pos);
    pos = s.end;
    order.push_back(s.name);
  }
  CHECK(pos == data_size);
  // Equal offsets (empty tensors) tie; compare the order of the non-empty ones.
  std::vector<std::string> nonempty, want_nonempty;
  for (const auto& name : order)
    if (sd.at(name).numel() > 0) nonempty.push_back(name);
  for (const auto& name : kSampleLayoutOrder)
    if (sd.at(name).numel() > 0) want_nonempty.push_back(name);
  CHECK(nonempty == want_nonempty);
}

TEST_CASE("save_safetensors is atomic and cleans up after failures", "[io]") {
  TempDir tmp;
  const StateDict sd = sample_dict();

  SECTION("a missing directory throws naming the path and creates nothing") {
    const std::string path = tmp.path("no/such/dir/model.safetensors");
    REQUIRE_TG_ERROR(save_safetensors(path, sd), "save_safetensors", path.c_str());
    CHECK_FALSE(fs::exists(tmp.dir / "no"));
    CHECK(fs::is_empty(tmp.dir));
  }
  // The names in tmp.dir, sorted.
  const auto names = [&] {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(tmp.dir)) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    return files;
  };
  SECTION("a failing rename (target is a directory) removes the temp file") {
    const std::string path = tmp.path("taken");
    fs::create_directory(path);
    REQUIRE_TG_ERROR(save_safetensors(path, sd), "save_safetensors", path.c_str(), "rename");
    CHECK(names() == std::vector<std::string>{"taken"});
    CHECK(fs::is_directory(path));
  }
  SECTION("overwriting replaces the file, leaves no temp file of its own, and another's alone") {
    const std::string path = tmp.path("model.safetensors");
    write_bytes(path, "old contents");
    write_bytes(path + ".tmp", "a temp file of another program");
    save_safetensors(path, sd);
    CHECK(read_bytes(path) == to_safetensors_bytes(sd));
    CHECK(read_bytes(path + ".tmp") == "a temp file of another program");
    CHECK(names() == std::vector<std::string>{"model.safetensors", "model.safetensors.tmp"});
  }
  SECTION("two processes saving one path at once each rename a whole file of their own") {
    // With one temporary name for both, one truncates and rewrites the file the other is writing
    // or has just renamed, and the result is torn.
    const std::string path = tmp.path("model.safetensors");
    StateDict big[2];
    big[0].insert("w", full({1 << 18}, 1.0f));
    big[1].insert("w", full({1 << 18}, 2.0f));
    big[1].insert("b", full({3}, 5.0f));
    pid_t pids[2];
    for (int who = 0; who < 2; ++who) {
      std::cout.flush();
      pids[who] = ::fork();
      if (pids[who] == 0) {
        int code = 0;
        for (int i = 0; i < 40; ++i) try {
            save_safetensors(path, big[who]);
          } catch (...) {
            code = 1;
          }
        ::_exit(code);
      }
    }
    for (pid_t pid : pids) {
      int st = 0;
      REQUIRE(::waitpid(pid, &st, 0) == pid);
      CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
    }
    const std::string bytes = read_bytes(path);
    CHECK((bytes == to_safetensors_bytes(big[0]) || bytes == to_safetensors_bytes(big[1])));
    CHECK(names() == std::vector<std::string>{"model.safetensors"});
  }
  SECTION("a file replaced keeps its permission bits") {
    const std::string path = tmp.path("private.safetensors");
    write_bytes(path, "old");
    fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
    save_safetensors(path, sd);
    CHECK(fs::status(path).permissions() == (fs::perms::owner_read | fs::perms::owner_write));
    CHECK(read_bytes(path) == to_safetensors_bytes(sd));
  }
  SECTION("temporary names that a killed process of the same pid left are passed over, and kept") {
    const std::string path = tmp.path("model.safetensors");
    // The next names this process would take: "<path>.<pid>.<n>.tmp" for the counts after this one.
    const std::string one = tg::detail::atomic_temp_name(path);
    const std::string stem = one.substr(0, one.rfind('.', one.size() - 5) + 1);
    const long n = std::stol(one.substr(stem.size()));
    std::vector<std::string> left;
    for (long k = n + 1; k <= n + 5; ++k) {
      left.push_back(stem + std::to_string(k) + ".tmp");
      write_bytes(left.back(), "a killed writer's");
    }
    save_safetensors(path, sd);
    CHECK(read_bytes(path) == to_safetensors_bytes(sd));
    for (const std::string& f : left) CHECK(read_bytes(f) == "a killed writer's");
    CHECK(names().size() == 6);
  }
  SECTION("a file name as long as the directory takes still has a temporary file beside it") {
    // NAME_MAX (255 bytes on most file systems): "<name>.<pid>.<n>.tmp" would pass it, so the
    // temporary name cuts the file name, at a UTF-8 character's start.
    const long most = ::pathconf(tmp.dir.c_str(), _PC_NAME_MAX);
    REQUIRE(most > 20);
    const std::string name = std::string(static_cast<std::size_t>(most) - 12, 'm') + ".safetensors";
    save_safetensors(tmp.path(name), sd);
    CHECK(read_bytes(tmp.path(name)) == to_safetensors_bytes(sd));
    CHECK(names() == std::vector<std::string>{name});
    // A name of two-byte characters: the cut falls inside one character or between two, by the
    // suffix's length (the pid's digits), so once with a one-byte prefix and once without.
    for (const std::string prefix : {"", "p"}) {
      std::string wide = prefix;  // "\u00e9" is two bytes: 0xC3 0xA9
      while (wide.size() + 2 <= static_cast<std::size_t>(most)) wide += "\u00e9";
      const std::string t = tg::detail::atomic_temp_name(tmp.path(wide));
      const std::string base = t.substr(t.rfind('/') + 1);
      const std::string kept = base.substr(0, base.find('.'));
      INFO("prefix '" << prefix << "', " << base.size() << " bytes, kept " << kept.size());
      CHECK(base.size() <= static_cast<std::size_t>(most));
      CHECK(base.size() + 1 >= static_cast<std::size_t>(most));  // at most one byte short: half a character
      CHECK((kept.size() - prefix.size()) % 2 == 0);                // whole characters only
      CHECK(wide.compare(0, kept.size(), kept) == 0);
      save_safetensors(tmp.path(wide), sd);
      CHECK(read_bytes(tmp.path(wide)) == to_safetensors_bytes(sd));
    }
    CHECK(names().size() == 3);
  }
  SECTION("write_file_atomic writes any bytes the same way") {
    const std::string path = tmp.path("notes.txt");
    write_file_atomic(path, "first");
    write_file_atomic(path, std::string("se\0cond", 7));
    CHECK(read_bytes(path) == std::string("se\0cond", 7));
    CHECK(names() == std::vector<std::string>{"notes.txt"});
    REQUIRE_TG_ERROR(write_file_atomic(tmp.path("no/such/dir/x"), "x"), "write_file_atomic", "no/such/dir/x");
  }
  SECTION("bad names and undefined tensors are refused before anything is written") {
    const std::string path = tmp.path("x.safetensors");
    StateDict empty_name;
    empty_name.insert("", zeros({1}));
    REQUIRE_TG_ERROR(save_safetensors(path, empty_name), "save_safetensors", path.c_str(), "empty");
    REQUIRE_TG_ERROR(to_safetensors_bytes(empty_name), "to_safetensors_bytes", "empty");
    StateDict reserved;
    reserved.insert("__metadata__", zeros({1}));
    REQUIRE_TG_ERROR(save_safetensors(path, reserved), "save_safetensors", "__metadata__");
    REQUIRE_TG_ERROR(to_safetensors_bytes(reserved), "to_safetensors_bytes", "__metadata__");
    StateDict undefined;
    undefined.insert("w", Tensor());
    REQUIRE_TG_ERROR(save_safetensors(path, undefined), "save_safetensors", "'w'", "undefined");
    StateDict bad_utf8;
    bad_utf8.insert("w\xff", zeros({1}));
    REQUIRE_TG_ERROR(save_safetensors(path, bad_utf8), "save_safetensors", "UTF-8");
    CHECK(fs::is_empty(tmp.dir));
  }
}

TEST_CASE("load_safetensors reports unreadable paths", "[io]") {
  TempDir tmp;
  REQUIRE_TG_ERROR(load_safetensors(tmp.path("missing.safetensors")), "load_safetensors: ", "missing.safetensors",
                   "cannot open");
  REQUIRE_TG_ERROR(load_safetensors(tmp.dir.string()), "load_safetensors: ", "not a regular file");
}

TEST_CASE("every truncation of a valid file is rejected", "[io]") {
  const std::string good = to_safetensors_bytes(sample_dict(), {{"k", "v"}});
  REQUIRE_NOTHROW(from_safetensors_bytes(good));
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    INFO("cut at " << cut << " of " << good.size());
    REQUIRE_TG_ERROR(from_safetensors_bytes(good.substr(0, cut)), "load_safetensors: ");
  }
  require_bad(good.substr(0, 5), {"shorter than the 8-byte"});
  require_bad("", {"shorter than the 8-byte"});
  // Cut inside the header, and inside the data block.
  require_bad(good.substr(0, 40), {"header length", "exceeds"});
  require_bad(good.substr(0, good.size() - 1), {"outside the data block"});
}

TEST_CASE("header length is checked against the limit and the file size", "[io]") {
  const std::string body = R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  const std::string data = le_bytes<float>({1.5f});
  require_bad(u64_le(std::uint64_t(1) << 63) + body + data, {"header length 9223372036854775808", "limit"});
  require_bad(u64_le(~std::uint64_t(0)) + body + data, {"header length", "limit"});
  require_bad(u64_le(kMaxSafetensorsHeader + 1) + body + data, {"limit of 100000000"});
  require_bad(u64_le(1000) + body + data, {"header length 1000", "exceeds"});
  require_bad(u64_le(body.size() + data.size() + 1) + body + data, {"exceeds"});
  // Sanity: the same pieces with the right length load.
  CHECK(from_safetensors_bytes(craft(body, data)).at("a").item() == 1.5);
}

TEST_CASE("malformed JSON headers are rejected", "[io]") {
  require_bad(craft(R"({"a":{"dtype":"F32",)"), {"not valid JSON"});
  require_bad(craft("not json at all"), {"not valid JSON"});
  require_bad(craft(""), {"not valid JSON"});
  require_bad(craft(R"({} trailing)"), {"not valid JSON"});
  require_bad(craft("{\"a\xff\":{}}"), {"not valid JSON"});  // invalid UTF-8
  require_bad(craft(R"([1,2,3])"), {"not a JSON object"});
  require_bad(craft(R"("str")"), {"not a JSON object"});
  require_bad(craft(std::string(100, '[') + std::string(100, ']')), {"nested"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                    R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
                    le_bytes<float>({1.0f})),
              {"duplicate key 'a'"});
}

TEST_CASE("malformed tensor entries are rejected", "[io]") {
  const std::string f2 = le_bytes<float>({1.0f, 2.0f});
  require_bad(craft(R"({"a":5})", f2), {"tensor 'a'", "not an object"});
  require_bad(craft(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f2), {"'a'", "missing \"dtype\""});
  require_bad(craft(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", f2), {"missing \"shape\""});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2]}})", f2), {"missing \"data_offsets\""});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", f2),
              {"unknown key 'extra'"});
  // dtypes
  require_bad(craft(R"({"a":{"dtype":"U16","shape":[4],"data_offsets":[0,8]}})", f2), {"U16 is not supported"});
  require_bad(craft(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", f2), {"span 8 bytes", "BF16", "need 4"});
  require_bad(craft(R"({"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})", f2), {"F16 is not supported"});
  require_bad(craft(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", f2), {"unknown dtype 'Q7'"});
  require_bad(craft(R"({"a":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", f2), {"dtype", "not a string"});
  // shapes
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f2),
              {"shape", "non-negative integers", "negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f2), {"non-negative integers"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", f2), {"non-negative integers"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", f2), {"shape", "not an array"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}})", f2),
              {"9 dims", "at most 8"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})", f2),
              {"non-negative integers"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", f2),
              {"overflow"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})", f2),
              {"overflow"});
  require_bad(craft(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})", f2),
              {"overflow"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", f2),
              {"overflow"});
  // data_offsets
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", f2),
              {"data_offsets must be two non-negative integers"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", f2), {"two non-negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", f2), {"two non-negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})", f2), {"two non-negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":{"b":0}}})", f2), {"two non-negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f2), {"end before"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f2),
              {"span 8 bytes", "need 12"});
  require_bad(craft(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", f2), {"span 8 bytes", "need 16"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,8]}})", f2), {"span 8", "need 4"});
}

TEST_CASE("offsets outside the data block, overlaps and gaps are rejected", "[io]") {
  const std::string f3 = le_bytes<float>({1.0f, 2.0f, 3.0f});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f3),
              {"'a'", "outside the data block of 12 bytes"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551616]}})",
                    f3),
              {"two non-negative"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,18446744073709551615]}})",
                    f3),
              {"outside the data block"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                    f3),
              {"overlap"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                    f3),
              {"overlap"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                    f3),
              {"overlap"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                    R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                    f3),
              {"gap", "[4, 8)", "'b'"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", f3), {"gap", "[0, 4)"});
  require_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f3), {"gap", "cover 8 of its 12"});
  require_bad(craft(R"({})", f3), {"gap", "cover 0 of its 12"});

  // Entries listed out of data order are fine; the loaded order follows the offsets.
  const StateDict sd = from_safetensors_bytes(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
                                                    R"("m":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},)"
                                                    R"("z":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                                    f3));
  std::vector<std::string> order;
  for (const auto& [name, t] : sd) order.push_back(name);
  CHECK(order == std::vector<std::string>{"z", "m", "a"});
  CHECK(sd.at("z").to_vector<double>() == std::vector<double>{1.0, 2.0});
  CHECK(sd.at("a").item() == 3.0);
  CHECK(sd.at("m").numel() == 0);
}

TEST_CASE("__metadata__ must be an object of strings", "[io]") {
  const std::string f1 = le_bytes<float>({1.0f});
  const std::string t = R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,4]})";
  require_bad(craft(R"({"__metadata__":{"k":"v","n":3},)" + t + "}", f1), {"__metadata__", "'n'", "not a string"});
  require_bad(craft(R"({"__metadata__":{"k":{"x":"y"}},)" + t + "}", f1), {"__metadata__", "not a string"});
  require_bad(craft(R"({"__metadata__":["k","v"],)" + t + "}", f1), {"__metadata__", "not an object"});
  require_bad(craft(R"({"__metadata__":"k",)" + t + "}", f1), {"__metadata__", "not an object"});
  Metadata md;
  const StateDict sd = from_safetensors_bytes(craft(R"({"__metadata__":{"k":"v","e":""},)" + t + "}", f1), &md);
  CHECK(md == Metadata{{"k", "v"}, {"e", ""}});
  CHECK(sd.size() == 1);
}

TEST_CASE("random byte flips of a valid file load or raise tg::Error, never crash", "[io]") {
  const std::string good = to_safetensors_bytes(sample_dict(), {{"format", "pt"}, {"epoch", "3"}});
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<std::uint64_t>(static_cast<unsigned char>(good[i])) << (8 * i);
  std::mt19937_64 rng(20240607);
  std::uniform_int_distribution<std::size_t> any_pos(0, good.size() - 1);
  std::uniform_int_distribution<std::size_t> header_pos(0, 8 + header_len - 1);
  std::uniform_int_distribution<int> byte(0, 255), nflips(1, 4), coin(0, 3);
  // Characters that keep JSON plausible, so that mutations reach the validation past the parser.
  const std::string jsonish = "0123456789-[]{},:\" .eE";
  std::uniform_int_distribution<std::size_t> pick(0, jsonish.size() - 1);
  int ok = 0, rejected = 0;
  TempDir tmp;
  const std::string path = tmp.path("fuzz.safetensors");
  for (int iter = 0; iter < 2000; ++iter) {
    std::string m = good;
    const int k = nflips(rng);
    for (int f = 0; f < k; ++f) {
      const int c = coin(rng);
      const std::size_t pos = c == 0 ? any_pos(rng) : header_pos(rng);
      m[pos] = static_cast<char>(c == 3 ? jsonish[pick(rng)] : byte(rng));
    }
    if (iter % 7 == 0) m.resize(any_pos(rng));  // sometimes truncated too
    INFO("iteration " << iter);
    const bool via_file = iter % 10 == 0;
    try {
      StateDict sd;
      if (via_file) {
        write_bytes(path, m);
        sd = load_safetensors(path);
      } else {
        sd = from_safetensors_bytes(m);
      }
      // A file that loads must be consistent: its tensors cover the data block exactly.
      std::uint64_t n = 0;
      for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(m[i])) << (8 * i);
      std::uint64_t covered = 0;
      for (const auto& [name, t] : sd) covered += t.nbytes();
      CHECK(covered == m.size() - 8 - n);
      ++ok;
    } catch (const Error& e) {
      const std::string msg = e.what();
      CHECK(msg.rfind("load_safetensors: ", 0) == 0);
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("unexpected exception type: " << e.what());
    } catch (...) {
      FAIL("unexpected non-std exception");
    }
  }
  CHECK(ok + rejected == 2000);
  // Both outcomes occur: flips in the data block load, most header damage is caught.
  CHECK(ok > 0);
  CHECK(rejected > 0);
}
