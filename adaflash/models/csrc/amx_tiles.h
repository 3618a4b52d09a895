// What the AMX kernels share (linear_amx.cpp, decode_attention.cpp where built with AMX-BF16).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace adaflash_amx {

// Linux gives a process AMX's tile state only when asked (once per process).
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// ldtilecfg's operand: palette 1, then each tile's bytes a row and rows
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace adaflash_amx
