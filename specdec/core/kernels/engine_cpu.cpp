// CPU kernels of the engine: an int8 linear layer whose weights stream from memory once
// however many rows it multiplies, and float32 attention whose result for one query never
// depends on the other queries in the pass.
//
// Batch invariance is the point of both. Verifying a draft tree must give every node the very
// logits a one-token step gives, so every sum a row's result depends on is taken in an order
// fixed by that row alone: integer sums are exact, and each float sum below runs over one
// row's own elements in one fixed order, whatever the number of rows, threads or the tree.
// Built with -ffp-contract=off so the compiler fuses no multiply-add the code did not write.
//
// Paths by instruction set, chosen at compile time (-march) inside each kernel: scalar (the
// reference), AVX2, AVX-512 (quantizers, attention, epilogues) with VNNI (the int8, block and
// K-quant dot products), and AMX's tiles for int8 passes of 4 or more rows and K-quant passes of
// 16 or more (`tiles` below, used where the kernel grants the process tile state). Every path
// gives the same bits; a CPU without one still builds and tests it: -DSPECDEC_SIMDE emulates
// AVX-512 VNNI through SIMDe's headers, -DSPECDEC_EMULATE_AMX the tiles in plain C++
// (kernels/__init__.py build(emulate=...)).
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
// Rows multiplied in one pass over a block's weights: their accumulators stay in registers
// (16 with AVX-512's 32 registers, 4 with AVX2's 16; more row groups re-read the block from
// L1), so the weights stream from memory once while the arithmetic hides under the transfer.
// The AVX-512 and scalar sums take activations as q + 128 (unsigned) and subtract 128 sum(w)
// after; the AVX2 sums take q itself: kZeroPoint is what the sums carry.
#if defined(__AVX512VNNI__) || !defined(__AVX2__)
constexpr int64_t kRows = 16;
constexpr int32_t kZeroPoint = 128;
constexpr int64_t kPlanes = 1;
#else
#define SPECDEC_MADDUBS 1
constexpr int64_t kRows = 4;
constexpr int32_t kZeroPoint = 0;
// vpmaddubsw multiplies unsigned by signed bytes: the rows are kept twice, |q| then q, so
// the inner loop takes both as they are instead of recomputing |q| for every block.
constexpr int64_t kPlanes = 2;
#endif

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

// Weights int8 [N, K] -> [N/16, K/4, 16, 4]: each 64-byte step holds four consecutive inputs
// of 16 output channels, the order VNNI's 4-way dot product reads them in.
torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "pack_weight takes int8 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = round_up(n, kBlock), k_pad = round_up(k, 4);
  return torch::constant_pad_nd(weight, {0, k_pad - k, 0, n_pad - n})
      .view({n_pad / kBlock, kBlock, k_pad / 4, 4})
      .permute({0, 2, 1, 3})
      .contiguous();
}

// Row sums of the weights, padded to the block: activations enter the kernel as x + 128
// (unsigned), and sum((x + 128) w) - 128 sum(w) recovers sum(x w) exactly.
torch::Tensor weight_sums(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "weight_sums takes int8 [N, K]");
  const auto rows = weight.contiguous();
  const int64_t n = rows.size(0), k = rows.size(1);
  auto sums = torch::zeros({round_up(n, kBlock)}, torch::kInt32);
  const int8_t* w = rows.data_ptr<int8_t>();
  int32_t* out = sums.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t total = 0;
      for (int64_t i = 0; i < k; ++i) total += w[r * k + i];
      out[r] = total;
    }
  });
  return sums;
}

// One row: scale = max|x * smoothing| / 127, q = round(x / scale) + 128, the same float
// operations as Int8Linear's torch path, so both give the same integers.
float quantize_row(const float* x, const float* smoothing, int64_t k, int64_t k_pad, uint8_t* out) {
#if defined(__AVX512F__)
  const auto lanes = [k](int64_t i) { return lanes_of(k - i); };
  const auto smoothed = [&](int64_t i) {
    const __m512 v = _mm512_maskz_loadu_ps(lanes(i), x + i);
    return smoothing ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes(i), smoothing + i)) : v;
  };
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(smoothed(i)));
  const float scale = std::max(_mm512_reduce_max_ps(top), 1e-12f) / 127.f;
  const __m512 divisor = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(smoothed(i), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(rounded), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(out + i, lanes(i), _mm512_cvtepi32_epi8(shifted));
  }
#elif defined(__AVX2__)
  const auto smoothed = [&](int64_t i) {
    const __m256i inside = lanes_of(k - i);
    const __m256 v = _mm256_maskload_ps(x + i, inside);
    return smoothing ? _mm256_mul_ps(v, _mm256_maskload_ps(smoothing + i, inside)) : v;
  };
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(smoothed(i), magnitude_bits));
  const float scale = std::max(max_of(top), 1e-12f) / 127.f;
  const __m256 divisor = _mm256_set1_ps(scale);
  int32_t shifted[8];
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 rounded = _mm256_round_ps(_mm256_div_ps(smoothed(i), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(shifted), _mm256_add_epi32(_mm256_cvtps_epi32(rounded), _mm256_set1_epi32(128)));
    for (int64_t j = 0; j < 8 && i + j < k; ++j) out[i + j] = static_cast<uint8_t>(shifted[j]);
  }
#else
  std::vector<float> smoothed(x, x + k);
  if (smoothing)
    for (int64_t i = 0; i < k; ++i) smoothed[i] = x[i] * smoothing[i];
  float largest = 0.f;
  for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(smoothed[i]));
  const float scale = std::max(largest, 1e-12f) / 127.f;
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(smoothed[i] / scale)) + 128);
#endif
  std::memset(out + k, 128, k_pad - k);  // zero after the shift; padded weights are zero too
  return scale;
}

// Quantized rows are laid out in chunks of kChunk steps (four inputs a step): chunk c of row r
// is the 64 bytes at (c * rows + r) * kChunkBytes. One base address then serves every row of
// a step (a pointer per row spilled registers past 8 rows and cost a third of the
// throughput), and each row's chunk is one cache line, so threads quantizing different rows
// never write the same line.
constexpr int64_t kChunk = 16;
constexpr int64_t kChunkBytes = 4 * kChunk;

int64_t chunks_of(int64_t k_steps) { return (k_steps + kChunk - 1) / kChunk; }

// Where step s of row 0 lies; row r's is kChunkBytes * r further.
int64_t step_offset(int64_t s, int64_t chunk_stride) { return (s / kChunk) * chunk_stride + (s % kChunk) * 4; }

// acc[r][c] = sum over k of x[r][k] * w[c][k] for R rows and the 16 channels of a block; x in
// chunks, chunk_stride bytes from one chunk to the next. Integer sums are exact, so how they
// are split and ordered never changes a result.
template <int R>
void block_dot(const uint8_t* x, int64_t chunk_stride, int64_t plane, const int8_t* block, int64_t k_steps, int32_t* acc) {
#if defined(__AVX512VNNI__)
  constexpr int kChains = R == 1 ? 2 : 1;  // one row: two chains, odd and even steps, hide the latency
  __m512i sums[R][kChains];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains; ++c) sums[r][c] = _mm512_setzero_si512();
  // Blocks lie one after another: while this block computes, the next one streams into L2
  // (every pass over the rows asks again; a line already there costs nothing).
  const int8_t* next = block + k_steps * 64;
  // One chunk of steps at a time: within it every row's four bytes lie at a constant offset
  // from one address.
  for (int64_t s0 = 0; s0 < k_steps; s0 += kChunk) {
    const uint8_t* xc = x + (s0 / kChunk) * chunk_stride;
    const int8_t* wc = block + s0 * 64;
    const auto step = [&](int64_t j, int chain) {
      _mm_prefetch(reinterpret_cast<const char*>(next + (s0 + j) * 64), _MM_HINT_T1);
      const __m512i w = _mm512_loadu_si512(wc + j * 64);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xc + r * kChunkBytes + j * 4, 4);
        sums[r][chain] = _mm512_dpbusd_epi32(sums[r][chain], _mm512_set1_epi32(four), w);
      }
    };
    if (s0 + kChunk <= k_steps) {
#pragma GCC unroll 16
      for (int64_t j = 0; j < kChunk; ++j) step(j, static_cast<int>(j % kChains));
    } else {
      for (int64_t j = 0; j < k_steps - s0; ++j) step(j, 0);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __m512i total = sums[r][0];
    for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, sums[r][c]);
    _mm512_storeu_si512(acc + r * kBlock, total);
  }
#elif defined(__AVX2__)
  // No 4-way byte dot product: q * w pairs through vpmaddubsw (unsigned x signed, summed to
  // int16), then to int32. vpmaddubsw saturates, so it multiplies |q| (plane 0) by w carrying
  // q's sign (plane 1): each pair is then at most 2 * 127 * 127, below the int16 limit, and
  // the sums are exact.
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i low[R], high[R];  // channels 0-7 and 8-15
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
  const int8_t* next = block + k_steps * 64;
  for (int64_t s = 0; s < k_steps; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(next + s * 64), _MM_HINT_T1);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + s * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + s * 64 + 32));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t four_magnitudes, four;
      std::memcpy(&four_magnitudes, x + step_offset(s, chunk_stride) + r * kChunkBytes, 4);
      std::memcpy(&four, x + plane + step_offset(s, chunk_stride) + r * kChunkBytes, 4);
      const __m256i magnitude = _mm256_set1_epi32(four_magnitudes), q = _mm256_set1_epi32(four);
      low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w0, q)), ones));
      high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w1, q)), ones));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlock), low[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlock + 8), high[r]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlock; ++c) {
      int32_t sum = 0;
      for (int64_t s = 0; s < k_steps; ++s)
        for (int j = 0; j < 4; ++j)
          sum += static_cast<int32_t>(x[step_offset(s, chunk_stride) + r * kChunkBytes + j]) * static_cast<int32_t>(block[(s * kBlock + c) * 4 + j]);
      acc[r * kBlock + c] = sum;
    }
#endif
}

// One row of one block: out[c] = float(acc[c] - kZeroPoint sum(w[c])) * (row_scale * w_scale[c]) (+ bias[c]).
void epilogue(const int32_t* acc, const int32_t* wsum, const float* ws, const float* bias, float row_scale, int64_t col0,
              int64_t n, float* out) {
#if defined(__AVX512F__)
  for (int64_t c = 0; c < kBlock && col0 + c < n; c += 16) {
    const __mmask16 inside = lanes_of(n - col0 - c);
    const __m512i sums = _mm512_sub_epi32(_mm512_loadu_si512(acc + c), _mm512_mullo_epi32(_mm512_loadu_si512(wsum + col0 + c), _mm512_set1_epi32(kZeroPoint)));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(row_scale), _mm512_maskz_loadu_ps(inside, ws + col0 + c));
    __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale);
    if (bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(inside, bias + col0 + c));
    _mm512_mask_storeu_ps(out + col0 + c, inside, value);
  }
#else
  for (int64_t c = 0; c < kBlock && col0 + c < n; ++c) {
    float value = static_cast<float>(acc[c] - kZeroPoint * wsum[col0 + c]) * (row_scale * ws[col0 + c]);
    if (bias) value = value + bias[col0 + c];
    out[col0 + c] = value;
  }
#endif
}

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
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;
  for (int t = 0; t < 8; ++t) {
    reinterpret_cast<uint16_t*>(config + 16)[t] = kBytes;
    config[48 + t] = kRows;
  }
  _tile_loadconfig(config);
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

// An int8 linear layer as Int8Linear holds it: packed weights, their row sums, per-channel
// scales, and an optional bias and input smoothing (empty tensors when absent).
struct Int8Layer {
  const int8_t* packed;
  const int32_t* sums;
  const float* scale;
  const float* bias;
  const float* smoothing;
  int64_t blocks, k_steps, n;

  Int8Layer(const torch::Tensor& packed_, const torch::Tensor& sums_, const torch::Tensor& scale_, const torch::Tensor& bias_,
            const torch::Tensor& smoothing_, int64_t n_)
      : packed(packed_.data_ptr<int8_t>()), sums(sums_.data_ptr<int32_t>()), scale(scale_.data_ptr<float>()),
        bias(bias_.defined() && bias_.numel() ? bias_.data_ptr<float>() : nullptr),
        smoothing(smoothing_.defined() && smoothing_.numel() ? smoothing_.data_ptr<float>() : nullptr),
        blocks(packed_.size(0)), k_steps(packed_.size(1)), n(n_) {}

  int64_t k_pad() const { return k_steps * 4; }
  int64_t row_bytes() const { return chunks_of(k_steps) * kChunkBytes; }  // one quantized row in its chunks

