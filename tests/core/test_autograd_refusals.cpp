// Autograd refuses what it cannot do right, as PyTorch does: a graph that an earlier backward freed
// (whatever happened to the tape since), a saved tensor written in place after the forward, and a
// backward that cannot reach the graph (a cleared tape, another thread's tape). Each refusal is a
// tg::Error that names its cause, thrown before any gradient changes.
#include <thread>

#include "helpers.h"
#include "tapegrad/optim.h"

using namespace tg;
using tgtest::param64;

namespace {
// The message of the tg::Error that f throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("state carried into the next step without detach() is refused, not read as a constant") {
  // Truncated-BPTT style: h from step 1 is used in step 2. Step 1's full backward freed h's graph
  // and emptied the tape, so step 2's backward cannot reach w through h. PyTorch: "Trying to
  // backward through the graph a second time".
  Tensor w = param64({3}, 1), x = param64({3}, 2);
  Tensor h = tanh(w * x);
  sum(h).backward();
  const Tensor grad_before = w.grad().clone();
  REQUIRE(tape().size() == 0);  // emptied: h's slot is from an older generation
  Tensor loss = sum(h * w);
  const std::string msg = error_of([&] { loss.backward(); });
  CHECK_THAT(msg, Catch::Contains("backward") && Catch::Contains("freed by an earlier backward()") &&
                      Catch::Contains("detach()") && Catch::Contains("keep_tape"));
  CHECK(tgtest::max_abs_diff(w.grad(), grad_before) == 0);  // nothing touched
  // The fixes the message names both work: detach() makes h a constant ...
  Tensor loss2 = sum(h.detach() * w);
  loss2.backward();
  CHECK(w.grad().at({0}) == Approx(grad_before.at({0}) + h.at({0})));
}

TEST_CASE("keep_tape on the first backward lets the second differentiate through the carried state") {
  Tensor w = param64({3}, 3), x = param64({3}, 4);
  Tensor h = tanh(w * x);
  sum(h).backward(Tensor(), /*keep_tape=*/false);
  w.zero_grad();
  Tensor h2 = tanh(w * x);
  tg::backward(sum(h2), Tensor(), /*keep_tape=*/true);
  w.zero_grad();
  Tensor loss = sum(h2 * w);
  loss.backward();  // through h2 (kept) and w
  // d/dw sum(tanh(w x) w) = (1 - tanh^2(w x)) x w + tanh(w x)
  for (std::int64_t i = 0; i < 3; ++i) {
    const double t = std::tanh(w.at({i}) * x.at({i}));
    CHECK(w.grad().at({i}) == Approx((1 - t * t) * x.at({i}) * w.at({i}) + t).epsilon(1e-12));
  }
}

TEST_CASE("a graph an earlier backward freed in part is refused on the same tape generation") {
  Tensor a = param64({2}, 5);
  Tensor b = exp(a);
  Tensor keep = sum(a * a);  // a second graph keeps the tape alive
  sum(b).backward();         // frees b's node only
  REQUIRE(tape().live() > 0);
  Tensor c = sum(b * a);
  CHECK_THAT(error_of([&] { c.backward(); }), Catch::Contains("freed by an earlier backward()") && Catch::Contains("exp"));
  keep.backward();
}

TEST_CASE("a backward after tape().clear() names the cleared tape") {
  Tensor w = param64({2}, 6);
  Tensor y = sum(exp(w));
  tape().clear();
  CHECK_THAT(error_of([&] { y.backward(); }), Catch::Contains("Tape::clear()") && !Catch::Contains("earlier backward"));
  Tensor y2 = exp(w);
  tape().clear();
  Tensor z = sum(y2 * w);
  CHECK_THAT(error_of([&] { z.backward(); }), Catch::Contains("Tape::clear()"));
}

TEST_CASE("a backward on another thread names the thread, not an earlier backward") {
  Tensor w = param64({2}, 7);
  Tensor y = sum(exp(w));
  std::string msg;
  std::thread t([&] { msg = error_of([&] { y.backward(); }); });
  t.join();
  CHECK_THAT(msg, Catch::Contains("another thread") && !Catch::Contains("earlier backward"));
  y.backward();  // on the thread that recorded it: fine
  CHECK(w.grad().at({0}) == Approx(std::exp(w.at({0}))));
}

