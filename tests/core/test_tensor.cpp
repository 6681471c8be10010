// Tensor basics: factories, dtypes, element access, views and copies, printing, the seeded generator.
#include <cmath>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#include "helpers.h"
#include "tapegrad/memory.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("factories fill shape, dtype and values") {
  Tensor z = zeros({2, 3});
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.dtype() == float32);
  CHECK(z.numel() == 6);
  for (double v : z.to_vector<double>()) CHECK(v == 0.0);
  for (double v : ones({4}, float64).to_vector<double>()) CHECK(v == 1.0);
  for (double v : full({2, 2}, 2.5, float64).to_vector<double>()) CHECK(v == 2.5);
  CHECK(full({3}, 7, int32).to_vector<int>() == std::vector<int>{7, 7, 7});
  CHECK(arange(4).to_vector<double>() == std::vector<double>{0, 1, 2, 3});
  CHECK(arange(1.0, 2.0, 0.25, float64).to_vector<double>() == std::vector<double>{1, 1.25, 1.5, 1.75});
  CHECK(arange(5.0, 0.0, -2.0, int32).to_vector<int>() == std::vector<int>{5, 3, 1});
  Tensor t = tensor({1, 2, 3, 4, 5, 6}, {2, 3}, float64);
  CHECK(t.at({1, 2}) == 6.0);
  CHECK(t.at({-1, 0}) == 4.0);
  CHECK(tensor({5}).dim() == 0);  // one value, no shape: a 0-d scalar
  CHECK(tensor({5}).item() == 5.0);
  CHECK(from_vector<int>({1, 2}, {2}).dtype() == int32);
  CHECK(zeros_like(t).shape() == t.shape());
  CHECK(Tensor::empty({0, 3}).numel() == 0);
}

TEST_CASE("bad factory arguments raise tg::Error naming the function") {
  REQUIRE_TG_ERROR(zeros({2, -1}), "empty", "negative dimension", "(2, -1)");
  // Byte counts beyond 1 TiB (or beyond 64 bits) are refused before any allocation...
  REQUIRE_TG_ERROR(zeros({std::int64_t(1) << 20, std::int64_t(1) << 19}), "empty", "too large");
  REQUIRE_TG_ERROR(zeros({std::int64_t(1) << 40, std::int64_t(1) << 40, 3}), "empty", "too large");
  // ...but a zero dimension makes any shape empty, wherever it stands.
  CHECK(Tensor::empty({std::int64_t(1) << 62, 0}).numel() == 0);
  CHECK(Tensor::empty({0, std::int64_t(1) << 62}).numel() == 0);
  REQUIRE_TG_ERROR(tensor({1, 2, 3}, {2, 2}), "tensor", "3 values", "(2, 2)");
  REQUIRE_TG_ERROR(arange(0.0, 1.0, 0.0), "arange");
  REQUIRE_TG_ERROR(randn({2}, int32), "randn", "int32");
  REQUIRE_TG_ERROR(randint(3, 3, {2}), "randint", "empty range");
  REQUIRE_TG_ERROR((Shape{1, 2, 3, 4, 5, 6, 7, 8, 9}), "Shape", "at most 8");
  Tensor t = zeros({2, 2});
  REQUIRE_TG_ERROR(t.item(), "item", "(2, 2)");
  REQUIRE_TG_ERROR(t.at({2, 0}), "at", "index 2", "(2, 2)");
  REQUIRE_TG_ERROR(t.at({0}), "at", "1 indices");
  REQUIRE_TG_ERROR(t.data<double>(), "data", "float32", "float64");
  REQUIRE_TG_ERROR(t.size(2), "size", "axis 2");
  Tensor ids = zeros({2}, int32);
  REQUIRE_TG_ERROR(ids.requires_grad_(), "requires_grad_", "int32");
}

