// Neural-network ops: softmax, log_softmax, masked_fill, causal_mask, embedding, cross_entropy,
// dropout. Values by hand / std:: math in float32 and float64, float64 gradchecks, errors.
#include <algorithm>
#include <limits>
#include <sstream>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

namespace {

const double kInf = std::numeric_limits<double>::infinity();

Tensor ids(const std::vector<std::int32_t>& v, const Shape& shape) { return from_vector<std::int32_t>(v, shape); }

// Row-wise softmax of a row-major (rows, C) array in double, the textbook way.
std::vector<double> ref_softmax(const std::vector<double>& x, std::size_t C, bool log) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < x.size() / C; ++r) {
    double mx = -kInf;
    for (std::size_t c = 0; c < C; ++c) mx = std::max(mx, x[r * C + c]);
    double s = 0;
    for (std::size_t c = 0; c < C; ++c) s += std::exp(x[r * C + c] - mx);
    for (std::size_t c = 0; c < C; ++c)
      y[r * C + c] = log ? x[r * C + c] - mx - std::log(s) : std::exp(x[r * C + c] - mx) / s;
  }
  return y;
}

// Values on a 1/16 grid in [-4, 4], exact in float32.
std::vector<double> grid_values(std::int64_t n, std::uint64_t seed) {
  Generator g(seed);
  std::vector<double> v = randn({n}, float64, &g).to_vector<double>();
  for (double& x : v) x = std::round(std::clamp(x * 1.5, -4.0, 4.0) * 16) / 16;
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// softmax / log_softmax
// ---------------------------------------------------------------------------------------------

TEST_CASE("softmax and log_softmax: values against std:: math in float32 and float64") {
  const std::vector<double> xv = {1, 2, 3, 0, 0, 0, -1, 0.5, 4, -2.5, 7, 0.25};
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(xv, {2, 2, 3}, dt);
    Tensor s = softmax(x);
    Tensor ls = log_softmax(x);
    CHECK(s.shape() == Shape{2, 2, 3});
    CHECK(s.dtype() == dt);
    CHECK(ls.dtype() == dt);
    check_close(s, ref_softmax(xv, 3, false));
    check_close(ls, ref_softmax(xv, 3, true));
    // explicit last axis, positive or negative
    check_close(softmax(x, 2), ref_softmax(xv, 3, false));
    check_close(log_softmax(x, -1), ref_softmax(xv, 3, true));
    // uniform row: 1/3 each
    CHECK(s.at({0, 1, 0}) == Approx(1.0 / 3).epsilon(1e-6));
    // each row sums to 1
    check_close(sum(s, {-1}), {1, 1, 1, 1});
    // log_softmax = log(softmax)
    CHECK(max_abs_diff(ls, log(s)) < (dt == float32 ? 1e-5 : 1e-12));
    // 1-d input
    check_close(softmax(tensor({0, std::log(3.0)}, {2}, dt)), {0.25, 0.75});
  }
}

TEST_CASE("softmax and log_softmax are stable for large logits") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1000, 1000, 999, 1000, 0, -1000, -1000, -1000, -1000}, {3, 3}, dt);
    Tensor s = softmax(x);
    for (double v : s.to_vector<double>()) CHECK(std::isfinite(v));
    const double e1 = std::exp(-1.0);
    check_close(s, {1 / (2 + e1), 1 / (2 + e1), e1 / (2 + e1), 1, 0, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3});
    check_close(sum(s, {1}), {1, 1, 1});
    Tensor ls = log_softmax(x);
    for (double v : ls.to_vector<double>()) CHECK(std::isfinite(v));
    const double l = std::log(2 + e1);
    check_close(ls, {-l, -l, -1 - l, 0, -1000, -2000, -std::log(3.0), -std::log(3.0), -std::log(3.0)});
    // shifting every logit leaves the result unchanged
    Tensor base = tensor({0.5, -1, 2, 0.25}, {1, 4}, dt);
    CHECK(max_abs_diff(softmax(add(base, 1000.0)), softmax(base)) < (dt == float32 ? 1e-6 : 1e-12));
  }
  // The gradient at large logits is finite and correct.
  Tensor x = leaf64({1000, 999, 998, -1000, -999, -1001}, {2, 3});
  require_gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0]); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0]); }, {x});
}

