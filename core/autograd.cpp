#include "tapegrad/autograd.h"

#include <iomanip>
#include <ostream>
#include <sstream>
#include <unordered_map>

#include "dispatch.h"
#include "kernels/parallel.h"
#include "tapegrad/ops.h"

namespace tg {

namespace {
thread_local bool t_grad_enabled = true;

std::string human_bytes(std::size_t b) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  if (b >= (1u << 20)) s << static_cast<double>(b) / (1 << 20) << " MiB";
  else if (b >= (1u << 10)) s << static_cast<double>(b) / (1 << 10) << " KiB";
  else s << b << " B";
  return s.str();
}
}  // namespace

// ---- Node ----

const Tensor& Node::grad_out(std::size_t i) const { return outputs[i]->grad; }

Tensor Node::grad_in(std::size_t i) const {
  if (!needs_grad(i)) return Tensor();
  return inputs[i]->grad_accumulator();
}

std::size_t Node::bytes_saved() const {
  std::size_t b = 0;
  for (const Tensor& t : saved) b += t.defined() ? t.nbytes() : 0;
  return b;
}

// ---- Tape ----

Tape& tape() {
  thread_local Tape t;
  return t;
}

Node& Tape::push(Node&& n) {
  if (nodes_.size() >= next_sweep_) sweep();
  nodes_.push_back(std::move(n));
  ++live_;
  return nodes_.back();
}

void Tape::clear() {
  nodes_.clear();
  live_ = 0;
  next_sweep_ = kFirstSweep;
  ++generation_;
}

void Tape::free_node(std::size_t i) {
  Node& n = nodes_[i];
  if (n.freed) return;
  n.freed = true;
  n.saved.clear();
  n.saved.shrink_to_fit();
  n.backward = nullptr;
  n.inputs.clear();
  n.inputs.shrink_to_fit();
  --live_;
}

void Tape::sweep() {
  // From the newest node back: a node is unreachable when the only owner of each of its outputs'
  // autograd slots is the node itself. Freeing it drops its references to its inputs, which may
  // make an earlier node unreachable in turn.
  for (std::size_t i = nodes_.size(); i-- > 0;) {
    Node& n = nodes_[i];
    if (n.freed) continue;
    bool unreachable = true;
    for (const auto& o : n.outputs) unreachable = unreachable && o.use_count() == 1;
    if (unreachable) free_node(i);
  }
  if (live_ == 0) clear();
  else next_sweep_ = std::max(kFirstSweep, 2 * nodes_.size());
}

std::size_t Tape::bytes_saved() const {
  std::size_t b = 0;
  for (const Node& n : nodes_) b += n.bytes_saved();
  return b;
}

void Tape::print(std::ostream& os) const {
  os << "tape: " << live_ << " nodes, " << human_bytes(bytes_saved()) << " saved for backward\n";
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.freed) continue;
    std::ostringstream line;
    line << std::setw(4) << i << "  " << std::left << std::setw(22) << n.op << std::right;
    bool first = true;
    for (std::size_t k = 0; k < n.input_shapes.size(); ++k) {
      if (k < 64 && (n.undefined_inputs >> k & 1)) continue;  // an absent optional input (e.g. no bias)
      line << (first ? "" : ", ") << n.input_shapes[k];
      first = false;
      if (n.needs_grad(k) && !n.inputs[k]->name.empty()) line << ' ' << n.inputs[k]->name;
    }
    line << " -> ";
    for (std::size_t k = 0; k < n.outputs.size(); ++k) line << (k ? ", " : "") << n.outputs[k]->shape;
    line << "   saved " << human_bytes(n.bytes_saved());
    os << line.str() << '\n';
  }
}

std::string Tape::to_dot() const {
  std::ostringstream s;
  s << "digraph tape {\n  rankdir=TB;\n  node [fontname=\"Helvetica\", fontsize=10];\n";
  std::unordered_map<std::uint64_t, bool> declared;
  auto tensor_node = [&](const AutogradMeta& m, bool leaf) {
    if (declared[m.id]) return;
    declared[m.id] = true;
    s << "  t" << m.id << " [shape=ellipse, label=\"" << (m.name.empty() ? "" : m.name + "\\n") << m.shape.str() << "\"";
    if (leaf) s << ", style=filled, fillcolor=\"#dbe9f6\"";
    s << "];\n";
  };
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.freed) continue;
    s << "  op" << i << " [shape=box, style=filled, fillcolor=\"#f6e7c1\", label=\"#" << i << ' ' << n.op
      << "\\nsaved " << human_bytes(n.bytes_saved()) << "\"];\n";
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      if (!n.inputs[k]) continue;
      tensor_node(*n.inputs[k], n.inputs[k]->node < 0);
      s << "  t" << n.inputs[k]->id << " -> op" << i << ";\n";
    }
    for (const auto& o : n.outputs) {
      tensor_node(*o, false);
      s << "  op" << i << " -> t" << o->id << ";\n";
    }
  }
  s << "}\n";
  return s.str();
}

