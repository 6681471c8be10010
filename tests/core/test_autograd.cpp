// The tape: recording, reverse walk, accumulation, freeing, no_grad, errors, printing.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "helpers.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("backward of a small expression gives the calculus answer") {
  // f(x, y) = sum(x * y + exp(x)) ; df/dx = y + exp(x), df/dy = x
  Tensor x = tensor({0.5, -1.0, 2.0}, {3}, float64).requires_grad_();
  Tensor y = tensor({3.0, 4.0, -5.0}, {3}, float64).requires_grad_();
  Tensor f = sum(x * y + exp(x));
  f.backward();
  for (int i = 0; i < 3; ++i) {
    CHECK(x.grad().at({i}) == Approx(y.at({i}) + std::exp(x.at({i}))));
    CHECK(y.grad().at({i}) == Approx(x.at({i})));
  }
  CHECK(tape().size() == 0);  // freed after backward
}

TEST_CASE("gradients accumulate across backward calls until zero_grad") {
  Tensor w = tensor({2.0}, {1}, float64).requires_grad_();
  sum(w * w).backward();  // d/dw w^2 = 2w = 4
  CHECK(w.grad().item() == 4.0);
  sum(w * 3.0).backward();
  CHECK(w.grad().item() == 7.0);
  w.zero_grad();
  CHECK_FALSE(w.grad().defined());
  sum(w * 3.0).backward();
  CHECK(w.grad().item() == 3.0);
}

TEST_CASE("a tensor used twice receives both contributions") {
  Tensor x = tensor({3.0}, {1}, float64).requires_grad_();
  Tensor y = x * x + x;  // dy/dx = 2x + 1 = 7
  sum(y).backward();
  CHECK(x.grad().item() == 7.0);
}

TEST_CASE("backward with an explicit upstream gradient") {
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor y = x * 2.0;
  y.backward(tensor({1, 10, 100}, {3}, float64));
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 20, 200});
}

TEST_CASE("backward errors are clear, never crashes") {
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor y = x * 2.0;
  REQUIRE_TG_ERROR(y.backward(), "backward", "scalar", "(2,)");
  REQUIRE_TG_ERROR(y.backward(ones({3}, float64)), "backward", "(3,)", "(2,)");
  Tensor s = sum(y);
  s.backward();
  REQUIRE_TG_ERROR(s.backward(), "backward", "freed", "keep_tape");
  Tensor c = tensor({1.0});
  REQUIRE_TG_ERROR(c.backward(), "backward", "does not require grad");
  REQUIRE_TG_ERROR(Tensor().backward(), "backward", "undefined");
}

TEST_CASE("keep_tape allows a second backward, results add up") {
  Tensor x = tensor({1.5}, {1}, float64).requires_grad_();
  Tensor s = sum(x * x * x);  // 3 x^2 = 6.75
  s.backward(ones({}, float64), /*keep_tape=*/true);
  CHECK(x.grad().item() == Approx(6.75));
  CHECK(tape().size() > 0);
  s.backward();
  CHECK(x.grad().item() == Approx(13.5));
  CHECK(tape().size() == 0);
}

TEST_CASE("NoGradGuard stops recording, detach cuts the graph") {
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  {
    NoGradGuard ng;
    CHECK_FALSE(grad_enabled());
    Tensor y = x * 2.0;
    CHECK_FALSE(y.requires_grad());
    CHECK(tape().size() == 0);
  }
  CHECK(grad_enabled());
  Tensor z = sum(x.detach() * x);  // only the second factor carries gradient: d/dx = x
  z.backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 2});
}

TEST_CASE("intermediate gradients are freed unless retained") {
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor h = x * 3.0;
  Tensor k = x * 4.0;
  k.retain_grad();
  sum(h * k).backward();
  CHECK_FALSE(h.grad().defined());
  REQUIRE(k.grad().defined());
  CHECK(k.grad().to_vector<double>() == std::vector<double>{3, 6});  // d/dk = h
  CHECK(x.grad().to_vector<double>() == std::vector<double>{24, 48});  // 2 * 12 x
  CHECK_FALSE(h.is_leaf());
  CHECK(x.is_leaf());
  REQUIRE_TG_ERROR(h.requires_grad_(false), "requires_grad_", "leaf");
}

