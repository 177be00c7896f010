// What every part shares: headers, the packed block's width, row and thread helpers, and the KV
// cache's element types.
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
#include "simde_avx512.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && !defined(SPECDEC_EMULATE_AMX)
#define SPECDEC_AMX_NATIVE 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(SPECDEC_AMX_NATIVE) || defined(SPECDEC_EMULATE_AMX)
#define SPECDEC_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // output channels per packed block: one vector

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// A buffer of at least n elements, only ever grown: a buffer kept between calls is not zeroed
// again (its elements are all written before they are read).
template <typename V>
V* at_least(std::vector<V>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Rows a thread quantizes at least: from 9 rows (a speculating round's pass) both threads take
// part, instead of one quantizing while the other waits for the multiply.
constexpr int64_t kQuantizeGrain = 8;

// Calls run(std::integral_constant<int, rows>{}) for 1 <= rows <= Most: a kernel gets its row
// count as a compile-time constant, so that its per-row sums stay in registers.
template <int Most, typename Run>
void with_rows(int rows, Run run) {
  if constexpr (Most > 1) {
    if (rows < Most) return with_rows<Most - 1>(rows, run);
  }
  run(std::integral_constant<int, Most>{});
}

// Calls work(first row, count) for each group of at most `most` of `rows` rows, split evenly:
// 17 -> 9 + 8, not 16 + 1.
template <typename Work>
void in_row_groups(int64_t rows, int64_t most, Work work) {
  const int64_t groups = (rows + most - 1) / most;
  for (int64_t g = 0, r0 = 0; g < groups; ++g) {
    const int count = static_cast<int>((rows - r0) / (groups - g));
    work(r0, count);
    r0 += count;
  }
}

#if defined(__AVX512F__)
// The lanes of a 16-wide vector that hold one of the `remaining` elements.
__mmask16 lanes_of(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : remaining > 0 ? static_cast<__mmask16>((1u << remaining) - 1) : __mmask16(0);
}
#elif defined(__AVX2__)
// The lanes of an 8-wide vector that hold one of the `remaining` elements (all bits set).
__m256i lanes_of(int64_t remaining) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(remaining, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Sum of 8 lanes in one fixed order.
float sum_of(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

float max_of(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
#endif

// KV cache elements are float32 or float16: under many sessions attention is bound by reading
// the caches, and float16 halves the bytes. Loads widen to float32 and every sum stays float32.
// A float16 cache's capacity is a multiple of 16, so a full vector read at any position below
// it stays inside the row; lanes past the positions in use are masked off after the load.
#if (defined(__AVX2__) || defined(__AVX512F__)) && !defined(__F16C__)
#error "the vector kernels read float16 caches with F16C"
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(__mmask16 inside, const float* p) { return _mm512_maskz_loadu_ps(inside, p); }
inline __m512 load16(__mmask16 inside, const c10::Half* p) { return _mm512_maskz_mov_ps(inside, load16(p)); }
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(__m256i inside, const float* p) { return _mm256_maskload_ps(p, inside); }
inline __m256 load8(__m256i inside, const c10::Half* p) { return _mm256_and_ps(load8(p), _mm256_castsi256_ps(inside)); }
#endif

#if defined(__AVX512BF16__)
// bfloat16 caches: attention multiplies pairs of bfloat16 (vdpbf16ps, two products a lane, sums
// in float32), twice the arithmetic of float32 FMAs per instruction. Keys are kept as pairs of
// channels ([KV][d/2][capacity][2]: one 32-bit lane per key holds channels 2p and 2p+1), values
// as rows ([KV][capacity][d]).
constexpr bool kBfloat16Cache = true;
#else
constexpr bool kBfloat16Cache = false;
#endif
using Bfloat16 = c10::BFloat16;

// n values as the cache keeps them: float16 saturated at +-65504 (no key or value becomes
// infinite) and rounded to nearest even, the rounding of c10::Half's conversion and of F16C's.
template <typename T>
void to_cache(const float* from, int64_t n, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, from, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(__AVX512F__)
    // max(limit, v) and min(limit, v) return v where v is NaN, as std::max/min below do
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_min_ps(_mm512_set1_ps(65504.f), _mm512_max_ps(_mm512_set1_ps(-65504.f), _mm512_loadu_ps(from + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_min_ps(_mm256_set1_ps(65504.f), _mm256_max_ps(_mm256_set1_ps(-65504.f), _mm256_loadu_ps(from + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; ++i) out[i] = T(std::min(std::max(from[i], -65504.f), 65504.f));
  }
}

// n floats to bfloat16, rounded to nearest even (vcvtneps2bf16; the tail, and n below 16, by
// c10's conversion, which rounds normal numbers alike). Which of the two converts an element
// depends on its index alone.
template <>
void to_cache<Bfloat16>(const float* from, int64_t n, Bfloat16* out) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(from + i)));
#endif
  for (; i < n; ++i) out[i] = Bfloat16(from[i]);
}

// out = layer(x) for the m rows of x [m, k] (an Int8Layer or a BlockLayer): quantized, then multiplied.
template <typename Layer>
torch::Tensor apply_layer(const Layer& layer, torch::Tensor x, int64_t n) {
  x = x.contiguous();
  auto out = torch::empty({x.size(0), n}, torch::kFloat32);
  const float* rows = x.data_ptr<float>();
  const int64_t k = x.size(1);
  std::vector<uint8_t> xq;
  std::vector<float> scales;
  layer.quantize(x.size(0), k, [&](int64_t r, float* row) { std::memcpy(row, rows + r * k, k * sizeof(float)); }, xq, scales);
  layer.multiply(xq, scales, x.size(0), out.data_ptr<float>());
  return out;
}

}  // namespace