TEST_CASE("softmax of a fully masked row is NaN (as PyTorch)") {
  Tensor x = tensor({-kInf, -kInf, 0, -kInf}, {2, 2}, float64);
  Tensor s = softmax(x);
  CHECK(std::isnan(s.at({0, 0})));
  CHECK(std::isnan(s.at({0, 1})));
  CHECK(s.at({1, 0}) == 1.0);
  CHECK(s.at({1, 1}) == 0.0);
}

TEST_CASE("softmax and log_softmax gradcheck") {
  Tensor x = param64({2, 3, 4}, 11, 2.0);
  require_gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0]); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0]); }, {x});
  require_gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0], 2); }, {x});
  Tensor v = param64({5}, 12);
  require_gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0], 0); }, {v});
  // The softmax gradient of sum(y) is 0 (rows always sum to 1).
  Tensor y = leaf64({0.3, -1, 2, 0.5, 0.5, 4}, {2, 3});
  sum(softmax(y)).backward();
  for (double g : y.grad().to_vector<double>()) CHECK(std::fabs(g) < 1e-15);
  y.zero_grad();
  // d sum(log_softmax(y)) / dy = 1 - C softmax(y)
  sum(log_softmax(y)).backward();
  const std::vector<double> sm = ref_softmax({0.3, -1, 2, 0.5, 0.5, 4}, 3, false);
  std::vector<double> want;
  for (double p : sm) want.push_back(1 - 3 * p);
  check_close(y.grad(), want);
}

TEST_CASE("softmax and log_softmax errors") {
  Tensor x = zeros({2, 3});
  REQUIRE_TG_ERROR(softmax(x, 0), "softmax:", "only the last axis", "(2, 3)");
  REQUIRE_TG_ERROR(log_softmax(x, -2), "log_softmax:", "only the last axis", "(2, 3)");
  REQUIRE_TG_ERROR(softmax(x, 2), "softmax:", "axis 2", "(2, 3)");
  REQUIRE_TG_ERROR(log_softmax(x, -3), "log_softmax:", "axis -3", "(2, 3)");
  REQUIRE_TG_ERROR(softmax(zeros({2, 3}, int32)), "softmax:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(log_softmax(zeros({2, 3}, int32)), "log_softmax:", "int32");
  REQUIRE_TG_ERROR(softmax(tensor({1}, Shape{})), "softmax:", "0-d");
  REQUIRE_TG_ERROR(log_softmax(tensor({1}, Shape{})), "log_softmax:", "0-d");
}

// ---------------------------------------------------------------------------------------------
// masked_fill / causal_mask
// ---------------------------------------------------------------------------------------------

TEST_CASE("causal_mask marks the future positions") {
  Tensor m = causal_mask(4);
  CHECK(m.dtype() == int32);
  CHECK(m.shape() == Shape{4, 4});
  CHECK(m.to_vector<int>() == std::vector<int>{0, 1, 1, 1,  //
                                               0, 0, 1, 1,  //
                                               0, 0, 0, 1,  //
                                               0, 0, 0, 0});
  CHECK(causal_mask(1).to_vector<int>() == std::vector<int>{0});
  CHECK(causal_mask(0).shape() == Shape{0, 0});
  REQUIRE_TG_ERROR(causal_mask(-1), "causal_mask:", "-1");
}

TEST_CASE("masked_fill with a causal mask broadcast over (B, H, T, T)") {
  const std::int64_t B = 2, H = 2, T = 3;
  const std::vector<double> xv = grid_values(B * H * T * T, 5);
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(xv, {B, H, T, T}, dt);
    Tensor y = masked_fill(x, causal_mask(T), -kInf);
    CHECK(y.shape() == x.shape());
    CHECK(y.dtype() == dt);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < T; ++i)
          for (std::int64_t j = 0; j < T; ++j) {
            INFO(b << "," << h << "," << i << "," << j);
            if (j > i) CHECK(y.at({b, h, i, j}) == -kInf);
            else CHECK(y.at({b, h, i, j}) == x.at({b, h, i, j}));
          }
    // attention weights: masked probabilities exactly 0, rows sum to 1, first row attends to itself only
    Tensor att = softmax(y);
    check_close(sum(att, {-1}), std::vector<double>(static_cast<std::size_t>(B * H * T), 1.0));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        CHECK(att.at({b, h, 0, 0}) == 1.0);
        for (std::int64_t i = 0; i < T; ++i)
          for (std::int64_t j = i + 1; j < T; ++j) CHECK(att.at({b, h, i, j}) == 0.0);
      }
    // a finite fill value
    Tensor z = masked_fill(x, causal_mask(T), 7.5);
    CHECK(z.at({1, 1, 0, 2}) == 7.5);
    CHECK(z.at({1, 1, 2, 0}) == x.at({1, 1, 2, 0}));
  }
}