TEST_CASE("only inputs that require grad get a gradient") {
  Tensor a = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor b = tensor({3, 4}, {2}, float64);
  sum(a * b).backward();
  CHECK(a.grad().defined());
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("the tape prints ops, shapes and bytes, and draws as Graphviz DOT") {
  Tensor W = randn({3, 4}, float64).requires_grad_().set_name("W");
  Tensor x = randn({2, 3}, float64);
  Tensor y = tanh(matmul(x, W));
  Tensor loss = mean(y);
  std::ostringstream s;
  tape().print(s);
  const std::string t = s.str();
  CHECK(t.find("tape: 3 nodes") != std::string::npos);
  CHECK(t.find("matmul") != std::string::npos);
  CHECK(t.find("(2, 3), (3, 4) W -> (2, 4)") != std::string::npos);
  CHECK(t.find("tanh") != std::string::npos);
  CHECK(t.find("mean") != std::string::npos);
  CHECK(tape()[1].bytes_saved() == 2 * 4 * 8);  // tanh keeps its output
  CHECK(tape().bytes_saved() == (2 * 3 + 3 * 4) * 8 + 2 * 4 * 8);
  const std::string dot = tape().to_dot();
  CHECK(dot.rfind("digraph tape {", 0) == 0);
  CHECK(dot.find("W\\n(3, 4)") != std::string::npos);
  CHECK(dot.find("op0 -> t") != std::string::npos);
  loss.backward();
  CHECK(W.grad().shape() == Shape{3, 4});
}

TEST_CASE("float32 and float64 graphs give the same gradients to float32 precision") {
  Tensor x64 = param64({4, 5}, 11);
  Tensor x32 = x64.detach().to(float32).requires_grad_();
  auto f = [](const Tensor& x) { return sum(sigmoid(x) * x + pow(x, 2.0)); };
  f(x64).backward();
  f(x32).backward();
  CHECK(max_abs_diff(x64.grad(), x32.grad().to(float64)) < 1e-5);
}

TEST_CASE("gradcheck reports a wrong gradient") {
  // A deliberately wrong op: forward x^2, but recorded with the derivative of x^3.
  auto wrong = [](const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    Tensor y = Tensor::empty(x.shape(), float64);
    for (std::int64_t i = 0; i < x.numel(); ++i) y.data<double>()[i] = x.data<double>()[i] * x.data<double>()[i];
    if (should_record({&x})) {
      struct Saved { Tensor x; };
      record("wrong_square", {&x}, {&y}, Saved{x.detach()}, [](Node& n, const Saved& s) {
        Tensor dx = n.new_grad(0);
        const double* xs = s.x.data<double>();
        for (std::int64_t i = 0; i < dx.numel(); ++i) dx.data<double>()[i] = n.grad_out().data<double>()[i] * 3 * xs[i] * xs[i];
        n.pass_grad(0, std::move(dx));
      });
    }
    return y;
  };
  GradcheckReport r = gradcheck(wrong, {param64({3}, 1)});
  CHECK_FALSE(r.ok);
  CHECK(r.str().find("FAILED") != std::string::npos);
  auto right = [](const std::vector<Tensor>& in) { return in[0] * in[0]; };
  CHECK(gradcheck(right, {param64({3}, 1)}).ok);
  REQUIRE_TG_ERROR(gradcheck(right, {randn({3}).requires_grad_()}), "gradcheck", "float64");
}

TEST_CASE("gradcheck reports a NaN error as NaN, not as the largest finite one") {
  // x * x at (1, NaN, 2): the second element's analytic and numeric derivatives are NaN.
  Tensor x = tensor({1, std::nan(""), 2}, {3}, float64).requires_grad_();
  GradcheckReport r = gradcheck([](const std::vector<Tensor>& in) { return in[0] * in[0]; }, {x});
  REQUIRE(r.inputs.size() == 1);
  CHECK_FALSE(r.ok);
  CHECK(std::isnan(r.inputs[0].max_abs_err));
  CHECK(std::isnan(r.inputs[0].max_rel_err));
  CHECK(r.str().find("max abs err nan") != std::string::npos);
}

TEST_CASE("Node::pass_grad moves a gradient into an empty slot, adds it into a filled one, copies one held elsewhere") {
  // y = 3 * x, recorded with x once, or (twice) as both inputs, each carrying half. The backward
  // passes a fresh buffer g to the tape. `handed` is g's address; when `share` is set, `keep`
  // holds a second reference to g's memory. (x's gradient is 3 either way: the addresses tell the
  // tape's paths apart.)
  struct Probe {
    const void* handed = nullptr;
    bool share = false;
    Tensor keep;
  };
  auto triple = [](const Tensor& x, Probe& probe, bool twice) {
    Tensor y = x.detach() * 3.0;
    struct Saved { Tensor none; };  // the inputs as a vector take a Saved struct; nothing to save
    std::vector<const Tensor*> in{&x};
    if (twice) in.push_back(&x);
    record("triple", in, {&y}, Saved{}, [&probe, twice](Node& n, const Saved&) {
      Tensor g = n.grad_out() * (twice ? 1.5 : 3.0);  // twice: each input carries half
      probe.handed = g.raw_data();
      if (probe.share) probe.keep = g;
      Tensor h = twice ? g * 1.0 : Tensor();  // input 1's part: a buffer of its own
      n.pass_grad(0, std::move(g));
      n.pass_grad(1, std::move(h));
    });
    return y;
  };
  const std::vector<double> three{3, 3, 3, 3};
  SECTION("an empty slot takes the very buffer") {
    Tensor x = zeros({4}, float64).requires_grad_();
    Probe probe;
    sum(triple(x, probe, false)).backward();
    CHECK(x.grad().raw_data() == probe.handed);
    CHECK(x.grad().to_vector<double>() == three);
  }
  SECTION("a filled slot: the tape adds into the gradient already there") {
    Tensor x = zeros({4}, float64).requires_grad_();
    Probe probe;
    sum(triple(x, probe, false)).backward();
    const void* first = x.grad().raw_data();
    sum(triple(x, probe, false)).backward();
    CHECK(x.grad().raw_data() == first);
    CHECK(x.grad().raw_data() != probe.handed);
    CHECK(x.grad().to_vector<double>() == std::vector<double>{6, 6, 6, 6});
  }
  SECTION("x passed twice (x * x): the first part moves in, the second is added") {
    Tensor x = zeros({4}, float64).requires_grad_();
    Probe probe;
    sum(triple(x, probe, true)).backward();
    CHECK(x.grad().raw_data() == probe.handed);
    CHECK(x.grad().to_vector<double>() == three);
  }
  SECTION("memory held elsewhere is copied, so a later add leaves the holder's data alone") {
    Tensor x = zeros({4}, float64).requires_grad_();
    Probe shared;
    shared.share = true;
    sum(triple(x, shared, false)).backward();
    CHECK(x.grad().raw_data() != shared.handed);
    CHECK(x.grad().to_vector<double>() == three);
    sum(x * 1.0).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{4, 4, 4, 4});
    CHECK(shared.keep.to_vector<double>() == three);
  }
}