TEST_CASE("an in-place write to a saved tensor is refused at backward time, naming the op") {
  // PyTorch: "one of the variables needed for gradient computation has been modified by an inplace
  // operation", from its version counter. mul saves both operands: dy/da = b.
  Tensor a = param64({3}, 8), b = param64({3}, 9);
  Tensor y = sum(a * b);
  const double b0 = b.at({0});
  b.set({0}, 5.0);  // after the forward, before the backward
  const std::string msg = error_of([&] { y.backward(); });
  CHECK_THAT(msg, Catch::Contains("backward") && Catch::Contains("'mul'") && Catch::Contains("modified in place") &&
                      Catch::Contains("float64 (3,)"));
  CHECK_FALSE(a.grad().defined());  // refused before mul's backward wrote anything
  tape().clear();
  b.set({0}, b0);
  // A write before the forward is fine, and the gradient is exact.
  Tensor y2 = sum(a * b);
  y2.backward();
  for (std::int64_t i = 0; i < 3; ++i) CHECK(a.grad().at({i}) == b.at({i}));
}

TEST_CASE("copy_, set, normal_ and uniform_ into a tensor made by a recorded op are refused while recording") {
  // Neither write is recorded: y = a * 2 overwritten with zeros would still send d sum(y) / dy = 1
  // back through mul, giving a the gradient 2 of values y no longer holds (PyTorch gives 0).
  Tensor a = param64({3}, 12);
  Tensor y = a * 2.0;
  REQUIRE_TG_ERROR(y.copy_(zeros({3}, float64)), "copy_", "float64 (3,)", "recorded op");
  REQUIRE_TG_ERROR(y.set({0}, 1.0), "set", "float64 (3,)", "recorded op");
  REQUIRE_TG_ERROR(normal_(y), "normal_", "float64 (3,)", "recorded op");
  REQUIRE_TG_ERROR(uniform_(y), "uniform_", "float64 (3,)", "recorded op");
  sum(y).backward();  // y is unchanged, so its gradient is right
  for (std::int64_t i = 0; i < 3; ++i) CHECK(a.grad().at({i}) == 2.0);
  // Allowed: a leaf (a parameter's own values), a detached tensor, anything under NoGradGuard.
  a.copy_(ones({3}, float64));
  Tensor z = (a * 3.0).detach();
  z.set({0}, 4.0);
  {
    NoGradGuard ng;
    Tensor w = a * 2.0;
    w.copy_(zeros({3}, float64));
    CHECK(w.at({2}) == 0.0);
  }
  CHECK(z.at({0}) == 4.0);
  CHECK(a.at({1}) == 1.0);
}

TEST_CASE("copy_ and an optimizer's step count as in-place writes, and views share the count") {
  Tensor w = param64({2, 2}, 10), x = param64({2, 2}, 11);
  {
    Tensor y = sum(matmul(x, w));
    Tensor v = w.detach().reshape({4});  // shares w's memory, so its writes count for w
    v.copy_(tensor({1, 2, 3, 4}, {4}, float64));
    CHECK_THAT(error_of([&] { y.backward(); }), Catch::Contains("'matmul'") && Catch::Contains("modified in place"));
    tape().clear();
  }
  {
    sum(w * w).backward();  // w has a gradient
    Tensor y = sum(matmul(x, w));
    optim::SGD opt({w}, 0.1);
    opt.step();  // updates w in place after the forward that saved it
    CHECK_THAT(error_of([&] { y.backward(); }), Catch::Contains("'matmul'") && Catch::Contains("modified in place"));
    tape().clear();
  }
}

TEST_CASE("normal_ and uniform_ count as in-place writes") {
  // As torch.nn.init's initialisers under no_grad: a graph that saved the tensor refuses its backward.
  Tensor w = param64({2, 2}, 13), x = param64({2, 2}, 14);
  for (const bool normal : {true, false}) {
    INFO((normal ? "normal_" : "uniform_"));
    Tensor y = sum(matmul(x, w));
    if (normal) normal_(w);
    else uniform_(w, -1.0, 1.0);
    CHECK_THAT(error_of([&] { y.backward(); }), Catch::Contains("'matmul'") && Catch::Contains("modified in place"));
    tape().clear();
  }
}
