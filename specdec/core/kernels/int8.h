// int8 weights: per-channel scales, activations per row (Int8Linear).
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

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
  // Each weight stream's tiles asked for into L1 this many chunks ahead: left to the hardware's
  // prefetchers the tile loads waited on memory (the 1.5B, 17 rows 0.80x, 9 rows 0.87x; 8 chunks
  // ahead or into L2 gained less). Beside it the next set's tiles go into L2 a set ahead (17 rows
  // 0.94x again; either alone gains less, and L2 16 chunks ahead instead lost 4%).
  static constexpr int64_t kTilesAhead = 4;

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
    constexpr int64_t kTileBytes = kChunk * kBlock * 4;  // one block's B tile: a chunk of 64 inputs x 16 channels
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
          // each of the set's blocks' tile from `tile` on, asked for into the cache __builtin_prefetch's locality names
          const auto ask_for = [&](const int8_t* tile, auto locality) {
            for (int b = 0; b < count; ++b)
              for (int64_t line = 0; line < kTileBytes; line += 64) __builtin_prefetch(tile + b * block_stride + line, 0, decltype(locality)::value);
          };
          for (int64_t c = 0; c < chunks; ++c) {
            const int8_t* wc = w + c * kTileBytes;
            if (c + kTilesAhead < chunks) ask_for(wc + kTilesAhead * kTileBytes, std::integral_constant<int, 3>{});  // L1
            // the next set's tiles, into L2, while its first row group streams this one's
            if (r0 == 0 && set + 1 < last) ask_for(wc + kSet * block_stride, std::integral_constant<int, 2>{});
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

torch::Tensor int8_linear(torch::Tensor x, c10::optional<torch::Tensor> smoothing, torch::Tensor packed,
                          torch::Tensor sums, torch::Tensor w_scale, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8_linear takes float32 [M, K]");
  return apply_layer(Int8Layer(packed, sums, w_scale, bias.value_or(torch::Tensor()), smoothing.value_or(torch::Tensor()), n), x, n);
}

}  // namespace