TEST_CASE("masked_fill: the gradient is zero at masked places") {
  Tensor x = param64({2, 2, 3, 3}, 21);
  Tensor y = masked_fill(x, causal_mask(3), -1e9);
  y.backward(ones({2, 2, 3, 3}, float64));
  Tensor g = x.grad();
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 3; ++j) CHECK(g.at({b, h, i, j}) == (j > i ? 0.0 : 1.0));
  Tensor mask = causal_mask(3);
  // (a moderate fill value: outputs of -1e9 would swamp the finite differences of the weighted sum)
  require_gradcheck([mask](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, -3.0); }, {x});
  // through the softmax with -inf, as causal attention does
  require_gradcheck([mask](const std::vector<Tensor>& in) { return softmax(masked_fill(in[0], mask, -kInf)); }, {x});
}

TEST_CASE("masked_fill with other broadcastable masks") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, dt);
    check_close(masked_fill(x, ids({1, 0, 1}, {3}), 0), {0, 2, 0, 0, 5, 0});            // (C,)
    check_close(masked_fill(x, ids({0, 1}, {2, 1}), -1), {1, 2, 3, -1, -1, -1});        // (R, 1)
    check_close(masked_fill(x, ids({1}, Shape{}), 9), {9, 9, 9, 9, 9, 9});              // 0-d
    check_close(masked_fill(x, ids({0, 0, 0, 0, 0, 0}, {2, 3}), 9), {1, 2, 3, 4, 5, 6});  // nothing masked
    check_close(masked_fill(x, ids({0, 5, -2}, {1, 3}), 0), {1, 0, 0, 4, 0, 0});        // any non-zero masks
  }
  // a padding mask (B, 1, 1, T) over (B, H, T, T)
  Tensor att = param64({2, 2, 2, 3}, 22);
  Tensor pad = ids({0, 0, 1, 0, 1, 1}, {2, 1, 1, 3});
  require_gradcheck([pad](const std::vector<Tensor>& in) { return masked_fill(in[0], pad, 0.5); }, {att});
  Tensor y = masked_fill(att, pad, 0.5);
  CHECK(y.at({0, 1, 1, 2}) == 0.5);
  CHECK(y.at({0, 1, 1, 1}) == att.at({0, 1, 1, 1}));
  CHECK(y.at({1, 0, 0, 1}) == 0.5);
  CHECK(y.at({1, 0, 0, 0}) == att.at({1, 0, 0, 0}));
}

TEST_CASE("masked_fill errors") {
  Tensor x = zeros({2, 3, 3});
  REQUIRE_TG_ERROR(masked_fill(x, causal_mask(4), 0), "masked_fill:", "(4, 4)", "(2, 3, 3)");
  REQUIRE_TG_ERROR(masked_fill(x, ids({0, 1}, {2}), 0), "masked_fill:", "(2,)", "(2, 3, 3)");
  REQUIRE_TG_ERROR(masked_fill(zeros({3, 3}), zeros({1, 3, 3}, int32), 0), "masked_fill:", "(1, 3, 3)", "(3, 3)");
  REQUIRE_TG_ERROR(masked_fill(x, zeros({3, 3}), 0), "masked_fill:", "mask must be int32", "float32");
  REQUIRE_TG_ERROR(masked_fill(zeros({3, 3}, int32), causal_mask(3), 0), "masked_fill:", "int32", "(3, 3)");
  REQUIRE_TG_ERROR(masked_fill(x, Tensor(), 0), "masked_fill:", "mask", "undefined");
}

// ---------------------------------------------------------------------------------------------
// embedding
// ---------------------------------------------------------------------------------------------

