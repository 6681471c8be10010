#pragma once
// Internal to tapegrad_dist: MPI return codes to tg::Error, and tapegrad's dtypes as MPI types.
#include <mpi.h>

#include "tapegrad/dtype.h"

namespace tg::dist::detail {

// Throws tg::Error "<fn>: <call> failed: <MPI's text>" unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* fn, const char* call);
// MPI_FLOAT or MPI_DOUBLE; tg::Error naming fn for any other dtype.
MPI_Datatype float_type(const char* fn, DType d);

}  // namespace tg::dist::detail
