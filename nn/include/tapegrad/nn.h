#pragma once
// The nn library: modules, layers, the four norms, attention and the GPT.
#include "tapegrad/nn/gpt.h"
#include "tapegrad/nn/layers.h"
#include "tapegrad/nn/module.h"
#include "tapegrad/nn/norms.h"