TEST_CASE("embedding picks rows") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor w = tensor({0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42}, {5, 3}, dt);
    Tensor y = embedding(w, ids({0, 4, 2, 4}, {2, 2}));
    CHECK(y.shape() == Shape{2, 2, 3});
    CHECK(y.dtype() == dt);
    check_close(y, {0, 1, 2, 40, 41, 42, 20, 21, 22, 40, 41, 42});
    // 1-d ids, 0-d id, empty ids
    check_close(embedding(w, ids({3}, {1})), {30, 31, 32});
    Tensor y0 = embedding(w, ids({1}, Shape{}));
    CHECK(y0.shape() == Shape{3});
    check_close(y0, {10, 11, 12});
    CHECK(embedding(w, ids({}, {0})).shape() == Shape{0, 3});
  }
}

TEST_CASE("embedding: repeated ids accumulate their gradients") {
  Tensor w = param64({4, 2}, 31);
  Tensor id = ids({1, 3, 1, 1, 0, 3}, {2, 3});
  embedding(w, id).backward(tensor({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 3, 2}, float64));
  // row 0 <- position 4; row 1 <- positions 0, 2, 3; row 2 <- none; row 3 <- positions 1, 5
  check_close(w.grad(), {9, 10, 1 + 5 + 7, 2 + 6 + 8, 0, 0, 3 + 11, 4 + 12});
  require_gradcheck([id](const std::vector<Tensor>& in) { return embedding(in[0], id); }, {w});
}

TEST_CASE("embedding errors") {
  Tensor w = zeros({5, 3});
  REQUIRE_TG_ERROR(embedding(w, ids({0, 5}, {2})), "embedding:", "id 5", "out of range", "(5, 3)");
  REQUIRE_TG_ERROR(embedding(w, ids({-1}, {1})), "embedding:", "id -1", "out of range", "(5, 3)");
  REQUIRE_TG_ERROR(embedding(w, zeros({2})), "embedding:", "ids must be int32", "float32");
  REQUIRE_TG_ERROR(embedding(zeros({5}), ids({0}, {1})), "embedding:", "2-D", "(5,)");
  REQUIRE_TG_ERROR(embedding(zeros({5, 3}, int32), ids({0}, {1})), "embedding:", "int32", "(5, 3)");
  REQUIRE_TG_ERROR(embedding(w, Tensor()), "embedding:", "ids", "undefined");
}

// ---------------------------------------------------------------------------------------------
// cross_entropy
// ---------------------------------------------------------------------------------------------

namespace {
// Mean over non-ignored rows of logsumexp(x_r) - x_r[t_r], in double with std:: math.
double ref_cross_entropy(const std::vector<double>& x, const std::vector<std::int32_t>& t, std::size_t V,
                         std::int64_t ignore = -100) {
  double total = 0;
  int count = 0;
  for (std::size_t r = 0; r < t.size(); ++r) {
    if (t[r] == ignore) continue;
    double mx = -kInf;
    for (std::size_t c = 0; c < V; ++c) mx = std::max(mx, x[r * V + c]);
    double s = 0;
    for (std::size_t c = 0; c < V; ++c) s += std::exp(x[r * V + c] - mx);
    total += mx + std::log(s) - x[r * V + static_cast<std::size_t>(t[r])];
    ++count;
  }
  return total / count;
}
}  // namespace

TEST_CASE("cross_entropy: value against a hand computation and against log_softmax") {
  const std::vector<double> xv = grid_values(2 * 3 * 5, 41);
  const std::vector<std::int32_t> tv = {0, 4, 2, 1, 1, 3};
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor logits = tensor(xv, {2, 3, 5}, dt);
    Tensor targets = ids(tv, {2, 3});
    Tensor loss = cross_entropy(logits, targets);
    CHECK(loss.dim() == 0);
    CHECK(loss.dtype() == dt);
    const double want = ref_cross_entropy(xv, tv, 5);
    CHECK(loss.item() == Approx(want).epsilon(dt == float32 ? 1e-5 : 1e-12));
    // -mean over rows of log_softmax(logits)[target]
    Tensor ls = log_softmax(logits);
    double acc = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t t = 0; t < 3; ++t) acc -= ls.at({b, t, tv[static_cast<std::size_t>(b * 3 + t)]});
    CHECK(loss.item() == Approx(acc / 6).epsilon(dt == float32 ? 1e-5 : 1e-12));
  }
  // uniform logits: the loss is log V
  CHECK(cross_entropy(zeros({4, 7}, float64), ids({0, 1, 2, 6}, {4})).item() == Approx(std::log(7.0)).epsilon(1e-14));
  // 1-d logits with a 0-d target
  Tensor one = tensor({1, 2, 3}, {3}, float64);
  CHECK(cross_entropy(one, ids({2}, Shape{})).item() == Approx(ref_cross_entropy({1, 2, 3}, {2}, 3)).epsilon(1e-14));
}

