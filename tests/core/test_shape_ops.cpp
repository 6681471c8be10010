// Shape ops: reshape, transpose, permute, slice, cat, split, to, clone. Values by hand in float32
// and float64 (and int32, which shape ops accept), float64 gradchecks, errors.
#include <limits>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {

constexpr DType kAllTypes[] = {float32, float64, int32};

// Exact comparison: shape ops only move values.
void check_values(const Tensor& y, const std::vector<double>& expected) {
  REQUIRE(y.numel() == static_cast<std::int64_t>(expected.size()));
  CHECK(y.to_vector<double>() == expected);
}

std::vector<double> iota(std::int64_t n, double start = 0) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = start + static_cast<double>(i);
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// reshape
// ---------------------------------------------------------------------------------------------

TEST_CASE("reshape: -1 inference, same element order, shared storage") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(iota(24), {2, 3, 4}, dt);
    Tensor y = reshape(x, {6, -1});
    CHECK(y.shape() == Shape{6, 4});
    CHECK(y.dtype() == dt);
    check_values(y, iota(24));
    CHECK(y.shares_storage(x));
    CHECK(reshape(x, {-1}).shape() == Shape{24});
    CHECK(reshape(x, {2, -1, 3}).shape() == Shape{2, 4, 3});
    CHECK(reshape(x, {-1, 1, 2}).shape() == Shape{12, 1, 2});
    CHECK(x.reshape({4, 6}).shape() == Shape{4, 6});
    CHECK(x.view({3, 8}).shape() == Shape{3, 8});
    CHECK(y.at({5, 3}) == 23.0);
    // writes through the view are visible in the original (storage is shared)
    y.set({1, 0}, 100);
    CHECK(x.at({0, 1, 0}) == 100.0);
  }
  // to and from 0-d; empty tensors
  Tensor s = reshape(tensor({5}, {1}), Shape{});
  CHECK(s.dim() == 0);
  CHECK(s.item() == 5.0);
  CHECK(reshape(s, {-1}).shape() == Shape{1});
  CHECK(reshape(zeros({0, 3}), {3, -1}).shape() == Shape{3, 0});
}

TEST_CASE("reshape gradcheck and gradient by hand") {
  Tensor x = param64({2, 3, 4}, 1);
  require_gradcheck([](const std::vector<Tensor>& in) { return reshape(in[0], {4, -1}); }, {x});
  // reshape, then broadcast against a (6,) row: the gradient lands in the original layout
  require_gradcheck([](const std::vector<Tensor>& in) { return mul(reshape(in[0], {4, 6}), in[1]); },
                    {x, param64({6}, 2)});
  Tensor a = leaf64(iota(6), {2, 3});
  reshape(a, {3, 2}).backward(tensor({1, 2, 3, 4, 5, 6}, {3, 2}, float64));
  REQUIRE(a.grad().shape() == Shape{2, 3});
  check_values(a.grad(), {1, 2, 3, 4, 5, 6});
}

TEST_CASE("reshape errors") {
  Tensor x = zeros({2, 3, 4});
  REQUIRE_TG_ERROR(reshape(x, {-1, -1}), "reshape:", "only one dimension can be -1", "(-1, -1)");
  REQUIRE_TG_ERROR(reshape(x, {5, 5}), "reshape:", "(2, 3, 4)", "(5, 5)");
  REQUIRE_TG_ERROR(reshape(x, {-1, 5}), "reshape:", "(2, 3, 4)", "(-1, 5)");
  REQUIRE_TG_ERROR(reshape(x, {-2, 12}), "reshape:", "invalid dimension -2", "(-2, 12)");
  REQUIRE_TG_ERROR(x.view({25}), "reshape:", "(2, 3, 4)", "(25,)");
  REQUIRE_TG_ERROR(reshape(Tensor(), {1}), "reshape:", "undefined");
}

// ---------------------------------------------------------------------------------------------
// transpose / permute
// ---------------------------------------------------------------------------------------------

