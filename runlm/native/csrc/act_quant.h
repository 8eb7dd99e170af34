// runlm kernels: activation quantization. A part of kernels.cpp's one translation unit (included in order).
// ------------------------------------------------------------------------------------------------------------
// Activation quantization. 32-value blocks carry their scale rounded to float16, as llama.cpp's Q8_0 activation
// blocks do: the codes and scales are then llama.cpp's own, so the two round a model's activations alike. Where a
// mixture of experts' router sits within rounding of a tie, both then pick the same experts (with float32 scales,
// a tiny random gpt-oss routed a token of twenty differently from llama.cpp on the same Q8_0 file).

inline void quantize_a32_scalar(const float* x, A32* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = half_to_float(float_to_half(amax / 127.f));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[j] * id));
      y[b].qs[j] = static_cast<int8_t>(q);
      sum += q;
    }
    y[b].d = d;
    y[b].s = d * static_cast<float>(sum);
  }
}

inline void quantize_ak_scalar(const float* x, AK* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    float amax = 0.f;
    for (int j = 0; j < QK_K; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int j = 16 * g; j < 16 * g + 16; ++j) {
        const int q = static_cast<int>(std::nearbyint(x[j] * id));
        y[b].qs[j] = static_cast<int8_t>(q);
        sum += q;
      }
      y[b].bsums[g] = static_cast<int16_t>(sum);
    }
    y[b].d = amax / 127.f;
  }
}

#if RUNLM_AVX2

inline float hsum_ps(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline int hsum_i32(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return _mm_cvtsi128_si32(r);
}

inline float hmax_ps(__m256 v) {
  __m128 r = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline __m256 abs_max32(const float* x, __m256 m) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int j = 0; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  return m;
}

// 8 floats * mul rounded half to even to int32
inline __m256i round8(const float* x, __m256 mul) {
  const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), mul);
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline void quant32(const float* x, __m256 mul, int8_t* out, int* sum_lo, int* sum_hi) {
  const __m256i i0 = round8(x, mul), i1 = round8(x + 8, mul), i2 = round8(x + 16, mul), i3 = round8(x + 24, mul);
  *sum_lo = hsum_i32(_mm256_add_epi32(i0, i1));
  *sum_hi = hsum_i32(_mm256_add_epi32(i2, i3));
  // packs work per 128-bit lane: dwords come out as i0a i1a i2a i3a i0b i1b i2b i3b; permute back to order.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
}

inline void quantize_a32(const float* x, A32* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const float amax = hmax_ps(abs_max32(x, _mm256_setzero_ps()));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int lo, hi;
    quant32(x, _mm256_set1_ps(id), y[b].qs, &lo, &hi);
    y[b].d = half_to_float(float_to_half(amax / 127.f));
    y[b].s = y[b].d * static_cast<float>(lo + hi);
#if RUNLM_AVX512
    set_half_offsets(y[b]);
#endif
  }
}

inline void quantize_ak(const float* x, AK* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 32) m = abs_max32(x + j, m);
    const float amax = hmax_ps(m);
    const __m256 mul = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int c = 0; c < 8; ++c) {
      int lo, hi;
      quant32(x + 32 * c, mul, y[b].qs + 32 * c, &lo, &hi);
      y[b].bsums[2 * c] = static_cast<int16_t>(lo);
      y[b].bsums[2 * c + 1] = static_cast<int16_t>(hi);
    }
    y[b].d = amax / 127.f;
  }
}

// AK's codes (the same values) in AKI's order.
inline void quantize_row(const float* x, AKI* y, int64_t nb) {
  AK k;
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    quantize_ak(x, &k, 1);
    y[b].d = k.d;
    for (int p = 0; p < 4; ++p) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.qs + 64 * p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.qs + 64 * p + 32));
      const __m256i lo = _mm256_permute2x128_si256(v0, v1, 0x20), hi = _mm256_permute2x128_si256(v0, v1, 0x31);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + 64 * p), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + 64 * p + 32), hi);
    }
  }
}

#else

inline void quantize_a32(const float* x, A32* y, int64_t nb) { quantize_a32_scalar(x, y, nb); }
inline void quantize_ak(const float* x, AK* y, int64_t nb) { quantize_ak_scalar(x, y, nb); }

#endif

inline void quantize_row(const float* x, A32* y, int64_t nb) { quantize_a32(x, y, nb); }
#if RUNLM_AVX2
// Only MXFP4's AVX2 kernel without VNNI takes A32Pairs (TableType::kLifted).
inline void quantize_row(const float* x, A32Pairs* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    quantize_a32(x, &y[b], 1);
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].pair_offsets),
                        _mm256_maddubs_epi16(_mm256_set1_epi8(kMxfp4Lift), codes));
  }
}
#endif
inline void quantize_row(const float* x, AK* y, int64_t nb) { quantize_ak(x, y, nb); }

