// The bfloat16 dtype: creation, element access, to() and its gradient (rounding as
// kernels::to_bf16), printing, copies, ops refusing it, safetensors "BF16" and load_state_dict.
#include <unistd.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "float_bits.h"
#include "helpers.h"
#include "kernels/bf16.h"

using namespace tg;
using namespace tgtest;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using tgtest::bits_of;
using tgtest::from_bits;
// The stored bits of a bfloat16 tensor.
std::vector<std::uint16_t> bf16_bits(const Tensor& t) {
  REQUIRE(t.dtype() == bfloat16);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(t.numel()));
  if (!out.empty()) std::memcpy(out.data(), t.raw_data(), out.size() * 2);
  return out;
}
Tensor bf16_from_bits(const std::vector<std::uint16_t>& bits, const Shape& shape) {
  Tensor t = Tensor::empty(shape, bfloat16);
  REQUIRE(t.nbytes() == bits.size() * 2);
  if (!bits.empty()) std::memcpy(t.raw_data(), bits.data(), bits.size() * 2);
  return t;
}
// The value a float32 has once stored as bfloat16 (kernels::to_bf16, the definition).
double rounded(float x) { return kernels::to_float(kernels::to_bf16(x)); }

// Floats whose rounding is worth checking: ties to even either way, just off ties, the carry into
// the exponent, the largest finite values (some round to infinity), subnormals, zeros, infinities
// and NaNs (quiet, signalling with the payload only in the lower half, negative).
std::vector<std::uint32_t> special_bits() {
  return {0x3F808000u,  // 1 + 2^-8: a tie, upper half even: stays 1
          0x3F818000u,  // 1 + 3 * 2^-8: a tie, upper half odd: up to 1 + 2^-6
          0x3F808001u, 0x3F807FFFu, 0x3F7FFFFFu,  // above and below a tie; 1 - 2^-24 carries to 1
          0x7F7F7FFFu, 0x7F7F8000u, 0x7F7FFFFFu,  // FLT_MAX region: stays finite, ties to inf, inf
          0xFF7F8000u, 0x00000001u, 0x00008000u, 0x00018000u, 0x807FFFFFu,  // subnormals
          0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u,               // zeros, infinities
          0x7FC00000u, 0x7F800001u, 0xFFC12345u, 0x7FA00000u};              // NaNs
}

}  // namespace

TEST_CASE("bfloat16 is a 2-byte storage dtype named as PyTorch names it", "[bf16_dtype]") {
  CHECK(itemsize(bfloat16) == 2);
  CHECK(std::string(dtype_name(bfloat16)) == "bfloat16");
  CHECK_FALSE(is_floating(bfloat16));  // no arithmetic: ops refuse it
  CHECK(is_storage_only(bfloat16));
  CHECK_FALSE(is_storage_only(float32));
  std::ostringstream s;
  s << bfloat16;
  CHECK(s.str() == "bfloat16");
}

TEST_CASE("bfloat16 tensors are created by every factory", "[bf16_dtype]") {
  const Tensor e = Tensor::empty({3, 5}, bfloat16);
  CHECK(e.dtype() == bfloat16);
  CHECK(e.nbytes() == 30);
  CHECK(bf16_bits(zeros({2, 3}, bfloat16)) == std::vector<std::uint16_t>(6, 0));
  CHECK(bf16_bits(ones({4}, bfloat16)) == std::vector<std::uint16_t>(4, 0x3F80));
  CHECK(bf16_bits(full({2}, -2.5, bfloat16)) == std::vector<std::uint16_t>(2, 0xC020));
  CHECK(bf16_bits(zeros_like(e)).size() == 15);
  // tensor(): each value rounded through float32 to bfloat16
  const std::vector<double> v = {0.1, -3.0, 1.0 + 1.0 / 256, 1e-40, 1e39, 257.0};
  const Tensor t = tensor(v, {2, 3}, bfloat16);
  CHECK(t.shape() == Shape{2, 3});
  const std::vector<double> got = t.to_vector<double>();
  for (std::size_t i = 0; i < v.size(); ++i) {
    INFO("value " << v[i]);
    CHECK(got[i] == rounded(static_cast<float>(v[i])));
  }
  CHECK(got[2] == 1.0);   // the tie goes to even
  CHECK(got[4] == kInf);  // beyond float32's range
  CHECK(got[5] == 256.0);
  CHECK(full({1}, -1e300, bfloat16).item() == -kInf);
  CHECK(bf16_bits(full({1}, 3.3961e38, bfloat16))[0] == 0x7F7F);  // the largest finite bfloat16
  CHECK(arange(4, bfloat16).to_vector<double>() == std::vector<double>{0, 1, 2, 3});
}