// ---- grad mode ----

bool grad_enabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

// ---- recording ----

bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->requires_grad()) return true;
  return false;
}

Node& record(const char* op, const std::vector<const Tensor*>& inputs, const std::vector<Tensor*>& outputs,
             std::function<void(Node&)> backward, std::vector<Tensor> saved) {
  Tape& tp = tape();
  Node n;
  n.op = op;
  n.inputs.reserve(inputs.size());
  n.input_shapes.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Tensor* t = inputs[i];
    n.inputs.push_back(t->requires_grad() ? t->meta() : nullptr);
    n.input_shapes.push_back(t->shape());
    if (!t->defined() && i < 64) n.undefined_inputs |= std::uint64_t(1) << i;
  }
  n.outputs.reserve(outputs.size());
  for (Tensor* t : outputs) n.outputs.push_back(t->ensure_meta());
  n.saved = std::move(saved);
  n.backward = std::move(backward);
  Node& node = tp.push(std::move(n));
  // Stamped after the push: its sweep may have emptied the tape and started a new generation.
  for (auto& m : node.outputs) {
    m->requires_grad = true;
    m->node = static_cast<std::int64_t>(tp.size()) - 1;
    m->generation = tp.generation();
  }
  return node;
}

Node& record(const char* op, std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
             std::function<void(Node&)> backward, std::vector<Tensor> saved) {
  return record(op, std::vector<const Tensor*>(inputs), std::vector<Tensor*>(outputs), std::move(backward),
                std::move(saved));
}

// ---- backward ----

void backward(const Tensor& root, const Tensor& grad, bool keep_tape) {
  detail::check_defined("backward", root, "tensor");
  if (!root.requires_grad())
    fail("backward", "tensor of shape ", root.shape(), " does not require grad (no input of its graph did, or it was made under NoGradGuard)");
  Tensor seed;
  if (grad.defined()) {
    if (!(grad.shape() == root.shape()) || grad.dtype() != root.dtype())
      fail("backward", "gradient ", grad.dtype(), " ", grad.shape(), " does not match tensor ", root.dtype(), " ", root.shape());
    seed = grad;
  } else {
    if (root.numel() != 1)
      fail("backward", "implicit gradient needs a scalar, got shape ", root.shape(), "; pass an upstream gradient");
    seed = ones(root.shape(), root.dtype());
  }
  AutogradMeta& rm = *root.meta();
  Tape& tp = tape();
  const char* freed_msg = "part of the graph of this tensor was freed by an earlier backward(); "
                          "call backward(grad, /*keep_tape=*/true) to differentiate a graph twice";
  if (rm.node >= 0 && (rm.generation != tp.generation() || rm.node >= static_cast<std::int64_t>(tp.size())))
    fail("backward", freed_msg);

  // Pass 1, before any gradient is touched: mark what the root depends on, and refuse if any of it
  // was freed (so a failing call changes nothing).
  static thread_local std::uint64_t epoch = 0;
  const std::uint64_t mark = ++epoch;
  rm.visit = mark;
  for (std::int64_t i = rm.node; i >= 0; --i) {
    Node& n = tp.node(static_cast<std::size_t>(i));
    bool reached = false;
    for (const auto& o : n.outputs) reached = reached || o->visit == mark;
    if (!reached) continue;
    if (n.freed) fail("backward", freed_msg, " (op '", n.op, "', node ", i, ")");
    for (const auto& in : n.inputs)
      if (in) in->visit = mark;
  }

  // Accumulate the seed (so backward on a leaf, or twice with keep_tape, adds up).
  {
    Tensor g = rm.grad_accumulator();
    detail::dispatch_float("backward", g.dtype(), [&](auto z) {
      using T = decltype(z);
      T* gp = g.data<T>();
      const T* sp = seed.data<T>();
      const std::int64_t n = g.numel();
      TG_PARALLEL_FOR(n)
      for (std::int64_t i = 0; i < n; ++i) gp[i] += sp[i];
    });
  }
  // Pass 2: the reverse walk over the marked nodes.
  NoGradGuard no_record;  // backward kernels must not append to the tape they walk
  for (std::int64_t i = rm.node; i >= 0; --i) {
    Node& n = tp.node(static_cast<std::size_t>(i));
    bool reached = false;
    for (const auto& o : n.outputs) reached = reached || (o->visit == mark && o->grad.defined());
    if (!reached || n.freed) continue;
    n.backward(n);
    // An intermediate gradient is dead once its node has run: free it (PyTorch keeps only leaves').
    for (const auto& o : n.outputs)
      if (!o->retains_grad) o->grad = Tensor();
    if (!keep_tape) tp.free_node(static_cast<std::size_t>(i));
  }
  if (tp.live() == 0) tp.clear();
}

}  // namespace tg
