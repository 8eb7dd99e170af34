// runlm kernels: attention, RMSNorm and the float32 path's decode step.
// A part of kernels.cpp's one translation unit, included in order.
// out[t] = q . keys[t] for n keys given by row pointers (D % 8 == 0; the decode attention of the float32 path and
// the fused blocks both score keys here; T: the cache's element type): lane l of key t's accumulator sums
// q[i + l] * k[i + l] by FMA over i = 0, 8, ..., and the lanes meet in tree8's order, for a key in a group of 8
// (AVX2) and for a key on its own alike, so a key's score never depends on which keys share the call.
template <typename T>
inline void score_rows(const float* q, const T* const* keys, int64_t n, int64_t D, float* out) {
  int64_t t = 0;
#if RUNLM_AVX2
  for (; t + 8 <= n; t += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, kv_load8(keys[t + j], i), acc[j]);
    }
    _mm256_storeu_ps(out + t, tree8_x8(acc));
  }
#endif
  for (; t < n; ++t) {
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < D; i += 8)
      for (int l = 0; l < 8; ++l) lanes[l] = std::fma(q[i + l], kv_elem(keys[t], i + l), lanes[l]);
    out[t] = tree8(lanes);
  }
}

// out[0..D) = sum_t w[t] * values[t] for n value rows given by pointers: every output element is one FMA chain
// over t in order (vector lanes and the scalar tail alike).
template <typename T>
inline void weighted_rows(const float* w, const T* const* values, int64_t n, int64_t D, float* out) {
  int64_t i = 0;
#if RUNLM_AVX2
  for (; i + 64 <= D; i += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 wt = _mm256_set1_ps(w[t]);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(wt, kv_load8(values[t], i + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + i + 8 * j, acc[j]);
  }
  for (; i + 8 <= D; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), kv_load8(values[t], i), acc);
    _mm256_storeu_ps(out + i, acc);
  }
#endif
  for (; i < D; ++i) {
    float acc = 0.f;
    for (int64_t t = 0; t < n; ++t) acc = std::fma(w[t], kv_elem(values[t], i), acc);
    out[i] = acc;
  }
}

#if RUNLM_AVX2
// score_rows for H query heads (q, D floats apart; scores `stride` apart) that share their keys (grouped-query
// attention): each key is loaded (and widened to float32) once for the H heads. Every score is the same FMA
// chain per lane and the same tree8 order as score_rows gives it, so the results are bit for bit score_rows'.
template <int H, typename T>
inline void score_rows_shared(const float* q, const T* const* keys, int64_t n, int64_t D, float* out,
                              int64_t stride) {
  int64_t t = 0;
#if RUNLM_AVX512
  // Two keys per 512-bit register (8 lanes each, every lane the chain it has below): half the loads, widenings
  // and FMAs per score.
  for (; t + 8 <= n; t += 8) {
    __m512 acc[H][4];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m512 k[4];
      for (int j = 0; j < 4; ++j) k[j] = kv_load8x2(keys[t + 2 * j], keys[t + 2 * j + 1], i);
      for (int h = 0; h < H; ++h) {
        const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + h * D + i));
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(qv, k[j], acc[h][j]);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm256_storeu_ps(out + h * stride + t, pair_scores(acc[h]));
    }
  }
#endif
  for (; t + 4 <= n; t += 4) {
    __m256 acc[H][4];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m256 k[4];
      for (int j = 0; j < 4; ++j) k[j] = kv_load8(keys[t + j], i);
      for (int h = 0; h < H; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + i);
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_fmadd_ps(qv, k[j], acc[h][j]);
      }
    }
    for (int h = 0; h < H; ++h) {  // [(l0+l1)+(l2+l3) of keys 0..3 | (l4+l5)+(l6+l7) of keys 0..3], halves added
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
      _mm_storeu_ps(out + h * stride + t, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
    }
  }
  for (int h = 0; h < H; ++h) score_rows(q + h * D, keys + t, n - t, D, out + h * stride + t);
}