TEST_CASE("bfloat16 elements read through item, at, to_vector and write through set", "[bf16_dtype]") {
  Tensor t = bf16_from_bits({0x3F80, 0xC020, 0x7F80, 0x0001, 0x7FC0, 0x8000}, {2, 3});
  CHECK(t.at({0, 0}) == 1.0);
  CHECK(t.at({0, 1}) == -2.5);
  CHECK(t.at({0, -1}) == kInf);
  CHECK(t.at({1, 0}) == std::ldexp(1.0, -133));  // the smallest bfloat16 subnormal
  CHECK(std::isnan(t.at({1, 1})));
  CHECK(std::signbit(t.at({1, 2})));
  CHECK(t.to_vector<float>()[1] == -2.5f);
  CHECK(bf16_from_bits({0x3F80, 0xC020}, {2}).to_vector<std::int32_t>() == std::vector<std::int32_t>{1, -2});
  REQUIRE_TG_ERROR(t.to_vector<std::int32_t>(), "to_vector", "value inf at position 2");  // inf has no int32
  CHECK(bf16_from_bits({0x4049}, {}).item() == 3.140625);
  t.set({0, 0}, 0.1);  // rounds: 0.1f = 0x3DCCCCCD -> 0x3DCD
  CHECK(bf16_bits(t)[0] == 0x3DCD);
  REQUIRE_TG_ERROR(t.item(), "item", "one element");
  REQUIRE_TG_ERROR(t.data<float>(), "bfloat16", "float32");
}

TEST_CASE("to: float32 -> bfloat16 rounds as kernels::to_bf16, and back is exact", "[bf16_dtype]") {
  std::vector<std::uint32_t> bits = special_bits();
  // Enough random floats for the vectorised conversion's full blocks and a tail, a few of them
  // specials (one block holding a subnormal takes the definition's path).
  std::mt19937 g(7);
  for (int i = 0; i < 1037; ++i) bits.push_back(i % 97 == 0 ? special_bits()[static_cast<std::size_t>(i / 97)] : g());
  const std::int64_t n = static_cast<std::int64_t>(bits.size());
  Tensor x = Tensor::empty({n}, float32);
  for (std::int64_t i = 0; i < n; ++i) x.data<float>()[i] = from_bits(bits[static_cast<std::size_t>(i)]);
  const Tensor y = x.to(bfloat16);
  REQUIRE(y.dtype() == bfloat16);
  REQUIRE(y.shape() == x.shape());
  const std::vector<std::uint16_t> yb = bf16_bits(y);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t u = bits[static_cast<std::size_t>(i)];
    INFO("float bits 0x" << std::hex << u);
    CHECK(yb[static_cast<std::size_t>(i)] == kernels::to_bf16(from_bits(u)).bits);
  }
  // The hand-worked cases, independent of the kernel: ties to even, the overflow to infinity, NaN.
  CHECK(yb[0] == 0x3F80);
  CHECK(yb[1] == 0x3F82);
  CHECK(yb[4] == 0x3F80);
  CHECK(yb[5] == 0x7F7F);
  CHECK(yb[6] == 0x7F80);
  CHECK(yb[7] == 0x7F80);
  CHECK(yb[17] == 0x7FC0);
  CHECK(yb[18] == 0x7FC0);  // a signalling NaN whose payload is all in the lower half stays a NaN
  CHECK(yb[19] == 0xFFC1);
  CHECK(yb[20] == 0x7FE0);
  // bfloat16 -> float32 puts the bits in the upper half
  const Tensor z = y.to(float32);
  for (std::int64_t i = 0; i < n; ++i)
    CHECK(bits_of(z.data<float>()[i]) == static_cast<std::uint32_t>(yb[static_cast<std::size_t>(i)]) << 16);
  // every bfloat16 value survives a round trip through float32 and float64
  CHECK(bf16_bits(z.to(bfloat16)) == yb);
  CHECK(bf16_bits(y.to(float64).to(bfloat16)) == yb);
}