TEST_CASE("an int32 tensor refuses a value that has no int32, in every factory and in set") {
  // A double converts to int32 by truncation toward zero when the result fits; NaN or a value
  // outside the range has no int32 (static_cast is undefined behaviour there, INT32_MIN on x86).
  REQUIRE_TG_ERROR(tensor({1, 3e9}, {2}, int32), "tensor", "value 3e+09", "int32", "(2,)");
  REQUIRE_TG_ERROR(full({2}, std::nan(""), int32), "full", "value nan", "int32", "(2,)");
  REQUIRE_TG_ERROR(full({0}, -1e10, int32), "full", "int32");  // refused as PyTorch does, even when empty
  REQUIRE_TG_ERROR(arange(2147483640.0, 2147483650.0, 1.0, int32), "arange", "value 2.14748e+09", "int32");
  Tensor t = zeros({2}, int32);
  REQUIRE_TG_ERROR(t.set({1}, -2147483649.0), "set", "int32", "(2,)");
  REQUIRE_TG_ERROR(t.set({1}, HUGE_VAL), "set", "inf");
  CHECK(t.to_vector<int>() == std::vector<int>{0, 0});  // nothing written
  // the whole range, each end truncated toward zero
  t.set({0}, 2147483647.9);
  t.set({1}, -2147483648.9);
  CHECK(t.to_vector<int>() == std::vector<int>{2147483647, -2147483647 - 1});
  CHECK(tensor({-2.7, 2.7}, {2}, int32).to_vector<int>() == std::vector<int>{-2, 2});
  // arange's element count is checked before it becomes an int64
  REQUIRE_TG_ERROR(arange(0.0, 1e300, 1.0), "arange", "1e+300 elements");
}

TEST_CASE("to_vector refuses an undefined tensor and a float that has no value of the integer type") {
  REQUIRE_TG_ERROR(Tensor().to_vector<double>(), "to_vector", "undefined");
  REQUIRE_TG_ERROR(tensor({1, std::nan("")}, {2}).to_vector<int>(), "to_vector", "value nan", "position 1", "float32 (2,)");
  REQUIRE_TG_ERROR(tensor({-3e9}, {1}, float64).to_vector<int>(), "to_vector", "-3e+09");
  CHECK(tensor({-2.7, 2.7, 3e9}, {3}, float64).to_vector<std::int64_t>() == std::vector<std::int64_t>{-2, 2, 3000000000});
  CHECK(tensor({-2.7, 2.7}, {2}).to_vector<int>() == std::vector<int>{-2, 2});
  // Each end of the type's range: -2^63 fits int64, 2^63 does not; -2^31 - 0.5 truncates into int32.
  CHECK(tensor({-0x1p63}, {1}, float64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{std::numeric_limits<std::int64_t>::min()});
  REQUIRE_TG_ERROR(tensor({0x1p63}, {1}, float64).to_vector<std::int64_t>(), "to_vector", "does not fit");
  CHECK(tensor({-2147483648.5, 2147483647.5}, {2}, float64).to_vector<std::int32_t>() ==
        std::vector<std::int32_t>{std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max()});
  REQUIRE_TG_ERROR(tensor({-2147483649.0}, {1}, float64).to_vector<std::int32_t>(), "to_vector", "does not fit");
}

TEST_CASE("an undefined tensor holds no elements and no bytes, a defined 0-d tensor holds one") {
  const Tensor u;
  CHECK_FALSE(u.defined());
  CHECK(u.dim() == 0);
  CHECK(u.numel() == 0);
  CHECK(u.nbytes() == 0);
  Tensor r = tensor({1, 2}, {2});
  r.reset();  // undefined again, as Tensor()
  CHECK(r.numel() == 0);
  CHECK(r.nbytes() == 0);
  CHECK(u.detach().numel() == 0);
  CHECK(Tensor().grad().numel() == 0);  // no gradient: an undefined tensor
  REQUIRE_TG_ERROR(u.item(), "item", "undefined");
  const Tensor s = full({}, 2.5, float64);  // 0-d: the empty product, one element
  CHECK(s.defined());
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.nbytes() == 8);
  CHECK(s.item() == 2.5);
  CHECK(zeros({0, 3}).numel() == 0);
  CHECK(zeros({0, 3}).defined());
}

TEST_CASE("set and at round-trip through every dtype") {
  for (DType d : {float32, float64, int32}) {
    Tensor t = zeros({2, 2}, d);
    t.set({0, 1}, 3);
    t.set({-1, -1}, -2);
    CHECK(t.at({0, 1}) == 3.0);
    CHECK(t.at({1, 1}) == -2.0);
    CHECK(t.to_vector<double>() == std::vector<double>{0, 3, 0, -2});
  }
}

TEST_CASE("copies share storage, clone and detach behave as in PyTorch") {
  Tensor a = tensor({1, 2, 3, 4}, {2, 2});
  Tensor b = a;  // handle copy
  b.set({0, 0}, 9);
  CHECK(a.at({0, 0}) == 9.0);
  Tensor c = a.clone();
  c.set({0, 0}, -1);
  CHECK(a.at({0, 0}) == 9.0);
  CHECK_FALSE(c.shares_storage(a));
  Tensor v = a.reshape({4});
  CHECK(v.shares_storage(a));
  v.set({3}, 7);
  CHECK(a.at({1, 1}) == 7.0);
  Tensor w = a.view({-1});
  CHECK(w.shape() == Shape{4});
  a.requires_grad_();
  Tensor d = a.detach();
  CHECK(d.shares_storage(a));
  CHECK_FALSE(d.requires_grad());
  CHECK(a.requires_grad());
}

