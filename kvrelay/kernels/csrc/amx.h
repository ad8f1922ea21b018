// AMX tile state shared by the kernels that use tiles (q8.cpp's int8 tiles, attention.cpp's
// and w8a16.cpp's bf16 tiles): the palette-1 configuration record, Linux's per-process
// permission, and the all-16x64 configuration of the bf16 kernels with their thread split.
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace kvr
#endif
