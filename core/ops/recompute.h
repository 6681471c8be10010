#pragma once
// What an op's forward does differently when a checkpointed segment's backward runs it again
// (tapegrad/checkpoint.h), asked here in one place so that no op body branches on checkpointing.
#include "tapegrad/checkpoint.h"

namespace tg::detail {

// A forward's update of state beyond its outputs (BatchNorm's running statistics and batch count):
// made once per forward, not again when a checkpoint recomputes the segment (PyTorch makes it
// twice).
template <class F>
void update_state_once(F&& update) {
  if (!in_checkpoint_recompute()) update();
}

// Whether a recorded op keeps a buffer that its backward can recompute (GELU's derivative):
// yes, except in a checkpoint's recomputation, which trades memory for time already.
inline bool keep_recomputable() { return !in_checkpoint_recompute(); }

}  // namespace tg::detail
