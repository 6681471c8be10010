// Post-accumulate-grad hooks (tg::register_post_accumulate_grad_hook): when they fire, with what,
// and what they refuse; and the generator shards that data parallelism draws dropout with.
#include <string>
#include <vector>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("a gradient hook fires once, with the leaf's final gradient, as soon as it is final") {
  // Nodes: 0 a = x * w0, 1 b = a * w1, 2 c = b * x, 3 s = sum(c). x feeds nodes 0 and 2, so its
  // gradient is final only after node 0; w1's after node 1, before node 0 runs.
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor w0 = tensor({0.5, -1, 2}, {3}, float64).requires_grad_();
  Tensor w1 = tensor({3, 0.25, -2}, {3}, float64).requires_grad_();
  std::vector<std::string> order;
  std::vector<double> x_seen, w1_seen;
  bool w0_done_when_w1_fired = true;
  GradHookHandle hx = register_post_accumulate_grad_hook(x, [&](const Tensor& g) {
    order.push_back("x");
    x_seen = g.to_vector<double>();
  });
  GradHookHandle h1 = register_post_accumulate_grad_hook(w1, [&](const Tensor& g) {
    order.push_back("w1");
    w1_seen = g.to_vector<double>();
    w0_done_when_w1_fired = w0.grad().defined();
  });
  GradHookHandle h0 = register_post_accumulate_grad_hook(w0, [&](const Tensor&) { order.push_back("w0"); });
  Tensor s = sum(x * w0 * w1 * x);
  s.backward();
  CHECK(order == std::vector<std::string>{"w1", "x", "w0"});  // registration order within node 0
  CHECK_FALSE(w0_done_when_w1_fired);                          // w1 fired before node 0 ran
  CHECK(x_seen == x.grad().to_vector<double>());                // both of x's contributions
  CHECK(w1_seen == w1.grad().to_vector<double>());
  for (int i = 0; i < 3; ++i)
    CHECK(x.grad().at({i}) == Approx(2 * x.at({i}) * w0.at({i}) * w1.at({i})));
}

TEST_CASE("a gradient hook does not fire for a backward that does not reach its leaf, nor once removed") {
  Tensor w = tensor({2.0}, {1}, float64).requires_grad_();
  Tensor v = tensor({3.0}, {1}, float64).requires_grad_();
  int fired = 0;
  GradHookHandle h = register_post_accumulate_grad_hook(w, [&](const Tensor&) { ++fired; });
  Tensor other = sum(w * 5.0);  // recorded, never differentiated: w's node is not reached
  sum(v * v).backward();
  CHECK(fired == 0);
  sum(w * w).backward();
  CHECK(fired == 1);
  h.remove();
  CHECK_FALSE(h.active());
  sum(w * w).backward();
  CHECK(fired == 1);
  {
    GradHookHandle scoped = register_post_accumulate_grad_hook(w, [&](const Tensor&) { ++fired; });
    GradHookHandle moved = std::move(scoped);
    CHECK_FALSE(scoped.active());
    sum(w * 2.0).backward();
  }
  sum(w * 2.0).backward();  // the moved handle went out of scope: removed
  CHECK(fired == 2);
}

TEST_CASE("a gradient hook sees accumulated gradients, on a kept tape and on a leaf root") {
  Tensor w = tensor({2.0}, {1}, float64).requires_grad_();
  std::vector<double> seen;
  GradHookHandle h = register_post_accumulate_grad_hook(w, [&](const Tensor& g) { seen.push_back(g.item()); });
  Tensor y = sum(w * w);  // dy/dw = 2w = 4
  y.backward(Tensor(), /*keep_tape=*/true);
  y.backward();
  CHECK(seen == std::vector<double>{4.0, 8.0});
  w.backward(tensor({1.5}, {1}, float64));  // the leaf is the root: seeded, then final
  CHECK(seen.back() == 9.5);
}

TEST_CASE("gradient hooks refuse what is not a parameter, naming the function") {
  Tensor w = tensor({1.0}, {1}, float64).requires_grad_();
  Tensor data = tensor({1.0}, {1}, float64);
  Tensor made = w * 2.0;
  auto noop = [](const Tensor&) {};
  REQUIRE_TG_ERROR((void)register_post_accumulate_grad_hook(data, noop), "register_post_accumulate_grad_hook",
                   "leaf that does not require grad");
  REQUIRE_TG_ERROR((void)register_post_accumulate_grad_hook(made, noop), "register_post_accumulate_grad_hook",
                   "made by an op");
  REQUIRE_TG_ERROR((void)register_post_accumulate_grad_hook(Tensor(), noop), "register_post_accumulate_grad_hook");
  REQUIRE_TG_ERROR((void)register_post_accumulate_grad_hook(w, nullptr), "register_post_accumulate_grad_hook", "empty");
  tape().clear();
}

TEST_CASE("an exception from a gradient hook stops the backward") {
  Tensor w = tensor({1.0, 2.0}, {2}, float64).requires_grad_();
  GradHookHandle h = register_post_accumulate_grad_hook(w, [](const Tensor&) { throw Error("hook: refused"); });
  Tensor y = sum(w * w);
  REQUIRE_TG_ERROR(y.backward(), "hook", "refused");
  tape().clear();
}

TEST_CASE("generator shards draw the rows of a batch a single process draws whole") {
  // Dropout over a (4, 3, 5) batch in one process, and over its two halves as shards 0 and 1 of
  // 2: the halves' masks are the whole's rows, and the generator ends at the same offset.
  Tensor x = ones({4, 3, 5});
  manual_seed(7);
  Tensor whole = dropout(x, 0.5, true);
  const std::uint64_t end = default_generator().offset();
  for (std::uint64_t r = 0; r < 2; ++r) {
    manual_seed(7);
    default_generator().set_shard(r, 2);
    Tensor half = dropout(x.slice(0, 0, 2), 0.5, true);
    default_generator().set_shard(0, 1);
    CHECK(half.to_vector<float>() == whole.slice(0, 2 * static_cast<std::int64_t>(r), 2 * static_cast<std::int64_t>(r) + 2).to_vector<float>());
    CHECK(default_generator().offset() == end);
  }
  REQUIRE_TG_ERROR(default_generator().set_shard(2, 2), "Generator::set_shard", "2 of 2");
  REQUIRE_TG_ERROR(default_generator().set_shard(0, 0), "Generator::set_shard");
}
