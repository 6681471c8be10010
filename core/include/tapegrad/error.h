#pragma once
// tg::Error: the one exception type the library throws for bad input. Its message names the op
// and the offending shapes or values, e.g. "matmul: inner dimensions differ: (12, 64, 128) @ (96, 384)".
#include <sstream>
#include <stdexcept>
#include <string>

namespace tg {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// fail("matmul", "inner dimensions differ: ", a.shape(), " @ ", b.shape()) throws
// tg::Error("matmul: inner dimensions differ: (2, 3) @ (4, 5)").
template <class... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream s;
  s << op << ": ";
  (s << ... << parts);
  throw Error(s.str());
}

}  // namespace tg