TEST_CASE("transpose swaps two dims (a copy)") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(iota(24), {2, 3, 4}, dt);
    Tensor y = transpose(x, 0, 2);
    REQUIRE(y.shape() == Shape{4, 3, 2});
    CHECK(y.dtype() == dt);
    CHECK_FALSE(y.shares_storage(x));
    for (std::int64_t i = 0; i < 2; ++i)
      for (std::int64_t j = 0; j < 3; ++j)
        for (std::int64_t k = 0; k < 4; ++k) CHECK(y.at({k, j, i}) == x.at({i, j, k}));
    Tensor z = transpose(x, -1, -2);
    REQUIRE(z.shape() == Shape{2, 4, 3});
    check_values(z.slice(0, 0, 1), {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
    check_values(x.transpose(2, 1), z.to_vector<double>());
    check_values(transpose(x, 1, 1), iota(24));  // same dim: identity
    // 2-d by hand
    check_values(transpose(tensor({1, 2, 3, 4, 5, 6}, {2, 3}, dt), 0, 1), {1, 4, 2, 5, 3, 6});
  }
}

TEST_CASE("permute reorders dims (a copy)") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(iota(24), {2, 3, 4}, dt);
    Tensor y = permute(x, {2, 0, 1});
    REQUIRE(y.shape() == Shape{4, 2, 3});
    CHECK(y.dtype() == dt);
    for (std::int64_t i = 0; i < 2; ++i)
      for (std::int64_t j = 0; j < 3; ++j)
        for (std::int64_t k = 0; k < 4; ++k) CHECK(y.at({k, i, j}) == x.at({i, j, k}));
    // negative dims name the same permutation
    check_values(permute(x, {-1, 0, -2}), y.to_vector<double>());
    check_values(x.permute({2, 0, 1}), y.to_vector<double>());
    // identity, and a permutation followed by its inverse
    check_values(permute(x, {0, 1, 2}), iota(24));
    check_values(permute(y, {1, 2, 0}), iota(24));
    CHECK(permute(y, {1, 2, 0}).shape() == Shape{2, 3, 4});
  }
  Tensor x4 = tensor(iota(120), {2, 3, 4, 5}, float64);
  Tensor y4 = permute(x4, {3, 1, 0, 2});
  REQUIRE(y4.shape() == Shape{5, 3, 2, 4});
  CHECK(y4.at({4, 2, 1, 3}) == x4.at({1, 2, 3, 4}));
  CHECK(y4.at({1, 0, 1, 2}) == x4.at({1, 0, 2, 1}));
}

TEST_CASE("transpose and permute gradcheck") {
  Tensor x = param64({2, 3, 4}, 3);
  require_gradcheck([](const std::vector<Tensor>& in) { return transpose(in[0], 0, 2); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return transpose(in[0], -1, -2); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return permute(in[0], {2, 0, 1}); }, {x});
  Tensor x4 = param64({2, 3, 2, 3}, 4);
  require_gradcheck([](const std::vector<Tensor>& in) { return permute(in[0], {3, 1, 0, 2}); }, {x4});
  // by hand: the upstream gradient is permuted back
  Tensor a = leaf64(iota(6), {2, 3});
  transpose(a, 0, 1).backward(tensor({1, 2, 3, 4, 5, 6}, {3, 2}, float64));
  check_values(a.grad(), {1, 3, 5, 2, 4, 6});
}

TEST_CASE("transpose and permute errors") {
  Tensor x = zeros({2, 3, 4});
  REQUIRE_TG_ERROR(transpose(x, 0, 3), "transpose:", "axis 3", "(2, 3, 4)");
  REQUIRE_TG_ERROR(transpose(x, -4, 0), "transpose:", "axis -4", "(2, 3, 4)");
  REQUIRE_TG_ERROR(permute(x, {0, 1}), "permute:", "2 dims", "(2, 3, 4)");
  REQUIRE_TG_ERROR(permute(x, {0, 1, 2, 3}), "permute:", "4 dims", "(2, 3, 4)");
  REQUIRE_TG_ERROR(permute(x, {0, 0, 1}), "permute:", "repeated", "(2, 3, 4)");
  REQUIRE_TG_ERROR(permute(x, {0, -3, 1}), "permute:", "repeated", "(2, 3, 4)");
  REQUIRE_TG_ERROR(permute(x, {0, 1, 3}), "permute:", "axis 3", "(2, 3, 4)");
  REQUIRE_TG_ERROR(transpose(Tensor(), 0, 1), "transpose:", "undefined");
}

// ---------------------------------------------------------------------------------------------
// slice
// ---------------------------------------------------------------------------------------------