  // Each row of the input, made by make_row(r, buffer) as k floats (each row on its own, in
  // any order), quantized for this layer: kPlanes planes of [chunks][m][kChunkBytes], as
  // block_dot reads them. Rows are split over threads only when there are many: a parallel
  // region costs more than a few rows' work.
  template <typename MakeRow>
  void quantize(int64_t m, int64_t k, MakeRow make_row, std::vector<uint8_t>& xq, std::vector<float>& row_scale) const {
    TORCH_CHECK(k_pad() == round_up(k, 4), "packed weights do not match the input");
    const int64_t bytes = row_bytes();
    // past the rows: a tile of 16 rows may start at the last chunk's last row
    at_least(xq, kPlanes * m * bytes + 16 * kChunkBytes);
    at_least(row_scale, m);
    at::parallel_for(0, m, kQuantizeGrain, [&](int64_t first, int64_t last) {
      std::vector<float> row(k);
      std::vector<uint8_t> planes(kPlanes * bytes);  // this row's planes, contiguous, before they go to their chunks
      for (int64_t r = first; r < last; ++r) {
        make_row(r, row.data());
        uint8_t* shifted = planes.data();
        row_scale[r] = quantize_row(row.data(), smoothing, k, k_pad(), shifted);
#if defined(SPECDEC_MADDUBS)
        uint8_t* signed_q = shifted + bytes;
        for (int64_t i = 0; i < k_pad(); i += 32) {  // k_pad is a multiple of 4
          const int64_t take = std::min<int64_t>(32, k_pad() - i);
          if (take == 32) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(shifted + i)), _mm256_set1_epi8(static_cast<char>(0x80)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(signed_q + i), q);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(shifted + i), _mm256_abs_epi8(q));
          } else {
            for (int64_t j = i; j < k_pad(); ++j) {
              const int8_t q = static_cast<int8_t>(shifted[j] ^ 0x80);
              signed_q[j] = static_cast<uint8_t>(q);
              shifted[j] = static_cast<uint8_t>(q < 0 ? -q : q);
            }
          }
        }
#endif
        for (int64_t p = 0; p < kPlanes; ++p)
          for (int64_t c = 0; c * kChunkBytes < bytes; ++c)
            std::memcpy(xq.data() + p * m * bytes + (c * m + r) * kChunkBytes, planes.data() + p * bytes + c * kChunkBytes, kChunkBytes);
      }
    });
  }

  // out[m][n] = float(sum_k q[m][k] w[n][k]) * (row_scale[m] * w_scale[n]) (+ bias[n]): Int8Linear's
  // torch path, operation for operation.
  void multiply(const std::vector<uint8_t>& xq, const std::vector<float>& row_scale, int64_t m, float* out) const {
    TORCH_CHECK(blocks * kBlock >= n, "packed weights do not match the output");
#if defined(SPECDEC_AMX)
    // the tiles take activations as q + 128, one plane (not AVX2's two)
    if (kPlanes == 1 && m >= kTileRowsFrom && k_steps % kChunk == 0 && use_tiles && tiles::available())
      return multiply_tiles(xq, row_scale, m, out);
#endif
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      int32_t acc[kRows * kBlock];
      for (int64_t blk = first; blk < last; ++blk) {
        const int8_t* block = packed + blk * k_steps * kBlock * 4;
        in_row_groups(m, kRows, [&](int64_t r0, int rows) {
          with_rows<kRows>(rows, [&](auto r) {
            block_dot<decltype(r)::value>(xq.data() + r0 * kChunkBytes, m * kChunkBytes, m * row_bytes(), block, k_steps, acc);
          });
          for (int r = 0; r < rows; ++r)
            epilogue(acc + r * kBlock, sums, scale, bias, row_scale[r0 + r], blk * kBlock, n, out + (r0 + r) * n);
        });
      }
    });
  }

#if defined(SPECDEC_AMX)
  // From this many rows the tiles multiply (below it the vector path streams the weights as fast).
  static constexpr int64_t kTileRowsFrom = 4;

  // The same sums through the tiles. Up to 16 rows: four blocks of 16 channels a pass (C tiles
  // 0-3), the rows' chunk of 64 inputs in A (tile 4), each block's 64 inputs in B (tiles 5 and 6
  // in turn). More rows: two row groups (A tiles 4 and 7) times two blocks, so that each B tile
  // loaded serves both. A row group shorter than 16 still fills its tile: the rows past it (the
  // next rows of the chunk, or the buffer's padding) are multiplied and dropped.
  void multiply_tiles(const std::vector<uint8_t>& xq, const std::vector<float>& row_scale, int64_t m, float* out) const {
    if (m <= tiles::kRows) return tiles_pass<1>(xq, row_scale, m, out);
    tiles_pass<2>(xq, row_scale, m, out);
  }

  template <int Groups>
  void tiles_pass(const std::vector<uint8_t>& xq, const std::vector<float>& row_scale, int64_t m, float* out) const {
    constexpr int64_t kSet = 4 / Groups;  // blocks a pass
    const int64_t chunks = k_steps / kChunk, sets = (blocks + kSet - 1) / kSet, block_stride = k_steps * kBlock * 4;
    at::parallel_for(0, sets, 1, [&](int64_t first, int64_t last) {
      tiles::configure();
      alignas(64) int32_t acc[4][tiles::kRows * kBlock];
      for (int64_t set = first; set < last; ++set) {
        const int64_t block0 = set * kSet;
        const int count = static_cast<int>(std::min<int64_t>(kSet, blocks - block0));
        const int8_t* w = packed + block0 * block_stride;
        in_row_groups(m, Groups * tiles::kRows, [&](int64_t r0, int rows) {
          const int64_t second = r0 + (rows + 1) / 2;  // the second group's first row (Groups = 2)
          tiles::zero<0>();
          tiles::zero<1>();
          tiles::zero<2>();
          tiles::zero<3>();
          for (int64_t c = 0; c < chunks; ++c) {
            const int8_t* wc = w + c * kChunk * kBlock * 4;
            tiles::load<4>(xq.data() + (c * m + r0) * kChunkBytes);
            tiles::load<5>(wc);
            if constexpr (Groups == 1) {
              tiles::dpbusd<0, 4, 5>();
              if (count > 1) {
                tiles::load<6>(wc + block_stride);
                tiles::dpbusd<1, 4, 6>();
              }
              if (count > 2) {
                tiles::load<5>(wc + 2 * block_stride);
                tiles::dpbusd<2, 4, 5>();
              }
              if (count > 3) {
                tiles::load<6>(wc + 3 * block_stride);
                tiles::dpbusd<3, 4, 6>();
              }
            } else {
              tiles::load<7>(xq.data() + (c * m + second) * kChunkBytes);
              tiles::dpbusd<0, 4, 5>();
              tiles::dpbusd<2, 7, 5>();
              if (count > 1) {
                tiles::load<6>(wc + block_stride);
                tiles::dpbusd<1, 4, 6>();
                tiles::dpbusd<3, 7, 6>();
              }
            }
          }
          tiles::store<0>(acc[0]);
          tiles::store<1>(acc[1]);
          tiles::store<2>(acc[2]);
          tiles::store<3>(acc[3]);
          // acc[g * kSet + b]: row group g, block b
          for (int g = 0; g < Groups; ++g) {
            const int64_t from = g == 0 ? r0 : second, to = g + 1 == Groups ? r0 + rows : second;
            for (int b = 0; b < count; ++b)
              for (int64_t r = from; r < to; ++r)
                epilogue(acc[g * kSet + b] + (r - from) * kBlock, sums, scale, bias, row_scale[r], (block0 + b) * kBlock, n, out + r * n);
          }
        });
      }
      tiles::release();
    });
  }
#endif

};

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

torch::Tensor int8_linear(torch::Tensor x, c10::optional<torch::Tensor> smoothing, torch::Tensor packed,
                          torch::Tensor sums, torch::Tensor w_scale, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8_linear takes float32 [M, K]");
  return apply_layer(Int8Layer(packed, sums, w_scale, bias.value_or(torch::Tensor()), smoothing.value_or(torch::Tensor()), n), x, n);
}

// Block weights as GGUF's Q4_0, Q4_1 and Q8_0 hold them: along K, blocks of 32 weights
// w = d q + m with one float16 d and m per block and channel; q in [0, 15] (4 bits) or
// [0, 255] (8 bits; Q8_0's signed q is q - 128, so m = -128 d; Q4_0: m = -8 d).
// Activations enter as int8 in blocks of 32 too, each block of a row with its own scale s, so
//   sum_k x w = sum over blocks of (sum q xq) (d s) + m (s sum xq),
// the integer sums exact and the float sum over a row's blocks taken in block order: a row's
// result depends on that row alone.
constexpr int64_t kQBlock = 32;  // weights per block along K
// One block of 16 channels, one stream: their 512 weights (4 bits: 256 bytes of nibbles; 8 bits:
// 512 bytes), then their 16 d and 16 m in float16.
constexpr int64_t weight_bytes(int bits) { return bits * kQBlock * kBlock / 8; }
constexpr int64_t block_bytes(int bits) { return weight_bytes(bits) + 2 * kBlock * 2; }
// Per block of a row's activations: its scale s, s sum(xq), and sum(xq) (exact in a float).
constexpr int64_t kBlockScales = 3;
#if defined(__AVX512VNNI__) || !defined(__AVX2__)
constexpr int kQRows = 8;  // rows a pass over the weights serves (their sums stay in registers)
#else
constexpr int kQRows = 2;
#endif

// One row's activations, quantized: xq (k_pad int8) and, per block, kBlockScales values:
// s = max|x| / 127 over the block, xq = round(x / s), the operations of BlockLinear's torch path.
void quantize_blocks(const float* x, int64_t k, int64_t k_pad, int8_t* xq, float* block_scales) {
  for (int64_t b = 0; b * kQBlock < k_pad; ++b) {
    const int64_t first = b * kQBlock, count = std::min<int64_t>(kQBlock, std::max<int64_t>(k - first, 0));
#if defined(__AVX512F__)
    const __m512 low = _mm512_maskz_loadu_ps(lanes_of(count), x + first);
    const __m512 high = _mm512_maskz_loadu_ps(lanes_of(count - 16), x + first + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const float scale = std::max(largest, 1e-12f) / 127.f;
    const __m512 divisor = _mm512_set1_ps(scale);
    const auto quantized = [&](__m512 v) {
      return _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    const __m512i q_low = quantized(low), q_high = quantized(high);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + first), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + first + 16), _mm512_cvtepi32_epi8(q_high));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
#else
    float block[kQBlock];
    float largest = 0.f;
    for (int64_t i = 0; i < kQBlock; ++i) {
      block[i] = i < count ? x[first + i] : 0.f;
      largest = std::max(largest, std::fabs(block[i]));
    }
    const float scale = std::max(largest, 1e-12f) / 127.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kQBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(block[i] / scale));
      xq[first + i] = static_cast<int8_t>(q);
      sum += q;
    }
#endif
    block_scales[kBlockScales * b] = scale;
    block_scales[kBlockScales * b + 1] = scale * static_cast<float>(sum);
    block_scales[kBlockScales * b + 2] = static_cast<float>(sum);
  }
}

