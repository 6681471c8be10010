// The caching allocator's arena for large blocks (core/block_arena.h): first fit, splitting, merging
// of free neighbours, segments, and the bookkeeping a training loop's memory depends on. Each case
// uses an arena of its own, so addresses and counts are exact.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <new>
#include <random>
#include <vector>

#include "block_arena.h"
#include "helpers.h"

using tg::detail::BlockArena;

namespace {
constexpr std::size_t KiB = 1024, MiB = 1024 * 1024;
char* as_bytes(void* p) { return static_cast<char*>(p); }
}  // namespace

TEST_CASE("arena: blocks are carved one after another from a segment, and a freed block is used again") {
  BlockArena arena(8 * MiB, 64 * KiB, 1024 * MiB);
  CHECK(arena.reserved_bytes() == 0);
  char* a = as_bytes(arena.allocate(1 * MiB));
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 4096 == 0);  // a segment starts on a page
  char* b = as_bytes(arena.allocate(2 * MiB));
  char* c = as_bytes(arena.allocate(512 * KiB));
  CHECK(b == a + 1 * MiB);
  CHECK(c == b + 2 * MiB);
  CHECK(arena.segment_count() == 1);
  CHECK(arena.reserved_bytes() == 8 * MiB);
  CHECK(arena.in_use_bytes() == 3 * MiB + 512 * KiB);
  CHECK(arena.largest_free_block() == 8 * MiB - (3 * MiB + 512 * KiB));
  arena.deallocate(b);
  CHECK(arena.in_use_bytes() == 1 * MiB + 512 * KiB);
  CHECK(as_bytes(arena.allocate(2 * MiB)) == b);  // the hole fits exactly: the tail stays whole
  CHECK(arena.largest_free_block() == 8 * MiB - (3 * MiB + 512 * KiB));
}

TEST_CASE("arena: a request takes the first free block it fits, in mapping order, then address order") {
  BlockArena arena(16 * MiB, 64 * KiB, 1024 * MiB);
  std::vector<char*> p;
  for (std::size_t size : {1 * MiB, 128 * KiB, 768 * KiB, 128 * KiB, 512 * KiB, 128 * KiB, 256 * KiB, 128 * KiB})
    p.push_back(as_bytes(arena.allocate(size)));
  // Free the 1 MiB, 768 KiB, 512 KiB and 256 KiB blocks: holes separated by live 128 KiB blocks.
  for (int i : {0, 2, 4, 6}) arena.deallocate(p[i]);
  // 300 KiB: the first hole, 1 MiB, though 512 KiB would fit more tightly (best fit's choice).
  CHECK(as_bytes(arena.allocate(300 * KiB)) == p[0]);
  // 720 KiB: the 724 KiB left of p[0]'s hole fits, and the 4 KiB over is too little to split off
  // (min 64 KiB): the request holds the rest of the hole.
  CHECK(as_bytes(arena.allocate(720 * KiB)) == p[0] + 300 * KiB);
  CHECK(as_bytes(arena.allocate(600 * KiB)) == p[2]);  // the first hole left that fits: 768 KiB
  CHECK(arena.in_use_bytes() == 4 * 128 * KiB + 1 * MiB + 600 * KiB);
  // A second segment, mapped after the first: a hole in the first comes before its free space,
  // whatever the two segments' addresses.
  char* far = as_bytes(arena.allocate(15 * MiB));
  CHECK(arena.segment_count() == 2);
  CHECK(as_bytes(arena.allocate(200 * KiB)) == p[4]);  // the first segment's 512 KiB hole, not far's tail
  arena.deallocate(far);
  CHECK(as_bytes(arena.allocate(1 * MiB)) == p[7] + 128 * KiB);  // the first segment's 13 MiB tail
  CHECK(as_bytes(arena.allocate(14 * MiB)) == far);  // too large for anything left in the first
}

TEST_CASE("arena: a freed block merges with free neighbours, so the memory serves any size again") {
  BlockArena arena(4 * MiB, 64 * KiB, 1024 * MiB);
  char* a = as_bytes(arena.allocate(1 * MiB));
  char* b = as_bytes(arena.allocate(1 * MiB));
  char* c = as_bytes(arena.allocate(1 * MiB));
  char* d = as_bytes(arena.allocate(1 * MiB));  // the segment is full
  CHECK(arena.largest_free_block() == 0);
  arena.deallocate(a);
  arena.deallocate(c);
  CHECK(arena.largest_free_block() == 1 * MiB);  // two separate holes
  arena.deallocate(b);                           // joins both: a, b and c are one block
  CHECK(arena.largest_free_block() == 3 * MiB);
  CHECK(as_bytes(arena.allocate(3 * MiB)) == a);  // three blocks' memory, one request, no new segment
  CHECK(arena.segment_count() == 1);
  arena.deallocate(a);
  arena.deallocate(d);  // the segment is whole again: one free block
  CHECK(arena.largest_free_block() == 4 * MiB);
  CHECK(arena.in_use_bytes() == 0);
  arena.release_free_segments();
  CHECK(arena.segment_count() == 0);
  CHECK(arena.reserved_bytes() == 0);
}

TEST_CASE("arena: a request larger than a segment gets a segment of its own, rounded up to 2 MiB") {
  BlockArena arena(4 * MiB, 64 * KiB, 1024 * MiB);
  char* small = as_bytes(arena.allocate(1 * MiB));
  char* big = as_bytes(arena.allocate(5 * MiB + 64));
  CHECK(arena.segment_count() == 2);
  CHECK(arena.reserved_bytes() == 4 * MiB + 6 * MiB);
  std::memset(big, 0x5a, 5 * MiB + 64);  // all of it is writable
  CHECK(big[5 * MiB + 63] == 0x5a);
  arena.deallocate(big);
  arena.release_free_segments();  // the big segment is free, the first one is not
  CHECK(arena.segment_count() == 1);
  CHECK(arena.reserved_bytes() == 4 * MiB);
  arena.deallocate(small);
}

