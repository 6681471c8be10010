#include "tapegrad/tensor.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "per_thread.h"
#include "tapegrad/autograd.h"
#include "tapegrad/ops.h"

namespace tg {

namespace {
std::atomic<std::uint32_t> next_meta_id{1};

// Recycles the small fixed-size blocks of the objects behind a Tensor (a Storage, an AutogradMeta, a
// gradient's Tensor) through a per-thread free list. A training step makes and drops a few hundred
// of each; a chain of 10^5 small ops, 10^5. Through malloc, the freed tail of the heap is trimmed
// back to the system and faulted in again on the next step, which cost more than the ops.
// A block freed on another thread joins that thread's list (any block fits any list of its size);
// each list keeps at most kPoolMax blocks and frees the rest.
// A thread's list is freed when the thread ends; a block dropped after that (a tensor held in a
// static, or by another thread_local) goes straight to the heap, as every block does under
// AddressSanitizer (so use-after-free stays detectable).
// The free blocks are an intrusive list (each free block holds the next one's address): a push or
// a pop is two moves and a count, with nothing to grow.
template <std::size_t Size, std::size_t Align>
struct BlockPool {
  static_assert(Size >= sizeof(void*));
  static constexpr std::size_t kPoolMax = std::size_t(1) << 18;
  void* head = nullptr;
  std::size_t count = 0;
  ~BlockPool() {
    while (head) {
      void* p = head;
      head = *static_cast<void**>(p);
      release(p);
    }
  }
  static void* get() {
    if constexpr (Align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return ::operator new(Size, std::align_val_t(Align));
    else return ::operator new(Size);
  }
  static void release(void* p) {
    if constexpr (Align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) ::operator delete(p, std::align_val_t(Align));
    else ::operator delete(p);
  }
  static BlockPool* mine() { return detail::per_thread<BlockPool>(); }
};
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kPoolOn = false;
#else
constexpr bool kPoolOn = true;
#endif

// Raw memory for one T, and its return.
template <class T>
T* pool_allocate() {
  using Pool = BlockPool<sizeof(T), alignof(T)>;
  auto* pool = kPoolOn ? Pool::mine() : nullptr;
  if (!pool || !pool->head) return static_cast<T*>(Pool::get());
  void* p = pool->head;
  pool->head = *static_cast<void**>(p);
  --pool->count;
  return static_cast<T*>(p);
}
template <class T>
void pool_deallocate(T* p) noexcept {
  using Pool = BlockPool<sizeof(T), alignof(T)>;
  auto* pool = kPoolOn ? Pool::mine() : nullptr;
  if (!pool || pool->count >= Pool::kPoolMax) return Pool::release(p);
  *reinterpret_cast<void**>(p) = pool->head;
  pool->head = p;
  ++pool->count;
}

// A T built in pooled memory, the memory given back if its constructor throws.
template <class T, class... Args>
T* pool_new(Args&&... args) {
  T* mem = pool_allocate<T>();
  try {
    return ::new (mem) T(std::forward<Args>(args)...);
  } catch (...) {
    pool_deallocate(mem);
    throw;
  }
}
template <class T>
void pool_delete(T* p) noexcept {
  p->~T();
  pool_deallocate(p);
}

// The shape's byte count, refusing negative dimensions and sizes beyond 1 TiB before anything is
// allocated (and before the count could overflow): no machine this runs on has that much memory,
// and the allocator's own failure is a less helpful message (or, under AddressSanitizer, an abort).
std::size_t checked_bytes(const char* op, const Shape& s, std::size_t itemsize) {
  constexpr std::uint64_t kMax = std::uint64_t(1) << 40;
  // Fast path: at most two dimensions, each in [1, 2^16]: at most 2^35 bytes, under the limit.
  if (s.ndim() <= 2) {
    const std::uint64_t d0 = s.ndim() > 0 ? static_cast<std::uint64_t>(s[0]) - 1 : 0;
    const std::uint64_t d1 = s.ndim() > 1 ? static_cast<std::uint64_t>(s[1]) - 1 : 0;
    if ((d0 | d1) < (std::uint64_t(1) << 16)) return itemsize * (d0 + 1) * (d1 + 1);
  }
  std::uint64_t n = itemsize;
  bool negative = false, zero = false, big = false;
  for (std::int64_t d : s) {
    negative = negative || d < 0;
    zero = zero || d == 0;
    if (d > 0 && !big) big = __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n) || n > kMax;
  }
  if (negative) fail(op, "negative dimension in shape ", s);
  if (zero) return 0;
  if (big) fail(op, "shape ", s, " is too large (over 1 TiB)");
  return static_cast<std::size_t>(n);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  const std::size_t bytes = checked_bytes("empty", shape, itemsize(dtype));
  detail::Ref<Storage> st;
  try {
    st = detail::Ref<Storage>(Storage::make(bytes));
  } catch (const std::bad_alloc&) {
    fail("empty", "out of memory allocating ", bytes, " bytes for ", dtype, " ", shape);
  }
  return Tensor(std::move(st), shape, dtype);
}

std::int64_t Tensor::size(int d) const { return shape_[detail::norm_axis("size", d, dim(), shape_)]; }

void Tensor::check_dtype(DType want) const {
  if (!defined()) fail("data", "tensor is undefined");
  if (want != dtype_) fail("data", "tensor has dtype ", dtype_, ", requested ", want);
}

std::int64_t Tensor::flat_index(std::initializer_list<std::int64_t> idx, const char* op) const {
  if (!defined()) fail(op, "tensor is undefined");
  if (static_cast<int>(idx.size()) != dim())
    fail(op, idx.size(), " indices for a ", dim(), "-d tensor of shape ", shape_);
  std::int64_t flat = 0;
  int d = 0;
  for (std::int64_t i : idx) {
    const std::int64_t n = shape_[d];
    if (i < -n || i >= n) fail(op, "index ", i, " is out of range for dim ", d, " of shape ", shape_);
    flat = flat * n + (i < 0 ? i + n : i);
    ++d;
  }
  return flat;
}

double Tensor::item() const {
  if (!defined()) fail("item", "tensor is undefined");
  if (numel() != 1) fail("item", "needs a tensor with one element, got shape ", shape_);
  return to_vector<double>()[0];
}

double Tensor::at(std::initializer_list<std::int64_t> idx) const {
  const std::int64_t i = flat_index(idx, "at");
  return detail::dispatch_all(dtype_, [&](auto t) {
    using T = decltype(t);
    return static_cast<double>(static_cast<const T*>(storage_->data)[i]);
  });
}

void Tensor::set(std::initializer_list<std::int64_t> idx, double v) {
  const std::int64_t i = flat_index(idx, "set");
  detail::dispatch_all(dtype_, [&](auto t) {
    using T = decltype(t);
    static_cast<T*>(storage_->data)[i] = static_cast<T>(v);
  });
}

// ---- autograd slot ----

Storage* Storage::make(std::size_t nbytes) { return pool_new<Storage>(nbytes); }
void Storage::destroy(Storage* s) noexcept { pool_delete(s); }
AutogradMeta* AutogradMeta::make(const Shape& s, DType d) { return pool_new<AutogradMeta>(s, d); }
void AutogradMeta::destroy(AutogradMeta* m) noexcept { pool_delete(m); }

detail::Ref<AutogradMeta>& Tensor::ensure_meta() {
  if (!meta_) meta_ = detail::Ref<AutogradMeta>(AutogradMeta::make(shape_, dtype_));
  return meta_;
}

Tensor& Tensor::requires_grad_(bool on) {
  if (!defined()) fail("requires_grad_", "tensor is undefined");
  if (on && !is_floating(dtype_)) fail("requires_grad_", "only float tensors can require grad, got ", dtype_, " ", shape_);
  if (!is_leaf()) fail("requires_grad_", "can only be set on a leaf tensor; use detach() first");
  if (on || meta_) ensure_meta()->requires_grad = on;
  return *this;
}

bool Tensor::is_leaf() const { return !meta_ || meta_->node < 0; }

Tensor Tensor::grad() const { return meta_ ? meta_->grad.get() : Tensor(); }

void Tensor::zero_grad() {
  if (meta_) meta_->grad.reset();
}

void Tensor::retain_grad() {
  if (!requires_grad()) fail("retain_grad", "tensor does not require grad");
  meta_->retains_grad = true;
  detail::note_retain_grad();
}

void Tensor::backward() const { tg::backward(*this); }
void Tensor::backward(const Tensor& grad, bool keep_tape) const { tg::backward(*this, grad, keep_tape); }

Tensor Tensor::detach() const { return Tensor(storage_, shape_, dtype_); }

Tensor& Tensor::set_name(std::string name) {
  ensure_meta()->name = std::make_unique<std::string>(std::move(name));
  return *this;
}

std::string Tensor::name() const { return meta_ ? meta_->label() : std::string(); }

std::uint32_t AutogradMeta::dot_id() {
  while (id == 0) id = next_meta_id++;  // (0 means none yet: skipped when the counter wraps)
  return id;
}

Tensor& AutogradMeta::grad_accumulator() {
  if (!grad.defined()) return grad.set(zeros(shape, dtype));
  return *grad.ptr();
}

// ---- gradient slot ----

namespace detail {

// Constant-initialised (Tensor's default constructor is constexpr): valid before any dynamic
// initialisation, so a slot read from another static's constructor sees it too.
constinit const Tensor g_undefined_tensor{};

Tensor& GradSlot::set(Tensor t) {
  if (!t.defined()) fail("autograd", "internal error: an undefined tensor stored as a gradient (use reset())");
  if (p_) {
    *p_ = std::move(t);
    return *p_;
  }
  p_ = pool_new<Tensor>(std::move(t));  // a move: cannot throw after the allocation
  return *p_;
}

void GradSlot::release() {
  Tensor* p = p_;
  p_ = nullptr;
  pool_delete(p);
}

}  // namespace detail

// ---- methods that forward to ops ----
Tensor Tensor::reshape(const Shape& s) const { return tg::reshape(*this, s); }
Tensor Tensor::transpose(int d0, int d1) const { return tg::transpose(*this, d0, d1); }
Tensor Tensor::permute(const std::vector<int>& dims) const { return tg::permute(*this, dims); }
Tensor Tensor::slice(int d, std::int64_t start, std::int64_t end, std::int64_t step) const {
  return tg::slice(*this, d, start, end, step);
}
Tensor Tensor::clone() const { return tg::clone(*this); }
Tensor Tensor::to(DType d) const { return tg::to(*this, d); }
Tensor Tensor::sum(const std::vector<int>& axes, bool keepdim) const { return tg::sum(*this, axes, keepdim); }
Tensor Tensor::mean(const std::vector<int>& axes, bool keepdim) const { return tg::mean(*this, axes, keepdim); }

// ---- factories ----

Tensor zeros(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor full(const Shape& shape, double value, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    const T v = static_cast<T>(value);
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = v;
  });
  return t;
}

Tensor ones(const Shape& shape, DType dtype) { return full(shape, 1.0, dtype); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype()); }

Tensor arange(std::int64_t end, DType dtype) { return arange(0.0, static_cast<double>(end), 1.0, dtype); }

Tensor arange(double start, double end, double step, DType dtype) {
  if (step == 0 || !std::isfinite(step) || !std::isfinite(start) || !std::isfinite(end))
    fail("arange", "invalid range start=", start, " end=", end, " step=", step);
  const double n = std::ceil((end - start) / step);
  const std::int64_t count = n > 0 ? static_cast<std::int64_t>(n) : 0;
  Tensor t = Tensor::empty(Shape{count}, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    for (std::int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(start + static_cast<double>(i) * step);
  });
  return t;
}

Tensor tensor(const std::vector<double>& values, const Shape& shape, DType dtype) {
  const Shape s = shape.ndim() == 0 && values.size() != 1 ? Shape{static_cast<std::int64_t>(values.size())} : shape;
  if (s.numel() != static_cast<std::int64_t>(values.size()))
    fail("tensor", values.size(), " values do not fill shape ", s);
  Tensor t = Tensor::empty(s, dtype);
  detail::dispatch_all(dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(t.raw_data());
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return t;
}

}  // namespace tg
