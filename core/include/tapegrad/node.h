#pragma once
// A Node is one recorded op: what its backward needs, and where its gradients go. This header is
// what an op implementer reads; tapegrad/autograd.h has the Tape that holds the nodes.
//
// Every differentiable op has the same shape (core/ops/*.cpp, docs/tutorial.md):
//
//   Tensor my_op(const Tensor& x, const Tensor& w) {
//     ...argument checks, naming the op and the shapes...
//     Tensor y = Tensor::empty(shape, x.dtype());
//     kernels::my_op_forward(x.data<float>(), w.data<float>(), y.data<float>(), N);
//     if (should_record({&x, &w})) {
//       struct Saved { Tensor x, w; };                  // what backward reads, by name
//       record("my_op", {&x, &w}, {&y}, Saved{x.detach(), w.detach()},
//              [N](Node& n, const Saved& s) {             // scalars are captured by value
//                GradDest dx = n.write_grad(0);           // writes dx (= or +=, as dx.acc says)
//                GradDest dw = n.add_grad(1);             // adds into dw
//                kernels::my_op_backward(s.x.data<float>(), s.w.data<float>(),
//                                        n.grad_out().data<float>(), dx.ptr<float>(),
//                                        dw.ptr<float>(), N, dx.acc);
//              });
//     }
//     return y;
//   }
//
// Saved holds only Tensor fields (detached: a saved tensor keeps its data, not its history); the
// node keeps them until its backward has run. An op that needs nothing saved passes the closure
// alone: record(op, inputs, outputs, [](Node& n) { ... }).
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

// Where a backward kernel puts input i's gradient: a buffer, and whether the kernel adds into it
// (acc = true) or assigns every element (acc = false). Null when input i needs no gradient.
struct GradDest {
  Tensor* buf = nullptr;
  bool acc = false;
  bool defined() const { return buf != nullptr; }
  template <class T> T* ptr() { return buf ? buf->data<T>() : nullptr; }
  Tensor tensor() const { return buf ? *buf : Tensor(); }
};

struct Node;
// How a node calls and destroys its closure: one static table per closure type.
namespace detail {
struct ClosureOps {
  void (*call)(void*, Node&);
  void (*destroy)(void*);  // null for a trivially destructible closure
};
}  // namespace detail

struct Node {
  const char* op = "";  // the op's name, a static string

  // ---- what a backward closure uses ----
  // dL/d(output j): the gradient that flowed into output j (undefined if none reached it).
  const Tensor& grad_out(std::size_t j = 0) const { return outputs()[j]->grad.get(); }
  // Input i's gradient for a kernel that writes every element of it. When input i has no gradient
  // yet: a fresh, uninitialised buffer and acc = false (assign every element: no zero fill, no read
  // of zeros). When it has one (another consumer ran first, or a leaf kept one from an earlier
  // backward), or the input is passed twice (x * x): acc = true (add).
  GradDest write_grad(std::size_t i) const;
  // The same for an elementwise kernel that reads dy[k] before writing dx[k]: when output j's
  // gradient is held by nothing else, that buffer becomes input i's gradient and is overwritten
  // in place (one buffer fewer per op). Read grad_out(j)'s data through a reference taken before
  // this call; afterwards grad_out(j) is undefined.
  GradDest write_grad_over_output(std::size_t i, std::size_t j = 0) const;
  // Input i's gradient for a kernel that adds into it (it may leave elements untouched): a buffer
  // of zeros when new, acc = true.
  GradDest add_grad(std::size_t i) const;
  // Hands g over as input i's gradient without a copy, when it can be: input i has no gradient
  // yet and is not passed twice, and g has its dtype and shape and is held by nothing else.
  // Returns false otherwise, leaving g as it was: write it through write_grad.
  bool take_grad(std::size_t i, Tensor& g) const;
  // ---- the one rule: a backward kernel writes a fresh gradient; the tape combines ----
  // A fresh, uninitialised buffer for input i's gradient (input i's shape and dtype), or an
  // undefined tensor when input i needs none. For a node recorded with may_overwrite_grad_out(),
  // the first call may instead return output 0's gradient itself, viewed in input i's shape, when
  // nothing else holds it: the kernel then writes dx over dy, reading dy[k] before writing dx[k].
  Tensor new_grad(std::size_t i) const;
  // Hands g, input i's gradient (or this node's part of it), to the tape: an input with no
  // gradient yet takes the buffer itself; otherwise the tape adds g to the gradient already there
  // (micrograd's +=, ggml's add_or_set). An undefined g, or an input that needs no gradient, is
  // ignored. g has input i's dtype and number of elements.
  void pass_grad(std::size_t i, Tensor&& g) const;
  // Declared when an op records: its backward kernel is elementwise and may write input 0's
  // gradient over output 0's (see new_grad). Returns *this.
  Node& may_overwrite_grad_out() {
    overwrite_ok_ = true;
    return *this;
  }
  // Whether input i needs a gradient at all (write_grad / add_grad return null dests when not).
  bool needs_grad(std::size_t i) const { return i < n_in && slots()[i] != nullptr; }
  // Input i's shape as recorded (for printing and messages; not available once the node is freed).
  const Shape& input_shape(std::size_t i) const;

