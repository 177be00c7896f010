// One Llama-family decoder layer: norms, rotary, the four linears, SwiGLU, attention.
// A part of engine_cpu.cpp's one translation unit, included there in order.
#pragma once

namespace {

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
// A linear of a GGUF file's layer, each tensor in its own format: blocks (Q4_0, Q4_1, Q5_0, Q8_0)
// or K-quants (Q4_K, Q6_K); a layer may mix them (a Q5_0 q|k|v beside a Q6_K down).
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
