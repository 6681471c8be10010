#pragma once
// Running a test at each instruction-set level the kernels have (kernels/isa.h), for unit tests
// (which see the library's internal headers).
#include <catch2/catch.hpp>
#include <initializer_list>

#include "kernels/isa.h"

namespace tgtest {

// Sets the kernels' instruction set for a scope (kernels/isa.h) and restores the one in use.
struct IsaScope {
  tg::kernels::Isa saved = tg::kernels::isa();
  explicit IsaScope(tg::kernels::Isa level) { tg::kernels::set_isa(level); }
  ~IsaScope() { tg::kernels::set_isa(saved); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

// Runs body(level) once for each of the levels this CPU can run, each set in-process in turn.
template <class F>
void each_isa(std::initializer_list<tg::kernels::Isa> levels, F&& body) {
  for (tg::kernels::Isa level : levels) {
    if (!tg::kernels::cpu_supports(level)) continue;
    IsaScope scope(level);
    INFO("isa=" << tg::kernels::isa_name(level));
    body(level);
  }
}

}  // namespace tgtest
