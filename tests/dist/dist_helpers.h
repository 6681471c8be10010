#pragma once
// What the tg::dist unit tests share.
#include <cstring>

#include <tapegrad/dist.h>

#include "helpers.h"

namespace tgdist {

namespace dist = tg::dist;

// Whether t holds the same bytes on every rank (the answer is the same on every rank).
inline bool same_on_every_rank(const tg::Tensor& t) {
  tg::Tensor first = t.clone();
  dist::broadcast(first, 0);
  const bool mine = std::memcmp(first.raw_data(), t.raw_data(), t.nbytes()) == 0;
  return dist::all_reduce(mine ? 0.0 : 1.0) == 0;
}

}  // namespace tgdist