// out[r][c] for R rows and the 16 channels of one channel block: the blocks along K in order,
// each adding float(sum q xq) * (d s) and then m * (s sum xq).
template <int R, int Bits>
void block_rows(const int8_t* x, int64_t x_stride, const float* xs, int64_t xs_stride, const uint8_t* w, int64_t k_blocks, float* out) {
#if defined(__AVX512VNNI__)
  __m512 total[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  constexpr int64_t kBytes = block_bytes(Bits);
  for (int64_t b = 0; b < k_blocks; ++b) {
    const uint8_t* wb = w + b * kBytes;
    const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + weight_bytes(Bits));
    const c10::Half* m = d + kBlock;
    // 32 blocks ahead into L2 (9-18 KB): 4 ahead into L1 left one row's stream at ~12 GB/s a core
#pragma GCC unroll 9
    for (int line = 0; line < kBytes / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + 32 * kBytes + 64 * line), _MM_HINT_T1);
    __m512i steps[8];  // step i: inputs 4i..4i+3 of the block for the 16 channels, one byte each
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = _mm512_loadu_si512(wb + i * 64);
        steps[i] = _mm512_and_si512(packed, low_nibbles);
        steps[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) steps[i] = _mm512_loadu_si512(wb + i * 64);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x + r * x_stride + b * kQBlock;
      __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains: half the latency
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        int32_t four;
        std::memcpy(&four, xb + 4 * i, 4);
        sums[i % 2] = _mm512_dpbusd_epi32(sums[i % 2], steps[i], _mm512_set1_epi32(four));
      }
      const float* s = xs + r * xs_stride + kBlockScales * b;
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[0], sums[1]));
      total[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dv, _mm512_set1_ps(s[0])), total[r]);
      total[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(s[1]), total[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, total[r]);
#elif defined(__AVX2__)
  // vpmaddubsw: unsigned times signed bytes, pairs summed to int16, then pairs of those to
  // int32. 4-bit q times xq: at most 2 * 15 * 128, no saturation. 8-bit q would saturate: it
  // goes as |q - 128| times xq with q - 128's sign (at most 2 * 128 * 127), and 128 sum(xq) is
  // added back. Channels 0-7 and 8-15 in two halves.
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  constexpr int64_t kBytes = block_bytes(Bits);
  for (int64_t b = 0; b < k_blocks; ++b) {
    const uint8_t* wb = w + b * kBytes;
    const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + weight_bytes(Bits));
    const c10::Half* m = d + kBlock;
    for (int line = 0; line < kBytes / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kBytes + 64 * line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i steps[8], signs[8];
      if constexpr (Bits == 4) {
        for (int i = 0; i < 4; ++i) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
          steps[i] = _mm256_and_si256(packed, low_nibbles);
          steps[i + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        }
      } else {
        for (int i = 0; i < 8; ++i) {
          signs[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32)), offset);  // q - 128
          steps[i] = _mm256_abs_epi8(signs[i]);
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + h * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + h * 8)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = x + r * x_stride + b * kQBlock;
        __m256i sums = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          int32_t four;
          std::memcpy(&four, xb + 4 * i, 4);
          __m256i xs4 = _mm256_set1_epi32(four);
          if constexpr (Bits == 8) xs4 = _mm256_sign_epi8(xs4, signs[i]);
          sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(steps[i], xs4), ones));
        }
        const float* s = xs + r * xs_stride + kBlockScales * b;
        if constexpr (Bits == 8) sums = _mm256_add_epi32(sums, _mm256_set1_epi32(128 * static_cast<int32_t>(s[2])));
        total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dv, _mm256_set1_ps(s[0])), total[r][h]);
        total[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(s[1]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, total[r][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, total[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlock; ++c) {
      float total = 0.f;
      for (int64_t b = 0; b < k_blocks; ++b) {
        int32_t sum = 0;
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 4; ++j) {
            int32_t q;
            if constexpr (Bits == 4) {
              const uint8_t byte = w[b * block_bytes(Bits) + (i % 4) * 64 + c * 4 + j];
              q = i < 4 ? (byte & 0x0F) : (byte >> 4);
            } else {
              q = w[b * block_bytes(Bits) + i * 64 + c * 4 + j];
            }
            sum += q * static_cast<int32_t>(x[r * x_stride + b * kQBlock + 4 * i + j]);
          }
        const float* s = xs + r * xs_stride + kBlockScales * b;
        const c10::Half* d = reinterpret_cast<const c10::Half*>(w + b * block_bytes(Bits) + weight_bytes(Bits));
        total = std::fma(static_cast<float>(sum), static_cast<float>(d[c]) * s[0], total);
        total = std::fma(static_cast<float>(d[kBlock + c]), s[1], total);
      }
      out[r * kBlock + c] = total;
    }
#endif
}

// A block linear layer as BlockLinear holds it: blocks [N/16][K/32][block_bytes(bits)] (the
// weights, then 16 d and 16 m in float16; 4 or 8 bits a weight, by the block's size) and an
// optional bias. The same calls as Int8Layer: quantize the rows, then multiply (xq holds the
// int8 rows, scales each row's block scales).
struct BlockLayer {
  const uint8_t* packed;
  const float* bias;
  int64_t blocks, k_blocks, n;
  int bits;

  BlockLayer(const torch::Tensor& packed_, const torch::Tensor& bias_, int64_t n_)
      : packed(packed_.data_ptr<uint8_t>()), bias(bias_.defined() && bias_.numel() ? bias_.data_ptr<float>() : nullptr),
        blocks(packed_.size(0)), k_blocks(packed_.size(1)), n(n_), bits(packed_.size(2) == block_bytes(8) ? 8 : 4) {
    TORCH_CHECK(packed_.dtype() == torch::kUInt8 && packed_.dim() == 3 && (packed_.size(2) == block_bytes(4) || packed_.size(2) == block_bytes(8)),
                "bad packed block weights");
  }

  int64_t k_pad() const { return k_blocks * kQBlock; }

  template <typename MakeRow>
  void quantize(int64_t rows, int64_t k, MakeRow make_row, std::vector<uint8_t>& xq, std::vector<float>& scales) const {
    TORCH_CHECK(k_pad() == round_up(k, kQBlock), "packed block weights do not match the input");
    at_least(xq, rows * k_pad());
    at_least(scales, rows * kBlockScales * k_blocks);
    at::parallel_for(0, rows, kQuantizeGrain, [&](int64_t first, int64_t last) {
      std::vector<float> row(k);
      for (int64_t r = first; r < last; ++r) {
        make_row(r, row.data());
        quantize_blocks(row.data(), k, k_pad(), reinterpret_cast<int8_t*>(xq.data()) + r * k_pad(), scales.data() + r * kBlockScales * k_blocks);
      }
    });
  }

  void multiply(const std::vector<uint8_t>& xq, const std::vector<float>& scales, int64_t rows, float* out) const {
    if (bits == 8) return multiply_bits<8>(xq, scales, rows, out);
    multiply_bits<4>(xq, scales, rows, out);
  }

  template <int Bits>
  void multiply_bits(const std::vector<uint8_t>& xq, const std::vector<float>& scales, int64_t rows, float* out) const {
    TORCH_CHECK(blocks * kBlock >= n, "packed block weights do not match the output");
    const int8_t* x = reinterpret_cast<const int8_t*>(xq.data());
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      float sums[kQRows * kBlock];
      for (int64_t blk = first; blk < last; ++blk) {
        const uint8_t* w = packed + blk * k_blocks * block_bytes(Bits);
        in_row_groups(rows, kQRows, [&](int64_t r0, int count) {
          with_rows<kQRows>(count, [&](auto r) {
            block_rows<decltype(r)::value, Bits>(x + r0 * k_pad(), k_pad(), scales.data() + r0 * kBlockScales * k_blocks, kBlockScales * k_blocks, w, k_blocks, sums);
          });
          for (int r = 0; r < count; ++r)
            for (int64_t c = 0; c < kBlock && blk * kBlock + c < n; ++c) {
              const int64_t col = blk * kBlock + c;
              out[(r0 + r) * n + col] = bias ? sums[r * kBlock + c] + bias[col] : sums[r * kBlock + c];
            }
        });
      }
    });
  }
};

torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "block_linear takes float32 [M, K]");
  return apply_layer(BlockLayer(packed, bias.value_or(torch::Tensor()), n), x, n);
}

// K-quant weights as a GGUF file holds them (Q4_K, Q6_K), each tensor in its own format: along
// K, super-blocks of 256 weights with float16 factors d and dmin, in sub-blocks with small
// integer factors a (per 16 weights) and b (per 32), so that
//   w = d a q - dmin b,  q unsigned (Q4_K: 4 bits, a = b's sub-block scale, b = its min;
//                                    Q6_K: 6 bits, a its signed scale, b = a, dmin = 32 d).
// Activations enter as int8 in super-blocks of 256 with one scale s each and the sums of every
// 16 of them (GGUF's Q8_K), so a super-block adds to a row
//   float(sum a (sum q xq)) (d s) - float(sum b (sum xq)) (dmin s),
// both integer sums exact and the float sums over a row's super-blocks taken in order: a row's
// result depends on that row alone.
// One super-block of 16 channels (a group), one stream:
//   nibbles [8 sub-blocks of 32][4 steps][16 channels][4]: q & 15 of inputs 4i..4i+3 (low
//     nibble) and 16 + 4i.. (high nibble) of the sub-block, as the 4-bit blocks above;
//   Q6_K only: high bits [8][2][16][4]: q >> 4 of steps p, p + 2, p + 4, p + 6 in bits 0-1, 2-3,
//     4-5, 6-7 of byte p (p = 0, 1);
//   factors: Q4_K [8][a for 16 channels, then b for 16] int8; Q6_K [8][16 channels][a of inputs
//     0-15, a of 16-31] int8 (b = a);
//   d [16] and dmin [16] float16.
constexpr int64_t kSuper = 256;
enum KFormat : int64_t { kQ4K = 0, kQ6K = 1 };
template <int Format>
constexpr int64_t factors_at() { return Format == kQ4K ? 2048 : 3072; }
template <int Format>
constexpr int64_t super_bytes() { return factors_at<Format>() + 256 + 64; }
// Rows whose sums stay in registers through a pass over a group's weights: with VNNI a row
// holds one accumulator at a time (ia, then ib), so 16 fit beside a sub-block's unpacked steps.
#if defined(__AVX512VNNI__)
constexpr int kKRows = 16;
#else
constexpr int kKRows = 4;
#endif

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One row's activations for the K-quant layers: xq (k int8), per super-block s = max|x| / 127 and
// xq = round(x / s), and the sums of each 16 of xq (int16).
// Every path divides and rounds to nearest even alike, so all give the same integers.
void quantize_super(const float* x, int64_t k, int8_t* xq, float* scales, int16_t* sums16) {
  for (int64_t b = 0; b * kSuper < k; ++b) {
    const float* xb = x + b * kSuper;
#if defined(__AVX512F__)
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < kSuper; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    const float scale = std::max(_mm512_reduce_max_ps(top), 1e-12f) / 127.f;
    scales[b] = scale;
    const __m512 divisor = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xb + g * 16), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i q = _mm512_cvtps_epi32(rounded);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kSuper + g * 16), _mm512_cvtepi32_epi8(q));
      sums16[b * (kSuper / 16) + g] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
#elif defined(__AVX2__)
    const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < kSuper; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude_bits));
    const float scale = std::max(max_of(top), 1e-12f) / 127.f;
    scales[b] = scale;
    const __m256 divisor = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      __m256i q[2];
      for (int h = 0; h < 2; ++h)
        q[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + g * 16 + h * 8), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // int32 -> int16 -> int8 (values within [-127, 127]: no saturation), back in lane order
      const __m256i packed16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
      const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(packed16), _mm256_extracti128_si256(packed16, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kSuper + g * 16), bytes);
      const __m256i sum8 = _mm256_add_epi32(q[0], q[1]);
      const __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      const __m128i sum2 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
      sums16[b * (kSuper / 16) + g] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 1))));
    }
#else
    float largest = 0.f;
    for (int64_t i = 0; i < kSuper; ++i) largest = std::max(largest, std::fabs(xb[i]));
    const float scale = std::max(largest, 1e-12f) / 127.f;
    scales[b] = scale;
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * 16; i < g * 16 + 16; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] / scale));
        xq[b * kSuper + i] = static_cast<int8_t>(q);
        sum += q;
      }
      sums16[b * (kSuper / 16) + g] = static_cast<int16_t>(sum);
    }
#endif
  }
}

#if defined(__AVX512VNNI__)
// The eighth of a K-quant super-block's lines that goes with sub-block j, asked for into L2 (all
// asked at once, they queued behind each other: a step and a 9-row pass cost 8-12% more).
template <int64_t Bytes>
inline void prefetch_part(const uint8_t* super_block, int j) {
  constexpr int kLines = Bytes / 64;
  for (int line = j * kLines / 8; line < (j == 7 ? kLines : (j + 1) * kLines / 8); ++line)
    _mm_prefetch(reinterpret_cast<const char*>(super_block + 64 * line), _MM_HINT_T1);
}

// Sub-block j (32 inputs) of super-block `wb`, unpacked: step s holds q of inputs 4s..4s+3 of
// the sub-block for the 16 channels, one byte each (Q6_K: with its two high bits).
template <int Format>
inline void kquant_steps(const uint8_t* wb, int j, __m512i q[8]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_pair = _mm512_set1_epi8(0x30);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512i packed = _mm512_loadu_si512(wb + j * 256 + i * 64);
    q[i] = _mm512_and_si512(packed, low_nibbles);
    q[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
  }
  if constexpr (Format == kQ6K) {
    // step s's two high bits: bits 2 (s / 2) of high plane s % 2
    const __m512i high[2] = {_mm512_loadu_si512(wb + 2048 + j * 128), _mm512_loadu_si512(wb + 2048 + j * 128 + 64)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i up = i < 2 ? _mm512_slli_epi16(high[i % 2], 4) : _mm512_slli_epi16(high[i % 2], 2);
      const __m512i down = i < 2 ? high[i % 2] : _mm512_srli_epi16(high[i % 2], 2);
      q[i] = _mm512_or_si512(q[i], _mm512_and_si512(up, high_pair));
      q[i + 4] = _mm512_or_si512(q[i + 4], _mm512_and_si512(down, high_pair));
    }
  }
}

