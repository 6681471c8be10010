// nn's norm modules on the paper's worked example.
#include "helpers.h"

using namespace tg;
using namespace tgtest;

TEST_CASE("the paper's worked example: RMSNorm([3, 4, 12], g = [1.5, 2.0, 0.8])") {
  // RMS = sqrt((9 + 16 + 144) / 3) = 7.5056; y = a / RMS * g
  for (DType dt : {float32, float64}) {
    nn::RMSNorm norm(3, 1e-8, true, false, 1.0, dt);
    std::vector<double> g = {1.5, 2.0, 0.8};
    for (int i = 0; i < 3; ++i) norm.weight.set({i}, g[static_cast<std::size_t>(i)]);
    Tensor y = norm(tensor({3, 4, 12}, {3}, dt));
    CHECK(y.at({0}) == Approx(0.5995).margin(1e-4));
    CHECK(y.at({1}) == Approx(1.0658).margin(1e-4));
    CHECK(y.at({2}) == Approx(1.2790).margin(1e-4));
  }
}

