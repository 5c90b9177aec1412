// What the AMX kernels (cpu_amx_linear.cpp, cpu_prefix_attention.cpp) share: whether the tiles
// may be used here, and the tile configuration.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)
#define SRT_LITE_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace srt_lite_amx {

#ifdef SRT_LITE_HAVE_AMX
// Linux hands a process AMX's tile data only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); a tile instruction before that raises SIGILL.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

inline bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// The 64-byte tile configuration of palette 1 (Intel SDM, LDTILECFG).
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row, per tile
  uint8_t rows[16] = {};    // rows, per tile
};

// Inline asm with a memory operand: GCC does not see _tile_loadconfig read cfg and drops
// the stores that fill it.
__attribute__((target("amx-tile"))) inline void load_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Released tiles are not saved and restored on every context switch.
__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }
#endif

// Whether this build and CPU run the AMX kernels, and Linux lets the process use the tiles.
inline bool supported() {
#ifdef SRT_LITE_HAVE_AMX
  static const bool ok = cpu_has_amx_bf16() && __builtin_cpu_supports("avx512bf16") &&
                         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
#else
  return false;
#endif
}

}  // namespace srt_lite_amx
