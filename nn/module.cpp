#include "tapegrad/nn/module.h"

#include <cstring>
#include <set>
#include <sstream>

#include "tapegrad/autograd.h"
#include "tapegrad/error.h"

namespace tg::nn {

namespace {
void check_name(const char* op, const std::string& name) {
  if (name.empty() || name.find('.') != std::string::npos)
    fail(op, "name '", name, "' must be non-empty and contain no '.'");
}
}  // namespace

Tensor Module::register_parameter(const std::string& name, Tensor t) {
  check_name("register_parameter", name);
  if (!t.defined()) fail("register_parameter", "'", name, "' is an undefined tensor");
  for (auto& [n, _] : params_) if (n == name) fail("register_parameter", "'", name, "' is already registered");
  t.requires_grad_(true);
  t.set_name(name);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  check_name("register_buffer", name);
  if (!t.defined()) fail("register_buffer", "'", name, "' is an undefined tensor");
  for (auto& [n, _] : buffers_) if (n == name) fail("register_buffer", "'", name, "' is already registered");
  buffers_.emplace_back(name, t);
  return t;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_name("register_module", name);
  if (!m) fail("register_module", "'", name, "' is null");
  for (auto& [n, _] : children_) if (n == name) fail("register_module", "'", name, "' is already registered");
  children_.emplace_back(name, std::move(m));
}

void Module::collect(const std::string& prefix, bool params, std::vector<std::pair<std::string, Tensor>>& out) const {
  for (const auto& [n, t] : params ? params_ : buffers_) out.emplace_back(prefix + n, t);
  for (const auto& [n, c] : children_) c->collect(prefix + n + ".", params, out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> all, out;
  collect("", true, all);
  std::set<const void*> seen;
  for (auto& item : all)
    if (seen.insert(item.second.raw_data()).second) out.push_back(std::move(item));
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [_, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", false, out);
  return out;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [_, c] : children_) c->train(on);
}

void Module::zero_grad() {
  for (auto& [_, t] : named_parameters()) t.zero_grad();
}

std::int64_t Module::num_parameters() const {
  std::int64_t n = 0;
  for (auto& [_, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::name_tensors(const std::string& prefix) {
  for (auto& [n, t] : params_) t.set_name(prefix + n);
  for (auto& [n, t] : buffers_) t.set_name(prefix + n);
  for (auto& [n, c] : children_) c->name_tensors(prefix + n + ".");
}

StateDict Module::state_dict() const {
  StateDict sd;
  std::vector<std::pair<std::string, Tensor>> all;
  collect("", true, all);
  collect("", false, all);
  std::set<const void*> seen;
  for (auto& [n, t] : all)
    if (seen.insert(t.raw_data()).second) sd.insert(n, t.detach());
  return sd;
}

void Module::load_state_dict(const StateDict& sd, bool strict) {
  const StateDict mine = state_dict();
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& [n, t] : mine) {
    const Tensor* src = sd.find(n);
    if (!src) { missing.push_back(n); continue; }
    if (!(src->shape() == t.shape()) || src->dtype() != t.dtype()) {
      std::ostringstream s;
      s << n << ": checkpoint " << src->dtype() << ' ' << src->shape() << ", model " << t.dtype() << ' ' << t.shape();
      if (src->dtype() != t.dtype()) s << " (convert it with to(" << t.dtype() << ") first)";
      mismatched.push_back(s.str());
    }
  }
  for (const auto& [n, _] : sd)
    if (!mine.contains(n)) unexpected.push_back(n);
  const bool bad = !mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty()));
  if (bad) {
    std::ostringstream s;
    auto list = [&s](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      s << "\n  " << what << ": ";
      for (std::size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
    };
    list("missing keys", missing);
    list("unexpected keys", unexpected);
    list("shape or dtype mismatch", mismatched);
    fail("load_state_dict", "the state dict does not fit ", type_name(), "; nothing was loaded", s.str());
  }
  for (const auto& [n, t] : mine) {
    const Tensor* src = sd.find(n);
    if (!src || src->shares_storage(t)) continue;
    Tensor dst = t;
    if (t.nbytes()) std::memcpy(dst.raw_data(), src->raw_data(), t.nbytes());
    dst.bump_version();  // an in-place write: a graph recorded before the load refuses its backward
  }
}

void Module::print(std::ostream& os, int indent) const {
  os << type_name() << '(' << extra_repr();
  if (!children_.empty()) {
    os << '\n';
    for (const auto& [n, c] : children_) {
      os << std::string(static_cast<std::size_t>(indent + 2), ' ') << '(' << n << "): ";
      c->print(os, indent + 2);
      os << '\n';
    }
    os << std::string(static_cast<std::size_t>(indent), ' ');
  }
  os << ')';
}

std::ostream& operator<<(std::ostream& os, const Module& m) {
  m.print(os);
  return os;
}

}  // namespace tg::nn
