// Sampling from a GPT, with a cache of every block's keys and values (KVCache).
//
// Without the cache, each new token runs the whole window through the model again: T positions'
// work for one position's logits. With it, a block's keys and values of the positions already
// seen are kept, and a new token runs through the model alone: its query attends to the cached
// keys and values and its own. The result is the same computation (causal attention never lets a
// position see later ones), so cached and uncached sampling pick the same tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "tapegrad/autograd.h"
#include "tapegrad/nn/gpt.h"
#include "tapegrad/ops.h"

namespace tg::nn {

namespace {

// Attention of T new positions to the L = len + T cached ones, per head, in one sequence:
//   q (T, ld) with head h in columns [h hs, (h+1) hs); K, V (L, C) the same head blocks;
//   y (T, C): y_i = sum_{j <= len + i} softmax_j(q_i . k_j * scale) v_j.
template <class T>
void cached_attention(const T* q, std::int64_t ld, const T* K, const T* V, T* y, std::int64_t Tn, std::int64_t len,
                      std::int64_t C, std::int64_t H) {
  const std::int64_t hs = C / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> s(static_cast<std::size_t>(len + Tn));
  for (std::int64_t i = 0; i < Tn; ++i)
    for (std::int64_t h = 0; h < H; ++h) {
      const T* qi = q + i * ld + h * hs;
      const std::int64_t L = len + i + 1;  // keys this position sees
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < L; ++j) {
        const T* kj = K + j * C + h * hs;
        double d = 0;
        for (std::int64_t e = 0; e < hs; ++e) d += static_cast<double>(qi[e]) * kj[e];
        s[static_cast<std::size_t>(j)] = d * scale;
        mx = std::max(mx, d * scale);
      }
      double z = 0;
      for (std::int64_t j = 0; j < L; ++j) z += (s[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - mx));
      T* yi = y + i * C + h * hs;
      for (std::int64_t e = 0; e < hs; ++e) {
        double acc = 0;
        for (std::int64_t j = 0; j < L; ++j) acc += s[static_cast<std::size_t>(j)] * V[j * C + h * hs + e];
        yi[e] = static_cast<T>(acc / z);
      }
    }
}

// One token from the last position's logits z (V values): softmax(z / temperature) over the top_k
// largest (all when top_k <= 0), sampled by inverting the cumulative sum at a uniform draw.
std::int32_t pick_token(std::vector<double> z, double temperature, std::int64_t top_k, Generator& g) {
  const auto V = static_cast<std::int64_t>(z.size());
  if (top_k > 0 && top_k < V) {
    std::vector<double> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[static_cast<std::size_t>(top_k - 1)];
    for (double& v : z)
      if (v < kth) v = -INFINITY;
  }
  const double mx = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (double& v : z) s += (v = std::exp((v - mx) / temperature));
  double u = g.next_uniform() * s;
  std::int32_t pick = 0;
  for (std::int64_t k = 0; k < V; ++k) {
    u -= z[static_cast<std::size_t>(k)];
    if (u < 0 || k == V - 1) { pick = static_cast<std::int32_t>(k); break; }
  }
  // a token of probability 0 is never picked, even at the end of the loop
  while (z[static_cast<std::size_t>(pick)] == 0 && pick > 0) --pick;
  return pick;
}

// The last position's logits of (1, T, V) logits, as doubles. Logits holding NaN or +inf, or
// only -inf, have no softmax (every probability NaN): refused, naming the step, as
// torch.multinomial refuses their probabilities, rather than read as a draw of the last token.
std::vector<double> last_logits(const Tensor& logits, std::int64_t step) {
  const Tensor l = logits.to(float64);
  const std::int64_t T = l.size(1), V = l.size(2);
  const double* last = l.data<double>() + (T - 1) * V;
  bool finite_one = false;
  for (std::int64_t k = 0; k < V; ++k) {
    if (std::isnan(last[k]) || last[k] == INFINITY)
      fail("generate", "the logits of token ", step, " are ", last[k], " at vocabulary entry ", k, " of ", V,
           ": nothing to sample from (the model's weights or its input are not finite)");
    finite_one = finite_one || std::isfinite(last[k]);
  }
  if (!finite_one) fail("generate", "the logits of token ", step, " are -inf for all ", V, " vocabulary entries");
  return std::vector<double>(last, last + V);
}

// "(1, 4, 16) float32", or "undefined", for messages.
std::string describe(const Tensor& t) {
  return t.defined() ? t.shape().str() + " " + dtype_name(t.dtype()) : std::string("undefined");
}

// Restores a module's training mode when generation ends, also by an exception.
struct TrainingModeKept {
  Module& m;
  bool was;
  explicit TrainingModeKept(Module& module) : m(module), was(module.is_training()) {}
  ~TrainingModeKept() { m.train(was); }
  TrainingModeKept(const TrainingModeKept&) = delete;
  TrainingModeKept& operator=(const TrainingModeKept&) = delete;
};

}  // namespace

