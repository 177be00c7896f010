// AVX-512 with VNNI emulated through SIMDe's headers (-DSPECDEC_SIMDE).
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

#if defined(SPECDEC_SIMDE)
// AVX-512 (F, BW, VL, DQ and VNNI) emulated by SIMDe's headers on a CPU without it, so the
// AVX-512 and VNNI paths compile and are checked bit for bit on any x86 (slowly).
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define __AVX512VNNI__ 1
// Reductions SIMDe lacks: a float sum in GCC's order (halves, quarters, then pairs), so the
// sums equal a native build's; an integer sum in any order.
inline float specdec_reduce_add_ps(simde__m512 v) {
  float x[16];
  simde_mm512_storeu_ps(x, v);
  float half[8], quarter[4];
  for (int i = 0; i < 8; ++i) half[i] = x[8 + i] + x[i];
  for (int i = 0; i < 4; ++i) quarter[i] = half[4 + i] + half[i];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}
inline int32_t specdec_reduce_add_epi32(simde__m512i v) {
  int32_t x[16], sum = 0;
  simde_mm512_storeu_si512(x, v);
  for (int i = 0; i < 16; ++i) sum += x[i];
  return sum;
}
// Conversions SIMDe lacks, lane by lane.
inline simde__m128i specdec_cvtepi32_epi8(simde__m512i v) {  // truncating
  int32_t x[16];
  int8_t y[16];
  simde_mm512_storeu_si512(x, v);
  for (int i = 0; i < 16; ++i) y[i] = static_cast<int8_t>(x[i]);
  return simde_mm_loadu_si128(y);
}
inline simde__m512i specdec_cvtepi8_epi32(simde__m128i v) {
  int8_t x[16];
  int32_t y[16];
  simde_mm_storeu_si128(x, v);
  for (int i = 0; i < 16; ++i) y[i] = x[i];
  return simde_mm512_loadu_si512(y);
}
inline simde__m256i specdec_cvtps_ph(simde__m512 v) {  // to nearest even, as the one caller asks
  float x[16];
  simde_mm512_storeu_ps(x, v);
  return simde_mm256_set_m128i(simde_mm256_cvtps_ph(simde_mm256_loadu_ps(x + 8), SIMDE_MM_FROUND_TO_NEAREST_INT),
                               simde_mm256_cvtps_ph(simde_mm256_loadu_ps(x), SIMDE_MM_FROUND_TO_NEAREST_INT));
}
// SIMDe's masked loads and stores touch all 64 bytes (a store writes the unmasked lanes back):
// past the end of a buffer that corrupts the heap. These touch the masked lanes alone.
inline simde__m512 specdec_maskz_loadu_ps(simde__mmask16 mask, const void* from) {
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = mask >> i & 1 ? static_cast<const float*>(from)[i] : 0.f;
  return simde_mm512_loadu_ps(x);
}
inline void specdec_mask_storeu_ps(void* to, simde__mmask16 mask, simde__m512 v) {
  float x[16];
  simde_mm512_storeu_ps(x, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) static_cast<float*>(to)[i] = x[i];
}
inline void specdec_mask_storeu_epi8(void* to, simde__mmask16 mask, simde__m128i v) {
  int8_t x[16];
  simde_mm_storeu_si128(x, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) static_cast<int8_t*>(to)[i] = x[i];
}
#define _mm512_reduce_add_ps specdec_reduce_add_ps
#define _mm512_reduce_add_epi32 specdec_reduce_add_epi32
#define _mm512_cvtepi32_epi8 specdec_cvtepi32_epi8
#define _mm512_cvtepi8_epi32 specdec_cvtepi8_epi32
#define _mm512_cvtps_ph(v, rounding) specdec_cvtps_ph(v)
#define _mm_mask_storeu_epi8 specdec_mask_storeu_epi8
#define _mm512_maskz_loadu_ps specdec_maskz_loadu_ps
#define _mm512_mask_storeu_ps specdec_mask_storeu_ps
#endif