// weighted_rows for H heads (weights `stride` apart, outputs D apart; D % 16 == 0) sharing their values: each
// value row is loaded once for the H heads; every output element is the same FMA chain over t as weighted_rows
// makes it.
#if RUNLM_AVX512
// Outputs i .. i + 16 S of H heads in one pass over the value rows (S 512-bit accumulators per head).
template <int H, int S, typename T>
inline void weighted_slices(const float* w, int64_t stride, const T* const* values, int64_t n, int64_t D, int64_t i,
                            float* out) {
  __m512 acc[H][S];
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < S; ++s) acc[h][s] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[S];
    for (int s = 0; s < S; ++s) v[s] = kv_load16(values[t], i + 16 * s);
    for (int h = 0; h < H; ++h) {
      const __m512 wt = _mm512_set1_ps(w[h * stride + t]);
      for (int s = 0; s < S; ++s) acc[h][s] = _mm512_fmadd_ps(wt, v[s], acc[h][s]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + h * D + i + 16 * s, acc[h][s]);
}
#endif

template <int H, typename T>
inline void weighted_rows_shared(const float* w, int64_t stride, const T* const* values, int64_t n, int64_t D,
                                 float* out) {
#if RUNLM_AVX512
  int64_t i = 0;
  for (; i + 64 <= D; i += 64) weighted_slices<H, 4>(w, stride, values, n, D, i, out);
  if (D - i == 48) weighted_slices<H, 3>(w, stride, values, n, D, i, out);
  if (D - i == 32) weighted_slices<H, 2>(w, stride, values, n, D, i, out);
  if (D - i == 16) weighted_slices<H, 1>(w, stride, values, n, D, i, out);
#else
  for (int64_t i = 0; i < D; i += 16) {
    __m256 acc[H][2];
    for (int h = 0; h < H; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = kv_load8(values[t], i), v1 = kv_load8(values[t], i + 8);
      for (int h = 0; h < H; ++h) {
        const __m256 wt = _mm256_set1_ps(w[h * stride + t]);
        acc[h][0] = _mm256_fmadd_ps(wt, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(wt, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm256_storeu_ps(out + h * D + i, acc[h][0]);
      _mm256_storeu_ps(out + h * D + i + 8, acc[h][1]);
    }
  }
#endif
}

// Heads h0 .. h0 + H of a chunk: scores, then each head's max and exp-sum, then the weighted values.
template <int H, typename T>
inline void attend_heads(const float* q, const T* const* keys, const T* const* values, int64_t n, int64_t D,
                         float* scores, int64_t stride, float* part_max, float* part_sum, float* part_out,
                         float softcap) {
  score_rows_shared<H>(q, keys, n, D, scores, stride);
  for (int h = 0; h < H; ++h) {
    float* sr = scores + h * stride;
    cap_scores(sr, n, softcap);
    part_max[h] = max_of(sr, n);
    part_sum[h] = exp_shift_sum(sr, n, part_max[h]);
  }
  weighted_rows_shared<H>(scores, stride, values, n, D, part_out);
}
#endif

// Softmax attention of `rep` query heads (q, D floats apart) over one chunk of n keys / values given by row
// pointers: per head, the chunk's max score, its exp-sum and the unnormalized weighted values (merged later by
// merge_chunks). `scores` is scratch for rep * n floats (stride `stride`). With AVX2 (and D % 16 == 0) the heads
// go up to 4 at a time over each key and value row loaded once (the same numbers as one head at a time).
template <typename T>
inline void attend_chunk(const float* q, int64_t rep, const T* const* keys, const T* const* values, int64_t n,
                         int64_t D, float* scores, int64_t stride, float* part_max, float* part_sum, float* part_out,
                         float softcap = 0.f) {
  int64_t j = 0;
#if RUNLM_AVX2
  for (; D % 16 == 0 && rep - j >= 2; j += std::min<int64_t>(4, rep - j)) {
    const int64_t heads = std::min<int64_t>(4, rep - j);
    const float* qj = q + j * D;
    float *sj = scores + j * stride, *mj = part_max + j, *zj = part_sum + j, *oj = part_out + j * D;
    if (heads == 4) attend_heads<4>(qj, keys, values, n, D, sj, stride, mj, zj, oj, softcap);
    else if (heads == 3) attend_heads<3>(qj, keys, values, n, D, sj, stride, mj, zj, oj, softcap);
    else attend_heads<2>(qj, keys, values, n, D, sj, stride, mj, zj, oj, softcap);
  }
#endif
  for (; j < rep; ++j) {
    float* sr = scores + j * stride;
    score_rows(q + j * D, keys, n, D, sr);
    cap_scores(sr, n, softcap);
    const float best = max_of(sr, n);
    part_max[j] = best;
    part_sum[j] = exp_shift_sum(sr, n, best);
    weighted_rows(sr, values, n, D, part_out + j * D);
  }
}

#if RUNLM_AVX512
// n keys widened to float32 in pairs, as kv_load8x2 lays two keys side by side: pair p's 8-value step s at
// (p * D / 8 + s) * 16, key 2p in the low half. Padded with zero keys to a multiple of 8 (their scores unused).
template <typename T>
inline void widen_key_pairs(const T* const* keys, int64_t n, int64_t D, float* out) {
  const int64_t steps = D / 8;
  for (int64_t t = 0; t < (n + 7) / 8 * 8; ++t)
    for (int64_t s = 0; s < steps; ++s)
      _mm256_storeu_ps(out + ((t / 2) * steps + s) * 16 + (t % 2) * 8,
                       t < n ? kv_load8(keys[t], 8 * s) : _mm256_setzero_ps());
}

// Scores of H query vectors (q, D floats apart) against the 8 keys of 4 widened pairs: out[h * stride + j], each
// with score_rows' chains and tree8 order (so the same bits as any other route gives that key).
template <int H>
inline void score_pair_tile(const float* q, const float* pairs, int64_t D, float* out, int64_t stride) {
  const int64_t steps = D / 8;
  __m512 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m512 k[4];
    for (int j = 0; j < 4; ++j) k[j] = _mm512_loadu_ps(pairs + (j * steps + s) * 16);
    for (int h = 0; h < H; ++h) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + h * D + 8 * s));
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(qv, k[j], acc[h][j]);
    }
  }
  for (int h = 0; h < H; ++h) {
    _mm256_storeu_ps(out + h * stride, pair_scores(acc[h]));
  }
}