TEST_CASE("slice: negative indices, clamping, step, empty results") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(iota(10), {10}, dt);
    check_values(slice(x, 0, 2, 5), {2, 3, 4});
    check_values(slice(x, 0, -3, 10), {7, 8, 9});             // negative start
    check_values(slice(x, 0, 3, -3), {3, 4, 5, 6});           // negative end
    check_values(slice(x, -1, -4, -1), {6, 7, 8});            // negative dim too
    check_values(slice(x, 0, -100, 3), {0, 1, 2});            // start clamped to 0
    check_values(slice(x, 0, 8, 100), {8, 9});                // end clamped to n
    check_values(slice(x, 0, -100, 100), iota(10));
    check_values(slice(x, 0, 1, 10, 3), {1, 4, 7});           // step 3
    check_values(slice(x, 0, 0, 10, 4), {0, 4, 8});
    check_values(slice(x, 0, 0, 9, 4), {0, 4, 8});
    check_values(slice(x, 0, 0, 8, 4), {0, 4});
    check_values(slice(x, 0, 2, 100, 20), {2});               // step beyond the end
    check_values(slice(x, 0, -9, -1, 2), {1, 3, 5, 7});
    check_values(x.slice(0, 4, 6), {4, 5});
    const std::vector<std::pair<std::int64_t, std::int64_t>> empties = {{5, 2}, {5, 5}, {10, 20}, {-1, -5}, {-100, -50}};
    for (auto [s, e] : empties) {
      INFO("empty slice " << s << ":" << e);
      Tensor y = slice(x, 0, s, e);
      CHECK(y.shape() == Shape{0});
      CHECK(y.dtype() == dt);
    }
    // along dim 1 of a 2-d tensor, with a step
    Tensor m = tensor(iota(12), {3, 4}, dt);
    Tensor c = slice(m, 1, 1, 4, 2);
    REQUIRE(c.shape() == Shape{3, 2});
    check_values(c, {1, 3, 5, 7, 9, 11});
    Tensor r = slice(m, -2, 1, 3);
    REQUIRE(r.shape() == Shape{2, 4});
    check_values(r, {4, 5, 6, 7, 8, 9, 10, 11});
    CHECK(slice(m, 1, 3, 1).shape() == Shape{3, 0});
    CHECK_FALSE(c.shares_storage(m));
  }
}

TEST_CASE("slice gradcheck and gradient by hand") {
  Tensor x = param64({2, 5, 3}, 5);
  require_gradcheck([](const std::vector<Tensor>& in) { return slice(in[0], 1, 0, 5, 2); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return slice(in[0], -1, -2, 3); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return slice(in[0], 0, 1, 2); }, {x});
  // the gradient is zero outside the slice
  Tensor a = leaf64(iota(10), {10});
  slice(a, 0, 1, 8, 3).backward(tensor({1, 2, 3}, {3}, float64));
  check_values(a.grad(), {0, 1, 0, 0, 2, 0, 0, 3, 0, 0});
  a.zero_grad();
  // an empty slice sends back zeros
  sum(slice(a, 0, 5, 2)).backward();
  check_values(a.grad(), std::vector<double>(10, 0.0));
  a.zero_grad();
  // two overlapping slices accumulate
  sum(add(slice(a, 0, 0, 6), slice(a, 0, 4, 10))).backward();
  check_values(a.grad(), {1, 1, 1, 1, 2, 2, 1, 1, 1, 1});
}

TEST_CASE("slice errors") {
  Tensor x = zeros({2, 3, 4});
  REQUIRE_TG_ERROR(slice(x, 0, 0, 2, 0), "slice:", "step", "0");
  REQUIRE_TG_ERROR(slice(x, 0, 2, 0, -1), "slice:", "step", "-1");
  REQUIRE_TG_ERROR(slice(x, 3, 0, 1), "slice:", "axis 3", "(2, 3, 4)");
  REQUIRE_TG_ERROR(slice(x, -4, 0, 1), "slice:", "axis -4", "(2, 3, 4)");
  REQUIRE_TG_ERROR(slice(tensor({1}, Shape{}), 0, 0, 1), "slice:", "0-d");
}

// ---------------------------------------------------------------------------------------------
// cat
// ---------------------------------------------------------------------------------------------

