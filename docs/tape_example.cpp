// The tape of a small classifier, printed and drawn; the example of docs/tape.md.
//
//   loss = cross_entropy(rms_norm(x W + b, g), t)
//
// x: 5 inputs of 3 features (data, no gradient); W (3, 4), b (4,), g (4,): named parameters;
// t: the 5 target classes. Prints the tape, writes it as Graphviz DOT (to argv[1], default
// tape.dot), runs backward and prints the parameters' gradients and the emptied tape. Then shows
// that a freed graph refuses a second backward, that a second forward and backward adds to the
// parameters' gradients, and two refusals: a tensor whose graph was freed used in a new graph, and
// a saved tensor written in place before the backward.
#include <fstream>
#include <iostream>

#include <tapegrad/tapegrad.h>
#include <tapegrad/nn.h>
#include <tapegrad/optim.h>

int main(int argc, char** argv) {
  tg::manual_seed(0);
  tg::Tensor W = tg::randn({3, 4}).requires_grad_().set_name("W");
  tg::Tensor b = tg::zeros({4}).requires_grad_().set_name("b");
  tg::Tensor g = tg::ones({4}).requires_grad_().set_name("g");
  tg::Tensor x = tg::randn({5, 3});
  tg::Tensor t = tg::tensor({0, 3, 1, 1, 2}, {5}, tg::int32);

  tg::Tensor a = tg::matmul(x, W) + b;                          // nodes 0 (matmul) and 1 (add)
  tg::Tensor logits = tg::rms_norm(a, g, tg::Tensor(), 1e-5);   // node 2 (rms_norm, no bias)
  tg::Tensor loss = tg::cross_entropy(logits, t);               // node 3 (cross_entropy)

  tg::tape().print(std::cout);
  std::ofstream(argc > 1 ? argv[1] : "tape.dot") << tg::tape().to_dot();

  std::cout << "loss = " << loss.item() << "\n";
  loss.backward();
  std::cout << "dL/dW =\n" << W.grad() << "\ndL/db =\n" << b.grad() << "\ndL/dg =\n" << g.grad() << "\n";
  std::cout << "a.grad() defined after backward: " << (a.grad().defined() ? "yes" : "no") << "\n";
  tg::tape().print(std::cout);

  // The nodes were freed: differentiating the same graph again is refused.
  try {
    loss.backward();
  } catch (const tg::Error& e) {
    std::cout << e.what() << "\n";
  }
  // A new forward records new nodes; its backward adds to the leaves' gradients (zero_grad() drops them).
  tg::Tensor loss2 = tg::cross_entropy(tg::rms_norm(tg::matmul(x, W) + b, g, tg::Tensor(), 1e-5), t);
  loss2.backward();
  std::cout << "dL/db after a second forward and backward =\n" << b.grad() << "\n";

  // Two refusals, in float64, each beside PyTorch's (docs/tape.md). refused(f) prints the tg::Error
  // that f throws, or "not refused", which fails the test that runs this program.
  auto refused = [](auto&& f) {
    try {
      f();
      std::cout << "not refused\n";
    } catch (const tg::Error& e) {
      std::cout << e.what() << "\n";
    }
  };
  {
    tg::Tensor w = tg::tensor({0.5, -1.0, 2.0}, {3}, tg::float64).requires_grad_();
    tg::Tensor u = tg::tensor({1.0, 2.0, 3.0}, {3}, tg::float64);
    tg::Tensor h = tg::tanh(w * u);
    tg::sum(h).backward();              // frees h's graph
    tg::Tensor loss3 = tg::sum(h * w);  // h still names its freed graph
    refused([&] { loss3.backward(); });
    tg::sum(h.detach() * w).backward();  // h as a constant: accepted
    tg::tape().clear();                  // drops loss3's refused graph
  }
  {
    tg::Tensor p = tg::tensor({1.0, 2.0, 3.0}, {3}, tg::float64).requires_grad_();
    tg::Tensor q = tg::tensor({4.0, 5.0, 6.0}, {3}, tg::float64).requires_grad_();
    tg::Tensor y = tg::sum(p * q);  // mul saves p and q: dy/dp = q
    q.set({0}, 7.0);                // an in-place write after the forward
    refused([&] { y.backward(); });
  }
}