TEST_CASE("Node::pass_grad takes a gradient of another shape with x's size, ignores an undefined one, refuses a wrong dtype") {
  Tensor x = zeros({4}, float64).requires_grad_();
  Tensor y = x.detach() * 1.0;
  record("offer", {&x}, {&y}, [&](Node& n) {
    n.pass_grad(0, Tensor());              // nothing to add
    n.pass_grad(0, ones({2, 2}, float64));  // x's size: kept in x's shape
  });
  sum(y).backward();
  CHECK(x.grad().shape() == Shape{4});
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 1, 1, 1});
  Tensor x2 = zeros({4}, float64).requires_grad_();
  Tensor y2 = x2.detach() * 1.0;
  record("offer", {&x2}, {&y2}, [](Node& n) { n.pass_grad(0, ones({4}, float32)); });
  REQUIRE_TG_ERROR(sum(y2).backward(), "offer", "float32");
  tape().clear();
}

TEST_CASE("Node::new_grad gives dy's own buffer to a node that may overwrite it, and declines when it must not") {
  // An elementwise y = 2 x recorded with may_reuse_grad_out(); the backward writes dx = 2 dy.
  // `given` says whether new_grad returned dy's buffer; the gradient is 2 either way.
  struct Probe {
    bool given = false;
    bool copy_dy = false;  // read dy through a copy of the handle: the reuse must be declined
  };
  auto twice = [](const Tensor& x, Probe& probe) {
    Tensor y = x.detach() * 2.0;
    record("twice", {&x}, {&y}, [&probe](Node& n) {
      const Tensor copy = probe.copy_dy ? n.grad_out() : Tensor();
      const Tensor& dy = n.grad_out();
      Tensor dx = n.new_grad(0);
      probe.given = dx.raw_data() == dy.raw_data();
      for (std::int64_t i = 0; i < dx.numel(); ++i) dx.data<double>()[i] = 2 * dy.data<double>()[i];
      n.pass_grad(0, std::move(dx));
    }).may_reuse_grad_out();
    return y;
  };
  const std::vector<double> two{2, 2, 2};
  SECTION("dy held by nothing else: dx is written over it") {
    Tensor x = zeros({3}, float64).requires_grad_();
    Probe probe;
    sum(twice(x, probe)).backward();
    CHECK(probe.given);
    CHECK(x.grad().to_vector<double>() == two);
  }
  SECTION("dy shared (another handle to it): a fresh buffer") {
    Tensor x = zeros({3}, float64).requires_grad_();
    Probe probe;
    probe.copy_dy = true;
    sum(twice(x, probe)).backward();
    CHECK_FALSE(probe.given);
    CHECK(x.grad().to_vector<double>() == two);
  }
  SECTION("y retains its gradient: a fresh buffer, and y's gradient stays dy") {
    Tensor x = zeros({3}, float64).requires_grad_();
    Probe probe;
    Tensor y = twice(x, probe);
    y.retain_grad();
    sum(y).backward();
    CHECK_FALSE(probe.given);
    CHECK(y.grad().to_vector<double>() == std::vector<double>{1, 1, 1});
    CHECK(x.grad().to_vector<double>() == two);
  }
  SECTION("without the declaration: a fresh buffer") {
    Tensor x = zeros({3}, float64).requires_grad_();
    Tensor y = x.detach() * 2.0;
    bool given = true;
    record("twice", {&x}, {&y}, [&given](Node& n) {
      const Tensor& dy = n.grad_out();
      Tensor dx = n.new_grad(0);
      given = dx.raw_data() == dy.raw_data();
      for (std::int64_t i = 0; i < dx.numel(); ++i) dx.data<double>()[i] = 2 * dy.data<double>()[i];
      n.pass_grad(0, std::move(dx));
    });
    sum(y).backward();
    CHECK_FALSE(given);
    CHECK(x.grad().to_vector<double>() == two);
  }
  SECTION("dy of another dtype than x: a fresh buffer of x's dtype") {
    Tensor x = zeros({3}, float32).requires_grad_();
    Tensor y = zeros({3}, float64);
    bool given = true;
    DType got = float64;
    record("widen", {&x}, {&y}, [&](Node& n) {
      const Tensor& dy = n.grad_out();
      Tensor dx = n.new_grad(0);
      given = dx.raw_data() == dy.raw_data();
      got = dx.dtype();
      for (std::int64_t i = 0; i < dx.numel(); ++i) dx.data<float>()[i] = static_cast<float>(dy.data<double>()[i]);
      n.pass_grad(0, std::move(dx));
    }).may_reuse_grad_out();
    sum(y).backward();
    CHECK_FALSE(given);
    CHECK(got == float32);
    CHECK(x.grad().to_vector<float>() == std::vector<float>{1, 1, 1});
  }
}