// Sub-block j's factors a of each channel, one int32 lane per channel: of its inputs 0-15 and of
// 16-31 (Q4_K: one a for both).
template <int Format>
inline std::pair<__m512i, __m512i> kquant_a(const uint8_t* wb, int j) {
  const int8_t* factors = reinterpret_cast<const int8_t*>(wb + factors_at<Format>() + j * 32);
  if constexpr (Format == kQ6K) {
    const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(factors)));
    return {_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16), _mm512_srai_epi32(pairs, 16)};
  } else {
    const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(factors)));
    return {a, a};
  }
}

// Sub-block j's factors b of each channel as an int16 pair (Q4_K: b, b; Q6_K: the two halves'
// a), for vpdpwssd with a row's pair of sums of 16 xq.
template <int Format>
inline __m512i kquant_b(const uint8_t* wb, int j) {
  const int8_t* factors = reinterpret_cast<const int8_t*>(wb + factors_at<Format>() + j * 32);
  if constexpr (Format == kQ6K) return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(factors)));
  const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(factors + 16));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(b16, b16), _mm_unpacklo_epi8(b16, b16)));
}

// Q4_K's factors b of sub-blocks 2p and 2p + 1 of each channel as an int16 pair, for vpdpwssd
// with a row's sums of those sub-blocks' 32 xq each.
inline __m512i q4k_b_pair(const uint8_t* wb, int p) {
  const int8_t* factors = reinterpret_cast<const int8_t*>(wb + factors_at<kQ4K>() + 2 * p * 32 + 16);
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(factors));
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(factors + 32));
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(first, second), _mm_unpacklo_epi8(first, second)));
}
#endif

// out[r][c] for `rows` rows (at most kKRows) and the 16 channels of one group: super-blocks in
// order, each adding float(ia) (d s) and then -float(ib) (dmin s).
template <int Format, int R>
void kquant_rows(const int8_t* x, int64_t k, const float* xs, const int16_t* sums16, const uint8_t* w, int64_t supers, float* out) {
  constexpr int64_t kBytes = super_bytes<Format>();
  constexpr int64_t kFactors = factors_at<Format>();
#if defined(__AVX512VNNI__)
  // vpdpbusd: unsigned q times xq, four inputs a lane, summed to int32 (exact). A sub-block's
  // eight steps are unpacked once and serve every row; each row's sums of a sub-block (or of
  // each half, Q6_K) times its factors a go to ia (vpmulld); then the rows' ib, the pair sums
  // of xq times the factors b (vpdpwssd). A row keeps one accumulator in registers at a time,
  // and its total in `out` (ia's term, then ib's: the scalar path's order).
  const auto x4 = [&](int r, int64_t at) { return _mm512_set1_epi32(load4(x + r * k + at)); };
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, _mm512_setzero_ps());
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* wb = w + sb * kBytes;
    const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + kFactors + 256);
    __m512i acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      prefetch_part<kBytes>(wb + 16 * kBytes, j);  // the super-block 16 ahead
      const int64_t at = sb * kSuper + j * 32;  // this sub-block's first input
      __m512i q[8];  // step s: inputs 4s..4s+3 of the sub-block
      kquant_steps<Format>(wb, j, q);
      const auto [a_low, a_high] = kquant_a<Format>(wb, j);
      // row r's sums of the sub-block's inputs 0-15 and 16-31: four steps each
      const auto halves = [&](int r) {
        __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], x4(r, at));
        __m512i top = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[4], x4(r, at + 16));
#pragma GCC unroll 3
        for (int s = 1; s < 4; ++s) {
          low = _mm512_dpbusd_epi32(low, q[s], x4(r, at + 4 * s));
          top = _mm512_dpbusd_epi32(top, q[s + 4], x4(r, at + 16 + 4 * s));
        }
        return std::pair{low, top};
      };
      if constexpr (Format == kQ6K) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const auto [low, top] = halves(r);
          acc[r] = _mm512_add_epi32(acc[r], _mm512_add_epi32(_mm512_mullo_epi32(low, a_low), _mm512_mullo_epi32(top, a_high)));
        }
      } else {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const auto [low, top] = halves(r);
          acc[r] = _mm512_add_epi32(acc[r], _mm512_mullo_epi32(_mm512_add_epi32(low, top), a_low));
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 16)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(xs[r * supers + sb]);
      _mm512_storeu_ps(out + r * kBlock, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(dv, s), _mm512_loadu_ps(out + r * kBlock)));
      acc[r] = _mm512_setzero_si512();
    }
    // ib: per sub-block, the factors b of a channel as an int16 pair (Q4_K: b, b; Q6_K: the two
    // halves' a) times the row's pair of sums of 16 xq
    for (int j = 0; j < 8; ++j) {
      const __m512i b = kquant_b<Format>(wb, j);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpwssd_epi32(acc[r], b, _mm512_set1_epi32(load4(sums16 + r * (k / 16) + sb * 16 + j * 2)));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(xs[r * supers + sb]);
      _mm512_storeu_ps(out + r * kBlock, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(mv, s), _mm512_loadu_ps(out + r * kBlock)));
    }
  }
#elif defined(__AVX2__)
  // vpmaddubsw: unsigned q (at most 63) times xq, pairs summed to int16 (at most 2 * 63 * 127);
  // those summed in int16 while they cannot overflow (Q4_K: all 8 steps of a sub-block, at most
  // 8 * 2 * 15 * 127; Q6_K: two steps), then vpmaddwd by the sub-block factors to int32.
  // Channels 0-7 and 8-15 in two halves; each step is unpacked once and serves every row while
  // the rows' sums stay in registers.
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), high_pair = _mm256_set1_epi8(0x30);
  const __m128i evens = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
  const __m128i odds = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
  const auto x4 = [&](int r, int64_t at) { return _mm256_set1_epi32(load4(x + r * k + at)); };
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* wb = w + sb * kBytes;
    for (int line = 0; line < kBytes / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * kBytes + 64 * line), _MM_HINT_T0);
    const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + kFactors + 256);
    for (int h = 0; h < 2; ++h) {
      __m256i ia[R], ib[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const uint8_t* nibbles = wb + j * 256 + h * 32;
        const int64_t at = sb * kSuper + j * 32;  // this sub-block's first input
        __m256i a_low, a_high, b;
        if constexpr (Format == kQ6K) {
          const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kFactors + j * 32 + h * 16));
          b = _mm256_cvtepi8_epi16(pairs);
          a_low = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(pairs, evens));
          a_high = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(pairs, odds));
          const __m256i high0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2048 + j * 128 + h * 32));
          const __m256i high1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2048 + j * 128 + 64 + h * 32));
          // steps i, i + 1 of inputs 0-15 (factor a_low) and 16-31 (a_high): bits 0-1 / 2-3 of the
          // high bytes for i = 0 / 2, bits 4-5 / 6-7 for the steps 4 further.
#pragma GCC unroll 2
          for (int i = 0; i < 4; i += 2) {
            const __m256i packed0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + i * 64));
            const __m256i packed1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + i * 64 + 64));
            const __m256i up0 = i == 0 ? _mm256_slli_epi16(high0, 4) : _mm256_slli_epi16(high0, 2);
            const __m256i up1 = i == 0 ? _mm256_slli_epi16(high1, 4) : _mm256_slli_epi16(high1, 2);
            const __m256i down0 = i == 0 ? high0 : _mm256_srli_epi16(high0, 2);
            const __m256i down1 = i == 0 ? high1 : _mm256_srli_epi16(high1, 2);
            const __m256i low0 = _mm256_or_si256(_mm256_and_si256(packed0, low_nibbles), _mm256_and_si256(up0, high_pair));
            const __m256i low1 = _mm256_or_si256(_mm256_and_si256(packed1, low_nibbles), _mm256_and_si256(up1, high_pair));
            const __m256i top0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed0, 4), low_nibbles), _mm256_and_si256(down0, high_pair));
            const __m256i top1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed1, 4), low_nibbles), _mm256_and_si256(down1, high_pair));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(low0, x4(r, at + 4 * i)), _mm256_maddubs_epi16(low1, x4(r, at + 4 * i + 4)));
              const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(top0, x4(r, at + 16 + 4 * i)), _mm256_maddubs_epi16(top1, x4(r, at + 20 + 4 * i)));
              ia[r] = _mm256_add_epi32(ia[r], _mm256_add_epi32(_mm256_madd_epi16(lo, a_low), _mm256_madd_epi16(hi, a_high)));
            }
          }
        } else {
          const __m128i a16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kFactors + j * 32));
          const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kFactors + j * 32 + 16));
          a_low = a_high = _mm256_cvtepi8_epi16(h == 0 ? _mm_unpacklo_epi8(a16, a16) : _mm_unpackhi_epi8(a16, a16));
          b = _mm256_cvtepi8_epi16(h == 0 ? _mm_unpacklo_epi8(b16, b16) : _mm_unpackhi_epi8(b16, b16));
          __m256i sums[R];
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + i * 64));
            const __m256i low = _mm256_and_si256(packed, low_nibbles), top = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(low, x4(r, at + 4 * i)), _mm256_maddubs_epi16(top, x4(r, at + 16 + 4 * i)));
              sums[r] = i == 0 ? both : _mm256_add_epi16(sums[r], both);
            }
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(sums[r], a_low));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_set1_epi32(load4(sums16 + r * (k / 16) + sb * 16 + j * 2));
          ib[r] = _mm256_add_epi32(ib[r], _mm256_madd_epi16(b, pair));
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + h * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 16 + h * 8)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(xs[r * supers + sb]);
        total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_mul_ps(dv, s), total[r][h]);
        total[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ib[r]), _mm256_mul_ps(mv, s), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, total[r][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, total[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlock; ++c) {
      float total = 0.f;
      for (int64_t sb = 0; sb < supers; ++sb) {
        const uint8_t* wb = w + sb * kBytes;
        int32_t ia = 0, ib = 0;
        for (int j = 0; j < 8; ++j) {
          for (int half = 0; half < 2; ++half) {  // inputs 0-15, 16-31 of the sub-block
            int32_t sum = 0;
            for (int i = 0; i < 4; ++i)
              for (int t = 0; t < 4; ++t) {
                const int step = half * 4 + i;
                int32_t q = (wb[j * 256 + i * 64 + c * 4 + t] >> (4 * half)) & 0x0F;
                if constexpr (Format == kQ6K) q |= ((wb[2048 + j * 128 + (step % 2) * 64 + c * 4 + t] >> (2 * (step / 2))) & 3) << 4;
                sum += q * x[r * k + sb * kSuper + j * 32 + 4 * step + t];
              }
            const int8_t* factors = reinterpret_cast<const int8_t*>(wb + kFactors + j * 32);
            ia += sum * (Format == kQ6K ? factors[c * 2 + half] : factors[c]);
          }
          const int16_t* pair = sums16 + r * (k / 16) + sb * 16 + j * 2;
          const int8_t* factors = reinterpret_cast<const int8_t*>(wb + kFactors + j * 32);
          ib += Format == kQ6K ? factors[c * 2] * pair[0] + factors[c * 2 + 1] * pair[1] : factors[16 + c] * (pair[0] + pair[1]);
        }
        const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + kFactors + 256);
        const float s = xs[r * supers + sb];
        total = std::fma(static_cast<float>(ia), static_cast<float>(d[c]) * s, total);
        total = std::fma(-static_cast<float>(ib), static_cast<float>(d[16 + c]) * s, total);
      }
      out[r * kBlock + c] = total;
    }
#endif
}

// A linear layer of K-quant groups as KQuantLinear holds them: `packed`, every group's super-blocks
// one after another; `groups` [G, 3] int64: each group's byte offset, format (a fused q|k|v may
// hold groups of both) and super-blocks along K; an optional bias. The same calls as Int8Layer: quantize the rows
// (xq: the int8 rows, then their sums of 16 as int16; scales: each row's super-block scales),
// then multiply.
struct KQuantLayer {
  const uint8_t* packed;
  const int64_t* groups;
  const float* bias;
  int64_t count, supers, n;

  KQuantLayer(const torch::Tensor& packed_, const torch::Tensor& groups_, const torch::Tensor& bias_, int64_t n_)
      : packed(packed_.data_ptr<uint8_t>()), groups(groups_.data_ptr<int64_t>()),
        bias(bias_.defined() && bias_.numel() ? bias_.data_ptr<float>() : nullptr), count(groups_.size(0)), supers(0), n(n_) {
    TORCH_CHECK(packed_.dtype() == torch::kUInt8 && packed_.dim() == 1 && groups_.dtype() == torch::kInt64 && groups_.dim() == 2 &&
                    groups_.size(1) == 3 && count > 0 && count * kBlock == n, "bad packed K-quant weights");
    supers = groups[2];
  }