  // ---- the record itself: the tape's business ----
  using Slot = detail::Ref<AutogradMeta>;
  template <class T>
  struct Span {
    T* p;
    std::size_t n;
    T* begin() const { return p; }
    T* end() const { return p + n; }
    std::size_t size() const { return n; }
    bool empty() const { return n == 0; }
    T& operator[](std::size_t i) const { return p[i]; }
  };
  // One autograd slot per input (null where it needs no gradient), the outputs' slots, and the
  // shapes of the inputs without a slot. They follow the saved tensors in one arena block, so a
  // node is four counts and 64 bytes, one cache line.
  Span<const Slot> inputs() const { return {slots(), n_in}; }
  Span<const Slot> outputs() const { return {slots() + n_in, n_out}; }
  Span<const Shape> other_shapes() const { return {reinterpret_cast<const Shape*>(slots() + n_in + n_out), n_other}; }
  bool input_repeated(std::size_t i) const { return n_in > 1 && input_repeated_slow(i); }  // x * x
  std::size_t bytes_saved() const;
  void run_backward() { ops_->call(closure_, *this); }
  // Destroys the saved tensors, the closure and the slots (their memory goes back with the
  // tape's arena) and leaves the arrays empty; the tape marks the node freed.
  void release();

  const Tensor* saved_begin() const { return saved_; }
  std::size_t saved_count() const { return n_saved; }
  std::uint32_t n_in = 0, n_other = 0, n_out = 0, n_saved = 0;
  bool freed = false;
  bool overwrite_ok_ = false;             // may_overwrite_grad_out()
  mutable bool grad_out_given_ = false;   // new_grad handed output 0's gradient out
  std::uint64_t undefined_inputs = 0;  // bit i: input i was an undefined (optional) tensor
  Tensor* saved_ = nullptr;            // n_saved tensors; the slots follow them
  void* closure_ = nullptr;            // the backward closure, in the tape's arena
  const detail::ClosureOps* ops_ = nullptr;

 private:
  bool input_repeated_slow(std::size_t i) const;
  Slot* slots() const {
    return reinterpret_cast<Slot*>(reinterpret_cast<char*>(saved_) + n_saved * sizeof(Tensor));
  }
};

// True when recording is on (no NoGradGuard) and any input requires a gradient.
namespace detail { extern thread_local constinit bool t_grad_enabled; }
inline bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!detail::t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->requires_grad()) return true;
  return false;
}

