// The process group and the collectives over MPI_COMM_WORLD (tapegrad/dist.h).
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "mpi_check.h"
#include "tapegrad/dist.h"
#include "tapegrad/error.h"

namespace tg::dist {

namespace detail {

void check_mpi(int rc, const char* fn, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  fail(fn, call, " failed: ", len > 0 ? std::string(text, static_cast<std::size_t>(len)) : "error " + std::to_string(rc));
}

MPI_Datatype float_type(const char* fn, DType d) {
  if (d == float32) return MPI_FLOAT;
  if (d == float64) return MPI_DOUBLE;
  fail(fn, "needs a float32 or float64 tensor, got ", d);
}

}  // namespace detail

using detail::check_mpi;

namespace {

bool has_env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

// Counts above INT_MAX (MPI's int counts) go in chunks of 2^30 elements.
constexpr std::int64_t kChunk = std::int64_t(1) << 30;

}  // namespace

bool launched() { return has_env("OMPI_COMM_WORLD_SIZE") || has_env("PMI_SIZE") || has_env("PMIX_RANK"); }

bool is_initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void init(int* argc, char*** argv) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin) fail("dist::init", "MPI was already finalized; it cannot start again in this process");
  if (init) return;
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "dist::init", "MPI_Init_thread");
  // Failures come back as codes and become tg::Error (the default handler would end the job).
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "dist::init", "MPI_Comm_set_errhandler");
  if (provided < MPI_THREAD_FUNNELED) fail("dist::init", "MPI provides no MPI_THREAD_FUNNELED support");
}

void finalize() {
  if (is_initialized()) check_mpi(MPI_Finalize(), "dist::finalize", "MPI_Finalize");
}

int rank() {
  if (!is_initialized()) return 0;
  int r = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &r), "dist::rank", "MPI_Comm_rank");
  return r;
}

int world_size() {
  if (!is_initialized()) return 1;
  int n = 1;
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &n), "dist::world_size", "MPI_Comm_size");
  return n;
}

int local_world_size() {
  if (!is_initialized()) return 1;
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "dist::local_world_size",
            "MPI_Comm_split_type");
  int n = 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return n;
}

void abort(int code) {
  if (is_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);  // a world of one (MPI_Abort does not return)
}

void all_reduce(Tensor& t, ReduceOp op) {
  if (!t.defined()) fail("all_reduce", "undefined tensor");
  const MPI_Datatype type = detail::float_type("all_reduce", t.dtype());
  const int n = world_size();
  if (n == 1) return;  // the sum and the mean of one value are the value
  char* p = static_cast<char*>(t.raw_data());
  const std::size_t item = itemsize(t.dtype());
  for (std::int64_t at = 0; at < t.numel(); at += kChunk) {
    const int count = static_cast<int>(std::min(kChunk, t.numel() - at));
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, p + static_cast<std::size_t>(at) * item, count, type, MPI_SUM, MPI_COMM_WORLD),
              "all_reduce", "MPI_Allreduce");
  }
  if (op == ReduceOp::mean) {
    if (t.dtype() == float32) {  // a division, correctly rounded (x * (1/3) is not always x / 3)
      float* d = t.data<float>();
      for (std::int64_t i = 0; i < t.numel(); ++i) d[i] /= static_cast<float>(n);
    } else {
      double* d = t.data<double>();
      for (std::int64_t i = 0; i < t.numel(); ++i) d[i] /= n;
    }
  }
}

double all_reduce(double v, ReduceOp op) {
  if (!is_initialized()) return v;
  double s = v;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "all_reduce", "MPI_Allreduce");
  return op == ReduceOp::mean ? s / world_size() : s;
}

void broadcast(Tensor& t, int root) {
  if (!t.defined()) fail("broadcast", "undefined tensor");
  const int n = world_size();
  if (root < 0 || root >= n) fail("broadcast", "root ", root, " is not a rank of a world of ", n);
  if (n == 1) return;
  char* p = static_cast<char*>(t.raw_data());
  const auto bytes = static_cast<std::int64_t>(t.nbytes());
  for (std::int64_t at = 0; at < bytes; at += kChunk) {
    const int count = static_cast<int>(std::min(kChunk, bytes - at));
    check_mpi(MPI_Bcast(p + at, count, MPI_BYTE, root, MPI_COMM_WORLD), "broadcast", "MPI_Bcast");
  }
}

void barrier() {
  if (is_initialized()) check_mpi(MPI_Barrier(MPI_COMM_WORLD), "barrier", "MPI_Barrier");
}

}  // namespace tg::dist
