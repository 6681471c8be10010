#include "tapegrad/threads.h"

#include <omp.h>

#include "tapegrad/error.h"

extern "C" void openblas_set_num_threads(int);

namespace tg {

void set_num_threads(int n) {
  if (n < 1) fail("set_num_threads", "need at least 1 thread, got ", n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int get_num_threads() { return omp_get_max_threads(); }

}  // namespace tg