TEST_CASE("arena: a free that leaves more than max_cached bytes free returns the free segments") {
  BlockArena arena(4 * MiB, 64 * KiB, 6 * MiB);
  char* a = as_bytes(arena.allocate(3 * MiB));
  char* b = as_bytes(arena.allocate(3 * MiB));  // does not fit a's segment: a second one
  CHECK(arena.segment_count() == 2);
  arena.deallocate(a);  // 4 + 1 MiB free, within the bound: a's segment stays, whole and free
  CHECK(arena.segment_count() == 2);
  CHECK(arena.free_bytes() == 5 * MiB);
  CHECK(as_bytes(arena.allocate(4 * MiB)) == a);  // and serves the next request without a mapping
  arena.deallocate(a);
  arena.deallocate(b);  // 8 MiB free, over the bound: both segments, now whole, go back
  CHECK(arena.segment_count() == 0);
  CHECK(arena.reserved_bytes() == 0);
}

TEST_CASE("arena: a mapping the system refuses is tried again after the free segments go back") {
  // In a child process, with a free 64 MiB segment cached, under an address-space limit 40 MiB
  // above what is mapped: an 80 MiB segment can be mapped only after the cached one goes back.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      BlockArena arena(64 * MiB, 64 * KiB, 1024 * MiB);
      void* a = arena.allocate(64 * MiB);
      arena.deallocate(a);  // kept: within max_cached
      if (arena.segment_count() != 1) ::_exit(2);
      rlimit cap{};
      ::getrlimit(RLIMIT_AS, &cap);
      std::ifstream status("/proc/self/status");
      std::string line;
      std::size_t vm_kb = 0;
      while (std::getline(status, line))
        if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoull(line.substr(7));
      cap.rlim_cur = vm_kb * 1024 + 40 * MiB;  // the cached 64 MiB are inside VmSize already
      if (::setrlimit(RLIMIT_AS, &cap) != 0) ::_exit(3);
      void* b = arena.allocate(80 * MiB);  // a new 80 MiB segment fits only once the 64 are gone
      code = arena.segment_count() == 1 && arena.reserved_bytes() == 80 * MiB ? 0 : 4;
      std::memset(b, 1, 4096);
    } catch (const std::bad_alloc&) {
      code = 5;
    }
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // 5: bad_alloc, the retry did not happen
}

TEST_CASE("arena: a request the system cannot map throws std::bad_alloc and changes nothing") {
  BlockArena arena(4 * MiB, 64 * KiB, 1024 * MiB);
  char* a = as_bytes(arena.allocate(1 * MiB));
  CHECK_THROWS_AS(arena.allocate(std::size_t(1) << 52), std::bad_alloc);  // 4 PiB: beyond any address space
  CHECK_THROWS_AS(arena.allocate(~std::size_t(0) / 64 * 64), std::bad_alloc);  // would overflow the rounding
  CHECK(arena.segment_count() == 1);
  CHECK(arena.in_use_bytes() == 1 * MiB);
  CHECK(as_bytes(arena.allocate(1 * MiB)) == a + 1 * MiB);
  CHECK(arena.in_use_bytes() == 2 * MiB);
}

TEST_CASE("arena: random requests and frees never overlap, keep the counts, and merge back to whole segments") {
  BlockArena arena(8 * MiB, 64 * KiB, 1024 * MiB);
  std::mt19937_64 rng(7);
  std::map<char*, std::size_t> live;  // address -> requested bytes
  std::size_t requested = 0;
  for (int i = 0; i < 4000; ++i) {
    if (live.empty() || rng() % 5 < 3) {
      const std::size_t size = (65 + rng() % (3 * 1024)) * 1024;  // 65 KiB .. 3136 KiB, whole KiB
      char* p = as_bytes(arena.allocate(size));
      REQUIRE(reinterpret_cast<std::uintptr_t>(p) % BlockArena::kAlign == 0);
      // No overlap with the live neighbours on either side.
      auto next = live.lower_bound(p);
      const auto at = [](const char* q) { return reinterpret_cast<std::uintptr_t>(q); };
      if (next != live.end()) REQUIRE(at(p) + size <= at(next->first));
      if (next != live.begin()) REQUIRE(at(std::prev(next)->first) + std::prev(next)->second <= at(p));
      std::memset(p, static_cast<int>(i & 0x7f), 64);  // touch it
      live[p] = size;
      requested += size;
    } else {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      arena.deallocate(it->first);
      requested -= it->second;
      live.erase(it);
    }
    // A block keeps at most a split's minimum beyond what was asked.
    REQUIRE(arena.in_use_bytes() >= requested);
    REQUIRE(arena.in_use_bytes() < requested + live.size() * 64 * KiB + 1);
  }
  CHECK(arena.reserved_bytes() == arena.segment_count() * 8 * MiB);  // every request fits one segment
  for (auto& [p, size] : live) arena.deallocate(p);
  CHECK(arena.in_use_bytes() == 0);
  CHECK(arena.largest_free_block() == 8 * MiB);
  arena.release_free_segments();  // releases whole free segments only: all go, so each was one block again
  CHECK(arena.reserved_bytes() == 0);
  CHECK(arena.segment_count() == 0);
}