TEST_CASE("cat joins several tensors along any dim") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor a = tensor({1, 2, 3, 4}, {2, 2}, dt);
    Tensor b = tensor({5, 6, 7, 8, 9, 10}, {2, 3}, dt);
    Tensor c = tensor({11, 12}, {2, 1}, dt);
    Tensor y = cat({a, b, c}, 1);
    REQUIRE(y.shape() == Shape{2, 6});
    CHECK(y.dtype() == dt);
    check_values(y, {1, 2, 5, 6, 7, 11, 3, 4, 8, 9, 10, 12});
    check_values(cat({a, b, c}, -1), y.to_vector<double>());
    // dim 0 (the default)
    Tensor d = tensor({1, 2, 3}, {1, 3}, dt);
    Tensor e = tensor({4, 5, 6, 7, 8, 9}, {2, 3}, dt);
    Tensor z = cat({d, e});
    REQUIRE(z.shape() == Shape{3, 3});
    check_values(z, iota(9, 1));
    // a middle dim of a 3-d tensor
    Tensor p = tensor({0, 1, 2, 10, 11, 12}, {2, 1, 3}, dt);
    Tensor q = tensor({3, 4, 5, 6, 7, 8, 13, 14, 15, 16, 17, 18}, {2, 2, 3}, dt);
    Tensor w = cat({p, q}, 1);
    REQUIRE(w.shape() == Shape{2, 3, 3});
    check_values(w, {0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18});
    // one tensor: a copy; an empty piece contributes nothing
    Tensor one = cat({a});
    check_values(one, {1, 2, 3, 4});
    CHECK_FALSE(one.shares_storage(a));
    check_values(cat({a, Tensor::empty({2, 0}, dt), c}, 1), {1, 2, 11, 3, 4, 12});
  }
}

TEST_CASE("cat gradcheck and gradient routing") {
  Tensor a = param64({2, 1, 3}, 6), b = param64({2, 2, 3}, 7), c = param64({2, 3, 3}, 8);
  require_gradcheck([](const std::vector<Tensor>& in) { return cat(in, 1); }, {a, b, c});
  require_gradcheck([](const std::vector<Tensor>& in) { return cat({in[0], in[0]}, -1); }, {a});
  Tensor d = param64({1, 2, 3}, 9);
  require_gradcheck([](const std::vector<Tensor>& in) { return cat({in[0], in[1]}, 0); }, {b, d});
  // a constant among the inputs
  Tensor k = ones({2, 2, 3}, float64);
  require_gradcheck([k](const std::vector<Tensor>& in) { return cat({in[0], k, in[1]}, 1); }, {a, c});
  // by hand: each input gets its own block of the upstream gradient; a repeated input gets both
  Tensor x = leaf64({1, 2}, {2, 1});
  Tensor y = leaf64({3, 4, 5, 6}, {2, 2});
  cat({x, y, x}, 1).backward(tensor(iota(8, 1), {2, 4}, float64));
  check_values(x.grad(), {1 + 4, 5 + 8});
  check_values(y.grad(), {2, 3, 6, 7});
}

TEST_CASE("cat errors") {
  Tensor a = zeros({2, 3});
  REQUIRE_TG_ERROR(cat({}), "cat:", "at least one");
  REQUIRE_TG_ERROR(cat({a, zeros({3, 3})}, 1), "cat:", "tensor 1", "(3, 3)", "(2, 3)");
  REQUIRE_TG_ERROR(cat({a, zeros({2, 4})}, 0), "cat:", "tensor 1", "(2, 4)", "(2, 3)");
  REQUIRE_TG_ERROR(cat({a, zeros({3})}, 0), "cat:", "tensor 1", "(3,)", "(2, 3)");
  REQUIRE_TG_ERROR(cat({a, a, zeros({2, 3}, float64)}), "cat:", "tensor 2", "float64", "float32");
  REQUIRE_TG_ERROR(cat({a, zeros({2, 3}, int32)}), "cat:", "int32", "float32");
  REQUIRE_TG_ERROR(cat({a, a}, 2), "cat:", "axis 2", "(2, 3)");
  REQUIRE_TG_ERROR(cat({a, Tensor()}), "cat:", "tensor 1", "undefined");
}

// ---------------------------------------------------------------------------------------------
// split
// ---------------------------------------------------------------------------------------------