TEST_CASE("two graphs on one tape: backward of one leaves the other usable") {
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor a = sum(x * 3.0);
  Tensor b = sum(x * x);
  a.backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3});
  CHECK(tape().live() == 2);  // b's nodes
  b.backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{5, 7});
  CHECK(tape().size() == 0);
}

TEST_CASE("a node keeps its arrays in one arena block, and a freed node's arrays read as empty") {
  // What a long graph costs in memory per op: a node of 64 bytes and an autograd slot of 128 (its
  // gradient out of line, its reference count inside), not 112 and 232 as with a (pointer, length)
  // pair per array and the gradient inline; a Tensor handle of 96 (two one-word Refs, not two
  // two-word shared_ptrs). Growing any is a deliberate change: see docs/tape.md.
  STATIC_REQUIRE(sizeof(Node) <= 64);
  STATIC_REQUIRE(sizeof(AutogradMeta) <= 128);
  STATIC_REQUIRE(sizeof(Tensor) <= 96);
  STATIC_REQUIRE(std::is_trivially_copyable_v<Node>);
  tape().clear();
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor c = tensor({4, 5}, {2}, float64);
  Tensor h = x * c;   // node 0: inputs (x, c), c without a slot
  Tensor a = sum(h);  // node 1
  Tensor b = sum(exp(x));
  const Node& n0 = tape()[0];
  REQUIRE(n0.inputs().size() == 2);
  CHECK(n0.inputs()[0] == x.meta());
  CHECK(n0.inputs()[1] == nullptr);
  REQUIRE(n0.outputs().size() == 1);
  CHECK(n0.outputs()[0] == h.meta());
  CHECK(n0.input_shape(0) == Shape{2});
  CHECK(n0.input_shape(1) == Shape{2});  // c's shape, kept without a slot
  CHECK(n0.bytes_saved() == 2 * 2 * sizeof(double));  // mul saves a and b
  a.backward();  // frees nodes 0 and 1; exp's and b's stay
  CHECK(n0.freed());
  CHECK(n0.inputs().empty());
  CHECK(n0.outputs().empty());
  CHECK(n0.bytes_saved() == 0);
  CHECK(x.grad().to_vector<double>() == std::vector<double>{4, 5});
  b.backward();  // walks past the freed nodes
  CHECK(x.grad().at({1}) == Approx(5 + std::exp(2.0)));
  CHECK(tape().size() == 0);
}