Tensor Block::forward_cached(const Tensor& x, Tensor& k_cache, Tensor& v_cache, std::int64_t len, std::int64_t pos0) {
  const std::int64_t C = qkv->in_features, H = n_head_;
  if (!x.defined() || x.dim() != 3 || x.size(0) != 1 || x.size(2) != C || x.dtype() != qkv->weight.dtype())
    fail("Block.forward_cached", "expects x (1, T, ", C, ") ", qkv->weight.dtype(), ", got ", describe(x));
  const std::int64_t Tn = x.size(1);
  // The new keys and values are written at rows [len, len + Tn) of the (capacity, C) tables.
  for (const Tensor* t : {&k_cache, &v_cache})
    if (!t->defined() || t->dim() != 2 || t->size(1) != C || t->dtype() != x.dtype())
      fail("Block.forward_cached", "expects k_cache and v_cache (capacity, ", C, ") ", x.dtype(), ", got ", describe(*t));
  if (!(k_cache.shape() == v_cache.shape()) || len < 0 || pos0 < 0 || len > k_cache.size(0) - Tn)
    fail("Block.forward_cached", "cannot add ", Tn, " positions at row ", len, " (position ", pos0,
         ") to caches k ", k_cache.shape(), " and v ", v_cache.shape());
  Tensor packed = qkv->forward(ln1->forward(x));  // (1, T, 3C)
  if (arch_ == Arch::llama) packed = rope(packed, rope_cos_, rope_sin_, C / H, 2 * C, pos0);
  Tensor y = Tensor::empty({1, Tn, C}, x.dtype());
  auto run = [&](auto z) {
    using T = decltype(z);
    const T* p = packed.data<T>();
    T* K = k_cache.data<T>();
    T* V = v_cache.data<T>();
    for (std::int64_t t = 0; t < Tn; ++t) {  // the new keys and values join the cache
      std::memcpy(K + (len + t) * C, p + t * 3 * C + C, static_cast<std::size_t>(C) * sizeof(T));
      std::memcpy(V + (len + t) * C, p + t * 3 * C + 2 * C, static_cast<std::size_t>(C) * sizeof(T));
    }
    cached_attention(p, 3 * C, K, V, y.data<T>(), Tn, len, C, H);
  };
  if (x.dtype() == float64) run(double{});
  else run(float{});
  // x + proj(y), then h + mlp(ln2(h)), each add in its product's epilogue. Generation applies no
  // dropout, whatever the module's mode.
  Tensor h = linear(y, proj->weight, proj->bias, x);
  return Block::mlp(ln2->forward(h), h);
}

void KVCache::drop_oldest() {
  if (len < 1) fail("KVCache", "nothing to drop from an empty cache");
  for (auto* tables : {&k, &v})
    for (const Tensor& t : *tables)
      if (len > capacity || !t.defined() || t.dim() != 2 || t.size(0) != capacity)
        fail("KVCache", "drop_oldest: a table ", describe(t), " does not hold len ", len, " of capacity ", capacity,
             " rows");
  for (auto* tables : {&k, &v})
    for (Tensor& t : *tables) {
      auto* base = static_cast<char*>(t.raw_data());
      const std::size_t row = t.nbytes() / static_cast<std::size_t>(capacity);
      std::memmove(base, base + row, row * static_cast<std::size_t>(len - 1));
    }
  --len;
  ++start;
}

KVCache GPT::start_cache() const {
  KVCache c;
  c.capacity = cfg_.block_size;
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    c.k.push_back(zeros({c.capacity, cfg_.n_embd}, wte->weight.dtype()));
    c.v.push_back(zeros({c.capacity, cfg_.n_embd}, wte->weight.dtype()));
  }
  return c;
}