  int64_t k() const { return supers * kSuper; }

  template <typename MakeRow>
  void quantize(int64_t rows, int64_t k_in, MakeRow make_row, std::vector<uint8_t>& xq, std::vector<float>& scales) const {
    TORCH_CHECK(k_in == k(), "packed K-quant weights do not match the input");
    // past the sums: the tail of a row tile reads up to 15 rows past the last (their products dropped)
    at_least(xq, rows * k() + rows * (k() / 16) * 2 + 16 * k());
    at_least(scales, rows * supers);
    at::parallel_for(0, rows, kQuantizeGrain, [&](int64_t first, int64_t last) {
      std::vector<float> row(k());
      for (int64_t r = first; r < last; ++r) {
        make_row(r, row.data());
        quantize_super(row.data(), k(), reinterpret_cast<int8_t*>(xq.data()) + r * k(), scales.data() + r * supers, sums16(xq, rows) + r * (k() / 16));
      }
    });
  }

  int16_t* sums16(const std::vector<uint8_t>& xq, int64_t rows) const {
    return reinterpret_cast<int16_t*>(const_cast<uint8_t*>(xq.data()) + rows * k());
  }

  void multiply(const std::vector<uint8_t>& xq, const std::vector<float>& scales, int64_t rows, float* out) const {
    const int8_t* x = reinterpret_cast<const int8_t*>(xq.data());
    const int16_t* sums = sums16(xq, rows);
#if defined(SPECDEC_AMX) && defined(__AVX512VNNI__)
    if (rows >= kTileRowsFrom && use_tiles && tiles::available()) return multiply_tiles(x, sums, scales.data(), rows, out);
#endif
    at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      float part[kKRows * kBlock];
      for (int64_t g = first; g < last; ++g) {
        const uint8_t* w = packed + groups[3 * g];
        in_row_groups(rows, kKRows, [&](int64_t r0, int take) {
          const int8_t* xr = x + r0 * k();
          const float* sr = scales.data() + r0 * supers;
          const int16_t* br = sums + r0 * (k() / 16);
          with_rows<kKRows>(take, [&](auto r) {
            if (groups[3 * g + 1] == kQ6K) {
              kquant_rows<kQ6K, decltype(r)::value>(xr, k(), sr, br, w, supers, part);
            } else {
              kquant_rows<kQ4K, decltype(r)::value>(xr, k(), sr, br, w, supers, part);
            }
          });
          for (int r = 0; r < take; ++r)
            for (int64_t c = 0; c < kBlock; ++c) {
              const int64_t col = g * kBlock + c;
              out[(r0 + r) * n + col] = bias ? part[r * kBlock + c] + bias[col] : part[r * kBlock + c];
            }
        });
      }
    });
  }
#if defined(SPECDEC_AMX) && defined(__AVX512VNNI__)
  // From a whole row tile the tiles multiply (the 1.5B's passes against the VNNI path: 5 rows
  // 1.15x, 9 1.0x, 12 0.98-1.03x, 16 0.89-0.93x, 33 0.71x, a 176-token prompt 0.58x).
  static constexpr int64_t kTileRowsFrom = 16;

  // The same sums through AMX's tiles. A super-block's integer sum ia = sum over its inputs of
  // (a q) xq, a q being at most 14 bits, goes as two tile products, a q = 256 h + l: the low bytes
  // l (unsigned) and the high bytes h (signed) of every weight times a, made once per super-block
  // and group into B tiles (64 inputs each) and shared by all row tiles, which take the rows'
  // xq as A (signed) in row tiles of 16, two at a time. ia = C_l + 256 C_h; ib and the float
  // terms as in kquant_rows, in its order, so every row gets kquant_rows' bits. Rows past the
  // last (a row tile's tail) read the buffer's padding and are dropped.
  void multiply_tiles(const int8_t* x, const int16_t* sums, const float* scales, int64_t rows, float* out) const {
    // each row's sums of 32 xq (Q4_K's b is one factor per 32 inputs: half the vpdpwssd of 16s)
    std::vector<int16_t> sums32(rows * k() / 32);
    for (size_t i = 0; i < sums32.size(); ++i) sums32[i] = static_cast<int16_t>(sums[2 * i] + sums[2 * i + 1]);
    at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      tiles::configure();
      std::vector<float> totals(rows * kBlock);
      for (int64_t g = first; g < last; ++g) {
        const uint8_t* w = packed + groups[3 * g];
        if (groups[3 * g + 1] == kQ6K) {
          tiles_group<kQ6K>(x, sums, scales, rows, w, totals.data());
        } else {
          tiles_group<kQ4K>(x, sums32.data(), scales, rows, w, totals.data());
        }
        const __m512 offset = bias ? _mm512_loadu_ps(bias + g * kBlock) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 total = _mm512_loadu_ps(totals.data() + r * kBlock);
          _mm512_storeu_ps(out + r * n + g * kBlock, bias ? _mm512_add_ps(total, offset) : total);
        }
      }
      tiles::release();
    });
  }

  // `sums`: each row's sums of 16 xq (Q6_K) or of 32 (Q4_K)
  template <int Format>
  void tiles_group(const int8_t* x, const int16_t* sums, const float* scales, int64_t rows, const uint8_t* w, float* totals) const {
    constexpr int64_t kBytes = super_bytes<Format>();
    constexpr int kChunks = kSuper / tiles::kBytes;  // B tiles of 64 inputs a super-block
    alignas(64) uint8_t low[kChunks][tiles::kRows * tiles::kBytes], high[kChunks][tiles::kRows * tiles::kBytes];
    alignas(64) int32_t c[4][tiles::kRows * kBlock];
    const int64_t k = this->k(), row_tiles = (rows + tiles::kRows - 1) / tiles::kRows;
    const __m512i low_bytes = _mm512_set1_epi16(0x00FF), high_bytes = _mm512_set1_epi16(static_cast<int16_t>(0xFF00));
    // a of a channel in both int16 halves of its lane
    const auto both_halves = [](__m512i a) { return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(a, 16)); };
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* wb = w + sb * kBytes;
      // ib's factors against a row's pairs of sums: Q6_K the two halves' a of each sub-block; Q4_K
      // the b of two sub-blocks
      constexpr int kPairs = Format == kQ6K ? 8 : 4;
      __m512i b[kPairs];
      for (int j = 0; j < 8; ++j) {
        prefetch_part<kBytes>(wb + kBytes, j);  // the next super-block
        if constexpr (Format == kQ6K) {
          b[j] = kquant_b<kQ6K>(wb, j);
        } else if (j % 2 == 0) {
          b[j / 2] = q4k_b_pair(wb, j / 2);
        }
        __m512i q[8];
        kquant_steps<Format>(wb, j, q);
        const auto [a_low, a_high] = kquant_a<Format>(wb, j);
        const __m512i a[2] = {both_halves(a_low), both_halves(a_high)};
#pragma GCC unroll 8
        for (int step = 0; step < 8; ++step) {
          // the even and odd bytes of each lane as int16, times a (exact: |a q| < 2^14)
          const __m512i even = _mm512_mullo_epi16(_mm512_and_si512(q[step], low_bytes), a[step / 4]);
          const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(q[step], 8), a[step / 4]);
          const int64_t at = ((j % 2) * 8 + step) * tiles::kBytes;  // the B tile's row: inputs 4 row..4 row + 3 of its 64
          _mm512_store_si512(low[j / 2] + at, _mm512_or_si512(_mm512_and_si512(even, low_bytes), _mm512_slli_epi16(odd, 8)));
          _mm512_store_si512(high[j / 2] + at, _mm512_or_si512(_mm512_srli_epi16(even, 8), _mm512_and_si512(odd, high_bytes)));
        }
      }
      const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + factors_at<Format>() + 256);
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 16)));
      for (int64_t tile = 0; tile < row_tiles; tile += 2) {
        const bool two = tile + 1 < row_tiles;
        const int8_t* a0 = x + tile * tiles::kRows * k + sb * kSuper;
        const int8_t* a1 = a0 + tiles::kRows * k;
        tiles::zero<0>();
        tiles::zero<1>();
        if (two) {
          tiles::zero<2>();
          tiles::zero<3>();
        }
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          tiles::load<4>(a0 + chunk * tiles::kBytes, k);
          tiles::load<5>(low[chunk]);
          tiles::load<6>(high[chunk]);
          tiles::dpbsud<0, 4, 5>();
          tiles::dpbssd<1, 4, 6>();
          if (two) {
            tiles::load<7>(a1 + chunk * tiles::kBytes, k);
            tiles::dpbsud<2, 7, 5>();
            tiles::dpbssd<3, 7, 6>();
          }
        }
        tiles::store<0>(c[0]);
        tiles::store<1>(c[1]);
        if (two) {
          tiles::store<2>(c[2]);
          tiles::store<3>(c[3]);
        }
        const int64_t end = std::min<int64_t>(rows, (tile + (two ? 2 : 1)) * tiles::kRows);
        for (int64_t r = tile * tiles::kRows; r < end; ++r) {
          const int64_t at = r - tile * tiles::kRows;  // 0-31: tiles 0, 1 (first row tile) or 2, 3
          const int32_t* c_low = c[at / tiles::kRows * 2] + at % tiles::kRows * kBlock;
          const int32_t* c_high = c[at / tiles::kRows * 2 + 1] + at % tiles::kRows * kBlock;
          const __m512i ia = _mm512_add_epi32(_mm512_loadu_si512(c_low), _mm512_slli_epi32(_mm512_loadu_si512(c_high), 8));
          const __m512 s = _mm512_set1_ps(scales[r * supers + sb]);
          const __m512 before = sb == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(totals + r * kBlock);
          const __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(dv, s), before);
          __m512i ib = _mm512_setzero_si512();
          const int16_t* row_sums = sums + (r * supers + sb) * 2 * kPairs;
#pragma GCC unroll 8
          for (int j = 0; j < kPairs; ++j) ib = _mm512_dpwssd_epi32(ib, b[j], _mm512_set1_epi32(load4(row_sums + 2 * j)));
          _mm512_storeu_ps(totals + r * kBlock, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(mv, s), total));
        }
      }
    }
  }
#endif
};

torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor groups, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "kquant_linear takes float32 [M, K]");
  return apply_layer(KQuantLayer(packed, groups, bias.value_or(torch::Tensor()), n), x, n);
}

#if defined(__AVX512F__)
// exp(x) for 16 lanes (Cody-Waite reduction, degree-6 polynomial; ~2 ulp). Each lane's result
// depends on that lane's input only.
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__)
// exp(x) for 8 lanes, the same reduction and polynomial as exp16; 2^n built in the exponent bits.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif

// Query heads that share one pass over the keys (scores_of) and over the values
// (accumulate_values): the heads of several rows of one key/value head, so each key and value
// is read once for all of them. The accumulators stay in registers (AVX-512 has 32, AVX2 16).
#if defined(__AVX512F__)
constexpr int kScoreHeads = 12;
constexpr int kValueHeads = 6;
#else
constexpr int kScoreHeads = 4;
constexpr int kValueHeads = 4;
#endif
constexpr int64_t kKeysAhead = 256;  // keys prefetched this far ahead: each of the d key rows is its own stream

// Scores q . k / sqrt(d) of G query heads (q transposed: q[d * q_stride + g], so one address
// serves all heads of a step) against keys [0, needed) held transposed, [d][stride], into
// scores [G][score_stride]. Each lane of a vector is one key's
// dot product with one head, summed over d in order, so a score never depends on its
// neighbours, on G, or on which of the two loops computes it.
template <int G, typename T>
void scores_of(const float* q, int64_t q_stride, const T* keys_t, int64_t stride, int64_t dim, int64_t needed, float scale,
               float* scores, int64_t score_stride) {
#if defined(__AVX512F__)
  constexpr int kKeyBlocks = G <= 6 ? 4 : G <= 8 ? 3 : 2;  // blocks of 16 keys a pass: G * kKeyBlocks <= 24 accumulators
  constexpr int64_t kLineBytes = 64, kRowBytes = static_cast<int64_t>(sizeof(T)) * 16 * kKeyBlocks;
  const __m512 scaling = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 * kKeyBlocks <= needed; j += 16 * kKeyBlocks) {
    const bool far = j + kKeysAhead + 16 * kKeyBlocks <= needed;  // short caches stay in L1/L2: prefetching them only costs
    __m512 acc[G][kKeyBlocks];
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) acc[g][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const T* row = keys_t + d * stride + j;
      if (far)
        for (int64_t line = 0; line < kRowBytes; line += kLineBytes)
          _mm_prefetch(reinterpret_cast<const char*>(row + kKeysAhead) + line, _MM_HINT_T0);
      __m512 k[kKeyBlocks];
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) k[b] = load16(row + 16 * b);
#pragma GCC unroll 12
      for (int g = 0; g < G; ++g) {
        const __m512 qd = _mm512_set1_ps(q[d * q_stride + g]);
#pragma GCC unroll 4
        for (int b = 0; b < kKeyBlocks; ++b) acc[g][b] = _mm512_fmadd_ps(qd, k[b], acc[g][b]);
      }
    }
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) _mm512_storeu_ps(scores + g * score_stride + j + 16 * b, _mm512_mul_ps(acc[g][b], scaling));
  }
  for (; j < needed; j += 16) {
    const __mmask16 inside = lanes_of(needed - j);
    __m512 acc[G];
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k = load16(inside, keys_t + d * stride + j);
#pragma GCC unroll 12
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[d * q_stride + g]), k, acc[g]);
    }
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(scores + g * score_stride + j, inside, _mm512_mul_ps(acc[g], scaling));
  }
