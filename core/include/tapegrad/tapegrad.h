#pragma once
// The core, for users of tapegrad::core: #include <tapegrad/tapegrad.h>. Tensors, the tape and the
// differentiable ops. The modules and the optimizers have their own headers (tapegrad/nn.h,
// tapegrad/optim.h), and so does each engine feature a program asks for by name:
// tapegrad/autocast.h (bf16 products), tapegrad/checkpoint.h (activation checkpointing),
// tapegrad/hooks.h (gradient hooks), tapegrad/anomaly.h (anomaly mode, op timing) and
// tapegrad/memory.h (the allocator's counters).
#include "tapegrad/autograd.h"
#include "tapegrad/composite.h"
#include "tapegrad/dtype.h"
#include "tapegrad/error.h"
#include "tapegrad/gradcheck.h"
#include "tapegrad/io.h"
#include "tapegrad/node.h"
#include "tapegrad/ops.h"
#include "tapegrad/random.h"
#include "tapegrad/shape.h"
#include "tapegrad/tensor.h"
#include "tapegrad/threads.h"
