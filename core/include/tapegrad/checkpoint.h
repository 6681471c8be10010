#pragma once
// Activation checkpointing (PyTorch's torch.utils.checkpoint.checkpoint): memory for compute.
//
// y = checkpoint(fn, x, params) computes y = fn(x) but keeps none of fn's activations: the tape
// records one node, which saves x alone. When backward() reaches that node, it runs fn(x) again
// with recording on, on a tape of its own, and walks that tape back from y with the gradient y
// received. x's gradient goes on to the rest of the walk; the parameters' gradients accumulate as
// they do without the checkpoint. The result and every gradient are the same bits as without
// checkpointing: the kernels are deterministic, and the recomputation restores the forward's
// conditions (the default generator's state and data-parallel shard, so dropout draws the same
// masks; autocast on or off).
//
// Cost: fn runs twice. Memory: the forward runs fn without recording, and what fn saves for its
// backward lives during the segment's own backward only. Checkpointing each block of an L-block
// model keeps L block inputs instead of L blocks' activations (nn::GPT::set_gradient_checkpointing).
//
// params: every tensor that requires grad which fn uses and does not compute from x (a module's
// parameters()). Difference from PyTorch, which finds them itself: here the list makes the node
// an input of each parameter, so the tape knows when their gradients are final (gradient hooks,
// data parallelism). The recomputation checks the list: an op of fn that reads a tensor requiring
// grad that is neither x, nor in params, nor computed by fn from them makes backward() throw,
// naming the op, before any gradient of the segment is written.
//
// fn may read x, params and tensors that need no gradient and do not change before the backward,
// and must give the same result when run again. The node keeps fn
// until its backward: capture by value what would not outlive it (a lambda capturing a local by
// reference, made in a function that returns before the backward, dangles). BatchNorm's
// running statistics are updated by the forward only, not again by the recomputation (PyTorch
// updates them twice). With op timing on (set_op_timing), the "checkpoint" row's backward time
// includes the recomputation and its inner backward, which the rows of fn's ops count as well.
//
// Under NoGradGuard, or when neither x nor any of params requires grad, checkpoint is fn(x); so it
// is in anomaly mode (set_detect_anomaly), recorded op by op, so that a NaN names its op.
// Differences from PyTorch besides params: one tensor in and one out; the recomputation runs
// inside the backward (PyTorch's reentrant variant); the state restored is the default
// generator's, which is per process, so dropout in another thread during a backward races with it.
#include <functional>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& x, const std::vector<Tensor>& params);

// True while a checkpoint recomputes its segment on this thread: ops with side effects beyond
// their outputs (batch_norm's running statistics) skip them then.
bool in_checkpoint_recompute();

}  // namespace tg