#elif defined(__AVX2__)
  const __m256 scaling = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= needed; j += 16) {  // G heads times two blocks of keys: up to eight chains
    __m256 acc[G][2];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const T* row = keys_t + d * stride + j;
      const __m256 k0 = load8(row), k1 = load8(row + 8);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256 qd = _mm256_set1_ps(q[d * q_stride + g]);
        acc[g][0] = _mm256_fmadd_ps(qd, k0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(qd, k1, acc[g][1]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(scores + g * score_stride + j, _mm256_mul_ps(acc[g][0], scaling));
      _mm256_storeu_ps(scores + g * score_stride + j + 8, _mm256_mul_ps(acc[g][1], scaling));
    }
  }
  for (; j < needed; j += 8) {
    const __m256i inside = lanes_of(needed - j);
    __m256 acc[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 k = load8(inside, keys_t + d * stride + j);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[d * q_stride + g]), k, acc[g]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) _mm256_maskstore_ps(scores + g * score_stride + j, inside, _mm256_mul_ps(acc[g], scaling));
  }
#else
  for (int g = 0; g < G; ++g)
    for (int64_t j = 0; j < needed; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot = dot + q[d * q_stride + g] * static_cast<float>(keys_t[d * stride + j]);
      scores[g * score_stride + j] = dot * scale;
    }
#endif
}

#if defined(__AVX512BF16__)
// scores_of for a bfloat16 cache: G query heads as pairs of channels (q[p * q_stride + g], a
// 32-bit word holding channels 2p and 2p + 1) against keys [d/2][stride][2]. Each lane is one
// key's sum over the pairs in order, so a score depends on its query and key alone.
template <int G>
void scores_bf16(const uint32_t* q, int64_t q_stride, const Bfloat16* keys, int64_t stride, int64_t dim, int64_t needed, float scale,
                 float* scores, int64_t score_stride) {
  constexpr int kKeyBlocks = G <= 6 ? 4 : G <= 8 ? 3 : 2;  // G * kKeyBlocks <= 24 accumulators
  const __m512 scaling = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < needed; j += 16 * kKeyBlocks) {
    __m512 acc[G][kKeyBlocks];
    __mmask16 inside[kKeyBlocks];
#pragma GCC unroll 4
    for (int b = 0; b < kKeyBlocks; ++b) inside[b] = lanes_of(needed - j - 16 * b);
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) acc[g][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      const Bfloat16* row = keys + (p * stride + j) * 2;
      __m512bh k[kKeyBlocks];
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) k[b] = (__m512bh)_mm512_maskz_loadu_epi32(inside[b], row + 32 * b);
#pragma GCC unroll 12
      for (int g = 0; g < G; ++g) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[p * q_stride + g]));
#pragma GCC unroll 4
        for (int b = 0; b < kKeyBlocks; ++b) acc[g][b] = _mm512_dpbf16_ps(acc[g][b], k[b], pair);
      }
    }
#pragma GCC unroll 12
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int b = 0; b < kKeyBlocks; ++b) _mm512_mask_storeu_ps(scores + g * score_stride + j + 16 * b, inside[b], _mm512_mul_ps(acc[g][b], scaling));
  }
}

// accumulate_values for a bfloat16 cache: positions taken in pairs (j, j + 1), j - j0 even,
// weights [G][weight_stride] in bfloat16 (a pair is one 32-bit word); past j1 a pair's second
// weight is 0 and its value row the first's. Each lane sums its (head, channel) in order.
template <int G>
void accumulate_values_bf16(const Bfloat16* values, int64_t dim, const int64_t* seen, int64_t j0, int64_t j1, const Bfloat16* weights,
                            int64_t weight_stride, float* acc) {
  const auto value_row = [&](int64_t j) { return values + (seen ? seen[j] : j) * dim; };
  const auto weight_pair = [&](int g, int64_t j) {
    uint32_t pair;
    std::memcpy(&pair, weights + g * weight_stride + j, 4);
    return pair;
  };
  if (dim % 64 == 0) {
    // 64 channels at a time (their sums for G heads fill the registers): two rows' 32 channels
    // interleaved into (v0[c], v1[c]) pairs, channels in order. Each lane still sums its
    // (head, channel) over the positions in order, whatever the slice.
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t slice = 0; slice < dim; slice += 64) {
      __m512 sums[G][4];
#pragma GCC unroll 6
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sums[g][c] = _mm512_loadu_ps(acc + g * dim + slice + 16 * c);
      for (int64_t j = j0; j < j1; j += 2) {
        const Bfloat16* v0 = value_row(j) + slice;
        const Bfloat16* v1 = (j + 1 < j1 ? value_row(j + 1) : value_row(j)) + slice;
        __m512bh pairs[4];
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * half), b = _mm512_loadu_si512(v1 + 32 * half);
          pairs[2 * half] = (__m512bh)_mm512_permutex2var_epi16(a, low, b);
          pairs[2 * half + 1] = (__m512bh)_mm512_permutex2var_epi16(a, high, b);
        }
#pragma GCC unroll 6
        for (int g = 0; g < G; ++g) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weight_pair(g, j)));
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) sums[g][c] = _mm512_dpbf16_ps(sums[g][c], pairs[c], w);
        }
      }
#pragma GCC unroll 6
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * dim + slice + 16 * c, sums[g][c]);
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    float* o = acc + g * dim;
    for (int64_t j = j0; j < j1; j += 2) {
      const Bfloat16* v0 = value_row(j);
      const Bfloat16* v1 = j + 1 < j1 ? value_row(j + 1) : v0;
      const float w0 = static_cast<float>(weights[g * weight_stride + j]), w1 = static_cast<float>(weights[g * weight_stride + j + 1]);
      for (int64_t d = 0; d < dim; ++d) o[d] = o[d] + (static_cast<float>(v0[d]) * w0 + static_cast<float>(v1[d]) * w1);
    }
  }
}
#endif

// scores <- exp(scores - max) over `count` scores; returns their sum. Whole vectors only (the
// tail masked), so a score's exp never depends on where it sits.
float softmax_numerators(float* scores, int64_t count) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 real = lanes_of(count - j);
    top = _mm512_mask_max_ps(top, real, top, _mm512_maskz_loadu_ps(real, scores + j));
  }
  const float largest = _mm512_reduce_max_ps(top);  // a maximum is the same in any order
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 real = lanes_of(count - j);
    const __m512 e = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(real, scores + j), _mm512_set1_ps(largest))));
    _mm512_mask_storeu_ps(scores + j, real, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__)
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = lowest;
  for (int64_t j = 0; j < count; j += 8) {
    const __m256i real = lanes_of(count - j);
    top = _mm256_max_ps(top, _mm256_blendv_ps(lowest, _mm256_maskload_ps(scores + j, real), _mm256_castsi256_ps(real)));
  }
  const __m256 largest = _mm256_set1_ps(max_of(top));  // a maximum is the same in any order
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8) {
    const __m256i real = lanes_of(count - j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + j, real), largest)), _mm256_castsi256_ps(real));
    _mm256_maskstore_ps(scores + j, real, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum_of(sum);
#else
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) largest = std::max(largest, scores[j]);
  float total = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = std::exp(scores[j] - largest);
    total = total + scores[j];
  }
  return total;
#endif
}

// acc[g] += weights[g][j] * v(j) for j in [j0, j1) in order, v(j) the value row seen[j] (row j
// where seen is null), for G query heads sharing the values; acc [G][dim] in memory, so a sum
// can stop and go on (the shared context for a block of rows, then each row's own keys) and
// still add the same numbers in the same order. With AVX-512 each value row is loaded once
// for all heads; AVX2's 16 registers hold one head's 32 channels at a time.
template <int G, typename T>
void accumulate_values(const T* values, int64_t dim, const int64_t* seen, int64_t j0, int64_t j1, const float* weights,
                       int64_t weight_stride, float* acc) {
  const auto value_row = [&](int64_t j) { return values + (seen ? seen[j] : j) * dim; };
#if defined(__AVX512F__)
  if (dim == 64) {
    __m512 sums[G][4];
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) sums[g][c] = _mm512_loadu_ps(acc + g * dim + 16 * c);
    for (int64_t j = j0; j < j1; ++j) {
      const T* value = value_row(j);
      __m512 v[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) v[c] = load16(value + 16 * c);
#pragma GCC unroll 6
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(weights[g * weight_stride + j]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sums[g][c] = _mm512_fmadd_ps(p, v[c], sums[g][c]);
      }
    }
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * dim + 16 * c, sums[g][c]);
    return;
  }
#elif defined(__AVX2__)
  if (dim % 32 == 0) {  // one head and 32 channels at a time: four accumulators
    for (int g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        float* a = acc + g * dim + d0;
        __m256 sums[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sums[c] = _mm256_loadu_ps(a + 8 * c);
        for (int64_t j = j0; j < j1; ++j) {
          const T* value = value_row(j) + d0;
          const __m256 p = _mm256_set1_ps(weights[g * weight_stride + j]);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) sums[c] = _mm256_fmadd_ps(p, load8(value + 8 * c), sums[c]);
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(a + 8 * c, sums[c]);
      }
    return;
  }
#endif
  for (int g = 0; g < G; ++g) {
    float* o = acc + g * dim;
    for (int64_t j = j0; j < j1; ++j) {
      const T* value = value_row(j);
      const float p = weights[g * weight_stride + j];
      for (int64_t d = 0; d < dim; ++d) o[d] = o[d] + p * static_cast<float>(value[d]);
    }
  }
}

// out = acc / total, element by element (a division rounds alike in any vector width).
void divide(const float* acc, float total, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_loadu_ps(acc + i), _mm512_set1_ps(total)));
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_loadu_ps(acc + i), _mm256_set1_ps(total)));
#endif
  for (; i < n; ++i) out[i] = acc[i] / total;
}

