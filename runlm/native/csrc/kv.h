// runlm kernels: KV cache element types. A part of kernels.cpp's one translation unit (included in order).
// KV cache elements: float32, IEEE half (half the memory) or q8_0 (GGML's block_q8_0: 32 values as int8 times one
// half scale, 34 bytes; 17/32 of half's memory). A cache row (one kv head at one position: D values) is D floats or
// halves, or D / 32 blocks; rows lie one after another (kv_row). Values are widened to float32 as they are loaded:
// a half exactly (F16C on AVX2), a q8_0 value as float(q) * float(d), one rounding that the vector and the scalar
// load make alike. So attention computes over exactly the values the cache holds, whichever load reads them.
struct KvQ8Block {
  uint16_t d;  // the scale, IEEE half bits
  int8_t qs[32];
};
static_assert(sizeof(KvQ8Block) == 34, "a q8_0 block is GGML's block_q8_0: 34 bytes");
constexpr int64_t kQ8Values = 32;  // values per q8_0 block

// Storage units of type T (float, Half or KvQ8Block) per row of D values, and that row's bytes.
template <typename T>
constexpr int64_t kv_row_units(int64_t D) {
  return std::is_same_v<std::remove_const_t<T>, KvQ8Block> ? D / kQ8Values : D;
}
template <typename T>
constexpr size_t kv_row_bytes(int64_t D) {
  return sizeof(T) * kv_row_units<T>(D);
}

// A cache row's lines on their way into the cache (a no-op without SIMD builds' prefetch).
template <typename T>
inline void prefetch_kv_row(const T* row, int64_t D) {
#if RUNLM_AVX2
  const char* p = reinterpret_cast<const char*>(row);
  for (size_t o = 0; o < kv_row_bytes<T>(D); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
  (void)row, (void)D;
#endif
}

// Row `index` of rows of D values each.
template <typename T>
inline T* kv_row(T* rows, int64_t index, int64_t D) {
  return rows + index * kv_row_units<T>(D);
}

// Value i of a row, as float32.
inline float kv_elem(const float* row, int64_t i) { return row[i]; }
inline float kv_elem(const Half* row, int64_t i) { return half_to_float(row[i].x); }
inline float kv_elem(const KvQ8Block* row, int64_t i) {
  const KvQ8Block& b = row[i / kQ8Values];
  return static_cast<float>(b.qs[i % kQ8Values]) * half_to_float(b.d);
}
#if RUNLM_AVX2
// Values i .. i + 7 of a row (i % 8 == 0), as float32.
inline __m256 kv_load8(const float* row, int64_t i) { return _mm256_loadu_ps(row + i); }
inline __m256 kv_load8(const Half* row, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
}
inline __m256 kv_load8(const KvQ8Block* row, int64_t i) {
  const KvQ8Block& b = row[i / kQ8Values];
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + i % kQ8Values)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(b.d))));
}
#endif
#if RUNLM_AVX512
// Values i .. i + 15 of a row (i % 16 == 0), as float32: the same widening as kv_load8, 16 lanes at a time.
inline __m512 kv_load16(const float* row, int64_t i) { return _mm512_loadu_ps(row + i); }
inline __m512 kv_load16(const Half* row, int64_t i) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
}
inline __m512 kv_load16(const KvQ8Block* row, int64_t i) {
  const KvQ8Block& b = row[i / kQ8Values];
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + i % kQ8Values)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(b.d))));
}
// Values i .. i + 7 of two rows, a's in the low half and b's in the high half: two keys' score lanes side by side.
inline __m512 kv_load8x2(const float* a, const float* b, int64_t i) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a + i)), _mm256_loadu_ps(b + i), 1);
}
inline __m512 kv_load8x2(const Half* a, const Half* b, int64_t i) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)), 1));
}
inline __m512 kv_load8x2(const KvQ8Block* a, const KvQ8Block* b, int64_t i) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(kv_load8(a, i)), kv_load8(b, i), 1);
}
#endif

// A cache row of D values widened to float32 (each exactly as kv_elem / kv_load8 read it).
template <typename T>
inline void kv_widen(const T* row, float* out, int64_t D) {
  int64_t i = 0;
#if RUNLM_AVX2
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, kv_load8(row, i));
#endif
  for (; i < D; ++i) out[i] = kv_elem(row, i);
}

// n floats stored as cache elements: copied, or rounded to the nearest half (ties to even; F16C and the scalar
// conversion agree on every non-NaN value).
inline void kv_store(const float* x, float* out, int64_t n) { std::memcpy(out, x, sizeof(float) * n); }
inline void kv_store(const float* x, Half* out, int64_t n) {
  int64_t i = 0;
#if RUNLM_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i].x = float_to_half(x[i]);
}
// n floats (n % 32 == 0) as q8_0 blocks, the bytes GGML's reference quantizer makes: d = max |x| / 127 (kept as a
// half), q = x * (1 / d) rounded half away from zero (all zeros for a block of zeros).
inline void kv_store(const float* x, KvQ8Block* out, int64_t n) {
  for (int64_t b = 0; b < n / kQ8Values; ++b) {
    const float* v = x + b * kQ8Values;
    float amax = 0.f;
    for (int64_t j = 0; j < kQ8Values; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    out[b].d = float_to_half(d);
    for (int64_t j = 0; j < kQ8Values; ++j) out[b].qs[j] = static_cast<int8_t>(std::round(v[j] * inv));
  }
}

// The 8 lanes of a dot product's accumulator reduced in the order _mm256_hadd_ps pairs them below.
inline float tree8(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

#if RUNLM_AVX2
// Eight keys' accumulators reduced to their eight scores, each in tree8's order.
inline __m256 tree8_x8(const __m256* acc) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if RUNLM_AVX512
// Four accumulators of two keys each (kv_load8x2's halves) reduced to the eight keys' scores, in tree8's order.
inline __m256 pair_scores(const __m512* acc) {
  __m256 keyed[8];
  for (int j = 0; j < 4; ++j) {
    keyed[2 * j] = _mm512_castps512_ps256(acc[j]);
    keyed[2 * j + 1] = _mm512_extractf32x8_ps(acc[j], 1);
  }
  return tree8_x8(keyed);
}
#endif

