// tg::dist::DistributedDataParallel: the start-up broadcast, gradients averaged in buckets that
// start during the backward, equal to one process's gradient of the whole batch, identical and
// reproducible replicas, no_sync, parameters without gradient, BatchNorm's per-rank statistics.
// Run under mpirun at 2 and 3 ranks, and alone. Every rank takes the same path through each test.
#include <memory>

#include "dist_helpers.h"

using namespace tg;
using namespace tgdist;
using namespace tgtest;

namespace {

// tanh(x W1^T + b1) [-> BatchNorm] -> W2 . + b2, mean squared error; float64 unless asked; the
// first layer one checkpointed segment (tg::checkpoint) when asked.
struct Net : nn::Module {
  Net(bool batchnorm, bool spare_param, DType dt = float64, bool checkpointed = false) : ckpt(checkpointed) {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(6, 8, true, dt));
    if (batchnorm) bn = register_module("bn", std::make_shared<nn::BatchNorm1d>(8, 1e-5, 0.1, true, true, false, dt));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(8, 3, true, dt));
    if (spare_param) spare = register_parameter("spare", zeros({4}, dt));  // takes no part in the loss
  }
  Tensor loss(const Tensor& x, const Tensor& y) {
    Tensor h = ckpt ? checkpoint([this](const Tensor& in) { return tanh((*fc1)(in)); }, x, fc1->parameters())
                    : tanh((*fc1)(x));
    if (bn) h = (*bn)(h);
    Tensor d = (*fc2)(h) - y;
    return mean(d * d);
  }
  std::string type_name() const override { return "Net"; }
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<nn::BatchNorm1d> bn;
  Tensor spare;
  bool ckpt;
};

// A global batch of 2 rows per rank, the same on every rank; rows [2r, 2r + 2) are rank r's.
struct Batch {
  Tensor x, y;
  explicit Batch(std::uint64_t seed, int rows_per_rank = 2) {
    Generator g(seed);
    x = randn({rows_per_rank * dist::world_size(), 6}, float64, &g);
    y = randn({rows_per_rank * dist::world_size(), 3}, float64, &g);
  }
  Tensor xs(int r) const { return x.slice(0, 2 * r, 2 * r + 2); }
  Tensor ys(int r) const { return y.slice(0, 2 * r, 2 * r + 2); }
};

double max_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, max_abs_diff(a[i], b[i]));
  return m;
}

std::vector<Tensor> state(const nn::Module& m) {
  std::vector<Tensor> s;
  for (const auto& [name, t] : m.state_dict()) s.push_back(t);
  return s;
}

std::vector<Tensor> grads(const nn::Module& m) {
  std::vector<Tensor> g;
  for (const Tensor& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : zeros_like(p));
  return g;
}

// The gradient of the whole batch's loss in this process alone (a model without hooks).
std::vector<Tensor> whole_batch_grads(std::uint64_t model_seed, const Batch& b, bool spare = false) {
  manual_seed(model_seed);
  Net ref(false, spare);
  ref.loss(b.x, b.y).backward();
  return grads(ref);
}

}  // namespace

TEST_CASE("DDP starts from rank 0's parameters and buffers") {
  manual_seed(100 + static_cast<std::uint64_t>(dist::rank()));  // different weights on every rank
  Net net(true, false);
  net.bn->running_mean.data<double>()[0] = dist::rank() + 0.5;
  std::vector<Tensor> rank0;
  for (const Tensor& t : state(net)) rank0.push_back(t.clone());
  for (Tensor& t : rank0) dist::broadcast(t, 0);
  if (dist::world_size() > 1) CHECK_FALSE(same_on_every_rank(net.fc1->weight));
  dist::DistributedDataParallel ddp(net);
  std::vector<Tensor> now = state(net);
  for (std::size_t i = 0; i < now.size(); ++i) {
    CHECK(same_on_every_rank(now[i]));
    CHECK(max_abs_diff(now[i].to(float64), rank0[i].to(float64)) == 0);
  }
  CHECK_NOTHROW(ddp.check_replicas());
}

TEST_CASE("DDP averages gradients to one process's gradient of the whole batch, for any bucket size") {
  const Batch b(7);
  const std::vector<Tensor> want = whole_batch_grads(1, b);
  for (std::size_t cap : {std::size_t(1) << 20, std::size_t(256), std::size_t(1)}) {
    manual_seed(1);
    Net net(false, false);
    dist::DistributedDataParallel ddp(net, {cap, true});
    net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
    ddp.finish_gradient_sync();  // already done by the last hook: a no-op
    INFO("bucket cap " << cap << " bytes, " << ddp.num_buckets() << " buckets");
    CHECK(max_diff(grads(net), want) < 1e-14);
    for (const Tensor& p : net.parameters()) CHECK(same_on_every_rank(p.grad()));
    if (dist::world_size() > 1) {
      // Reverse order, 24 + 192 + 64 + 384 bytes: 256 makes (fc2.bias, fc2.weight), (fc1.bias), (fc1.weight).
      CHECK(ddp.num_buckets() == (cap == 1 ? 4 : cap == 256 ? 3 : 1));
      CHECK(ddp.last_stats().bytes == (8 * 6 + 8 + 3 * 8 + 3) * sizeof(double));
    }
  }
}