// attend_chunk's partial results for m query vectors (qs, D apart; D % 16 == 0) that see the same n keys, from
// those keys widened in pairs and their values widened to float32: query vectors of several prompt rows go 4 at a
// time over each key and value loaded once. scores: scratch of m rows, `stride` >= n rounded up to 8, apart.
inline void attend_gathered(const float* qs, int64_t m, const float* key_pairs, const float* const* values, int64_t n,
                            int64_t D, float* scores, int64_t stride, float* part_max, float* part_sum,
                            float* part_out, float softcap) {
  for (int64_t v = 0; v < m; v += 4) {
    const int64_t heads = std::min<int64_t>(4, m - v);
    for (int64_t t = 0; t < n; t += 8) {
      const float* pairs = key_pairs + t * D;
      float* out = scores + v * stride + t;
      if (heads == 4) score_pair_tile<4>(qs + v * D, pairs, D, out, stride);
      else if (heads == 3) score_pair_tile<3>(qs + v * D, pairs, D, out, stride);
      else if (heads == 2) score_pair_tile<2>(qs + v * D, pairs, D, out, stride);
      else score_pair_tile<1>(qs + v * D, pairs, D, out, stride);
    }
  }
  for (int64_t v = 0; v < m; ++v) {
    float* sr = scores + v * stride;
    cap_scores(sr, n, softcap);
    part_max[v] = max_of(sr, n);
    part_sum[v] = exp_shift_sum(sr, n, part_max[v]);
  }
  for (int64_t v = 0; v < m; v += 4) {
    const int64_t heads = std::min<int64_t>(4, m - v);
    const float* w = scores + v * stride;
    float* o = part_out + v * D;
    if (heads == 4) weighted_rows_shared<4>(w, stride, values, n, D, o);
    else if (heads == 3) weighted_rows_shared<3>(w, stride, values, n, D, o);
    else if (heads == 2) weighted_rows_shared<2>(w, stride, values, n, D, o);
    else weighted_rows(w, values, n, D, o);
  }
}
#endif

