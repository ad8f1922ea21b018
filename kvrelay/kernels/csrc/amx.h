// AMX tile state shared by the kernels that use tiles (q8.cpp's int8 tiles, attention.cpp's
// and w8a16.cpp's bf16 tiles): the palette-1 configuration record, Linux's per-process
// permission, and the all-16x64 configuration of the bf16 kernels with their thread split.
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace kvr {

// _tile_loadconfig's 64-byte record: each kernel loads its own shapes on the thread that runs
// its tiles (the configuration is per thread) and releases them when done.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux grants AMX tile data per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); asked once.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1 with every tile 16 rows x 64 bytes, on the calling thread.
inline void load_full_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// body(begin, end) over [0, n) split across torch's threads (grain 1), each thread with
// load_full_tiles() for its share and its tiles released after.
template <class Body>
void parallel_on_full_tiles(int64_t n, const Body& body) {
  parallel_for(n, 1, [&](int64_t begin, int64_t end) {
    load_full_tiles();
    body(begin, end);
    _tile_release();
  });
}

// unit(u) for every u in [0, n), each thread with load_full_tiles(): a thread first takes the
// units of its own contiguous share (the one parallel_on_full_tiles would give it) one by one,
// then helps with what is left of the other shares. With fixed halves, a thread whose core ran
// slower for a while (the other processes of the stack, the hypervisor) held the other in the
// region's barrier: libgomp's spin was 6-11% of each compute thread's samples in a long-context
// run. Units write disjoint outputs, so which thread runs one changes no bit.
template <class Unit>
void claim_on_full_tiles(int64_t n, const Unit& unit) {
  const int64_t threads = std::min<int64_t>(std::max(1, num_threads()), n);
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next.store(n * t / threads, std::memory_order_relaxed);
    shares[t].end = n * (t + 1) / threads;
  }
  parallel_for(threads, 1, [&](int64_t first, int64_t last) {
    load_full_tiles();
    for (int64_t t = first; t < last; ++t)
      for (int64_t k = 0; k < threads; ++k) {
        Share& s = shares[(t + k) % threads];
        for (int64_t u; (u = s.next.fetch_add(1, std::memory_order_relaxed)) < s.end;) unit(u);
      }
    _tile_release();
  });
}

}  // namespace kvr
#endif
