// AMX: the tile operations the int8 and K-quant layers multiply through, native or emulated.
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

#if defined(SPECDEC_AMX)
// AMX's int8 tiles, the few operations the int8 layer uses: every tile 16 rows of 64 bytes; C
// tiles hold 16 x 16 int32 sums, A tiles 16 rows of 64 unsigned bytes, B tiles 16 steps of 16
// channels x 4 signed bytes (the packed weights' own layout), and dpbusd(C, A, B) adds
// A x B to C, each sum exact. SPECDEC_EMULATE_AMX builds the same operations in plain C++ on any
// CPU, so the tiled path is tested where no tiles exist.
namespace tiles {
constexpr int kRows = 16, kBytes = 64;
#if defined(SPECDEC_AMX_NATIVE)
// A process may use the tiles once the kernel has granted it their state (else the first tile
// instruction dies with SIGILL); asked once, and refused cleanly where the CPU or kernel has none.
bool available() {
  static const bool granted = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
    constexpr long kArchRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
  }();
  return granted;
}
// Palette 1, every tile 16 x 64 bytes; per thread (the configuration is thread state).
void configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = kBytes;
    config.rows[t] = kRows;
  }
  // GCC does not see ldtilecfg read the whole block: compiled out of line, it dropped these stores
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
void release() { _tile_release(); }
// GCC's tile intrinsics paste their tile numbers into the instruction's text: literals only.
#define SPECDEC_TILE(T, statement) \
  if constexpr (Tile == T) statement;
#define SPECDEC_EACH_TILE(statement) \
  SPECDEC_TILE(0, statement(0)) SPECDEC_TILE(1, statement(1)) SPECDEC_TILE(2, statement(2)) SPECDEC_TILE(3, statement(3)) \
  SPECDEC_TILE(4, statement(4)) SPECDEC_TILE(5, statement(5)) SPECDEC_TILE(6, statement(6)) SPECDEC_TILE(7, statement(7))
#define SPECDEC_ZERO(T) _tile_zero(T)
#define SPECDEC_LOAD(T) _tile_loadd(T, at, stride)
#define SPECDEC_STORE(T) _tile_stored(T, at, kBytes)
template <int Tile> void zero() { SPECDEC_EACH_TILE(SPECDEC_ZERO) }
// `stride`: bytes from one of the tile's rows to the next in memory
template <int Tile> void load(const void* at, int64_t stride = kBytes) { SPECDEC_EACH_TILE(SPECDEC_LOAD) }
template <int Tile> void store(void* at) { SPECDEC_EACH_TILE(SPECDEC_STORE) }
// The products the layers take, by the signs of A's and B's bytes (U unsigned, S signed): the
// int8 layer's C tiles 0-3 from A in 4 (or 7) and B in 5 or 6 (US); the K-quant layer's C 0 and 2
// from A in 4 and 7 times B in 5 (SU), C 1 and 3 times B in 6 (SS).
#define SPECDEC_PRODUCT(C_, A_, B_, op) \
  if constexpr (C == C_ && A == A_ && B == B_) op(C_, A_, B_);
template <int C, int A, int B> void dpbusd() {
  static_assert((A == 4 || A == 7) && (B == 5 || B == 6) && C >= 0 && C < 4, "C tiles 0-3, A 4 or 7, B 5 or 6");
  SPECDEC_PRODUCT(0, 4, 5, _tile_dpbusd) SPECDEC_PRODUCT(1, 4, 6, _tile_dpbusd) SPECDEC_PRODUCT(2, 4, 5, _tile_dpbusd)
  SPECDEC_PRODUCT(3, 4, 6, _tile_dpbusd) SPECDEC_PRODUCT(2, 7, 5, _tile_dpbusd) SPECDEC_PRODUCT(3, 7, 6, _tile_dpbusd)
}
template <int C, int A, int B> void dpbsud() {
  static_assert((C == 0 && A == 4 || C == 2 && A == 7) && B == 5, "C 0 from A 4, C 2 from A 7, B 5");
  SPECDEC_PRODUCT(0, 4, 5, _tile_dpbsud) SPECDEC_PRODUCT(2, 7, 5, _tile_dpbsud)
}
template <int C, int A, int B> void dpbssd() {
  static_assert((C == 1 && A == 4 || C == 3 && A == 7) && B == 6, "C 1 from A 4, C 3 from A 7, B 6");
  SPECDEC_PRODUCT(1, 4, 6, _tile_dpbssd) SPECDEC_PRODUCT(3, 7, 6, _tile_dpbssd)
}
#else
bool available() { return true; }
alignas(64) thread_local uint8_t registers[8][kRows * kBytes];
void configure() {}
void release() {}
template <int T> void zero() { std::memset(registers[T], 0, sizeof(registers[T])); }
template <int T> void load(const void* at, int64_t stride = kBytes) {
  for (int row = 0; row < kRows; ++row) std::memcpy(registers[T] + row * kBytes, static_cast<const uint8_t*>(at) + row * stride, kBytes);
}
template <int T> void store(void* at) { std::memcpy(at, registers[T], sizeof(registers[T])); }
// C += A x B with A's and B's bytes read as AType and BType
template <typename AType, typename BType, int C, int A, int B> void product() {
  int32_t* c = reinterpret_cast<int32_t*>(registers[C]);
  const AType* a = reinterpret_cast<const AType*>(registers[A]);
  const BType* b = reinterpret_cast<const BType*>(registers[B]);
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < 16; ++n) {
      int64_t sum = 0;
      for (int s = 0; s < kRows; ++s)
        for (int j = 0; j < 4; ++j) sum += static_cast<int32_t>(a[m * kBytes + 4 * s + j]) * b[s * kBytes + 4 * n + j];
      // wraps as the hardware does (only the dropped rows past a group could ever wrap)
      c[m * 16 + n] = static_cast<int32_t>(static_cast<uint32_t>(c[m * 16 + n]) + static_cast<uint32_t>(sum));
    }
}
template <int C, int A, int B> void dpbusd() { product<uint8_t, int8_t, C, A, B>(); }
template <int C, int A, int B> void dpbsud() { product<int8_t, uint8_t, C, A, B>(); }
template <int C, int A, int B> void dpbssd() { product<int8_t, int8_t, C, A, B>(); }
#endif
}  // namespace tiles

// Whether the int8 and K-quant layers multiply through the tiles (where available; tests switch
// them off to compare the paths).
bool use_tiles = true;
#endif

}  // namespace