TEST_CASE("split by split_size and by sizes") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(iota(7), {7}, dt);
    std::vector<Tensor> p = split(x, 3);
    REQUIRE(p.size() == 3);
    check_values(p[0], {0, 1, 2});
    check_values(p[1], {3, 4, 5});
    check_values(p[2], {6});  // the last piece is smaller
    CHECK(p[2].dtype() == dt);
    std::vector<Tensor> q = split(x, std::vector<std::int64_t>{2, 5});
    REQUIRE(q.size() == 2);
    check_values(q[0], {0, 1});
    check_values(q[1], {2, 3, 4, 5, 6});
    std::vector<Tensor> one = split(x, 10);
    REQUIRE(one.size() == 1);
    check_values(one[0], iota(7));
    std::vector<Tensor> z = split(x, std::vector<std::int64_t>{0, 7});
    REQUIRE(z.size() == 2);
    CHECK(z[0].shape() == Shape{0});
    check_values(z[1], iota(7));
    // along dim 1 (and -1) of a 2-d tensor
    Tensor m = tensor(iota(10), {2, 5}, dt);
    std::vector<Tensor> c = split(m, 2, 1);
    REQUIRE(c.size() == 3);
    CHECK(c[0].shape() == Shape{2, 2});
    CHECK(c[2].shape() == Shape{2, 1});
    check_values(c[0], {0, 1, 5, 6});
    check_values(c[1], {2, 3, 7, 8});
    check_values(c[2], {4, 9});
    std::vector<Tensor> c2 = split(m, std::vector<std::int64_t>{4, 1}, -1);
    check_values(c2[0], {0, 1, 2, 3, 5, 6, 7, 8});
    check_values(c2[1], {4, 9});
    // split then cat is the identity
    check_values(cat(c, 1), iota(10));
  }
}

TEST_CASE("split: the gradient flows through the pieces that are used") {
  Tensor x = leaf64(iota(12, 1), {2, 6});
  std::vector<Tensor> p = split(x, 2, 1);  // three (2, 2) pieces
  REQUIRE(p.size() == 3);
  sum(mul(p[0], p[2])).backward();  // the middle piece is unused
  // d/dp0 = p2, d/dp1 = 0, d/dp2 = p0
  check_values(x.grad(), {5, 6, 0, 0, 1, 2, 11, 12, 0, 0, 7, 8});
  Tensor y = param64({2, 6}, 10);
  require_gradcheck(
      [](const std::vector<Tensor>& in) {
        std::vector<Tensor> s = split(in[0], 2, 1);
        return mul(s[0], s[2]);
      },
      {y});
  require_gradcheck(
      [](const std::vector<Tensor>& in) {
        std::vector<Tensor> s = split(in[0], std::vector<std::int64_t>{1, 3, 2}, -1);
        return cat({s[2], s[0]}, 1);
      },
      {y});
  require_gradcheck([](const std::vector<Tensor>& in) { return split(in[0], 1, 0)[1]; }, {y});
}

TEST_CASE("split errors") {
  Tensor x = zeros({7});
  REQUIRE_TG_ERROR(split(x, std::vector<std::int64_t>{2, 4}), "split:", "sum to 6", "(7,)");
  REQUIRE_TG_ERROR(split(x, std::vector<std::int64_t>{2, 6}), "split:", "sum to 8", "(7,)");
  REQUIRE_TG_ERROR(split(x, std::vector<std::int64_t>{-1, 8}), "split:", "negative size -1");
  REQUIRE_TG_ERROR(split(x, 0), "split:", "split_size", "0");
  REQUIRE_TG_ERROR(split(x, 2, 1), "split:", "axis 1", "(7,)");
  REQUIRE_TG_ERROR(split(x, std::vector<std::int64_t>{7}, -2), "split:", "axis -2", "(7,)");
}

// ---------------------------------------------------------------------------------------------
// to / clone
// ---------------------------------------------------------------------------------------------