TEST_CASE("cross_entropy is stable for large logits") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor logits = tensor({1000, 0, -1000, 0, 1000, 1000}, {2, 3}, dt);
    // row 0 target 0: ~0; row 1 target 1: log 2
    Tensor loss = cross_entropy(logits, ids({0, 1}, {2}));
    CHECK(std::isfinite(loss.item()));
    CHECK(loss.item() == Approx(std::log(2.0) / 2).epsilon(1e-6));
    // row 0 target 2: 2000
    CHECK(cross_entropy(logits, ids({2, 2}, {2})).item() == Approx((2000 + std::log(2.0)) / 2).epsilon(1e-6));
  }
}

TEST_CASE("cross_entropy: gradient is (softmax - onehot) / count, zero on ignored rows") {
  const std::vector<double> xv = grid_values(4 * 3, 42);
  Tensor logits = leaf64(xv, {4, 3});
  const std::vector<std::int32_t> tv = {2, -100, 0, -100};
  Tensor loss = cross_entropy(logits, ids(tv, {4}));
  // the mean is over the 2 non-ignored rows only
  CHECK(loss.item() == Approx(ref_cross_entropy(xv, tv, 3)).epsilon(1e-12));
  loss.backward();
  const std::vector<double> sm = ref_softmax(xv, 3, false);
  std::vector<double> want(12, 0.0);
  for (std::size_t r = 0; r < 4; ++r) {
    if (tv[r] == -100) continue;
    for (std::size_t c = 0; c < 3; ++c) want[r * 3 + c] = (sm[r * 3 + c] - (static_cast<int>(c) == tv[r] ? 1 : 0)) / 2;
  }
  check_close(logits.grad(), want);
  for (std::int64_t c = 0; c < 3; ++c) {
    CHECK(logits.grad().at({1, c}) == 0.0);
    CHECK(logits.grad().at({3, c}) == 0.0);
  }
}

TEST_CASE("cross_entropy gradcheck, with and without ignored rows") {
  Tensor logits = param64({2, 3, 5}, 43, 1.5);
  Tensor t = ids({0, 4, 2, 1, 1, 3}, {2, 3});
  require_gradcheck([t](const std::vector<Tensor>& in) { return cross_entropy(in[0], t); }, {logits});
  Tensor ti = ids({0, -100, 2, -100, 1, 3}, {2, 3});
  require_gradcheck([ti](const std::vector<Tensor>& in) { return cross_entropy(in[0], ti); }, {logits});
  // a custom ignore_index that is also a valid class id
  Tensor tc = ids({0, 4, 2, 1, 1, 2}, {2, 3});
  require_gradcheck([tc](const std::vector<Tensor>& in) { return cross_entropy(in[0], tc, 2); }, {logits});
  Tensor p = param64({3, 4}, 44);
  require_gradcheck([](const std::vector<Tensor>& in) { return cross_entropy(in[0], ids({3, 0, 1}, {3})); }, {p});
}

TEST_CASE("cross_entropy: a custom ignore_index") {
  const std::vector<double> xv = grid_values(4 * 3, 45);
  Tensor logits = tensor(xv, {4, 3}, float64);
  const std::vector<std::int32_t> tv = {1, 0, 1, 2};
  // ignore class 1: rows 0 and 2 drop out of the mean
  CHECK(cross_entropy(logits, ids(tv, {4}), 1).item() == Approx(ref_cross_entropy(xv, tv, 3, 1)).epsilon(1e-12));
  CHECK(cross_entropy(logits, ids(tv, {4}), 1).item() != Approx(ref_cross_entropy(xv, tv, 3)).epsilon(1e-6));
  // with ignore_index -1, the default -100 is an error (out of range)
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({-100, 0, 1, 2}, {4}), -1), "cross_entropy:", "target -100", "out of range");
}

