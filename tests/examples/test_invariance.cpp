// The paper's Table 1 and section-4 claims hold as measured, for several deltas, shapes and seeds.
#include "helpers.h"
#include "invariance/invariance.h"

TEST_CASE("every cell of Table 1 agrees with the paper", "[invariance]") {
  for (double delta : {0.01, 0.5, 3.7, 250.0})
    for (auto [N, m, n] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{16, 24, 32}, {4, 7, 17}, {64, 3, 8}})
      for (std::uint64_t seed : {0u, 1u, 2u}) {
        inv::Setup s;
        s.delta = delta;
        s.N = N;
        s.m = m;
        s.n = n;
        s.seed = seed;
        for (inv::Norm nm : inv::all_norms())
          for (inv::Transform t : inv::all_transforms()) {
            const inv::Cell c = inv::measure(nm, t, s);
            INFO(inv::name(nm) << " / " << inv::name(t) << " delta " << delta << " shape " << N << "x" << m << "x" << n
                               << " seed " << seed << ": change " << c.change);
            if (inv::paper_says_invariant(nm, t)) CHECK(c.change < 1e-12);
            else CHECK(c.change > 1e-3);  // clearly not invariant, far from rounding
          }
      }
}

TEST_CASE("section 4: gradient invariances and the 1/delta weight-gradient scaling", "[invariance]") {
  for (double delta : {0.1, 3.7, 42.0})
    for (std::uint64_t seed : {0u, 5u})
      for (bool partial : {false, true}) {
        inv::Setup s;
        s.delta = delta;
        s.seed = seed;
        for (const inv::Claim& c : inv::measure_gradients(s, partial)) {
          INFO(c.what << " delta " << delta << " seed " << seed << " partial " << partial);
          CHECK(c.deviation < 1e-12);
          CHECK(c.ratio == Approx(c.expected).epsilon(1e-12));
        }
      }
}

TEST_CASE("eps > 0 breaks the exact invariances, most for small scales", "[invariance]") {
  inv::Setup s;
  s.eps = 1e-3;
  s.delta = 0.01;  // scaled-down activations: eps is no longer negligible against mean(a^2)
  CHECK_FALSE(inv::measure(inv::Norm::rmsnorm, inv::Transform::data_rescale, s).invariant);
  CHECK(inv::measure(inv::Norm::rmsnorm, inv::Transform::data_rescale, s).change > 1e-2);
  s.delta = 3.7;
  s.eps = 1e-8;  // a large scale and a tiny eps: invariant again to about eps / mean(a^2)
  CHECK(inv::measure(inv::Norm::rmsnorm, inv::Transform::data_rescale, s).change < 1e-7);
}