TEST_CASE("DDP averages the gradients of a checkpointed segment, whose parameters' hooks fire after its recomputation") {
  // The segment's inner backward fires no hooks; the outer walk fires fc1's once the checkpoint
  // node has run, so each bucket is reduced once, with final gradients.
  const Batch b(7);
  const std::vector<Tensor> want = whole_batch_grads(1, b);
  for (std::size_t cap : {std::size_t(1) << 20, std::size_t(1)}) {
    manual_seed(1);
    Net net(false, false, float64, true);
    dist::DistributedDataParallel ddp(net, {cap, true});
    net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
    ddp.finish_gradient_sync();
    INFO("bucket cap " << cap << " bytes");
    CHECK(max_diff(grads(net), want) < 1e-14);
    for (const Tensor& p : net.parameters()) CHECK(same_on_every_rank(p.grad()));
    if (dist::world_size() > 1) CHECK(ddp.last_stats().bytes == (8 * 6 + 8 + 3 * 8 + 3) * sizeof(double));  // each once
  }
}

TEST_CASE("a DDP bucket starts its reduction while the backward is still running") {
  if (dist::world_size() == 1) return;  // nothing to reduce
  manual_seed(1);
  Net net(false, false);
  dist::DistributedDataParallel ddp(net, {1, true});  // one parameter per bucket: fc2.bias, fc2.weight, fc1.bias, fc1.weight
  int started = -1;
  bool fc1_done = true;
  // Fires after DDP's own hook on fc2.weight (registered first), before fc1's gradients exist.
  GradHookHandle probe = register_post_accumulate_grad_hook(net.fc2->weight, [&](const Tensor&) {
    started = ddp.buckets_started();
    fc1_done = net.fc1->weight.grad().defined();
  });
  const Batch b(7);
  net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
  CHECK(started == 2);
  CHECK_FALSE(fc1_done);
  CHECK(ddp.buckets_started() == 0);  // the backward's reductions are complete
  CHECK(ddp.last_stats().buckets == 4);
  CHECK(ddp.last_stats().comm_s >= ddp.last_stats().overlapped_s);
}

TEST_CASE("DDP keeps the replicas identical over training steps, and a run repeats bit for bit") {
  auto run = [] {
    manual_seed(3);
    Net net(false, false);
    dist::DistributedDataParallel ddp(net, {256, true});
    optim::SGD opt(net.parameters(), 0.1, 0.9);
    for (std::uint64_t step = 0; step < 5; ++step) {
      const Batch b(20 + step);
      opt.zero_grad();
      net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
      opt.step();
      CHECK_NOTHROW(ddp.check_replicas());
    }
    std::vector<Tensor> w;
    for (const Tensor& p : net.parameters()) w.push_back(p.clone());
    return w;
  };
  const std::vector<Tensor> first = run(), second = run();
  CHECK(max_diff(first, second) == 0);
}

TEST_CASE("no_sync accumulates locally and the next synchronised backward averages the sum") {
  const Batch b1(11), b2(12);
  manual_seed(1);
  Net net(false, false);
  dist::DistributedDataParallel ddp(net);
  {
    auto local = ddp.no_sync();
    net.loss(b1.xs(dist::rank()), b1.ys(dist::rank())).backward();
  }
  CHECK(ddp.buckets_started() == 0);
  net.loss(b2.xs(dist::rank()), b2.ys(dist::rank())).backward();
  // One process: the whole batch of each of the two steps, gradients added.
  manual_seed(1);
  Net ref(false, false);
  ref.loss(b1.x, b1.y).backward();
  ref.loss(b2.x, b2.y).backward();
  CHECK(max_diff(grads(net), grads(ref)) < 1e-14);
}

TEST_CASE("a parameter without gradient counts as zeros, and finish_gradient_sync completes the step") {
  const Batch b(5);
  manual_seed(1);
  Net net(false, true);
  dist::DistributedDataParallel ddp(net, {100, true});
  net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
  ddp.finish_gradient_sync();
  ddp.finish_gradient_sync();  // nothing left: a no-op
  CHECK(max_diff(grads(net), whole_batch_grads(1, b, true)) < 1e-14);
  if (dist::world_size() > 1) CHECK(net.spare.grad().to_vector<double>() == std::vector<double>(4, 0.0));
}

TEST_CASE("a second backward before the first one's gradients are averaged is refused") {
  if (dist::world_size() == 1) return;
  const Batch b(5);
  manual_seed(1);
  Net net(false, true);  // the spare parameter keeps the first backward's sync open
  dist::DistributedDataParallel ddp(net, {1, true});
  net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward();
  REQUIRE_TG_ERROR(net.loss(b.xs(dist::rank()), b.ys(dist::rank())).backward(), "DistributedDataParallel", "twice",
                   "finish_gradient_sync");
  tape().clear();
  ddp.finish_gradient_sync();
  CHECK_NOTHROW(ddp.check_replicas());
}

TEST_CASE("BatchNorm's statistics stay per rank; sync_buffers gives every rank rank 0's") {
  manual_seed(1);
  Net net(true, false);
  dist::DistributedDataParallel ddp(net);
  const Batch b(9, 3);
  net.loss(b.x.slice(0, 3 * dist::rank(), 3 * dist::rank() + 3), b.y.slice(0, 3 * dist::rank(), 3 * dist::rank() + 3)).backward();
  if (dist::world_size() > 1) CHECK_FALSE(same_on_every_rank(net.bn->running_mean));  // each rank's own rows
  Tensor rank0 = net.bn->running_mean.clone();
  dist::broadcast(rank0, 0);
  ddp.sync_buffers();
  CHECK(same_on_every_rank(net.bn->running_mean));
  CHECK(same_on_every_rank(net.bn->running_var));
  CHECK(max_abs_diff(net.bn->running_mean, rank0) == 0);
}
