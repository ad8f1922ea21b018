// AMX tile state shared by the kernels that use tiles (q8.cpp's int8 tiles, attention.cpp's
// bf16 tiles): the palette-1 configuration record and Linux's per-process permission.
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace kvr
#endif
