// two_moons: the smallest complete training program. A 2-layer MLP learns to separate two
// interleaving half circles with plain SGD. Read this first: data, model, loss, backward, step.
#include <cmath>
#include <cstdio>
#include <numbers>
#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

using namespace tg;

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 500;
  manual_seed(0);

  // Data: N points on two half circles (label 0: upper, label 1: lower, shifted), with noise.
  const std::int64_t N = 200;
  Tensor x = Tensor::empty({N, 2});
  Tensor y = Tensor::empty({N}, int32);
  Tensor noise = randn({N, 2}) * 0.1;
  for (std::int64_t i = 0; i < N; ++i) {
    const int label = static_cast<int>(i % 2);
    const double t = std::numbers::pi * static_cast<double>(i / 2) / static_cast<double>(N / 2 - 1);
    x.set({i, 0}, (label ? 1.0 - std::cos(t) : std::cos(t)) + noise.at({i, 0}));
    x.set({i, 1}, (label ? 0.5 - std::sin(t) : std::sin(t)) + noise.at({i, 1}));
    y.set({i}, label);
  }

  // Model: 2 -> 16 -> 16 -> 2 with ReLU (tanh would do too).
  nn::Linear l1(2, 16), l2(16, 16), l3(16, 2);
  auto forward = [&](const Tensor& in) { return l3(relu(l2(relu(l1(in))))); };
  std::vector<Tensor> params;
  for (nn::Module* m : std::initializer_list<nn::Module*>{&l1, &l2, &l3})
    for (auto& p : m->parameters()) params.push_back(p);
  optim::SGD opt(params, /*lr=*/0.1, /*momentum=*/0.9);

  double accuracy = 0;
  for (int step = 0; step <= steps; ++step) {
    Tensor logits = forward(x);             // (N, 2), recorded on the tape
    Tensor loss = cross_entropy(logits, y); // mean negative log-likelihood
    opt.zero_grad();
    loss.backward();                        // fills every parameter's .grad()
    opt.step();                             // p -= lr * (momentum-smoothed) grad

    if (step % 100 == 0 || step == steps) {
      NoGradGuard ng;  // evaluation: nothing to differentiate
      Tensor pred = forward(x);
      int correct = 0;
      for (std::int64_t i = 0; i < N; ++i)
        correct += (pred.at({i, 1}) > pred.at({i, 0})) == (y.at({i}) == 1);
      accuracy = static_cast<double>(correct) / static_cast<double>(N);
      std::printf("step %4d  loss %.4f  accuracy %.1f%%\n", step, loss.item(), 100 * accuracy);
    }
  }
  return accuracy >= 0.95 ? 0 : 1;  // exit status says whether it learned the moons
}