TEST_CASE("a graph that shares freed nodes is refused before any gradient changes") {
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor h = exp(x);
  Tensor a = sum(h);
  Tensor b = sum(h * 2.0);
  a.backward();
  const auto before = x.grad().to_vector<double>();
  REQUIRE_TG_ERROR(b.backward(), "backward", "freed", "exp");
  CHECK(x.grad().to_vector<double>() == before);
  tape().clear();
}

TEST_CASE("graphs nobody can reach are swept as the tape grows") {
  tape().clear();
  Tensor w = tensor({1.0}, {1}, float64).requires_grad_();
  const auto first = static_cast<int>(Tape::kFirstSweep);
  for (int i = 0; i < first + first / 2; ++i) {
    Tensor y = w * 2.0;  // recorded, then dropped: nothing can reach this node any more
    (void)y;
  }
  CHECK(tape().live() <= static_cast<std::size_t>(first / 2));  // the sweep at `first` freed all before it
  Tensor keep = w * 5.0;
  for (int i = 0; i < first + 1000; ++i) (void)(w * 2.0);
  CHECK(tape().live() < static_cast<std::size_t>(first));
  sum(keep).backward();  // the kept graph survived every sweep
  CHECK(w.grad().item() == 5.0);
  tape().clear();
}

TEST_CASE("clearing the tape releases the live nodes' references") {
  // Nodes are trivially destructible (the tape forgets freed ones in O(1)), so Tape::clear must
  // release the live ones itself: their input slots and saved tensors.
  tape().clear();
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor y = x * x;  // one node: x's slot twice as inputs, x's storage twice as saved
  CHECK(x.meta().use_count() == 3);
  CHECK_FALSE(x.sole_owner());
  tape().clear();
  CHECK(x.meta().use_count() == 1);
  CHECK(x.sole_owner());
  CHECK(tape().size() == 0);
}