// One query head's output from its chunks' partial results, in chunk order: partial c sits at index
// first + c * step of part_max / part_sum (and of part_out, D floats each).
// `sink`: a logit that joins the softmax's denominator with no value of its own (gpt-oss's attention sinks), or
// -infinity for none.
inline void merge_chunks(const float* part_max, const float* part_sum, const float* part_out, int64_t first,
                         int64_t step, int64_t n_chunks, int64_t D, float* o, float sink = -INFINITY) {
  float best = sink, total = 0.f;
  for (int64_t c = 0; c < n_chunks; ++c) best = std::max(best, part_max[first + c * step]);
  if (sink != -INFINITY) total = std::exp(sink - best);
  std::fill(o, o + D, 0.f);
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t k = first + c * step;
    const float w = std::exp(part_max[k] - best);
    total += w * part_sum[k];
    const float* po = part_out + k * D;
    for (int64_t i = 0; i < D; ++i) o[i] += w * po[i];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < D; ++i) o[i] *= inv;
}

// A KV cache's element type: float32, float16 or q8_0 blocks (KvQ8Block).
enum KvType : int64_t { kKvF32 = 0, kKvF16 = 1, kKvQ8 = 2 };

// f(T{}) with T the element type of caches of `type`: float, Half or KvQ8Block.
template <typename F>
auto with_kv_type(int64_t type, F&& f) {
  if (type == kKvF16) return f(Half{});
  if (type == kKvQ8) return f(KvQ8Block{});
  return f(float{});
}

// RMSNorm over rows of n values in one pass: x * rsqrt(mean(x^2) + eps) * w, the sum of squares in double. One call
// instead of the half-dozen small ops (and their dispatch cost) that the decode step would otherwise spend on it.
void rms_norm_rows(const float* xp, int64_t rows, int64_t n, const float* wp, double eps, float* op) {
  auto scale_row = [&](int64_t r, double sum) {
    const float scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
    const float* xr = xp + r * n;
    float* orow = op + r * n;
    for (int64_t i = 0; i < n; ++i) orow[i] = (xr[i] * scale) * wp[i];
  };
  auto body = [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    // four rows' sums side by side: four chains of additions in flight instead of one, each row's in its own order
    for (; r + 4 <= end; r += 4) {
      double sum[4] = {0.0, 0.0, 0.0, 0.0};
      for (int64_t i = 0; i < n; ++i)
        for (int j = 0; j < 4; ++j) sum[j] += static_cast<double>(xp[(r + j) * n + i]) * xp[(r + j) * n + i];
      for (int j = 0; j < 4; ++j) scale_row(r + j, sum[j]);
    }
    for (; r < end; ++r) {
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xp[r * n + i]) * xp[r * n + i];
      scale_row(r, sum);
    }
  };
  parallel_for(0, rows, std::max<int64_t>(4, row_grain(n)), body);
}

// A GGUF weight as the blocks take it: `rows` rows of blocks of GGML type `type` (+ X4 for the interleaved layout).
struct Weight {
  const uint8_t* data = nullptr;
  int64_t type = 0, rows = 0;
};

// y [M, N] = x [M, K] @ W.T on the 8-bit activation kernels, or in float32 for float weights (float_gemm.h).
void linear_rows(const float* x, int64_t M, int64_t K, const Weight& w, float* y) {
  if (M == 0 || w.rows == 0) return;
  if (is_float_type(w.type)) return float_linear(x, M, K, w.data, w.type, w.rows, y);
  RUNLM_DISPATCH(w.type, gemm, x, M, K, w.data, w.rows, y)
}