TEST_CASE("to converts between dtypes") {
  Tensor x64 = tensor({0.1, -2.5, 1e10, 3}, {2, 2}, float64);
  Tensor x32 = to(x64, float32);
  CHECK(x32.dtype() == float32);
  CHECK(x32.shape() == Shape{2, 2});
  CHECK(x32.to_vector<float>() == std::vector<float>{0.1f, -2.5f, 1e10f, 3.0f});
  Tensor back = to(x32, float64);
  CHECK(back.dtype() == float64);
  CHECK(back.to_vector<double>() == std::vector<double>{static_cast<double>(0.1f), -2.5, static_cast<double>(1e10f), 3});
  CHECK(x64.to(float32).dtype() == float32);
  // to the same dtype: the same values
  check_values(to(x64, float64), x64.to_vector<double>());
  // int32 -> float
  Tensor i = from_vector<std::int32_t>({-3, 0, 7, 2147483647}, {4});
  check_values(to(i, float64), {-3, 0, 7, 2147483647});
  check_values(to(i, float32), {-3, 0, 7, static_cast<double>(2147483647.0f)});
  // float -> int32 truncates toward zero (as a C++ cast and PyTorch)
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor f = tensor({2.7, -2.7, 0, -0.5, 1e9}, {5}, dt);
    Tensor t = to(f, int32);
    CHECK(t.dtype() == int32);
    CHECK(t.to_vector<int>() == std::vector<int>{2, -2, 0, 0, 1000000000});
    // the ends of int32's range convert exactly
    CHECK(to(tensor({-2147483648.0}, {1}, dt), int32).to_vector<int>() ==
          std::vector<int>{std::numeric_limits<std::int32_t>::min()});
  }
  CHECK(to(tensor({2147483647.0, 2147483647.9}, {2}, float64), int32).to_vector<int>() ==
        std::vector<int>{2147483647, 2147483647});
  CHECK(to(tensor({-2147483648.9}, {1}, float64), int32).to_vector<int>() == std::vector<int>{-2147483647 - 1});
}

TEST_CASE("to int32 of a value with no int32 value throws") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    REQUIRE_TG_ERROR(to(tensor({1, nan}, {2}, dt), int32), "to:", "position 1", "(2,)", "int32");
    REQUIRE_TG_ERROR(to(tensor({inf}, {1}, dt), int32), "to:", "int32");
    REQUIRE_TG_ERROR(to(tensor({-inf}, {1}, dt), int32), "to:", "int32");
    REQUIRE_TG_ERROR(to(tensor({3e9}, {1}, dt), int32), "to:", "int32");
    REQUIRE_TG_ERROR(to(tensor({2147483648.0}, {1}, dt), int32), "to:", "int32");
  }
  REQUIRE_TG_ERROR(to(tensor({-2147483649.0}, {1}, float64), int32), "to:", "int32");
  REQUIRE_TG_ERROR(to(Tensor(), float32), "to:", "undefined");
}

TEST_CASE("to is differentiable between float32 and float64") {
  // float64 leaf through a float32 computation: the gradient comes back as float64
  Tensor x = leaf64({0.5, -1.25, 2}, {3});
  sum(mul(to(x, float32), 3.0)).backward();
  REQUIRE(x.grad().dtype() == float64);
  check_values(x.grad(), {3, 3, 3});
  // float32 leaf through a float64 computation
  Tensor y = tensor({1.5, -0.5}, {2}, float32);
  y.requires_grad_();
  Tensor y64 = to(y, float64);
  CHECK(y64.requires_grad());
  sum(mul(y64, y64)).backward();
  REQUIRE(y.grad().dtype() == float32);
  check_values(y.grad(), {3, -1});
  // gradcheck through a float32 round trip: the function is linear, so a large step is exact up to
  // float32 rounding of the output (~1e-7 / 2e-2)
  GradcheckOptions opt;
  opt.eps = 1e-2;
  opt.atol = 1e-4;
  require_gradcheck([](const std::vector<Tensor>& in) { return to(mul(to(in[0], float32), 2.5), float64); },
                    {param64({2, 3}, 11)}, opt);
  // float64 -> float64 keeps the graph
  require_gradcheck([](const std::vector<Tensor>& in) { return to(in[0], float64); }, {param64({3}, 12)});
  // to int32 is not differentiable: the result does not require grad
  Tensor z = param64({3}, 13);
  CHECK_FALSE(to(z, int32).requires_grad());
}

TEST_CASE("clone copies the data and is differentiable") {
  for (DType dt : kAllTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, dt);
    Tensor c = clone(x);
    CHECK(c.shape() == Shape{2, 3});
    CHECK(c.dtype() == dt);
    check_values(c, {1, 2, 3, 4, 5, 6});
    CHECK_FALSE(c.shares_storage(x));
    c.set({0, 0}, 42);
    CHECK(x.at({0, 0}) == 1.0);  // the original is untouched
    check_values(x.clone(), {1, 2, 3, 4, 5, 6});
  }
  require_gradcheck([](const std::vector<Tensor>& in) { return clone(in[0]); }, {param64({2, 3}, 14)});
  Tensor a = leaf64({1, 2}, {2});
  sum(mul(clone(a), a)).backward();  // d(a*a)/da through a clone on one side
  check_values(a.grad(), {2, 4});
  REQUIRE_TG_ERROR(clone(Tensor()), "clone:", "undefined");
}
