#pragma once
// Everything, for users of the umbrella target tapegrad::tapegrad: #include <tapegrad/tapegrad.h>
// (the libraries' own sources include only what they use).
#include "tapegrad/autocast.h"
#include "tapegrad/autograd.h"
#include "tapegrad/checkpoint.h"
#include "tapegrad/dtype.h"
#include "tapegrad/error.h"
#include "tapegrad/gradcheck.h"
#include "tapegrad/io.h"
#include "tapegrad/nn.h"
#include "tapegrad/ops.h"
#include "tapegrad/optim.h"
#include "tapegrad/random.h"
#include "tapegrad/shape.h"
#include "tapegrad/tensor.h"
#include "tapegrad/threads.h"