TEST_CASE("a recording whose closure fails to copy leaves no live node behind") {
  struct Saved { Tensor x; };
  struct ThrowsOnCopy {
    ThrowsOnCopy() = default;
    ThrowsOnCopy(const ThrowsOnCopy&) { throw std::runtime_error("closure copy failed"); }
    void operator()(Node&, const Saved&) const {}
  };
  tape().clear();
  Tensor x = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor kept = x * 3.0;
  const std::size_t live = tape().live();
  Tensor y = Tensor::empty({2}, float64);
  const ThrowsOnCopy closure;
  CHECK_THROWS_WITH(record("custom", {&x}, {&y}, Saved{x}, closure), "closure copy failed");
  CHECK(tape().live() == live);  // the half-made node was freed, its saved x and slots released
  sum(kept).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3});
}

TEST_CASE("forward passes made without NoGradGuard do not pile up their saved activations") {
  // Each exp saves its 4 MiB output and is dropped at once, as an evaluation loop that forgot
  // NoGradGuard drops its logits: 100 of them save 400 MiB, and the node count (100) is far below
  // the count that sweeps. The byte trigger sweeps every kSweepBytes instead.
  tape().clear();
  Tensor x = randn({1 << 20}).requires_grad_();
  std::size_t most = 0;
  for (int i = 0; i < 100; ++i) {
    Tensor y = exp(x);
    most = std::max(most, tape().bytes_saved());
  }
  CHECK(most <= Tape::kSweepBytes + (std::size_t(4) << 20));
  CHECK(tape().bytes_saved() < Tape::kSweepBytes);
  // A graph still in use survives those sweeps.
  Tensor keep = exp(x);
  for (int i = 0; i < 100; ++i) (void)exp(x);
  sum(keep).backward();
  CHECK(x.grad().at({0}) == Approx(std::exp(x.at({0}))));
  tape().clear();
}

TEST_CASE("a node recorded right after a sweep that emptied the tape is still differentiable") {
  tape().clear();
  Tensor w = tensor({1.0}, {1}, float64).requires_grad_();
  for (std::size_t i = 0; i < Tape::kFirstSweep; ++i) (void)(w * 2.0);  // fills the tape to the first sweep
  Tensor s = sum(w * 3.0);                              // this push sweeps everything away first
  s.backward();
  CHECK(w.grad().item() == 3.0);
}

// ---- gradient buffers: the first write assigns, later ones add ----

TEST_CASE("the first gradient into a tensor overwrites stale memory, later paths add to it") {
  // Fresh gradient buffers come uninitialised from the caching allocator, which hands back blocks
  // just freed: fill the cache with garbage of the right size first, so a kernel that forgot to
  // write an element (or added to the garbage) would show it.
  for (int rep = 0; rep < 3; ++rep) {
    { Tensor junk = full({4, 6}, 1e6); }
    Tensor x = tensor({1, -2, 3, 0.5, 2, -1, 4, 1, -3, 2, 0.25, 1, 1, 2, 3, 4, 5, 6, -1, -2, -3, -4, -5, -6}, {4, 6},
                      float64).requires_grad_();
    Tensor w = tensor({1, 2, 3, 4, 5, 6}, {6}, float64).requires_grad_();
    // x feeds three paths: a row-broadcast add, a norm, and a product with itself.
    Tensor y = sum((x + w) * 2.0) + sum(rms_norm(x, w, Tensor(), 1e-5, 1.0)) + sum(x * x);
    y.backward();
    // Reference: the same function from composite ops, whose gradients are checked elsewhere.
    Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    Tensor y2 = sum((x2 + w2) * 2.0) + sum(composite::rms_norm(x2, w2, Tensor(), 1e-5, 1.0)) + sum(x2 * x2);
    y2.backward();
    CHECK(max_abs_diff(x.grad(), x2.grad()) < 1e-12);
    CHECK(max_abs_diff(w.grad(), w2.grad()) < 1e-12);
  }
}

