// GGUF's block formats: Q4_0, Q4_1 (4-bit blocks), Q5_0 (5-bit) and Q8_0 (8-bit) (BlockLinear).
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

// Block weights as GGUF's Q4_0, Q4_1 and Q8_0 hold them: along K, blocks of 32 weights
// w = d q + m with one float16 d and m per block and channel; q in [0, 15] (4 bits), [0, 31]
// (5 bits; Q5_0: m = -16 d) or [0, 255] (8 bits; Q8_0's signed q is q - 128, so m = -128 d;
// Q4_0: m = -8 d).
// Activations enter as int8 in blocks of 32 too, each block of a row with its own scale s, so
//   sum_k x w = sum over blocks of (sum q xq) (d s) + m (s sum xq),
// the integer sums exact and the float sum over a row's blocks taken in block order: a row's
// result depends on that row alone.
constexpr int64_t kQBlock = 32;  // weights per block along K
// One block of 16 channels, one stream: their 512 weights (4 bits: 256 bytes of nibbles; 5 bits:
// those nibbles and 64 bytes of fifth bits, a 64-bit mask per step; 8 bits: 512 bytes), then
// their 16 d and 16 m in float16.
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
    if constexpr (Bits != 8) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = _mm512_loadu_si512(wb + i * 64);
        steps[i] = _mm512_and_si512(packed, low_nibbles);
        steps[i + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
      if constexpr (Bits == 5) {
        const __m512i sixteen = _mm512_set1_epi8(16);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          uint64_t fifths;
          std::memcpy(&fifths, wb + 256 + 8 * i, 8);
          steps[i] = _mm512_mask_add_epi8(steps[i], static_cast<__mmask64>(fifths), steps[i], sixteen);
        }
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
  // a step half's 32 fifth bits to bytes: byte t takes bit t % 8 of the mask's byte t / 8
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit_of = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL)), sixteen = _mm256_set1_epi8(16);
  const auto fifths_of = [&](const uint8_t* wb, int i, int h) {
    int32_t mask;
    std::memcpy(&mask, wb + 256 + 8 * i + 4 * h, 4);
    const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(mask), spread), bit_of);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bits, bit_of), sixteen);
  };
  constexpr int64_t kBytes = block_bytes(Bits);
  for (int64_t b = 0; b < k_blocks; ++b) {
    const uint8_t* wb = w + b * kBytes;
    const c10::Half* d = reinterpret_cast<const c10::Half*>(wb + weight_bytes(Bits));
    const c10::Half* m = d + kBlock;
    for (int line = 0; line < kBytes / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kBytes + 64 * line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i steps[8], signs[8];
      if constexpr (Bits != 8) {
        for (int i = 0; i < 4; ++i) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
          steps[i] = _mm256_and_si256(packed, low_nibbles);
          steps[i + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        }
        if constexpr (Bits == 5)
          for (int i = 0; i < 8; ++i) steps[i] = _mm256_or_si256(steps[i], fifths_of(wb, i, h));
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
            if constexpr (Bits != 8) {
              const uint8_t byte = w[b * block_bytes(Bits) + (i % 4) * 64 + c * 4 + j];
              q = i < 4 ? (byte & 0x0F) : (byte >> 4);
              if constexpr (Bits == 5) q |= ((w[b * block_bytes(Bits) + 256 + i * 8 + (c * 4 + j) / 8] >> ((c * 4 + j) % 8)) & 1) << 4;
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
// weights, then 16 d and 16 m in float16; 4, 5 or 8 bits a weight, by the block's size) and an
// optional bias. The same calls as Int8Layer: quantize the rows, then multiply (xq holds the
// int8 rows, scales each row's block scales).
struct BlockLayer {
  const uint8_t* packed;
  const float* bias;
  int64_t blocks, k_blocks, n;
  int bits;

  BlockLayer(const torch::Tensor& packed_, const torch::Tensor& bias_, int64_t n_)
      : packed(packed_.data_ptr<uint8_t>()), bias(bias_.defined() && bias_.numel() ? bias_.data_ptr<float>() : nullptr),
        blocks(packed_.size(0)), k_blocks(packed_.size(1)), n(n_), bits(bits_of(packed_)) {
    TORCH_CHECK(packed_.dtype() == torch::kUInt8 && packed_.dim() == 3 && bits > 0, "bad packed block weights");
  }

  static int bits_of(const torch::Tensor& packed) {
    const int64_t bytes = packed.dim() == 3 ? packed.size(2) : 0;
    return bytes == block_bytes(4) ? 4 : bytes == block_bytes(5) ? 5 : bytes == block_bytes(8) ? 8 : 0;
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
    if (bits == 5) return multiply_bits<5>(xq, scales, rows, out);
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

}  // namespace
