// Attention over a session's KV cache, a draft tree's masks included.
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

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

}  // namespace