// x @ [W_0; W_1; ...].T into y [M, sum of rows] for weights kept as separate GGUF tensors (Gemma mixes Q5_0 and
// Q8_0 inside its QKV).
void linear_parts_rows(const float* x, int64_t M, int64_t K, const std::vector<Weight>& ws, float* y) {
  if (ws.size() == 1) return linear_rows(x, M, K, ws[0], y);
  int64_t width = 0, offset = 0;
  for (const Weight& w : ws) width += w.rows;
  std::vector<float> part;
  for (const Weight& w : ws) {
    part.resize(M * w.rows);
    linear_rows(x, M, K, w, part.data());
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(y + m * width + offset, part.data() + m * w.rows, sizeof(float) * w.rows);
    offset += w.rows;
  }
}

#ifndef RUNLM_STANDALONE
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "runlm::rms_norm: float32 only");
  const int64_t n = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, "runlm::rms_norm: last dim ", x.size(-1), " != weight size ", n);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  rms_norm_rows(xc.data_ptr<float>(), n == 0 ? 0 : xc.numel() / n, n, wc.data_ptr<float>(), eps, out.data_ptr<float>());
  return out;
}

// The element type of a cache tensor (kv_cache_type_ok).
inline int64_t kv_type_of(const at::Tensor& cache) {
  const at::ScalarType type = cache.scalar_type();
  return type == at::kHalf ? kKvF16 : type == at::kByte ? kKvQ8 : kKvF32;
}

// One decode step of attention for one sequence: RoPE on the new query and key, the new key / value written into
// the pre-allocated cache at `pos`, then softmax(q K^T * scale) V over positions 0..pos for every query head (GQA:
// query head h reads kv head h / (n_heads / n_kv_heads)). qkv: float32 [n_heads + 2 * n_kv_heads, D] (queries, keys,
// values); cos / sin: [D] rotate-half tables with the sign folded into sin (x * cos + roll(x, D/2) * sin);
// k_cache / v_cache: float32, float16 or q8_0 [1, n_kv_heads, capacity, row] (see kv_cache_row), contiguous. Returns
// [n_heads * D].
// Used by decode_attention (the float32 reference path's decode step over a full cache: len = pos + 1).
template <typename T>
at::Tensor attend_cache(const at::Tensor& x, const float* cp, const float* sp, T* kc, T* vc, int64_t D, int64_t cap,
                        int64_t pos, int64_t len, int64_t n_heads, int64_t n_kv_heads, double scale) {
  const float* xp = x.data_ptr<float>();
  const int64_t half = D / 2, rep = n_heads / n_kv_heads;
  auto rope = [&](const float* in, float* out, float mult) {
    for (int64_t i = 0; i < half; ++i) out[i] = (in[i] * cp[i] + in[i + half] * sp[i]) * mult;
    for (int64_t i = half; i < D; ++i) out[i] = (in[i] * cp[i] + in[i - half] * sp[i]) * mult;
  };
  std::vector<float> roped(D);
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    rope(xp + (n_heads + h) * D, roped.data(), 1.f);
    kv_store(roped.data(), kv_row(kc, h * cap + pos, D), D);
    kv_store(xp + (n_heads + n_kv_heads + h) * D, kv_row(vc, h * cap + pos, D), D);
  }
  std::vector<float> q(n_heads * D);  // roped queries, pre-multiplied by the scale
  for (int64_t h = 0; h < n_heads; ++h) rope(xp + h * D, q.data() + h * D, static_cast<float>(scale));
  // Work items are (kv head, chunk of positions): each reads its keys and values once for all `rep` query heads
  // of the group, keeping a running max, exp-sum and unnormalized output per head; the chunks merge at the end.
  const int64_t chunk = std::max<int64_t>(kAttnChunk, (len + kAttnMaxChunks - 1) / kAttnMaxChunks);
  const int64_t n_chunks = (len + chunk - 1) / chunk, items = n_kv_heads * n_chunks;
  std::vector<float> part_out(items * rep * D), part_max(items * rep), part_sum(items * rep);
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rep * chunk);
    std::vector<const T*> keys(chunk), values(chunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / n_chunks, t0 = (item % n_chunks) * chunk, t1 = std::min(len, t0 + chunk), n = t1 - t0;
      for (int64_t t = 0; t < n; ++t) {
        keys[t] = kv_row(kc, g * cap + t0 + t, D);
        values[t] = kv_row(vc, g * cap + t0 + t, D);
      }
      attend_chunk(q.data() + g * rep * D, rep, keys.data(), values.data(), n, D, scores.data(), chunk,
                   part_max.data() + item * rep, part_sum.data() + item * rep, part_out.data() + item * rep * D);
    }
  };
  if (len * n_heads * D >= (1 << 16) && items > 1) {
    parallel_for(0, items, 1, work);
  } else {
    work(0, items);
  }
  at::Tensor out = at::empty({n_heads * D}, x.options());
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t g = h / rep;
    merge_chunks(part_max.data(), part_sum.data(), part_out.data(), g * n_chunks * rep + h % rep, rep, n_chunks, D,
                 op + h * D);
  }
  return out;
}