// f(std::integral_constant<int, count>) for a count in [1, N]: the templates above take their
// number of heads at compile time, to keep the accumulators in registers.
template <int N, typename F>
void with_heads(int count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_heads<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// One sequence's attention: t queries (q [t, heads, d] rows) over the first `length` positions
// of its cache, keys [kv_heads][d][capacity] (transposed) and values [kv_heads][capacity][d];
// `allowed` [t, length] or null (causal: query r sees positions up to start + r). Writes
// out [t, heads * d].
template <typename T>
struct AttentionSegment {
  const float* q;
  int64_t t;
  const T* keys_t;
  const T* values;
  int64_t capacity, length, start;
  const bool* allowed;
  float* out;
};

// The attention of every segment in one parallel region (a region costs more than one
// one-token segment's work). One work item is a block of one segment's rows and one key/value
// head: their query heads share each pass over the keys, and over the values of the keys every
// row of the block sees in order (the committed context); each row then adds its own (its
// branch of the tree). Every (row, head) still sums its own numbers in its own fixed order.
template <typename T>
void attend(const std::vector<AttentionSegment<T>>& segments, int64_t heads, int64_t dim, int64_t kv_heads) {
  const int64_t groups = heads / kv_heads;
  const int64_t block_rows = std::max<int64_t>(1, kScoreHeads / groups);
  const auto blocks_of = [&](int64_t t) { return (t + block_rows - 1) / block_rows; };
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  std::vector<int64_t> ends;  // items of segments 0..i
  int64_t longest = 0, widest = 1;
  for (const auto& segment : segments) {
    ends.push_back((ends.empty() ? 0 : ends.back()) + kv_heads * blocks_of(segment.t));
    longest = std::max(longest, segment.length);
    widest = std::max(widest, std::min(segment.t, block_rows));
  }
  if (ends.empty()) return;
  constexpr bool paired = std::is_same_v<T, Bfloat16>;  // bfloat16: pairs of channels and of positions
  // Scratch for the widest block only; a row of weights has room for a pair's zero past its end.
  const int64_t padded = round_up(longest + 1, 16), most = widest * groups;
  at::parallel_for(0, ends.back(), 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> seen(widest * longest), counts(widest), prefixes(widest);
    std::vector<const int64_t*> seen_of(widest);
    std::vector<float> queries(paired ? 0 : most * dim), scores(most * padded), weights(most * padded), totals(most), acc(most * dim);
    std::vector<uint32_t> query_pairs(paired ? most * dim / 2 : 0);
    std::vector<Bfloat16> weights16(paired ? most * padded : 0), query16(paired ? dim : 0);
    for (int64_t item = first; item < last; ++item) {
      const size_t index = std::upper_bound(ends.begin(), ends.end(), item) - ends.begin();
      const AttentionSegment<T>& sg = segments[index];
      const int64_t local = item - (index ? ends[index - 1] : 0), blocks = blocks_of(sg.t);
      const int64_t kv = local / blocks, block = local % blocks;  // one key/value head's blocks in turn: its keys stay in cache
      const int64_t r0 = block * sg.t / blocks, rows = (block + 1) * sg.t / blocks - r0, count_heads = rows * groups;
      int64_t needed = 0, shared = longest;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = r0 + i;
        int64_t count = 0, prefix;
        if (sg.allowed) {
          int64_t* own = seen.data() + i * longest;
          for (int64_t j = 0; j < sg.length; ++j)
            if (sg.allowed[row * sg.length + j]) own[count++] = j;
          prefix = 0;  // own[j] == j up to here: copied, not gathered
          while (prefix < count && own[prefix] == prefix) ++prefix;
          seen_of[i] = own;
          needed = std::max(needed, count ? own[count - 1] + 1 : 0);
        } else {
          count = prefix = sg.start + row + 1;
          seen_of[i] = nullptr;
          needed = std::max(needed, count);
        }
        counts[i] = count;
        prefixes[i] = prefix;
        shared = std::min(shared, prefix);
        for (int64_t g = 0; g < groups; ++g) {
          const float* query = sg.q + (row * heads + kv * groups + g) * dim;
          if constexpr (paired) {
            to_cache(query, dim, query16.data());
            for (int64_t p = 0; p < dim / 2; ++p) std::memcpy(&query_pairs[p * most + i * groups + g], &query16[2 * p], 4);
          } else {
            for (int64_t d = 0; d < dim; ++d) queries[d * most + i * groups + g] = query[d];
          }
        }
      }
      if constexpr (paired) shared &= ~int64_t(1);  // the shared sum ends on a whole pair of positions
      const T* k = sg.keys_t + kv * sg.capacity * dim;
      const T* v = sg.values + kv * sg.capacity * dim;
      for (int64_t h = 0; h < count_heads; h += kScoreHeads)
        with_heads<kScoreHeads>(static_cast<int>(std::min<int64_t>(kScoreHeads, count_heads - h)), [&](auto n) {
#if defined(__AVX512BF16__)
          if constexpr (paired) {
            scores_bf16<decltype(n)::value>(query_pairs.data() + h, most, k, sg.capacity, dim, needed, scale, scores.data() + h * padded, padded);
            return;
          }
#endif
          if constexpr (!paired)
            scores_of<decltype(n)::value>(queries.data() + h, most, k, sg.capacity, dim, needed, scale, scores.data() + h * padded, padded);
        });
      for (int64_t h = 0; h < count_heads; ++h) {
        const int64_t i = h / groups;
        float* w = weights.data() + h * padded;
        const float* from = scores.data() + h * padded;
        std::memcpy(w, from, prefixes[i] * sizeof(float));
        for (int64_t j = prefixes[i]; j < counts[i]; ++j) w[j] = from[seen_of[i][j]];
        totals[h] = softmax_numerators(w, counts[i]);
        if constexpr (paired) {
          to_cache(w, counts[i], weights16.data() + h * padded);
          weights16[h * padded + counts[i]] = Bfloat16(0.f);
        }
      }
      std::fill(acc.begin(), acc.begin() + count_heads * dim, 0.f);
      const auto add_values = [&](int64_t h0, int64_t heads_here, const int64_t* own, int64_t j0, int64_t j1) {
        for (int64_t h = h0; h < h0 + heads_here; h += kValueHeads)
          with_heads<kValueHeads>(static_cast<int>(std::min<int64_t>(kValueHeads, h0 + heads_here - h)), [&](auto n) {
#if defined(__AVX512BF16__)
            if constexpr (paired) {
              accumulate_values_bf16<decltype(n)::value>(v, dim, own, j0, j1, weights16.data() + h * padded, padded, acc.data() + h * dim);
              return;
            }
#endif
            if constexpr (!paired)
              accumulate_values<decltype(n)::value>(v, dim, own, j0, j1, weights.data() + h * padded, padded, acc.data() + h * dim);
          });
      };
      add_values(0, count_heads, nullptr, 0, shared);
      for (int64_t i = 0; i < rows; ++i) add_values(i * groups, groups, seen_of[i], shared, counts[i]);
      for (int64_t h = 0; h < count_heads; ++h)
        divide(acc.data() + h * dim, totals[h], dim, sg.out + (r0 + h / groups) * heads * dim + (kv * groups + h % groups) * dim);
    }
  });
}

const bool* mask_rows(const c10::optional<torch::Tensor>& mask, int64_t t, int64_t length, torch::Tensor& holder) {
  if (!mask) return nullptr;
  holder = mask->to(torch::kBool).contiguous();
  TORCH_CHECK(holder.dim() == 2 && holder.size(0) == t && holder.size(1) == length, "mask must be [T, length]");
  return holder.data_ptr<bool>();
}

// One layer's cache, dense: values [KV, capacity, d]; keys [KV, d, capacity] (transposed),
// float32 or (capacity a multiple of 16) float16, or, where the kernels multiply bfloat16,
// keys [KV, d/2, capacity, 2] (pairs of channels) in bfloat16.
void check_cache(const torch::Tensor& keys, const torch::Tensor& values) {
  TORCH_CHECK(keys.dtype() == values.dtype() && keys.is_contiguous() && values.is_contiguous() && values.dim() == 3, "keys and values must be dense, of one dtype");
  const int64_t kv_heads = values.size(0), capacity = values.size(1), dim = values.size(2);
  if (keys.dtype() == torch::kBFloat16) {
    TORCH_CHECK(kBfloat16Cache, "these kernels were built for a CPU without bfloat16 dot products: use a float16 or float32 cache");
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == kv_heads && keys.size(1) * 2 == dim && keys.size(2) == capacity && keys.size(3) == 2,
                "bfloat16 keys must be [KV, d/2, capacity, 2] and values [KV, capacity, d]");
    return;
  }
  TORCH_CHECK(keys.dtype() == torch::kFloat32 || (keys.dtype() == torch::kHalf && capacity % 16 == 0),
              "the cache must be float32, float16 with a capacity that is a multiple of 16, or bfloat16");
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == kv_heads && keys.size(1) == dim && keys.size(2) == capacity,
              "keys must be [KV, d, capacity] and values [KV, capacity, d]");
}

// q [T, H, d]; keys [KV, d, capacity] and values [KV, capacity, d] holding `length` positions
// (the new tokens' at start .. start + T); mask [T, length] bool or none (causal). Returns [T, H * d].
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t length, int64_t start,
                        c10::optional<torch::Tensor> mask) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "attention takes float32 q [T, H, d]");
  check_cache(keys, values);
  TORCH_CHECK(keys.dtype() != torch::kHalf, "attention reads a float32 or bfloat16 cache");
  q = q.contiguous();
  const int64_t t = q.size(0), heads = q.size(1), dim = q.size(2);
  auto out = torch::empty({t, heads * dim}, torch::kFloat32);
  torch::Tensor holder;
  const auto run = [&](auto element) {
    using T = decltype(element);
    attend<T>({{q.data_ptr<float>(), t, keys.data_ptr<T>(), values.data_ptr<T>(), values.size(1), length, start,
                mask_rows(mask, t, length, holder), out.data_ptr<float>()}},
              heads, dim, values.size(0));
  };
  if (keys.dtype() == torch::kBFloat16) {
    run(Bfloat16());
  } else {
    run(float());
  }
  return out;
}

// out = weight * (x / sqrt(mean(x^2) + eps)), one row; the squares summed in a fixed order.
void rms_norm(const float* x, const float* weight, float eps, int64_t h, float* out) {
  float squares = 0.f;
#if defined(__AVX512F__)
  if (h % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    squares = _mm512_reduce_add_ps(acc);
  } else
#endif
    for (int64_t i = 0; i < h; ++i) squares = squares + x[i] * x[i];
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = weight[i] * (x[i] * inverse);
}

// x * cos + rotate_half(x) * sin for one head's row, as transformers' apply_rotary_pos_emb:
// element i is x[i] * cos[i] + r[i] * sin[i], two products and a sum, in any vector width.
void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (; i + 16 <= half; i += 16) {
    const __m512 low = _mm512_loadu_ps(x + i), high = _mm512_loadu_ps(x + half + i);
    _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_mul_ps(low, _mm512_loadu_ps(cos + i)), _mm512_mul_ps(_mm512_xor_ps(high, sign), _mm512_loadu_ps(sin + i))));
    _mm512_storeu_ps(x + half + i, _mm512_add_ps(_mm512_mul_ps(high, _mm512_loadu_ps(cos + half + i)), _mm512_mul_ps(low, _mm512_loadu_ps(sin + half + i))));
  }
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= half; i += 8) {
    const __m256 low = _mm256_loadu_ps(x + i), high = _mm256_loadu_ps(x + half + i);
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_mul_ps(low, _mm256_loadu_ps(cos + i)), _mm256_mul_ps(_mm256_xor_ps(high, sign), _mm256_loadu_ps(sin + i))));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(high, _mm256_loadu_ps(cos + half + i)), _mm256_mul_ps(low, _mm256_loadu_ps(sin + half + i))));
  }
#endif
  for (; i < half; ++i) {
    const float low = x[i], high = x[half + i];
    x[i] = low * cos[i] + (-high) * sin[i];
    x[half + i] = high * cos[half + i] + low * sin[half + i];
  }
}

// silu(gate) * (up + delta) = gate / (1 + exp(-gate)) * (up + delta), elementwise.
void swiglu(const float* gate, const float* up, const float* delta, int64_t n, float* out) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 inside = lanes_of(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(inside, gate + i);
    __m512 u = _mm512_maskz_loadu_ps(inside, up + i);
    if (delta) u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(inside, delta + i));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_mask_storeu_ps(out + i, inside, _mm512_mul_ps(silu, u));
  }
#elif defined(__AVX2__)
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i inside = lanes_of(n - i);
    const __m256 g = _mm256_maskload_ps(gate + i, inside);
    __m256 u = _mm256_maskload_ps(up + i, inside);
    if (delta) u = _mm256_add_ps(u, _mm256_maskload_ps(delta + i, inside));
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_maskstore_ps(out + i, inside, _mm256_mul_ps(silu, u));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float u = delta ? up[i] + delta[i] : up[i];
    out[i] = gate[i] / (1.f + std::exp(-gate[i])) * u;
  }
#endif
}

// Rows rotated and written to the caches per thread: one row is ~0.3 us of work, so a region
// (a few us) pays only for several.
constexpr int64_t kRotaryGrain = 8;

