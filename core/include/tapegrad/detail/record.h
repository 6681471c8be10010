#pragma once
// Recording a node (the template half of tapegrad/node.h's record()): the node's arrays and its
// closure are placed in the tape's arena by detail::record_node (core/autograd.cpp), the closure
// is constructed there, and a static table remembers how to call and destroy it. A learner can
// skip this file: record() appends one node holding the inputs' slots, the saved tensors and the
// closure.
#include <new>
#include <type_traits>
#include <utility>

#include "tapegrad/node.h"

namespace tg::detail {

// Appends a node for `op` to this thread's tape: copies the saved tensors and the inputs' and
// outputs' slots into the tape's arena, marks the outputs as requiring grad, and returns the node
// with closure_bytes of raw arena memory for the closure.
Node& record_node(const char* op, const Tensor* const* inputs, std::size_t n_in, Tensor* const* outputs,
                  std::size_t n_out, const Tensor* saved, std::size_t n_saved, std::size_t closure_bytes,
                  std::size_t closure_align);
// Frees the node just recorded (its closure failed to copy) and rethrows.
[[noreturn]] void drop_last_node_and_rethrow();
// After a node is recorded, when anomaly mode or op timing is on (t_record_hook).
extern thread_local constinit bool t_record_hook;
void after_record(Node& node, const Tensor* const* outputs, std::size_t n_out, const Tensor* const* inputs,
                  std::size_t n_in);

struct NodeAccess {
  static void*& closure(Node& n) { return n.closure_; }
  static const ClosureOps*& ops(Node& n) { return n.ops_; }
  static const Tensor* saved(const Node& n) { return n.saved_; }
};

template <class S>
constexpr bool is_saved_struct = std::is_class_v<S> && std::is_standard_layout_v<S> &&
                                 sizeof(S) % sizeof(Tensor) == 0 && alignof(S) == alignof(Tensor);

// The saved tensors are copied into the arena one by one; the closure reads them back as the
// struct they came from (a standard-layout struct of Tensor fields has the layout of Tensor[k]).
template <class Fn, class S>
void call_closure(void* p, Node& n) {
  if constexpr (std::is_void_v<S>) (*static_cast<Fn*>(p))(n);
  else (*static_cast<Fn*>(p))(n, *std::launder(reinterpret_cast<const S*>(NodeAccess::saved(n))));
}
template <class Fn, class S>
inline constexpr ClosureOps kClosureOps{
    &call_closure<Fn, S>,
    std::is_trivially_destructible_v<Fn> ? nullptr : +[](void* p) { static_cast<Fn*>(p)->~Fn(); }};

template <class S, class F>
Node& record_with(const char* op, Span<const Tensor* const> in, std::initializer_list<Tensor*> out, const Tensor* saved,
                  std::size_t n_saved, F&& backward) {
  using Fn = std::decay_t<F>;
  Node& node = record_node(op, in.begin(), in.size(), out.begin(), out.size(), saved, n_saved, sizeof(Fn), alignof(Fn));
  try {
    NodeAccess::closure(node) = ::new (NodeAccess::closure(node)) Fn(std::forward<F>(backward));
  } catch (...) {  // the op throws and its outputs are never seen: leave no half-made node live
    drop_last_node_and_rethrow();
  }
  NodeAccess::ops(node) = &kClosureOps<Fn, S>;
  if (t_record_hook) after_record(node, out.begin(), out.size(), in.begin(), in.size());
  return node;
}

template <class S, class F>
Node& record_saved(const char* op, Span<const Tensor* const> in, std::initializer_list<Tensor*> out, const S& saved,
                   F&& backward) {
  static_assert(is_saved_struct<S>, "Saved must be a plain struct of Tensor fields");
  return record_with<S>(op, in, out, reinterpret_cast<const Tensor*>(&saved), sizeof(S) / sizeof(Tensor),
                        std::forward<F>(backward));
}
template <class F>
Node& record_plain(const char* op, Span<const Tensor* const> in, std::initializer_list<Tensor*> out, F&& backward) {
  static_assert(std::is_invocable_v<F, Node&>, "backward must be callable as backward(Node&)");
  return record_with<void>(op, in, out, nullptr, 0, std::forward<F>(backward));
}

}  // namespace tg::detail