namespace detail {
// Appends a node for `op` to this thread's tape: copies the saved tensors and the inputs' and
// outputs' slots into the tape's arena, marks the outputs as requiring grad, and returns the node
// with closure_bytes of raw arena memory in closure_ (core/autograd.cpp).
Node& record_node(const char* op, const Tensor* const* inputs, std::size_t n_in, Tensor* const* outputs,
                  std::size_t n_out, const Tensor* saved, std::size_t n_saved, std::size_t closure_bytes,
                  std::size_t closure_align);
// Frees the node just recorded (its closure failed to copy) and rethrows.
[[noreturn]] void drop_last_node_and_rethrow();
// After a node is recorded, when anomaly mode or op timing is on (t_record_hook): anomaly mode's
// check of its outputs, and op timing.
extern thread_local constinit bool t_record_hook;
void after_record(Node& node, const Tensor* const* outputs, std::size_t n_out, const Tensor* const* inputs,
                  std::size_t n_in);

template <class S>
constexpr bool is_saved_struct = std::is_class_v<S> && std::is_standard_layout_v<S> &&
                                 sizeof(S) % sizeof(Tensor) == 0 && alignof(S) == alignof(Tensor);

template <class Fn, class S>
void call_closure(void* p, Node& n) {
  if constexpr (std::is_void_v<S>) (*static_cast<Fn*>(p))(n);
  else (*static_cast<Fn*>(p))(n, *std::launder(reinterpret_cast<const S*>(n.saved_begin())));
}
template <class Fn, class S>
inline constexpr ClosureOps kClosureOps{
    &call_closure<Fn, S>,
    std::is_trivially_destructible_v<Fn> ? nullptr : +[](void* p) { static_cast<Fn*>(p)->~Fn(); }};

template <class S, class F>
Node& record_with(const char* op, const Tensor* const* in, std::size_t n_in, Tensor* const* out, std::size_t n_out,
                  const Tensor* saved, std::size_t n_saved, F&& backward) {
  using Fn = std::decay_t<F>;
  Node& node = record_node(op, in, n_in, out, n_out, saved, n_saved, sizeof(Fn), alignof(Fn));
  try {
    node.closure_ = ::new (node.closure_) Fn(std::forward<F>(backward));
  } catch (...) {  // the op throws and its outputs are never seen: leave no half-made node live
    drop_last_node_and_rethrow();
  }
  node.ops_ = &kClosureOps<Fn, S>;
  if (t_record_hook) after_record(node, out, n_out, in, n_in);
  return node;
}
}  // namespace detail

// Records op on this thread's tape (call only when should_record() said yes). `saved` is a struct
// of Tensor fields that the closure receives by name: backward(Node&, const Saved&).
template <class Saved, class F>
Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             const Saved& saved, F&& backward) {
  static_assert(detail::is_saved_struct<Saved>, "Saved must be a plain struct of Tensor fields");
  return detail::record_with<Saved>(op, inputs.begin(), inputs.size(), outputs.begin(), outputs.size(),
                                    reinterpret_cast<const Tensor*>(&saved), sizeof(Saved) / sizeof(Tensor),
                                    std::forward<F>(backward));
}
// The same for an op that saves nothing: backward(Node&).
template <class F>
Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             F&& backward) {
  static_assert(std::is_invocable_v<F, Node&>, "backward must be callable as backward(Node&)");
  return detail::record_with<void>(op, inputs.begin(), inputs.size(), outputs.begin(), outputs.size(), nullptr, 0,
                                   std::forward<F>(backward));
}
// Any number of inputs (cat): the same two forms over a vector.
template <class Saved, class F>
Node& record(const char* op, const std::vector<const Tensor*>& inputs, std::initializer_list<Tensor*> outputs,
             const Saved& saved, F&& backward) {
  static_assert(detail::is_saved_struct<Saved>, "Saved must be a plain struct of Tensor fields");
  return detail::record_with<Saved>(op, inputs.data(), inputs.size(), outputs.begin(), outputs.size(),
                                    reinterpret_cast<const Tensor*>(&saved), sizeof(Saved) / sizeof(Tensor),
                                    std::forward<F>(backward));
}
template <class F>
Node& record(const char* op, const std::vector<const Tensor*>& inputs, std::initializer_list<Tensor*> outputs,
             F&& backward) {
  static_assert(std::is_invocable_v<F, Node&>, "backward must be callable as backward(Node&)");
  return detail::record_with<void>(op, inputs.data(), inputs.size(), outputs.begin(), outputs.size(), nullptr, 0,
                                   std::forward<F>(backward));
}

}  // namespace tg
