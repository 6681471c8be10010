#pragma once
// The parts of tapegrad/node.h that only the tape reads: the span type of a node's slot arrays,
// the table that calls and destroys a closure, and declarations of the recording machinery
// (tapegrad/detail/record.h). A learner can skip this file.
#include <cstddef>
#include <initializer_list>

namespace tg {
class Node;
class Tensor;
namespace detail {

extern thread_local constinit bool t_grad_enabled;  // off under a NoGradGuard
struct TapeAccess;  // core/tape_internal.h: recording, the backward walk and the sweep
struct NodeAccess;  // tapegrad/detail/record.h: a node's closure and saved tensors

// A view of n elements at p (a node's slots live in the tape's arena).
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

// How a node calls and destroys its closure: one static table per closure type.
struct ClosureOps {
  void (*call)(void*, Node&);
  void (*destroy)(void*);  // null for a trivially destructible closure
};

template <class S, class F>
Node& record_saved(const char* op, Span<const Tensor* const> in, std::initializer_list<Tensor*> out, const S& saved,
                   F&& backward);
template <class F>
Node& record_plain(const char* op, Span<const Tensor* const> in, std::initializer_list<Tensor*> out, F&& backward);

}  // namespace detail
}  // namespace tg