// The attention block of native_decoder_layer after q|k|v (`projected`, rows `width` wide): rotary on
// q and k, k and v written to each segment's cache, then every segment's attention into `attended`.
template <typename T>
void rotate_store_attend(float* projected, int64_t width, const torch::Tensor& cos, const torch::Tensor& sin,
                         const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                         const std::vector<int64_t>& counts, const std::vector<torch::Tensor>& masks, int64_t heads, float* q, float* attended) {
  const int64_t kv_heads = values[0].size(0), dim = values[0].size(2), segments = keys.size();
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  std::vector<int64_t> firsts(segments + 1, 0);  // segment i's rows are [firsts[i], firsts[i + 1])
  for (int64_t i = 0; i < segments; ++i) firsts[i + 1] = firsts[i] + counts[i];
  const int64_t t = firsts[segments];
  // Each row's keys in the cache's type, [t][kv_size], before they go to the transposed cache.
  thread_local std::vector<T> converted_keys;
  T* converted = at_least(converted_keys, t * kv_size);
  at::parallel_for(0, t, kRotaryGrain, [&](int64_t first_row, int64_t last_row) {
    for (int64_t r = first_row, i = std::upper_bound(firsts.begin(), firsts.end(), first_row) - firsts.begin() - 1; r < last_row; ++r) {
      while (r >= firsts[i + 1]) ++i;
      float* row = projected + r * width;
      const float* c = cos.data_ptr<float>() + r * dim;
      const float* sn = sin.data_ptr<float>() + r * dim;
      for (int64_t head = 0; head < heads; ++head) {
        rotate(row + head * dim, c, sn, dim);
        std::memcpy(q + (r * heads + head) * dim, row + head * dim, dim * sizeof(float));
      }
      const int64_t capacity = values[i].size(1), position = starts[i] + r - firsts[i];
      T* vp = values[i].data_ptr<T>();
      for (int64_t head = 0; head < kv_heads; ++head) {
        float* key = row + q_size + head * dim;
        rotate(key, c, sn, dim);
        to_cache(key, dim, converted + r * kv_size + head * dim);
        to_cache(row + q_size + kv_size + head * dim, dim, vp + (head * capacity + position) * dim);
      }
    }
  });
  std::vector<AttentionSegment<T>> attention;
  std::vector<torch::Tensor> mask_holders(segments);
  for (int64_t i = 0; i < segments; ++i) {
    T* kp = keys[i].data_ptr<T>();
    T* vp = values[i].data_ptr<T>();
    const int64_t capacity = values[i].size(1), start = starts[i], length = start + counts[i];
    // Keys are [kv_heads][d][capacity] (bfloat16: [kv_heads][d/2][capacity][2]): one (head,
    // channel or pair) row at a time, the new positions side by side (row by row, each key
    // touched dim lines of the cache, each a miss).
    constexpr int64_t kWidth = std::is_same_v<T, Bfloat16> ? 2 : 1;  // channels a position holds in one row
    for (int64_t hd = 0; hd < kv_size / kWidth; ++hd)
      for (int64_t r = firsts[i]; r < firsts[i + 1]; ++r)
        std::memcpy(kp + (hd * capacity + start + r - firsts[i]) * kWidth, converted + r * kv_size + hd * kWidth, kWidth * sizeof(T));
    const c10::optional<torch::Tensor> mask = masks[i].numel() ? c10::optional<torch::Tensor>(masks[i]) : c10::nullopt;
    attention.push_back({q + firsts[i] * q_size, counts[i], kp, vp, capacity, length, start,
                         mask_rows(mask, counts[i], length, mask_holders[i]), attended + firsts[i] * q_size});
  }
  attend(attention, heads, dim, kv_heads);
}

// A decoder layer's weights as native_decoder_layer reads them, converted from Python once: a call
// then passes one object instead of 22 tensors (converting them took ~15 us a layer, ~0.5 ms of
// a one-token step). `weights`: norm_in, then qkv's (packed, sums, scale, bias, smoothing), o's,
// norm_post, gate_up's, down's; `widths`: the four layers' output widths.
struct LayerWeights {
  std::vector<torch::Tensor> weights;
  std::vector<int64_t> widths;
  double eps;

  LayerWeights(std::vector<torch::Tensor> weights_, std::vector<int64_t> widths_, double eps_)
      : weights(std::move(weights_)), widths(std::move(widths_)), eps(eps_) {
    TORCH_CHECK(weights.size() == 22 && widths.size() == 4, "a layer has 22 weight tensors and 4 widths");
  }
};

// The largest buffer native_decoder_layer keeps between calls: 4 MB of floats (a pass of ~340 rows
// of the default verifier; trees and batched steps stay far below).
constexpr size_t kKeptElements = size_t(1) << 20;

// One Llama-family decoder layer with int8, block or K-quant linears over T new tokens x [T, hidden]:
//   x += o(attention(rotary(q, k), v)) with q|k|v = qkv(norm_in(x)), k and v written to the cache;
//   x += down(silu(gate) * (up + delta)) with gate|up = gate_up(norm_post(x)),
// the weights those of `layer`. The rows are segments, one per
// sequence: segment i is counts[i] rows after starts[i] positions of its own cache (keys[i],
// values[i]), attending under masks[i] ([counts[i], starts[i] + counts[i]] bool; empty = causal).
// Every row's result depends on that row and its own cache alone, so sequences batched
// together get exactly what each gets alone. Returns the new x.
// A linear of a GGUF file's layer, each tensor in its own format: blocks (q4_0, q4_1, q8_0, and
// Q5_0 held as 8-bit blocks) or K-quants (Q4_K, Q6_K); a layer may mix them (a Q5_0 q|k|v beside a
// Q6_K down).
struct GgufLayer {
  std::variant<BlockLayer, KQuantLayer> layer;

  template <typename MakeRow>
  void quantize(int64_t rows, int64_t k, MakeRow make_row, std::vector<uint8_t>& xq, std::vector<float>& scales) const {
    std::visit([&](const auto& linear) { linear.quantize(rows, k, make_row, xq, scales); }, layer);
  }

  void multiply(const std::vector<uint8_t>& xq, const std::vector<float>& scales, int64_t rows, float* out) const {
    std::visit([&](const auto& linear) { linear.multiply(xq, scales, rows, out); }, layer);
  }
};

// A linear layer of a LayerWeights: its five tensors from index i (Int8Layer: packed, sums,
// scale, bias, smoothing; BlockLayer: packed [groups, blocks, bytes], bias, then three unused;
// KQuantLayer: packed (flat), groups, bias, then two unused).
template <typename Layer>
Layer layer_linear(const std::vector<torch::Tensor>& weights, int i, int64_t width) {
  if constexpr (std::is_same_v<Layer, GgufLayer>) {
    if (weights[i].dim() == 1) return GgufLayer{KQuantLayer(weights[i], weights[i + 1], weights[i + 2], width)};
    return GgufLayer{BlockLayer(weights[i], weights[i + 1], width)};
  } else {
    return Int8Layer(weights[i], weights[i + 1], weights[i + 2], weights[i + 3], weights[i + 4], width);
  }
}

template <typename Layer>
torch::Tensor decoder_layer(torch::Tensor x, const LayerWeights& layer, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> starts,
                            std::vector<int64_t> counts, std::vector<torch::Tensor> masks, int64_t heads, c10::optional<torch::Tensor> delta) {
  const std::vector<torch::Tensor>& weights = layer.weights;
  const std::vector<int64_t>& widths = layer.widths;
  const double eps = layer.eps;
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "bad layer arguments");
  const size_t segments = keys.size();
  TORCH_CHECK(segments > 0 && values.size() == segments && starts.size() == segments && counts.size() == segments &&
                  masks.size() == segments, "one cache, start, count and mask per segment");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t t = x.size(0), hidden = x.size(1), kv_heads = values[0].size(0), dim = values[0].size(2);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(dim <= 512 && widths[0] == q_size + 2 * kv_size, "layer shapes do not match the cache");
  int64_t rows_total = 0;
  for (size_t i = 0; i < segments; ++i) {
    check_cache(keys[i], values[i]);
    TORCH_CHECK(keys[i].dtype() == keys[0].dtype(), "the segments' caches must share one dtype");
    TORCH_CHECK(values[i].size(0) == kv_heads && values[i].size(2) == dim && starts[i] + counts[i] <= values[i].size(1),
                "a segment's cache does not fit the layer or its tokens");
    rows_total += counts[i];
  }
  TORCH_CHECK(rows_total == t, "the segments' counts must add up to the rows of x");
  const Layer qkv = layer_linear<Layer>(weights, 1, widths[0]), o = layer_linear<Layer>(weights, 6, widths[1]),
              gate_up = layer_linear<Layer>(weights, 12, widths[2]), down = layer_linear<Layer>(weights, 17, widths[3]);
  const float* norm_in = weights[0].data_ptr<float>();
  const float* norm_post = weights[11].data_ptr<float>();
  const int64_t inner = widths[2] / 2;
  const float* up_delta = nullptr;
  torch::Tensor delta_rows;
  if (delta) {
    delta_rows = delta->to(torch::kFloat32).contiguous();
    TORCH_CHECK(delta_rows.numel() == inner, "delta must have one value per intermediate channel");
    up_delta = delta_rows.data_ptr<float>();
  }

  auto out = x.clone();
  float* h = out.data_ptr<float>();
  // Buffers kept between calls by each calling thread: zeroing fresh ones took ~0.5 ms of a
  // 17-token pass. Every element is written before it is read. A long prompt's are let go at
  // the end (kKeptElements), so a served process does not hold them for good.
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> row_scale, projected_rows, attended_rows, q_rows, mlp_rows;
  float* projected = at_least(projected_rows, t * std::max(widths[0], widths[2]));
  float* attended = at_least(attended_rows, t * q_size);
  float* q = at_least(q_rows, t * q_size);
  float* mlp = at_least(mlp_rows, t * hidden);
  const float epsilon = static_cast<float>(eps);

  qkv.quantize(t, hidden, [&](int64_t r, float* row) { rms_norm(h + r * hidden, norm_in, epsilon, hidden, row); }, xq, row_scale);
  qkv.multiply(xq, row_scale, t, projected);
  if (keys[0].dtype() == torch::kBFloat16) {
    rotate_store_attend<Bfloat16>(projected, widths[0], cos, sin, keys, values, starts, counts, masks, heads, q, attended);
  } else if (keys[0].dtype() == torch::kHalf) {
    rotate_store_attend<c10::Half>(projected, widths[0], cos, sin, keys, values, starts, counts, masks, heads, q, attended);
  } else {
    rotate_store_attend<float>(projected, widths[0], cos, sin, keys, values, starts, counts, masks, heads, q, attended);
  }
  o.quantize(t, q_size, [&](int64_t r, float* row) { std::memcpy(row, attended + r * q_size, q_size * sizeof(float)); }, xq, row_scale);
  o.multiply(xq, row_scale, t, projected);

  // x += o(...), then the MLP's input: its norm, quantized; one pass over each row.
  gate_up.quantize(t, hidden, [&](int64_t r, float* row) {
    float* hr = h + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) hr[i] = hr[i] + projected[r * hidden + i];
    rms_norm(hr, norm_post, epsilon, hidden, row);
  }, xq, row_scale);
  gate_up.multiply(xq, row_scale, t, projected);
  down.quantize(t, inner, [&](int64_t r, float* row) {
    const float* gu = projected + r * widths[2];
    swiglu(gu, gu + inner, up_delta, inner, row);
  }, xq, row_scale);
  down.multiply(xq, row_scale, t, mlp);
  for (int64_t i = 0; i < t * hidden; ++i) h[i] = h[i] + mlp[i];
  for (std::vector<float>* kept : {&projected_rows, &attended_rows, &q_rows, &mlp_rows})
    if (kept->size() > kKeptElements) std::vector<float>().swap(*kept);
  if (xq.size() > kKeptElements) std::vector<uint8_t>().swap(xq);
  return out;
}

// One Llama-family decoder layer with int8 linears, or with block and K-quant ones in any mix
// (decoder_layer), by the layer's packed weights: int8 for int8, uint8 for the others.
torch::Tensor native_decoder_layer(torch::Tensor x, const LayerWeights& layer, torch::Tensor cos, torch::Tensor sin,
                                   std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> starts,
                                   std::vector<int64_t> counts, std::vector<torch::Tensor> masks, int64_t heads,
                                   c10::optional<torch::Tensor> delta) {
  const auto run = layer.weights[1].dtype() != torch::kUInt8 ? &decoder_layer<Int8Layer> : &decoder_layer<GgufLayer>;
  return run(x, layer, cos, sin, keys, values, starts, counts, masks, heads, delta);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack_weight", &pack_weight);
  // The dtype of the caches the native layers read fastest on this CPU.
  module.def("cache_dtype", [] { return std::string(kBfloat16Cache ? "bfloat16" : "float16"); });
  module.def("weight_sums", &weight_sums);
  // The passes run without Python's lock: a service's gRPC threads take requests and send
  // replies while its compute thread is inside a layer, instead of waiting for the
  // interpreter's switch interval (5 ms) to win the lock from it.
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  module.def("int8_linear", &int8_linear, unlocked);
  module.def("attention", &attention, unlocked);
  py::class_<LayerWeights>(module, "LayerWeights").def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, double>());
  module.def("block_linear", &block_linear, unlocked);
  module.def("kquant_linear", &kquant_linear, unlocked);
  module.def("native_decoder_layer", &native_decoder_layer, unlocked);
  // Whether the int8 and K-quant layers multiply through AMX's tiles (emulated in a
  // SPECDEC_EMULATE_AMX build); `enabled` switches them on or off where they exist.
  module.def("tiles", [](c10::optional<bool> enabled) {
#if defined(SPECDEC_AMX)
    if (enabled) use_tiles = *enabled;
    return use_tiles && tiles::available();
#else
    return false;
#endif
  }, py::arg("enabled") = py::none());
}
