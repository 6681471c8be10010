// tg::dist's collectives: all_reduce (sum and mean, float32 and float64, in place), broadcast,
// barrier, and their errors. Run under mpirun at 2 and 3 ranks, and alone (a world of one).
// Every rank takes the same path through every test (CHECK, not REQUIRE, where a collective
// follows), so the collectives always meet.
#include <chrono>
#include <cstring>
#include <thread>

#include "dist_helpers.h"

using namespace tg;
using namespace tgdist;
using namespace tgtest;

TEST_CASE("all_reduce sums and averages float32 and float64 in place, the same bits on every rank") {
  const int n = dist::world_size(), r = dist::rank();
  for (DType dt : {float32, float64}) {
    // Element i on rank r: r + i / 4 (exact in both dtypes): the sum is n (n - 1) / 2 + n i / 4.
    Tensor t = Tensor::empty({5, 3}, dt);
    for (std::int64_t i = 0; i < t.numel(); ++i) t.set({i / 3, i % 3}, r + i / 4.0);
    Tensor m = t.clone();
    dist::all_reduce(t);
    dist::all_reduce(m, dist::ReduceOp::mean);
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double sum = n * (n - 1) / 2.0 + n * (i / 4.0);
      CHECK(t.at({i / 3, i % 3}) == sum);
      CHECK(m.at({i / 3, i % 3}) == Approx(sum / n).epsilon(1e-7));
    }
    CHECK(same_on_every_rank(m));
  }
  CHECK(dist::all_reduce(r + 0.5) == n * (n - 1) / 2.0 + 0.5 * n);
  CHECK(dist::all_reduce(r + 0.5, dist::ReduceOp::mean) == Approx((n - 1) / 2.0 + 0.5));
}

TEST_CASE("all_reduce of a larger float32 tensor equals the sum computed on one rank") {
  const int n = dist::world_size();
  // Element i on rank r: (r + 1) * v_i with v_i an integer in [-500, 500): every partial sum is an
  // integer below 2^24, exact in float32 whatever the order of the additions.
  Tensor t = Tensor::empty({257, 129});
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>((dist::rank() + 1) * (i % 1000 - 500));
  dist::all_reduce(t);
  bool all_equal = true;
  for (std::int64_t i = 0; i < t.numel(); ++i) all_equal = all_equal && p[i] == static_cast<float>(n * (n + 1) / 2 * (i % 1000 - 500));
  CHECK(all_equal);
}

TEST_CASE("broadcast copies the root's data to every rank, for every root and dtype") {
  const int n = dist::world_size();
  for (int root = 0; root < n; ++root) {
    Tensor f = full({4, 2}, 10.0 * dist::rank() + 1.5);
    Tensor i = full({3}, dist::rank(), int32);
    Tensor h = full({2}, dist::rank() + 0.25, float64).to(bfloat16);
    dist::broadcast(f, root);
    dist::broadcast(i, root);
    dist::broadcast(h, root);
    CHECK(f.to_vector<double>() == std::vector<double>(8, 10.0 * root + 1.5));
    CHECK(i.to_vector<std::int32_t>() == std::vector<std::int32_t>(3, root));
    CHECK(h.to_vector<double>() == std::vector<double>(2, root + 0.25));
  }
}

TEST_CASE("barrier returns on every rank only after the last rank reached it") {
  using Clock = std::chrono::steady_clock;
  dist::barrier();
  const auto t0 = Clock::now();
  if (dist::rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  dist::barrier();
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  if (dist::world_size() > 1) CHECK(waited > 0.25);  // rank 0 slept 0.3 s before its barrier
}

TEST_CASE("collectives refuse what they cannot reduce, naming the function") {
  Tensor i = zeros({3}, int32);
  REQUIRE_TG_ERROR(dist::all_reduce(i), "all_reduce", "float32 or float64", "int32");
  Tensor undefined;
  REQUIRE_TG_ERROR(dist::all_reduce(undefined), "all_reduce", "undefined");
  REQUIRE_TG_ERROR(dist::broadcast(undefined), "broadcast", "undefined");
  Tensor f = zeros({2});
  REQUIRE_TG_ERROR(dist::broadcast(f, dist::world_size()), "broadcast", "root");
  REQUIRE_TG_ERROR(dist::broadcast(f, -1), "broadcast", "root");
}

TEST_CASE("the process group answers where it is") {
  CHECK(dist::world_size() >= 1);
  CHECK(dist::rank() >= 0);
  CHECK(dist::rank() < dist::world_size());
  CHECK(dist::local_world_size() == dist::world_size());  // the tests run on one machine
  CHECK(dist::is_initialized() == dist::launched());
}