TEST_CASE("to: float64 and int32 <-> bfloat16 go through float32", "[bf16_dtype]") {
  const std::vector<double> v = {1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), -0.0, 1e300, -1e-320, 3.0};
  const Tensor x = tensor(v, {5}, float64);
  const std::vector<std::uint16_t> yb = bf16_bits(x.to(bfloat16));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    CHECK(yb[i] == kernels::to_bf16(f).bits);
  }
  // 1 + 2^-8 + 2^-30 rounds to 1 + 2^-8 in float32, a tie that float32 -> bfloat16 sends to 1
  // (PyTorch's cast through float32 does the same; a direct rounding would give 1 + 2^-7).
  CHECK(yb[0] == 0x3F80);
  CHECK(yb[1] == 0x8000);
  CHECK(yb[2] == 0x7F80);
  CHECK(bf16_from_bits({0x3F81}, {1}).to(float64).item() == 1.0 + 1.0 / 128);

  const Tensor ids = tensor({257, -3, 16777217, 0}, {4}, int32);
  CHECK(ids.to(bfloat16).to_vector<double>() == std::vector<double>{256, -3, 16777216, 0});
  // to int32 truncates toward zero; NaN, infinities and values beyond int32 are refused
  CHECK(tensor({2.75, -2.75, -1e9}, {3}, bfloat16).to(int32).to_vector<double>() ==
        std::vector<double>{2, -2, -998244352});
  REQUIRE_TG_ERROR(bf16_from_bits({0x3F80, 0x7FC0}, {2}).to(int32), "to", "does not fit int32", "position 1");
  REQUIRE_TG_ERROR(full({1}, 3e9, bfloat16).to(int32), "to", "does not fit int32");
  REQUIRE_TG_ERROR(full({1}, -kInf, bfloat16).to(int32), "to", "does not fit int32");
}

TEST_CASE("to(bfloat16) is differentiable: the gradient comes back in the input's dtype", "[bf16_dtype]") {
  Tensor x = tensor({0.3, -1.7, 2.0}, {3}, float32).requires_grad_();
  const Tensor y = x.to(bfloat16);
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  const Tensor w = tensor({1.0 + 1.0 / 512, -3.0, 0.1}, {3}, float32);
  const Tensor loss = sum(mul(y.to(float32), w));
  loss.backward();
  REQUIRE(x.grad().defined());
  CHECK(x.grad().dtype() == float32);
  // y's gradient is bfloat16: w rounded on its way to x
  const std::vector<double> g = x.grad().to_vector<double>();
  CHECK(g[0] == 1.0);  // 1 + 2^-9 has no bfloat16
  CHECK(g[1] == -3.0);
  CHECK(g[2] == rounded(0.1f));

  SECTION("two uses of a bfloat16 tensor add their gradients in bfloat16") {
    Tensor a = tensor({5.0}, {1}, float64).requires_grad_();
    const Tensor b = a.to(bfloat16);
    const Tensor l = add(sum(mul(b.to(float32), 1.0)), sum(mul(b.to(float32), 1.0 / 512)));
    l.backward();
    REQUIRE(a.grad().dtype() == float64);
    CHECK(a.grad().item() == 1.0);  // 1 + 2^-9 rounded to bfloat16; float32 would keep 1.001953125
  }
  SECTION("reshape and clone carry a bfloat16 gradient") {
    Tensor a = tensor({1, 2, 3, 4}, {4}, float32).requires_grad_();
    const Tensor b = a.to(bfloat16).reshape({2, 2}).clone();
    sum(mul(b.to(float32), 2.0)).backward();
    CHECK(a.grad().to_vector<double>() == std::vector<double>{2, 2, 2, 2});
  }
  SECTION("a bfloat16 leaf cannot require grad; permute, slice and cat refuse to record") {
    REQUIRE_TG_ERROR(zeros({2}, bfloat16).requires_grad_(), "requires_grad_", "bfloat16", "to()");
    Tensor a = ones({2, 3}, float32).requires_grad_();
    const Tensor b = a.to(bfloat16);
    REQUIRE_TG_ERROR(b.transpose(0, 1), "permute", "bfloat16", "to(float32)");
    REQUIRE_TG_ERROR(b.slice(1, 0, 2), "slice", "bfloat16", "to(float32)");
    REQUIRE_TG_ERROR(cat({b, b}, 0), "cat", "bfloat16", "to(float32)");
    NoGradGuard ng;
    CHECK(b.transpose(0, 1).shape() == Shape{3, 2});
  }
}

