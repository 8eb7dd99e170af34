// runlm kernels: weights stored as floats (F32, F16, BF16). A part of kernels.cpp's one translation unit (included
// in order).
// ------------------------------------------------------------------------------------------------------------
// Float weights: y [M, N] = x [M, K] @ W.T with W's rows as the file stores them (no regrouping, read in place), the
// activations kept in float32 (no 8-bit rounding: an F32 file gives transformers' float32 results to rounding) and
// each weight value widened to float32 as it is read.
//
// Every output y[m, n] is one fixed reduction of its two rows, whatever the tile it falls in: 8 lanes (one AVX2
// vector, or 8 scalars) accumulate w[n, k] * x[m, k] for k = lane (mod 8) in order of k, then the lanes are summed
// pairwise (0+4, 1+5, ..., then 0+2, 1+3, then 0+1) and the K % 8 tail added value by value. So a row's result does
// not depend on M or on the rows beside it, as the block's route invariance needs. An AVX-512 build runs 16 lanes
// (k = lane mod 16, lanes i and i + 8 added first, the K % 16 tail value by value): one 512-bit multiply-add does
// twice a 256-bit one's work; its results are its own, as fixed.

inline bool is_float_type(int64_t type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

inline int64_t float_type_bytes(int64_t type) { return type == T_F32 ? 4 : 2; }

template <int64_t W>
inline float float_value(const uint8_t* row, int64_t k) {
  if constexpr (W == T_F32) {
    float v;
    std::memcpy(&v, row + 4 * k, 4);
    return v;
  } else if constexpr (W == T_F16) {
    return f16(row + 2 * k);
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  }
}

#if RUNLM_AVX2
inline float sum_lanes(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes i + (i + 4)
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));                       // then i + (i + 2)
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));                          // then 0 + 1
}
#endif

