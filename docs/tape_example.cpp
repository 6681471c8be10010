// The tape of a small classifier, printed and drawn; the example of docs/tape.md.
//
//   loss = cross_entropy(rms_norm(x W + b, g), t)
//
// x: 5 inputs of 3 features (data, no gradient); W (3, 4), b (4,), g (4,): named parameters;
// t: the 5 target classes. Prints the tape, writes it as Graphviz DOT (to argv[1], default
// tape.dot), runs backward and prints the parameters' gradients and the emptied tape. Then shows
// that a freed graph refuses a second backward, and that a second forward and backward adds to
// the parameters' gradients.
#include <fstream>
#include <iostream>

#include <tapegrad/tapegrad.h>

int main(int argc, char** argv) {
  tg::manual_seed(0);
  tg::Tensor W = tg::randn({3, 4}).requires_grad_().set_name("W");
  tg::Tensor b = tg::zeros({4}).requires_grad_().set_name("b");
  tg::Tensor g = tg::ones({4}).requires_grad_().set_name("g");
  tg::Tensor x = tg::randn({5, 3});
  tg::Tensor t = tg::tensor({0, 3, 1, 1, 2}, {5}, tg::DType::i32);

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
}
