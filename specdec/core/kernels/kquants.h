// GGUF's K-quants: Q4_K and Q6_K (KQuantLinear).
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

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
// holds one accumulator at a time (ia, then ib) beside a sub-block's unpacked steps; past ~11
// rows the 32 registers spill (on a Zen 4 a 16-row pass ran faster as two passes of 8).
#if defined(__AVX512VNNI__)
constexpr int kKRows = 12;
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
// The eighth of a K-quant super-block's lines that goes with sub-block j, asked for into L2
// (Locality 2: prefetcht1; 3, prefetcht0, for L1). All asked at once, they queued behind each
// other: a step and a 9-row pass cost 8-12% more.
template <int64_t Bytes, int Locality = 2>
inline void prefetch_part(const uint8_t* super_block, int j) {
  constexpr int kLines = Bytes / 64;
  for (int line = j * kLines / 8; line < (j == 7 ? kLines : (j + 1) * kLines / 8); ++line)
    __builtin_prefetch(super_block + 64 * line, 0, Locality);
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
// Never inlined: inlined into a caller, each row count's code moved with every other (17 rows,
// passes of 8 and 9, were 1.04-1.06x slower when the largest count changed).
template <int Format, int R>
__attribute__((noinline)) void kquant_rows(const int8_t* x, int64_t k, const float* xs, const int16_t* sums16, const uint8_t* w, int64_t supers, float* out) {
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
      // and, in a one-row pass, the super-block 4 ahead into L1 (on a Zen 4 a step 0.92-0.97x
      // over seven A/Bs; from 2 rows it gained nothing)
      if constexpr (R == 1) prefetch_part<kBytes, 3>(wb + 4 * kBytes, j);
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

}  // namespace
