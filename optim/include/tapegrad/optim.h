#pragma once
// Optimizers, learning-rate schedules and gradient clipping, with PyTorch 1.13's semantics and
// defaults (torch.optim.SGD, Adam, AdamW; torch.nn.utils.clip_grad_norm_ / clip_grad_value_).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tapegrad/io.h"
#include "tapegrad/tensor.h"

namespace tg::optim {

// A set of parameters sharing hyperparameters (PyTorch's param_groups entries). A negative lr or
// weight_decay given to a constructor means "the optimizer's default"; set later through
// param_groups(), it is refused at the next step. A parameter (a tensor's memory: copies of one
// Tensor handle are one parameter) appears once across all groups: the constructors throw
// tg::Error naming both places of a repeat (PyTorch warns within a group, raises across groups).
struct ParamGroup {
  std::vector<Tensor> params;
  double lr = -1;
  double weight_decay = -1;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Drops every parameter's gradient (PyTorch's zero_grad(set_to_none=True)).
  void zero_grad();
  // One update of every parameter that has a gradient; parameters without one are skipped.
  virtual void step() = 0;
  // Gradient clipping and the update in one call (PyTorch has no such call): the total L2 norm of
  // the gradients of every parameter, group by group (grad_norm); when it is finite, the gradients
  // scaled by max_norm / (norm + 1e-6) where that is below 1, then step(). Parameters, state and
  // gradients end bit-identical to
  //   clip_grad_norm(<the parameters, group by group, in order>, max_norm);  step();
  // (the gradients are left clipped, as torch.nn.utils.clip_grad_norm_ leaves them). A norm that is
  // not finite changes nothing (gradients, parameters, state) and is returned for the caller to
  // stop or skip on; clip_grad_norm_ then step() would write NaN into every parameter. Adam and
  // AdamW scale each gradient in registers inside their single update pass, saving clipping's
  // read-and-write pass over the gradients; other optimizers scale, then step. max_norm > 0.
  // Returns the total norm before clipping.
  virtual double clip_and_step(double max_norm);
  // The groups, for their hyperparameters to change (lr, weight_decay), as PyTorch's param_groups.
  // The parameters must stay the ones the optimizer was made with (their state is kept by
  // position): step(), clip_and_step(), state_dict() and load_state_dict() refuse groups whose
  // parameters were added, removed or replaced, or whose lr or weight_decay is not valid, with a
  // tg::Error saying which, before anything changes. Other parameters need a new optimizer.
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Sets the learning rate of every group (what a schedule drives).
  void set_lr(double lr);
  const std::string& name() const { return name_; }

  // Everything a resumed run needs: per-parameter state ("state.<i>.<buffer>", i counting
  // parameters across groups in order) and per-group hyperparameters ("group.<g>.lr", ...), all
  // as tensors so the dict can be written as safetensors.
  StateDict state_dict() const;
  // Checks every key, shape and dtype first, and the values the constructor checks (lr and
  // weight_decay finite and >= 0) or a step relies on (a step count whole and >= 0); on error
  // nothing changes.
  void load_state_dict(const StateDict& sd);

 protected:
  Optimizer(std::vector<ParamGroup> groups, std::string name, double default_lr, double default_wd);
  // The per-parameter state buffer `key` of parameter i, created as zeros on first use.
  Tensor& state(std::size_t i, const std::string& key, const Tensor& like);
  // Scalar per-parameter state (e.g. Adam's step count), stored as a float64 0-d tensor.
  double& scalar_state(std::size_t i, const std::string& key);
  // Calls f(group, param index, param) for every parameter that has a gradient.
  template <class F> void for_each_param_with_grad(F&& f);
  void check_lr(double lr) const;
  // Why a group's lr or weight_decay is not valid (not finite, or below 0), or "" when both are.
  static std::string hyperparameter_error(const ParamGroup& g);
  // Every parameter, group by group, in order (the order of clip_and_step's norm).
  std::vector<Tensor> all_params() const;
  // Refuses groups changed through param_groups() in a way the state cannot follow (above).
  void check_groups() const;

 private:
  std::string name_;
  std::vector<ParamGroup> groups_;
  // Each group's parameters as the optimizer was made with them. The handles keep their memory
  // alive, so that no other tensor can take its address.
  std::vector<std::vector<Tensor>> made_;
  // state_[i]: name -> tensor, in creation order
  std::vector<std::vector<std::pair<std::string, Tensor>>> state_;
};