Tensor GPT::forward_cached(const std::vector<std::int32_t>& ids, KVCache& cache) {
  NoGradGuard ng;
  const auto Tn = static_cast<std::int64_t>(ids.size());
  if (cache.k.empty()) cache = start_cache();
  // A cache made by start_cache() of this model: one (capacity, n_embd) table of keys and one of
  // values per block, in the model's dtype (another model's would be written out of bounds).
  const auto n_layer = static_cast<std::size_t>(cfg_.n_layer);
  if (cache.k.size() != n_layer || cache.v.size() != n_layer)
    fail("generate", "the KVCache holds ", cache.k.size(), " key and ", cache.v.size(),
         " value tables; this model has ", n_layer, " blocks; use start_cache()");
  if (cache.len < 0 || cache.start < 0)
    fail("generate", "the KVCache's len and start must be >= 0, got ", cache.len, " and ", cache.start);
  for (const auto* tables : {&cache.k, &cache.v})
    for (const Tensor& t : *tables)
      if (!t.defined() || !(t.shape() == Shape{cache.capacity, cfg_.n_embd}) || t.dtype() != wte->weight.dtype())
        fail("generate", "a KVCache table is ", describe(t), "; this model's are (", cache.capacity, ", ", cfg_.n_embd,
             ") ", wte->weight.dtype(), "; use start_cache()");
  if (Tn < 1 || cache.len + Tn > cache.capacity)
    fail("generate", "cannot add ", Tn, " positions to a cache holding ", cache.len, " of ", cache.capacity);
  const std::int64_t pos0 = cache.start + cache.len;
  Tensor x = wte->forward(from_vector(ids, {1, Tn}));
  if (wpe) {
    if (pos0 + Tn > cfg_.block_size) fail("generate", "position ", pos0 + Tn - 1, " is past the learned positions");
    x = x + wpe->forward(arange(static_cast<double>(pos0), static_cast<double>(pos0 + Tn), 1.0, int32));
  } else if (pos0 + Tn > rope_cos_.size(0)) {  // llama past its tables: longer ones, the same first rows
    std::tie(rope_cos_, rope_sin_) = rope_tables(2 * (pos0 + Tn), cfg_.head_size(), 10000.0, wte->weight.dtype());
    for (auto& b : *blocks) b->set_rope_tables(rope_cos_, rope_sin_);
  }
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i)
    x = (*blocks)[static_cast<std::size_t>(i)].forward_cached(x, cache.k[static_cast<std::size_t>(i)],
                                                               cache.v[static_cast<std::size_t>(i)], cache.len, pos0);
  cache.len += Tn;
  return logits(x);
}

std::vector<std::int32_t> GPT::generate(const std::vector<std::int32_t>& prompt, std::int64_t n, double temperature,
                                        std::int64_t top_k, Generator* gen, bool use_cache) {
  if (prompt.empty()) fail("generate", "needs a non-empty prompt");
  if (n < 0) fail("generate", "number of tokens must be >= 0, got ", n);
  if (!(temperature > 0) || !std::isfinite(temperature)) fail("generate", "temperature must be positive, got ", temperature);
  for (std::int32_t t : prompt)
    if (t < 0 || t >= cfg_.vocab_size) fail("generate", "prompt token ", t, " is out of range for vocab ", cfg_.vocab_size);
  Generator& g = gen ? *gen : default_generator();
  NoGradGuard ng;
  const TrainingModeKept kept(*this);
  eval();
  const std::int64_t W = cfg_.block_size;
  std::vector<std::int32_t> ctx = prompt, out;
  auto window = [&] { return std::vector<std::int32_t>(ctx.end() - std::min<std::int64_t>(ctx.size(), W), ctx.end()); };
  KVCache cache;
  for (std::int64_t i = 0; i < n; ++i) {
    Tensor logits;
    if (!use_cache || (wpe && static_cast<std::int64_t>(ctx.size()) > W)) {
      // the whole window, every time (learned positions past the window: the cropped window, as
      // without the cache, through the fused forward)
      const std::vector<std::int32_t> w = window();
      logits = forward(from_vector(w, {1, static_cast<std::int64_t>(w.size())}));
    } else if (i == 0) {  // the prompt fills a fresh cache
      cache = start_cache();
      logits = forward_cached(window(), cache);
    } else {
      if (cache.len == W) cache.drop_oldest();  // llama: the window slides
      logits = forward_cached({ctx.back()}, cache);
    }
    const std::int32_t pick = pick_token(last_logits(logits, i), temperature, top_k, g);
    ctx.push_back(pick);
    out.push_back(pick);
  }
  return out;
}

}  // namespace tg::nn