TEST_CASE("a tensor passed as both operands gets both gradients (x * x, a @ a, a norm of its own gain)") {
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  sum(x * x).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 4, 6});
  Tensor a = tensor({1, 2, 3, 4}, {2, 2}, float64).requires_grad_();
  sum(matmul(a, a)).backward();
  // d/dA sum(A A) = 1 A^T + A^T 1 = [[3, 7], [3, 7]] + [[4, 4], [6, 6]]
  CHECK(a.grad().to_vector<double>() == std::vector<double>{7, 11, 9, 13});
  Tensor g = tensor({0.5, 1.5, 2.5}, {3}, float64).requires_grad_();
  Tensor g2 = g.detach().clone().requires_grad_(), g3 = g.detach().clone().requires_grad_();
  sum(rms_norm(g, g, Tensor(), 1e-5, 1.0)).backward();
  sum(rms_norm(g2, g3, Tensor(), 1e-5, 1.0)).backward();
  CHECK(max_abs_diff(g.grad(), g2.grad() + g3.grad()) < 1e-12);
}

TEST_CASE("backward with a given upstream gradient leaves the caller's tensor untouched, retained gradients add up") {
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor y = x * 2.0;
  y.retain_grad();
  Tensor dy = tensor({1, 1, 1}, {3}, float64);
  y.backward(dy, true);
  y.backward(dy);
  CHECK(dy.to_vector<double>() == std::vector<double>{1, 1, 1});
  CHECK(y.grad().to_vector<double>() == std::vector<double>{2, 2, 2});
  CHECK(x.grad().to_vector<double>() == std::vector<double>{4, 4, 4});
  // The same for a retained intermediate: each backward sends only its own gradient through it.
  Tensor a = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor h = a * 3.0;
  h.retain_grad();
  Tensor l = sum(h * h);
  l.backward(Tensor(), true);
  l.backward();
  CHECK(h.grad().to_vector<double>() == std::vector<double>{12, 24});  // 2 x 2h
  CHECK(a.grad().to_vector<double>() == std::vector<double>{36, 72});  // 2 x 3 x 2h
}

TEST_CASE("an elementwise backward may write over its incoming gradient, never over one someone else holds") {
  // A chain of elementwise ops hands each incoming gradient buffer on as the next input's
  // gradient (Node::grad_dest_over). The caller's upstream gradient, a retained gradient and the
  // second operand of a product must come through unchanged.
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor g = tensor({1, -1, 0.5}, {3}, float64);
  Tensor z = exp((x * 2.0 + 1.0) * 3.0);
  z.backward(g);
  CHECK(g.to_vector<double>() == std::vector<double>{1, -1, 0.5});
  for (int i = 0; i < 3; ++i) {
    const double xi = i + 1.0, gi = std::vector<double>{1, -1, 0.5}[static_cast<std::size_t>(i)];
    CHECK(x.grad().to_vector<double>()[static_cast<std::size_t>(i)] == Approx(gi * 6 * std::exp(6 * xi + 3)));
  }
  // y's gradient is kept: y's own node must not write x's gradient over it.
  Tensor a = tensor({1, 2}, {2}, float64).requires_grad_();
  Tensor y = a * 2.0;
  y.retain_grad();
  sum(y * 3.0).backward();
  CHECK(y.grad().to_vector<double>() == std::vector<double>{3, 3});
  CHECK(a.grad().to_vector<double>() == std::vector<double>{6, 6});
  // p * q: dp is written first (reading dq's source, the incoming gradient), dq may take it over.
  Tensor p = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor q = tensor({4, 5, 6}, {3}, float64).requires_grad_();
  ((p * q) * 2.0).backward(tensor({1, 10, 100}, {3}, float64));
  CHECK(p.grad().to_vector<double>() == std::vector<double>{8, 100, 1200});
  CHECK(q.grad().to_vector<double>() == std::vector<double>{2, 40, 600});
}

// ---- anomaly mode ----