// torch.optim.SGD: with weight decay wd, momentum m, dampening d:
//   g = grad + wd p;  buf = g (first step) or m buf + (1 - d) g;  g = g + m buf (nesterov) or buf;
//   p -= lr g.
class SGD : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, double lr, double momentum = 0, double dampening = 0, double weight_decay = 0,
      bool nesterov = false);
  SGD(std::vector<Tensor> params, double lr, double momentum = 0, double dampening = 0, double weight_decay = 0,
      bool nesterov = false);
  void step() override;
  double momentum, dampening;
  bool nesterov;
};

// torch.optim.Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay,
// p *= 1 - lr wd, Loshchilov & Hutter 2019). With t the step count:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  (amsgrad: vmax = max(vmax, v), used for v)
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
class Adam : public Optimizer {
 public:
  Adam(std::vector<ParamGroup> groups, double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
       double weight_decay = 0, bool amsgrad = false);
  Adam(std::vector<Tensor> params, double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
       double weight_decay = 0, bool amsgrad = false);
  void step() override;
  // The norm's read pass, then one pass per element over p, grad, m, v (and the AMSGrad maximum)
  // that scales the gradient by the clip coefficient, writes it back, and updates m, v and p;
  // threaded over all the parameters at once.
  double clip_and_step(double max_norm) override;
  double beta1, beta2, eps;
  bool amsgrad;

 protected:
  Adam(std::vector<ParamGroup> groups, std::string name, double lr, double beta1, double beta2, double eps,
       double weight_decay, bool amsgrad, bool decoupled);
  bool decoupled_;

 private:
  // The update of every parameter with a gradient, each gradient first scaled by coef when
  // coef < 1 (clip_grad_norm's rule; coef >= 1 leaves it as it is).
  void update(double coef);
};

class AdamW : public Adam {
 public:
  AdamW(std::vector<ParamGroup> groups, double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
        double weight_decay = 1e-2, bool amsgrad = false);
  AdamW(std::vector<Tensor> params, double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
        double weight_decay = 1e-2, bool amsgrad = false);
};

// ---- learning-rate schedules: the lr as a function of the step (0-based) ----
class Schedule {
 public:
  virtual ~Schedule() = default;
  // The learning rate at step >= 0 (the steps a run counts from 0).
  virtual double operator()(std::int64_t step) const = 0;
  // opt.set_lr(this(step))
  void apply(Optimizer& opt, std::int64_t step) const { opt.set_lr((*this)(step)); }
};

class ConstantLR : public Schedule {
 public:
  explicit ConstantLR(double lr);
  double operator()(std::int64_t) const override { return lr_; }

 private:
  double lr_;
};

// lr * gamma^floor(step / step_size) (torch.optim.lr_scheduler.StepLR).
class StepLR : public Schedule {
 public:
  StepLR(double lr, std::int64_t step_size, double gamma = 0.1);
  double operator()(std::int64_t step) const override;

 private:
  double lr_;
  std::int64_t step_size_;
  double gamma_;
};

// Linear warmup to lr over `warmup` steps, then cosine decay to min_lr at decay_steps, then
// min_lr (the baby-GPT schedule; equals lr_at in the PyTorch reference benchmark):
//   step < warmup:        lr (step + 1) / (warmup + 1)
//   step > decay_steps:   min_lr (also every step after the warmup when decay_steps <= warmup,
//                         where the reference's formula would divide by zero or go negative)
//   otherwise:            min_lr + (1 + cos(pi (step - warmup) / (decay_steps - warmup))) / 2 (lr - min_lr)
class WarmupCosineLR : public Schedule {
 public:
  WarmupCosineLR(double lr, double min_lr, std::int64_t warmup, std::int64_t decay_steps);
  double operator()(std::int64_t step) const override;

 private:
  double lr_, min_lr_;
  std::int64_t warmup_, decay_;
};

// ---- gradient clipping ----
// The total L2 norm sqrt(sum_i sum_k grad_i[k]^2) over the gradients of params (parameters without
// one are skipped), summed in double in a fixed order: each tensor cut into blocks of 2^15
// elements, each block summed over 16 interleaved lanes, the block sums added in order. The bits
// depend on the gradients and their order only, not on the thread count. Throws tg::Error for an
// undefined tensor or a gradient that is not float32 or float64.
double grad_norm(const std::vector<Tensor>& params);
// Scales every gradient by max_norm / (total + 1e-6) when the total L2 norm over all of them
// exceeds max_norm (PyTorch's rule). Returns the total norm before clipping (grad_norm). Parameters
// without a gradient are ignored. An infinite total scales them by 0, as PyTorch's; a NaN total
// leaves them as they are (PyTorch 1.13 multiplies them by NaN), for the caller to test the
// returned norm and skip the step.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);
// Clamps every gradient element to [-clip_value, clip_value].
void clip_grad_value(const std::vector<Tensor>& params, double clip_value);

}  // namespace tg::optim
