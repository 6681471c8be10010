#pragma once
// One thread pool for everything: OpenMP runs the kernels and, through Debian's OpenMP build of
// OpenBLAS, the matrix products too.
namespace tg {
void set_num_threads(int n);  // n >= 1
int get_num_threads();
}  // namespace tg