TEST_CASE("cross_entropy errors") {
  Tensor logits = zeros({2, 3, 5});
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({-100, -100, -100, -100, -100, -100}, {2, 3})), "cross_entropy:",
                   "ignore_index", "-100");
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({0, 0, 0, 0, 0, 0, 0, 0}, {2, 4})), "cross_entropy:", "(2, 4)",
                   "(2, 3, 5)");
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({0, 0, 0, 0, 0, 0}, {6})), "cross_entropy:", "(6,)", "(2, 3, 5)");
  REQUIRE_TG_ERROR(cross_entropy(logits, zeros({2, 3})), "cross_entropy:", "targets must be int32", "float32");
  REQUIRE_TG_ERROR(cross_entropy(zeros({2, 5}, int32), ids({0, 1}, {2})), "cross_entropy:", "int32", "(2, 5)");
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({0, 5, 0, 0, 0, 0}, {2, 3})), "cross_entropy:", "target 5",
                   "out of range", "5 classes");
  REQUIRE_TG_ERROR(cross_entropy(logits, ids({0, -1, 0, 0, 0, 0}, {2, 3})), "cross_entropy:", "target -1",
                   "out of range");
  REQUIRE_TG_ERROR(cross_entropy(tensor({1}, Shape{}), ids({0}, Shape{})), "cross_entropy:", "0-d");
  REQUIRE_TG_ERROR(cross_entropy(logits, Tensor()), "cross_entropy:", "targets", "undefined");
}

// ---------------------------------------------------------------------------------------------
// dropout
// ---------------------------------------------------------------------------------------------

TEST_CASE("dropout: eval mode and p = 0 return the input unchanged") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor({1, -2, 3.5, 4, 0.25, -6}, {2, 3}, dt);
    Tensor a = dropout(x, 0.5, false);
    Tensor b = dropout(x, 0.0);
    CHECK(a.shape() == x.shape());
    CHECK(max_abs_diff(a, x) == 0.0);
    CHECK(max_abs_diff(b, x) == 0.0);
    CHECK(max_abs_diff(dropout(x, 1.0, false), x) == 0.0);
  }
  // and pass the gradient through unchanged
  Tensor x = param64({3}, 51);
  sum(mul(dropout(x, 0.9, false), 2.0)).backward();
  check_close(x.grad(), {2, 2, 2});
}

TEST_CASE("dropout with p = 1 gives zeros, and a zero gradient") {
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor y = dropout(tensor({1, -2, 3, 4}, {4}, dt), 1.0);
    check_close(y, {0, 0, 0, 0});
  }
  Tensor x = param64({5}, 52);
  sum(dropout(x, 1.0)).backward();
  check_close(x.grad(), {0, 0, 0, 0, 0});
}

TEST_CASE("dropout: kept elements are scaled by 1/(1-p), and the same seed gives the same mask") {
  const double p = 0.3;
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = add(arange(1.0, 201.0, 1.0, dt), 0.5);  // non-zero, distinct
    manual_seed(1234);
    Tensor y1 = dropout(x, p);
    manual_seed(1234);
    Tensor y2 = dropout(x, p);
    CHECK(max_abs_diff(y1, y2) == 0.0);
    Tensor y3 = dropout(x, p);  // the generator moved on: another mask
    CHECK(max_abs_diff(y1, y3) > 0.0);
    int kept = 0, dropped = 0;
    const std::vector<double> xv = x.to_vector<double>(), yv = y1.to_vector<double>();
    for (std::size_t i = 0; i < xv.size(); ++i) {
      if (yv[i] == 0.0) {
        ++dropped;
      } else {
        ++kept;
        INFO("element " << i);
        CHECK(yv[i] == Approx(xv[i] / (1 - p)).epsilon(dt == float32 ? 1e-6 : 1e-14));
      }
    }
    CHECK(kept > 0);
    CHECK(dropped > 0);
  }
}

TEST_CASE("dropout: the fraction dropped is near p on a large tensor, the mean is preserved") {
  for (double p : {0.1, 0.5, 0.8}) {
    INFO("p = " << p);
    manual_seed(99);
    const std::int64_t n = 200000;
    Tensor y = dropout(ones({n}), p);
    std::int64_t zeros_seen = 0;
    for (float v : y.to_vector<float>()) zeros_seen += v == 0.0f;
    const double frac = static_cast<double>(zeros_seen) / static_cast<double>(n);
    // standard deviation of the fraction is sqrt(p(1-p)/n) <= 0.0012; allow ~8 of them
    CHECK(std::fabs(frac - p) < 0.01);
    CHECK(mean(y).item() == Approx(1.0).margin(0.05));
  }
}