TEST_CASE("bfloat16 tensors print their values with dtype=bfloat16", "[bf16_dtype]") {
  std::ostringstream s;
  s << tensor({1.5, -2.0, 0.1}, {3}, bfloat16);
  CHECK(s.str() == "tensor([ 1.5000, -2.0000,  0.1001], shape=(3,), dtype=bfloat16)");
  std::ostringstream s2;
  s2 << bf16_from_bits({0x3F80, 0x7FC0, 0xFF80, 0x4000}, {2, 2});
  CHECK(s2.str() == "tensor([[  1.,  nan],\n        [-inf,   2.]], shape=(2, 2), dtype=bfloat16)");
}

TEST_CASE("bfloat16 tensors are copied by the data-movement ops, bit for bit", "[bf16_dtype]") {
  const std::vector<std::uint16_t> bits = {0x3F80, 0x7FA1, 0x8001, 0xC020, 0x7F80, 0x0000};
  const Tensor x = bf16_from_bits(bits, {2, 3});
  CHECK(bf16_bits(x.reshape({3, 2})) == bits);
  CHECK(bf16_bits(x.clone()) == bits);
  CHECK(bf16_bits(x.transpose(0, 1)) == std::vector<std::uint16_t>{0x3F80, 0xC020, 0x7FA1, 0x7F80, 0x8001, 0x0000});
  CHECK(bf16_bits(x.slice(1, 1, 3)) == std::vector<std::uint16_t>{0x7FA1, 0x8001, 0x7F80, 0x0000});
  const Tensor c = cat({x, x.slice(0, 0, 1)}, 0);
  CHECK(c.dtype() == bfloat16);
  CHECK(bf16_bits(c) == std::vector<std::uint16_t>{0x3F80, 0x7FA1, 0x8001, 0xC020, 0x7F80, 0x0000, 0x3F80, 0x7FA1, 0x8001});
  REQUIRE_TG_ERROR(cat({x, ones({1, 3})}, 0), "cat", "bfloat16", "float32");
}