#if RUNLM_AVX512
using FloatVec = __m512;
constexpr int64_t kFloatLanes = 16;
template <int64_t W>
inline __m512 float_vec(const uint8_t* row, int64_t k) {
  if constexpr (W == T_F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (W == T_F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline __m512 float_load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 float_zero() { return _mm512_setzero_ps(); }
inline __m512 float_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline float float_sum(__m512 v) {  // lanes i + (i + 8), then as sum_lanes
  return sum_lanes(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#elif RUNLM_AVX2
using FloatVec = __m256;
constexpr int64_t kFloatLanes = 8;
template <int64_t W>
inline __m256 float_vec(const uint8_t* row, int64_t k) {
  if constexpr (W == T_F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  } else if constexpr (W == T_F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

inline __m256 float_load(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 float_zero() { return _mm256_setzero_ps(); }
inline __m256 float_fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline float float_sum(__m256 v) { return sum_lanes(v); }
#endif

#if RUNLM_AVX2
// A vector loaded into a register of its own. Left to itself GCC folds an activation vector into every multiply-add
// that uses it, so a 4 x 3 tile loads it four times: F16 GEMMs ran 1.2-1.4x slower so (EPYC Zen 4, 2048 x 1536,
// 128 rows: AVX2 125 -> 175 GFLOP/s held, AVX-512 165 -> 200).
inline FloatVec float_held(const float* p) {
  FloatVec v = float_load(p);
  asm("" : "+v"(v));
  return v;
}
#endif

#if RUNLM_AVX2
// The multiply-adds of weight rows [n, n + RW) x activation rows [m, m + R) over values [k0, k1) (whole vectors),
// into sums carried in `acc` from the values before k0: each lane's chain goes on in the order of k.
template <int64_t W, int RW, int R>
inline void float_chunk(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n, int64_t m,
                        int64_t k0, int64_t k1, FloatVec (&acc)[RW][R]) {
  FloatVec sums[RW][R];
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) sums[i][r] = acc[i][r];
  for (int64_t k = k0; k < k1; k += kFloatLanes) {
    FloatVec xs[R];
    for (int r = 0; r < R; ++r) xs[r] = float_held(x + (m + r) * K + k);
    for (int i = 0; i < RW; ++i) {
      const FloatVec ws = float_vec<W>(w + (n + i) * row_bytes, k);
      for (int r = 0; r < R; ++r) sums[i][r] = float_fma(ws, xs[r], sums[i][r]);
    }
  }
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = sums[i][r];
}
#endif

// y for weight rows [n, n + RW) x activation rows [m, m + R) from their lanes' sums over the vectors' values (`body`
// of K): the lanes summed pairwise, then the K % lanes tail added value by value.
template <int64_t W, int RW, int R>
inline void float_finish(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t body, int64_t n,
                         int64_t m, int64_t N, const float (&out)[RW][R], float* y) {
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) {
      float s = out[i][r];
      for (int64_t k = body; k < K; ++k) s += float_value<W>(w + (n + i) * row_bytes, k) * x[(m + r) * K + k];
      y[(m + r) * N + n + i] = s;
    }
}

// Weight rows [n, n + RW) x activation rows [m, m + R).
template <int64_t W, int RW, int R>
inline void float_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n, int64_t m,
                       int64_t N, float* y) {
  float out[RW][R];
#if RUNLM_AVX2
  const int64_t body = K / kFloatLanes * kFloatLanes;
  FloatVec acc[RW][R];
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = float_zero();
  float_chunk<W, RW, R>(w, row_bytes, x, K, n, m, 0, body, acc);
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) out[i][r] = float_sum(acc[i][r]);
#else
  const int64_t body = K / 8 * 8;
  float acc[RW][R][8] = {};
  for (int64_t k = 0; k < body; k += 8)
    for (int i = 0; i < RW; ++i)
      for (int j = 0; j < 8; ++j) {
        const float wv = float_value<W>(w + (n + i) * row_bytes, k + j);
        for (int r = 0; r < R; ++r) acc[i][r][j] += wv * x[(m + r) * K + k + j];
      }
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) {
      float* a = acc[i][r];
      for (int j = 0; j < 4; ++j) a[j] += a[j + 4];
      for (int j = 0; j < 2; ++j) a[j] += a[j + 2];
      out[i][r] = a[0] + a[1];
    }
#endif
  float_finish<W, RW, R>(w, row_bytes, x, K, body, n, m, N, out, y);
}

#if RUNLM_AVX2
// Weight rows [n, n + 4 * kBlockTiles) x activation rows [m, m + R), K a chunk of kFloatChunk values at a time: the R
// rows' chunk is read from L2 once and meets every 4-row tile of the block from L1, each tile's sums kept in memory
// between chunks. float_tile instead reads all K of the R rows for each tile: with 16-lane vectors (6 activation rows,
// ~0.7 MB of them for a 64-row pass at K = 2560) an F16 GEMM on both threads ran ~15% slower so (Xeon, 2560 x 10240,
// 128 rows: 162 against 192 GFLOP/s; one thread 95 either way). Each lane's chain is float_tile's, in the same order:
// the same bits.
constexpr int kBlockTiles = 8;
constexpr int64_t kFloatChunk = 256;

template <int64_t W, int R>
inline void float_block(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n, int64_t m,
                        int64_t N, float* y) {
  const int64_t body = K / kFloatLanes * kFloatLanes;
  FloatVec acc[kBlockTiles][4][R];
  for (int t = 0; t < kBlockTiles; ++t)
    for (int i = 0; i < 4; ++i)
      for (int r = 0; r < R; ++r) acc[t][i][r] = float_zero();
  for (int64_t k0 = 0; k0 < body; k0 += kFloatChunk) {
    const int64_t k1 = std::min(body, k0 + kFloatChunk);
    for (int t = 0; t < kBlockTiles; ++t) float_chunk<W, 4, R>(w, row_bytes, x, K, n + 4 * t, m, k0, k1, acc[t]);
  }
  for (int t = 0; t < kBlockTiles; ++t) {
    float out[4][R];
    for (int i = 0; i < 4; ++i)
      for (int r = 0; r < R; ++r) out[i][r] = float_sum(acc[t][i][r]);
    float_finish<W, 4, R>(w, row_bytes, x, K, body, n + 4 * t, m, N, out, y);
  }
}
#endif

// A GEMV's weight rows n, n + stride, ... (kGemvStreams of them) against one activation row. A row's sum is one
// chain of multiply-adds (the order float_tile keeps), so a row alone waits on the multiply-add's latency: AVX2 read
// F16 at ~18 GB/s a core from cache or memory (EPYC Zen 4). Rows side by side give independent chains, and rows far
// apart keep each a long sequential stream the prefetchers follow (4 neighbouring rows, 4 short streams, read 11-16
// GB/s from memory): one AVX2 core 17.6 -> 33-35 GB/s from memory, two 35 -> 40-78 (AVX-512: one core 28-31 ->
// 32-33). Each activation vector is loaded once for all of them (a down projection's 8960 values come from L2).
constexpr int kGemvStreams = 4;

template <int64_t W>
inline void float_gemv_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n, int64_t stride,
                            float* y) {
#if RUNLM_AVX2
  const int64_t body = K / kFloatLanes * kFloatLanes;
  FloatVec acc[kGemvStreams];
  for (int i = 0; i < kGemvStreams; ++i) acc[i] = float_zero();
  for (int64_t k = 0; k < body; k += kFloatLanes) {
    const FloatVec xs = float_held(x + k);
    for (int i = 0; i < kGemvStreams; ++i)
      acc[i] = float_fma(float_vec<W>(w + (n + i * stride) * row_bytes, k), xs, acc[i]);
  }
  for (int i = 0; i < kGemvStreams; ++i) {
    float s = float_sum(acc[i]);
    for (int64_t k = body; k < K; ++k) s += float_value<W>(w + (n + i * stride) * row_bytes, k) * x[k];
    y[n + i * stride] = s;
  }
#else
  for (int i = 0; i < kGemvStreams; ++i) float_tile<W, 1, 1>(w, row_bytes, x, K, n + i * stride, 0, 0, y);
#endif
}

// Weight rows [n, n + RW) x activation rows [m, m + R): one tile, or with Blocked a block of kBlockTiles 4-row tiles.
template <int64_t W, int RW, int R, bool Blocked>
inline void float_rows_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n, int64_t m,
                            int64_t N, float* y) {
#if RUNLM_AVX2
  if constexpr (Blocked) {
    float_block<W, R>(w, row_bytes, x, K, n, m, N, y);
    return;
  }
#endif
  float_tile<W, RW, R>(w, row_bytes, x, K, n, m, N, y);
}

// Weight rows [n, n + RW) (Blocked: [n, n + 4 * kBlockTiles)) x all M activation rows, three at a time (six with
// AVX-512): a 4 x 3 tile keeps 12 sums in registers, so each weight vector widened and each activation vector loaded
// feeds three or four multiply-adds.
template <int64_t W, int RW, bool Blocked = false>
inline void float_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t n,
                       int64_t N, float* y) {
  int64_t m = 0;
#if RUNLM_AVX512
  // 32 vector registers: a 4 x 6 tile's 24 sums, and each widened weight vector feeds six multiply-adds
  for (; m + 6 <= M; m += 6) float_rows_tile<W, RW, 6, Blocked>(w, row_bytes, x, K, n, m, N, y);
#endif
  for (; m + 3 <= M; m += 3) float_rows_tile<W, RW, 3, Blocked>(w, row_bytes, x, K, n, m, N, y);
  if (M - m == 2) float_rows_tile<W, RW, 2, Blocked>(w, row_bytes, x, K, n, m, N, y);
  if (M - m == 1) float_rows_tile<W, RW, 1, Blocked>(w, row_bytes, x, K, n, m, N, y);
}