TEST_CASE("dropout's mask does not depend on the thread count") {
  const int before = get_num_threads();
  Tensor x = ones({100000}, float64);  // above the parallel threshold
  set_num_threads(1);
  manual_seed(5);
  Tensor a = dropout(x, 0.4);
  set_num_threads(2);
  manual_seed(5);
  Tensor b = dropout(x, 0.4);
  set_num_threads(before);
  CHECK(max_abs_diff(a, b) == 0.0);
}

TEST_CASE("dropout gradcheck with a fixed seed, and the gradient is the mask") {
  Tensor x = param64({3, 4}, 61);
  // Re-seeding inside f makes every call (the analytic pass and each finite difference) draw the same mask.
  require_gradcheck(
      [](const std::vector<Tensor>& in) {
        manual_seed(2024);
        return dropout(in[0], 0.4);
      },
      {x});
  manual_seed(2024);
  Tensor y = dropout(x, 0.4);
  sum(y).backward();
  const std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>(), gv = x.grad().to_vector<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    INFO("element " << i);
    CHECK(gv[i] == Approx(yv[i] / xv[i]).epsilon(1e-12));  // 0 or 1/(1-p)
    CHECK((gv[i] == 0.0 || gv[i] == Approx(1 / 0.6).epsilon(1e-12)));
  }
}

TEST_CASE("dropout errors") {
  Tensor x = ones({2, 3});
  REQUIRE_TG_ERROR(dropout(x, 1.5), "dropout:", "probability", "1.5");
  REQUIRE_TG_ERROR(dropout(x, -0.1), "dropout:", "probability", "-0.1");
  REQUIRE_TG_ERROR(dropout(x, std::numeric_limits<double>::quiet_NaN()), "dropout:", "probability");
  REQUIRE_TG_ERROR(dropout(zeros({2, 3}, int32), 0.5), "dropout:", "int32", "(2, 3)");
  REQUIRE_TG_ERROR(dropout(zeros({2, 3}, int32), 0.5, false), "dropout:", "int32");
}

TEST_CASE("large softmax and cross_entropy (parallel kernels) match the reference") {
  const std::int64_t rows = 400, V = 100;  // 40000 elements: above the OpenMP threshold
  const std::vector<double> xv = grid_values(rows * V, 77);
  std::vector<std::int32_t> tv;
  for (std::int64_t r = 0; r < rows; ++r) tv.push_back(r % 7 == 0 ? -100 : static_cast<std::int32_t>((r * 37) % V));
  for (DType dt : kFloatTypes) {
    INFO("dtype " << dt);
    Tensor x = tensor(xv, {rows, V}, dt);
    check_close(softmax(x), ref_softmax(xv, static_cast<std::size_t>(V), false));
    check_close(log_softmax(x), ref_softmax(xv, static_cast<std::size_t>(V), true));
    CHECK(cross_entropy(x, ids(tv, {rows})).item() ==
          Approx(ref_cross_entropy(xv, tv, static_cast<std::size_t>(V))).epsilon(dt == float32 ? 1e-5 : 1e-12));
  }
  // the fused gradient against softmax - onehot on the same large input
  Tensor x = leaf64(xv, {rows, V});
  cross_entropy(x, ids(tv, {rows})).backward();
  const std::vector<double> sm = ref_softmax(xv, static_cast<std::size_t>(V), false);
  std::int64_t count = 0;
  for (std::int32_t t : tv) count += t != -100;
  std::vector<double> want(sm.size(), 0.0);
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    if (tv[r] == -100) continue;
    for (std::size_t c = 0; c < static_cast<std::size_t>(V); ++c)
      want[r * V + c] = (sm[r * V + c] - (static_cast<std::int32_t>(c) == tv[r] ? 1.0 : 0.0)) / static_cast<double>(count);
  }
  CHECK(max_abs_diff(x.grad(), tensor(want, {rows, V}, float64)) < 1e-15);
}