// A cache's element type is float32, float16 or q8_0 (a uint8 tensor of KvQ8Block rows), keys and values alike.
inline bool kv_cache_type_ok(const at::Tensor& k, const at::Tensor& v) {
  const at::ScalarType type = k.scalar_type();
  return (type == at::kFloat || type == at::kHalf || type == at::kByte) && v.scalar_type() == type;
}

// The last dimension of a cache of head dim D: D elements, or for q8_0 D / 32 blocks' bytes (D % 32 == 0).
inline int64_t kv_cache_row(const at::Tensor& cache, int64_t D) {
  return cache.scalar_type() == at::kByte ? D / kQ8Values * static_cast<int64_t>(sizeof(KvQ8Block)) : D;
}


at::Tensor attend_one(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, int64_t pos, int64_t len, int64_t n_heads, int64_t n_kv_heads,
                      double scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "runlm::decode_attention: float32 activations only");
  TORCH_CHECK(kv_cache_type_ok(k_cache, v_cache),
              "runlm::decode_attention: caches must be float32, float16 or q8_0 (uint8), alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "runlm::decode_attention: caches must be contiguous");
  const int64_t D = cos.numel(), cap = k_cache.dim() == 4 ? k_cache.size(2) : 0;
  TORCH_CHECK(D % 8 == 0 && sin.numel() == D, "runlm::decode_attention: head dim must be a multiple of 8, with "
              "tables of that size");
  TORCH_CHECK(k_cache.scalar_type() != at::kByte || D % kQ8Values == 0, "runlm::decode_attention: a q8_0 cache "
              "needs a head dim that is a multiple of 32, got ", D);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) == n_kv_heads && k_cache.size(3) == kv_cache_row(k_cache, D) &&
              k_cache.sizes() == v_cache.sizes(), "runlm::decode_attention: cache shape mismatch");
  TORCH_CHECK(qkv.numel() == (n_heads + 2 * n_kv_heads) * D, "runlm::decode_attention: qkv has the wrong size");
  TORCH_CHECK(0 <= pos && pos < cap && 0 < len && len <= cap,
              "runlm::decode_attention: position ", pos, " outside the cache of ", cap);
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "runlm::decode_attention: heads must group evenly");
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous();
  const float* cp = c.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  return with_kv_type(kv_type_of(k_cache), [&](auto element) {
    using T = decltype(element);
    return attend_cache(x, cp, sp, static_cast<T*>(k_cache.data_ptr()), static_cast<T*>(v_cache.data_ptr()), D, cap,
                        pos, len, n_heads, n_kv_heads, scale);
  });
}

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t pos, int64_t n_heads, int64_t n_kv_heads, double scale) {
  return attend_one(qkv, cos, sin, k_cache, v_cache, pos, pos + 1, n_heads, n_kv_heads, scale);
}

#endif  // RUNLM_STANDALONE