template <int64_t W>
void float_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  const int64_t row_bytes = K * float_type_bytes(W);
  // ~64K multiply-adds a piece, tiles of activation rows small enough to stay in cache while weight rows stream by
  constexpr int64_t kRowsAtOnce = 64;
  const int64_t grain = std::max<int64_t>(4, (1 << 16) / std::max<int64_t>(1, K * std::min(M, kRowsAtOnce)));
  parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
      const int64_t rows = std::min(kRowsAtOnce, M - m0);
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      int64_t n = n0;
      if (rows == 1) {
        // A GEMV: the thread's rows in kGemvStreams quarters, a row of each at a time (float_gemv_rows)
        const int64_t per = (n1 - n) / kGemvStreams;
        for (int64_t i = 0; i < per; ++i) float_gemv_rows<W>(w, row_bytes, xm, K, n + i, per, ym);
        n += per * kGemvStreams;
        for (; n < n1; ++n) float_tile<W, 1, 1>(w, row_bytes, xm, K, n, 0, N, ym);
      } else {
#if RUNLM_AVX2
        for (; n + 4 * kBlockTiles <= n1; n += 4 * kBlockTiles)
          float_rows<W, 4, true>(w, row_bytes, xm, rows, K, n, N, ym);
#endif
        for (; n + 4 <= n1; n += 4) float_rows<W, 4>(w, row_bytes, xm, rows, K, n, N, ym);
        for (; n + 2 <= n1; n += 2) float_rows<W, 2>(w, row_bytes, xm, rows, K, n, N, ym);
      }
      for (; n < n1; ++n) float_rows<W, 1>(w, row_bytes, xm, rows, K, n, N, ym);
    }
  });
}

// float_gemm for the weight's float type.
void float_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t N, float* y) {
  switch (type) {
    case T_F32: float_gemm<T_F32>(x, M, K, w, N, y); break;
    case T_F16: float_gemm<T_F16>(x, M, K, w, N, y); break;
    case T_BF16: float_gemm<T_BF16>(x, M, K, w, N, y); break;
    default: RUNLM_CHECK(false, "not a float weight type: ", type);
  }
}