TEST_CASE("to() converts between dtypes") {
  Tensor a = tensor({1.5, -2.25, 3}, {3}, float64);
  Tensor f = a.to(float32);
  CHECK(f.dtype() == float32);
  CHECK(f.to_vector<double>() == std::vector<double>{1.5, -2.25, 3});
  CHECK(a.to(int32).to_vector<int>() == std::vector<int>{1, -2, 3});  // truncation toward zero, as PyTorch
  CHECK(a.to(float64).shares_storage(a));                           // same dtype: the tensor itself
}

TEST_CASE("operator<< prints shape, dtype and values like PyTorch") {
  std::ostringstream s;
  s << tensor({1, 2.5, -3, 4}, {2, 2});
  CHECK(s.str() == "tensor([[ 1.0000,  2.5000],\n        [-3.0000,  4.0000]], shape=(2, 2), dtype=float32)");
  std::ostringstream i;
  i << from_vector<int>({1, 20, 3}, {3});
  CHECK(i.str() == "tensor([ 1, 20,  3], shape=(3,), dtype=int32)");
  std::ostringstream g;
  Tensor p = ones({2}, float64);
  p.requires_grad_();
  g << p;
  CHECK(g.str() == "tensor([1., 1.], shape=(2,), dtype=float64, requires_grad=true)");
  std::ostringstream big;
  big << arange(2000);
  CHECK(big.str().find("...") != std::string::npos);
  CHECK(big.str().find("1999.") != std::string::npos);
  std::ostringstream sci;
  sci << tensor({1e-6, 1.0});
  CHECK(sci.str().find("e-06") != std::string::npos);
}

TEST_CASE("manual_seed makes random tensors reproducible") {
  manual_seed(42);
  Tensor a = randn({1000});
  Tensor u = rand({5}, float64);
  manual_seed(42);
  Tensor b = randn({1000});
  Tensor u2 = rand({5}, float64);
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  CHECK(u.to_vector<double>() == u2.to_vector<double>());
  manual_seed(43);
  CHECK(randn({1000}).to_vector<float>() != a.to_vector<float>());
}

TEST_CASE("random tensors have the right distribution") {
  Generator g(7);
  Tensor n = randn({200000}, float64, &g);
  const double m = mean(n).item(), v = var(n).item();
  CHECK(std::fabs(m) < 0.01);
  CHECK(std::fabs(v - 1.0) < 0.02);
  Tensor u = rand({200000}, float64, &g);
  CHECK(std::fabs(mean(u).item() - 0.5) < 0.005);
  CHECK(max(u).item() < 1.0);
  Tensor r = randint(-3, 4, {10000}, &g);
  auto rv = r.to_vector<int>();
  CHECK(*std::min_element(rv.begin(), rv.end()) == -3);
  CHECK(*std::max_element(rv.begin(), rv.end()) == 3);
}

TEST_CASE("a generator's state is (seed, offset) and restores exactly") {
  Generator g(123);
  (void)randn({7}, float32, &g);
  const auto seed = g.seed(), off = g.offset();
  Tensor a = randn({5}, float64, &g);
  g.set_state(seed, off);
  Tensor b = randn({5}, float64, &g);
  CHECK(a.to_vector<double>() == b.to_vector<double>());
}

TEST_CASE("random values do not depend on the thread count") {
  const int before = get_num_threads();
  Generator g1(5), g2(5);
  set_num_threads(1);
  Tensor a = randn({100000}, float32, &g1);
  set_num_threads(2);
  Tensor b = randn({100000}, float32, &g2);
  set_num_threads(before);
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  REQUIRE_TG_ERROR(set_num_threads(0), "set_num_threads");
}