TEST_CASE("anomaly mode is off by default: a NaN passes through silently") {
  CHECK_FALSE(is_anomaly_enabled());
  Tensor x = tensor({-1, 1}, {2}, float64).requires_grad_();
  Tensor y = sum(log(x));
  CHECK(std::isnan(y.item()));
  y.backward();
  tape().clear();
}

TEST_CASE("anomaly mode names the first op whose output is not finite, with its shapes") {
  Tensor x = tensor({-1, 1, 2, 3}, {2, 2}, float64).requires_grad_();
  {
    DetectAnomalyGuard on;
    Tensor a = x * 2.0;  // finite
    REQUIRE_TG_ERROR(log(a), "anomaly", "forward of op 'log'", "tape node 1", "(2, 2)", "NaN", "inputs were all finite");
  }
  CHECK_FALSE(is_anomaly_enabled());
  tape().clear();
  // A NaN already in the data is reported as coming in, not as made by the op.
  Tensor bad = tensor({1, NAN}, {2}, float64).requires_grad_();
  {
    DetectAnomalyGuard on;
    REQUIRE_TG_ERROR(bad * 3.0, "anomaly", "op 'mul'", "input 0 already had NaN at flat index 1");
  }
  tape().clear();
  // Inf counts too; ops under NoGradGuard are not recorded and so not checked.
  Tensor z = tensor({0, 1}, {2}, float64).requires_grad_();
  {
    DetectAnomalyGuard on;
    REQUIRE_TG_ERROR(rdiv(1.0, z), "anomaly", "op 'rdiv'", "+Inf at flat index 0");
    NoGradGuard ng;
    CHECK(std::isinf(rdiv(1.0, z).at({0})));
  }
  tape().clear();
}

TEST_CASE("anomaly mode names the first backward that makes a non-finite gradient") {
  // sqrt is finite at 0 but its derivative 1 / (2 sqrt(x)) is not.
  Tensor x = tensor({0, 4}, {2}, float64).requires_grad_();
  DetectAnomalyGuard on;
  Tensor y = sum(sqrt(x) * 3.0);
  REQUIRE_TG_ERROR(y.backward(), "anomaly", "backward of op 'sqrt'", "gradient of input 0", "+Inf at flat index 0",
                   "upstream gradient was finite");
  tape().clear();
}

TEST_CASE("anomaly mode changes no result when everything is finite") {
  Tensor x = param64({3, 5}, 11), w = param64({5}, 12);
  auto f = [&]() { return sum(gelu(layer_norm(x, w, Tensor(), 1e-5)) * x); };
  f().backward();
  const std::vector<double> gx = x.grad().to_vector<double>(), gw = w.grad().to_vector<double>();
  x.zero_grad();
  w.zero_grad();
  {
    DetectAnomalyGuard on;
    f().backward();
  }
  CHECK(x.grad().to_vector<double>() == gx);
  CHECK(w.grad().to_vector<double>() == gw);
}

TEST_CASE("an upstream gradient that is another tensor's gradient is not overwritten during the walk") {
  Tensor x = tensor({1, 2, 3, 4}, {4}, float64).requires_grad_();
  Tensor w = tensor({0.5, -1, 2, 3}, {4}, float64).requires_grad_();
  sum(x * w).backward();  // x.grad = w, w.grad = x
  Tensor y = x * w;
  y.backward(x.grad());   // adds x.grad * w into x.grad and x.grad * x into w.grad
  const std::vector<double> xv{1, 2, 3, 4}, wv{0.5, -1, 2, 3};
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(x.grad().to_vector<double>()[i] == wv[i] + wv[i] * wv[i]);
    CHECK(w.grad().to_vector<double>()[i] == xv[i] + wv[i] * xv[i]);
  }
}

TEST_CASE("a retained gradient survives a backward that frees the last node holding its tensor") {
  Tensor x = tensor({1, 2, 3}, {3}, float64).requires_grad_();
  Tensor loss;
  {
    Tensor h = x * 2.0;
    h.retain_grad();
    loss = sum(h * 3.0);
    loss.backward(Tensor(), true);
  }  // h dropped: only the tape's nodes hold its slot
  loss.backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{12, 12, 12});
  CHECK(tape().size() == 0);
}