TEST_CASE("ops refuse bfloat16, naming the op and to(float32)", "[bf16_dtype]") {
  const Tensor b = ones({2, 3}, bfloat16);
  const Tensor f = ones({2, 3}, float32);
  REQUIRE_TG_ERROR(add(b, b), "add", "bfloat16", "(2, 3)", "to(float32)");
  REQUIRE_TG_ERROR(add(f, b), "add", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(mul(b, 2.0), "mul", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(exp(b), "exp", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(matmul(b, ones({3, 2}, bfloat16)), "matmul", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(matmul(f, ones({3, 2}, bfloat16)), "matmul", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(sum(b), "sum", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(b.mean(), "mean", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(max(b), "max", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(rms_norm(b, Tensor(), Tensor()), "rms_norm", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(rms_norm(f, ones({3}, bfloat16), Tensor()), "rms_norm", "bfloat16");
  REQUIRE_TG_ERROR(layer_norm(b, Tensor(), Tensor()), "layer_norm", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(softmax(b), "softmax", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(embedding(b, zeros({1}, int32)), "embedding", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(cross_entropy(b, zeros({2}, int32)), "cross_entropy", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(causal_attention(ones({1, 2, 6}, bfloat16), 1), "causal_attention", "bfloat16");
  Tensor r = zeros({4}, bfloat16);
  REQUIRE_TG_ERROR(normal_(r, 0.0, 1.0), "normal_", "bfloat16", "to(float32)");
  REQUIRE_TG_ERROR(randn({2}, bfloat16), "randn", "bfloat16");
}

TEST_CASE("safetensors: BF16 round trips bit for bit, after I32 in the data block", "[bf16_dtype][io]") {
  const std::vector<std::uint16_t> bits = {0x3F80, 0x7FA1, 0x8001, 0xC020, 0xFF80, 0x0000};
  StateDict sd;
  sd.insert("h", bf16_from_bits(bits, {3, 2}));
  sd.insert("a", tensor({1, 2}, {2}, int32));
  sd.insert("z", tensor({1.5}, {1}, float32));
  const std::string bytes = to_safetensors_bytes(sd);
  // header order: F32, I32, then BF16 (the reference's dtype order descending)
  const std::size_t za = bytes.find("\"z\""), aa = bytes.find("\"a\""), ha = bytes.find("\"h\"");
  CHECK(za < aa);
  CHECK(aa < ha);
  CHECK(bytes.find(R"("h":{"dtype":"BF16","shape":[3,2],"data_offsets":[12,24]})") != std::string::npos);
  // the data block ends with the bits, little-endian
  const std::string tail = bytes.substr(bytes.size() - 12);
  for (std::size_t i = 0; i < bits.size(); ++i) {
    CHECK(static_cast<unsigned char>(tail[2 * i]) == (bits[i] & 0xFF));
    CHECK(static_cast<unsigned char>(tail[2 * i + 1]) == (bits[i] >> 8));
  }
  const StateDict back = from_safetensors_bytes(bytes);
  CHECK(back.at("h").dtype() == bfloat16);
  CHECK(back.at("h").shape() == Shape{3, 2});
  CHECK(bf16_bits(back.at("h")) == bits);

  const std::string path = (std::filesystem::temp_directory_path() /
                             ("tapegrad_bf16_dtype_" + std::to_string(::getpid()) + ".safetensors")).string();
  save_safetensors(path, sd);
  const StateDict file = load_safetensors(path);
  std::filesystem::remove(path);
  CHECK(bf16_bits(file.at("h")) == bits);
  CHECK(file.at("z").item() == 1.5);
}

TEST_CASE("safetensors: a crafted BF16 file reads, and a bad one is refused", "[bf16_dtype][io]") {
  auto craft = [](const std::string& json, const std::string& data) {
    std::string out;
    for (int b = 0; b < 8; ++b) out.push_back(static_cast<char>((json.size() >> (8 * b)) & 0xFF));
    return out + json + data;
  };
  // 1, -2.5, +inf, the smallest subnormal, little-endian
  const std::string data("\x80\x3F\x20\xC0\x80\x7F\x01\x00", 8);
  const StateDict sd = from_safetensors_bytes(craft(R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})", data));
  const Tensor& w = sd.at("w");
  REQUIRE(w.dtype() == bfloat16);
  CHECK(w.to_vector<double>() == std::vector<double>{1.0, -2.5, kInf, std::ldexp(1.0, -133)});
  CHECK(w.to(float32).to_vector<double>() == w.to_vector<double>());
  REQUIRE_TG_ERROR(from_safetensors_bytes(craft(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", data)),
                   "'w'", "span 8 bytes", "BF16", "need 6");
  REQUIRE_TG_ERROR(from_safetensors_bytes(craft(R"({"w":{"dtype":"BF16","shape":[5],"data_offsets":[0,10]}})", data)),
                   "outside the data block");
}

TEST_CASE("load_state_dict refuses a BF16 checkpoint tensor for a float32 parameter", "[bf16_dtype]") {
  nn::Linear lin(3, 2, false);
  StateDict sd;
  sd.insert("weight", zeros({2, 3}, bfloat16));
  REQUIRE_TG_ERROR(lin.load_state_dict(sd), "load_state_dict", "weight: checkpoint bfloat16 (2, 3), model float32 (2, 3)",
                   "to(float32)");
  StateDict converted;
  converted.insert("weight", sd.at("weight").to(float32));
  lin.load_state_dict(converted);
  CHECK(lin.state_dict().at("weight").to_vector<double>() == std::vector<double>(6, 0.0));
}
