// The main of the tg::dist unit tests: one Catch2 session per rank. Under mpirun every rank runs
// every test case in the same order (the collectives meet), and the job fails when any rank's
// tests failed; without mpirun the tests run in a world of one process.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <tapegrad/dist.h>

int main(int argc, char** argv) {
  if (tg::dist::launched()) tg::dist::init(&argc, &argv);
  const int failed = Catch::Session().run(argc, argv);
  const double ranks_failed = tg::dist::all_reduce(failed ? 1.0 : 0.0);
  tg::dist::finalize();
  return ranks_failed > 0 ? 1 : 0;
}
