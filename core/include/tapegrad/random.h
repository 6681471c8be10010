#pragma once
// Reproducible random numbers. A Generator is (seed, offset): value number i of the stream is a
// pure function of (seed, i) (SplitMix64's output function), so random ops fill tensors in
// parallel and still give the same numbers for any thread count, and a generator's state is two
// integers that a checkpoint can store.
#include <cstdint>

#include "tapegrad/tensor.h"

namespace tg {

class Generator {
 public:
  static constexpr std::uint64_t kDefaultSeed = 67280421310721ULL;  // PyTorch's default seed
  explicit Generator(std::uint64_t seed = kDefaultSeed) : seed_(seed) {}
  void manual_seed(std::uint64_t seed) { seed_ = seed; offset_ = 0; }
  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }
  void set_state(std::uint64_t seed, std::uint64_t offset) { seed_ = seed; offset_ = offset; }
  // Reserves n consecutive stream positions and returns the first. As shard i of k (set_shard),
  // reserves k * n and returns the first of the i-th n.
  std::uint64_t advance(std::uint64_t n) {
    const std::uint64_t o = offset_ + shard_ * n;
    offset_ += shards_ * n;
    return o;
  }
  // Data parallelism: this process computes rows [i * b, (i + 1) * b) of a batch of k * b rows
  // that a single process would compute whole (tg::dist, train_lm under mpirun). A random op on a
  // tensor whose first dimension is the batch (dropout on (B, T, C) or (B, H, T, T)) then draws
  // exactly the numbers the single process draws for those rows, and the stream ends at the
  // same offset. (0, 1), the default, is a whole batch. Not part of the state (seed, offset).
  void set_shard(std::uint64_t i, std::uint64_t k);
  std::uint64_t shard() const { return shard_; }
  std::uint64_t shards() const { return shards_; }

  // Stream value at position i: 64 random bits, a uniform double in [0, 1), one in (0, 1].
  static std::uint64_t bits(std::uint64_t seed, std::uint64_t i);
  static double uniform(std::uint64_t seed, std::uint64_t i);
  static double uniform_open0(std::uint64_t seed, std::uint64_t i);

  // Single draws (advance the stream by one).
  double next_uniform();
  std::int64_t next_int(std::int64_t low, std::int64_t high);  // in [low, high)

 private:
  std::uint64_t seed_;
  std::uint64_t offset_ = 0;
  std::uint64_t shard_ = 0, shards_ = 1;
};

// The generator used when none is passed.
Generator& default_generator();
// Seeds the default generator (torch.manual_seed).
void manual_seed(std::uint64_t seed);

Tensor randn(const Shape& shape, DType dtype = float32, Generator* gen = nullptr);  // N(0, 1)
Tensor rand(const Shape& shape, DType dtype = float32, Generator* gen = nullptr);   // U[0, 1)
Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Generator* gen = nullptr);  // int32

// In-place initialisers (no autograd), as torch.nn.init. Each is an in-place write (version()): a
// graph that saved t refuses its backward, as PyTorch's does after an init under no_grad; and, as
// Tensor::copy_, refused while recording for a t that a recorded op made.
void normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
void uniform_(Tensor& t, double low = 0.0, double high = 1.0, Generator* gen = nullptr);

}  // namespace tg
