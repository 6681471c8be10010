#pragma once
// Everything: #include <tapegrad/tapegrad.h>
#include "tapegrad/autograd.h"
#include "tapegrad/dtype.h"
#include "tapegrad/error.h"
#include "tapegrad/gradcheck.h"
#include "tapegrad/ops.h"
#include "tapegrad/random.h"
#include "tapegrad/shape.h"
#include "tapegrad/tensor.h"
#include "tapegrad/threads.h"
