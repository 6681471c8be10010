#include "tapegrad/random.h"

#include <cmath>
#include <numbers>

#include "dispatch.h"
#include "kernels/parallel.h"

namespace tg {

// SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
// the state after i steps is seed + i * gamma, so position i is reachable directly.
std::uint64_t Generator::bits(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double Generator::uniform(std::uint64_t seed, std::uint64_t i) {
  return static_cast<double>(bits(seed, i) >> 11) * 0x1.0p-53;  // 53 random bits in [0, 1)
}

double Generator::uniform_open0(std::uint64_t seed, std::uint64_t i) {
  return (static_cast<double>(bits(seed, i) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
}

void Generator::set_shard(std::uint64_t i, std::uint64_t k) {
  if (k < 1 || i >= k) fail("Generator::set_shard", "shard ", i, " of ", k, " does not exist (need i < k, k >= 1)");
  shard_ = i;
  shards_ = k;
}

double Generator::next_uniform() { return uniform(seed_, advance(1)); }

std::int64_t Generator::next_int(std::int64_t low, std::int64_t high) {
  if (high <= low) fail("randint", "empty range [", low, ", ", high, ")");
  const auto span = static_cast<std::uint64_t>(high - low);
  return low + static_cast<std::int64_t>(bits(seed_, advance(1)) % span);  // bias < span / 2^64
}

Generator& default_generator() {
  static Generator g;
  return g;
}

void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

namespace {
Generator& pick(Generator* g) { return g ? *g : default_generator(); }

// Box-Muller on pairs: elements 2j and 2j+1 come from stream positions 2j and 2j+1.
template <class T>
void fill_normal(T* p, std::int64_t n, double mean, double std, std::uint64_t seed, std::uint64_t base) {
  const std::int64_t pairs = (n + 1) / 2;
  kernels::parallel_for(pairs, n, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t j = lo; j < hi; ++j) {
      const double u1 = Generator::uniform_open0(seed, base + 2 * static_cast<std::uint64_t>(j));
      const double u2 = Generator::uniform(seed, base + 2 * static_cast<std::uint64_t>(j) + 1);
      const double r = std::sqrt(-2.0 * std::log(u1));
      const double th = 2.0 * std::numbers::pi * u2;
      p[2 * j] = static_cast<T>(mean + std * r * std::cos(th));
      if (2 * j + 1 < n) p[2 * j + 1] = static_cast<T>(mean + std * r * std::sin(th));
    }
  });
}
}  // namespace

void normal_(Tensor& t, double mean, double std, Generator* gen) {
  detail::check_float("normal_", t);
  detail::check_no_history("normal_", t);
  if (!(std >= 0) || !std::isfinite(std) || !std::isfinite(mean)) fail("normal_", "invalid mean ", mean, " or std ", std);
  Generator& g = pick(gen);
  const std::int64_t n = t.numel();
  const std::uint64_t base = g.advance(2 * static_cast<std::uint64_t>((n + 1) / 2));
  detail::dispatch_float("normal_", t.dtype(), [&](auto z) {
    using T = decltype(z);
    fill_normal(t.data<T>(), n, mean, std, g.seed(), base);
  });
  t.bump_version();  // an in-place write: a graph that saved t refuses its backward
}

void uniform_(Tensor& t, double low, double high, Generator* gen) {
  detail::check_float("uniform_", t);
  detail::check_no_history("uniform_", t);
  if (!(low <= high) || !std::isfinite(low) || !std::isfinite(high)) fail("uniform_", "invalid range [", low, ", ", high, ")");
  Generator& g = pick(gen);
  const std::int64_t n = t.numel();
  const std::uint64_t base = g.advance(static_cast<std::uint64_t>(n));
  const std::uint64_t seed = g.seed();
  detail::dispatch_float("uniform_", t.dtype(), [&](auto z) {
    using T = decltype(z);
    T* p = t.data<T>();
    kernels::parallel_for(n, n, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i)
        p[i] = static_cast<T>(low + (high - low) * Generator::uniform(seed, base + static_cast<std::uint64_t>(i)));
    });
  });
  t.bump_version();  // as normal_
}

Tensor randn(const Shape& shape, DType dtype, Generator* gen) {
  if (!is_floating(dtype)) fail("randn", "needs a float dtype, got ", dtype);
  Tensor t = Tensor::empty(shape, dtype);
  normal_(t, 0.0, 1.0, gen);
  return t;
}

Tensor rand(const Shape& shape, DType dtype, Generator* gen) {
  if (!is_floating(dtype)) fail("rand", "needs a float dtype, got ", dtype);
  Tensor t = Tensor::empty(shape, dtype);
  uniform_(t, 0.0, 1.0, gen);
  return t;
}

Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Generator* gen) {
  if (high <= low) fail("randint", "empty range [", low, ", ", high, ")");
  if (low < INT32_MIN || high - 1 > INT32_MAX) fail("randint", "range [", low, ", ", high, ") does not fit int32");
  Tensor t = Tensor::empty(shape, int32);
  Generator& g = pick(gen);
  const std::uint64_t base = g.advance(static_cast<std::uint64_t>(t.numel()));
  const auto span = static_cast<std::uint64_t>(high - low);
  std::int32_t* p = t.data<std::int32_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i)
    p[i] = static_cast<std::int32_t>(low + static_cast<std::int64_t>(Generator::bits(g.seed(), base + static_cast<std::uint64_t>(i)) % span));
  return t;
}

}  // namespace tg