TEST_CASE("tensors of up to 64 bytes keep their data inside the Storage, larger ones in a block of their own") {
  empty_cache();
  for (std::int64_t n : {0, 1, 15, 16, 17, 1000}) {
    INFO("numel " << n);
    Tensor t = arange(static_cast<double>(n), static_cast<double>(3 * n), 2.0);  // n, n + 2, ..., 3n - 2
    REQUIRE(t.numel() == n);
    CHECK(reinterpret_cast<std::uintptr_t>(t.raw_data()) % 64 == 0);  // the alignment kernels rely on
    Tensor r = t.reshape({n, 1});  // a view shares the memory, inline or not
    CHECK(r.raw_data() == t.raw_data());
    Tensor c = t.clone();
    if (n > 0) {
      c.set({0}, -5);
      CHECK(t.at({0}) == static_cast<double>(n));
      CHECK(r.at({n - 1, 0}) == static_cast<double>(3 * n - 2));
    }
  }
  // Nothing of up to 64 bytes passes through the cache; 17 floats (68 bytes, a 128-byte block) do.
#if !defined(__SANITIZE_ADDRESS__)
  CHECK(cached_bytes() >= 4000);  // the 1000-element tensors above
#endif
  empty_cache();
  { Tensor a = zeros({16}), b = zeros({2, 2}, float64); }
  CHECK(cached_bytes() == 0);
  { Tensor a = zeros({17}); }
#if !defined(__SANITIZE_ADDRESS__)
  CHECK(cached_bytes() == 128);
#endif
  empty_cache();
}

TEST_CASE("the caching allocator reuses freed blocks") {
  empty_cache();
  void* first = nullptr;
  { Tensor t = zeros({1000}); first = t.raw_data(); }
#if defined(__SANITIZE_ADDRESS__)
  CHECK(cached_bytes() == 0);  // off under AddressSanitizer, so use-after-free stays visible
  (void)first;
#else
  CHECK(cached_bytes() >= 4000);
  { Tensor t = zeros({1000}); CHECK(t.raw_data() == first); }
  empty_cache();
  CHECK(cached_bytes() == 0);
#endif
}

TEST_CASE("tensors made in a LongLivedAllocations scope keep out of the memory a step frees") {
  // A block of 4 MiB (above 64 KiB: the arenas' blocks) freed outside the scope stays for the next
  // request outside it; one made inside the scope comes from segments of its own, and goes back
  // there.
  empty_cache();
  void* freed = nullptr;
  { Tensor step = zeros({1 << 20}); freed = step.raw_data(); }
  {
    const LongLivedAllocations scope;
    Tensor state = zeros({1 << 20});
    CHECK(state.raw_data() != freed);
    { const LongLivedAllocations nested; }  // scopes nest: the outer one still holds after this
    Tensor more = zeros({1 << 20});
    CHECK(more.raw_data() != freed);
  }
#if !defined(__SANITIZE_ADDRESS__)
  { Tensor step = zeros({1 << 20}); CHECK(step.raw_data() == freed); }
#endif
  empty_cache();
  CHECK(cached_bytes() == 0);
}

TEST_CASE("tensor handles can be copied and dropped from several threads at once") {
  // Storages and autograd slots count their references atomically (detail::Ref), as shared_ptr
  // does, so threads may share a parameter and copy it freely. Counts updated without atomics
  // lose updates here (most runs of such a build end with a wrong count): the tensor would be
  // freed while held, or never.
  Tensor w = randn({16}).requires_grad_();
  std::vector<std::thread> team;
  for (int t = 0; t < 4; ++t)
    team.emplace_back([&w] {
      for (int i = 0; i < 500000; ++i) {
        Tensor c = w;
        Tensor d = c.detach();  // shares the storage only
        (void)d;
      }
    });
  for (auto& t : team) t.join();
  CHECK(w.meta().use_count() == 1);
  CHECK(w.sole_owner());
}

TEST_CASE("tensors and graphs made on one thread can be dropped on another") {
  // Their blocks (storage, slot, small data) join the pools of the thread that frees them, or the
  // heap once that thread's pools are gone; nothing may be freed twice or leak (AddressSanitizer
  // and LeakSanitizer watch the sanitizer build).
  std::vector<Tensor> made;
  std::thread maker([&made] {
    Tensor w = randn({8}).requires_grad_();
    for (int i = 0; i < 2000; ++i) made.push_back(w * static_cast<double>(i) + 1.0);  // recorded on this thread's tape
    made.push_back(randn({4096}));                                                  // a cached block, too
  });
  maker.join();  // the maker's tape and pools are gone; its tensors are still valid
  CHECK(made[1999].at({0}) == Approx(made[1].at({0}) + 1998 * (made[1].at({0}) - 1.0)));
  made.clear();

  std::vector<Tensor> handed;
  for (int i = 0; i < 2000; ++i) handed.push_back(full({i % 20 + 1}, static_cast<double>(i)));
  double seen = 0;
  std::thread dropper([&handed, &seen] {
    for (const Tensor& t : handed) seen += t.at({0});
    handed.clear();  // freed here, allocated on the main thread
  });
  dropper.join();
  CHECK(handed.empty());
  CHECK(seen == 1999.0 * 2000.0 / 2.0);
}
