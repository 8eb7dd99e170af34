// runlm kernels: dot products of the row layout, scalar and AVX2 / AVX-512 VNNI.
// A part of kernels.cpp's one translation unit, included in order.
// ------------------------------------------------------------------------------------------------------------
// Kernels: dot<RW, R>(w[RW], a[R], nb, out) computes out[i * R + r] = <weight row w[i], activation row a[r]> over
// nb weight blocks. RW weight rows x R activation rows run as independent accumulator chains (FMA latency, not
// throughput, bounds a single chain); each weight block is unpacked once for the R activation rows.
//
// Scalar path: each weight block decodes to int8 codes q[QK] and integer group scales / mins with
// weight = d * isc[g] * q + dm * imn[g] over groups of G values; the integer parts are summed exactly per block
// (like the AVX2 path), then scaled in float.

// A K-quant super-block's part of a (weight row, activation row) dot product goes to float in one sequence in every
// K-quant kernel (row layout, x4, AVX2, VNNI, scalar): its integer sums are exact (isum: scales x codes x activation
// codes, code offsets included; msum: mins . activation sums), then y = fma(d * da, isum, y) and, for the formats
// with mins, y = fma(-(dmin * da), msum, y). So the layouts and builds agree bit for bit.
inline float kquant_step(float y, float d, float da, int32_t isum) {
  return std::fma(d * da, static_cast<float>(isum), y);
}
inline float kquant_min_step(float y, float dmin, float da, int32_t msum) {
  return std::fma(-(dmin * da), static_cast<float>(msum), y);
}

// How the kernels prefetch and walk a decode GEMV's weights (set once per process, gguf_set_decode_walk): the 16-row
// kernels (AVX-512 builds), and the 4-row groups of the AVX2 builds (x4_prefetch, gemm.h's x4_stream_rows).
// What reads DRAM fastest differs by CPU, measured on the 1B Q4_K_M shape's Q4_K / Q6_K weights with two threads:
//  - "line" (line_ahead 2048, no bursts, streams 2 / 2): each 64-byte weight line read comes with a prefetch of the
//    line 2 KiB on, and each thread walks two far-apart groups side by side. On an Intel Xeon (Sapphire Rapids
//    class) the decode GEMV sequence went 22.3 -> 26.4 GB/s against a burst two super-blocks ahead (1.20x), and
//    two streams gave another 1.06-1.20x; distances 768 B-3 KiB: 1.06-1.22x, 2 KiB best.
//  - "burst" (line_ahead 2048, bursts 2048 / 2048, streams 1 / 2): before each super-block step of a decode GEMV (up
//    to 4 activation rows), the whole first super-block at least 2 KiB on (the next one for the K-quants) is
//    prefetched at once; one group per thread for the K-quants, two for the 32-wide types; the line prefetch stays
//    on. On an AMD EPYC Zen 5 VM the line walk read Q4_K at ~29 GB/s and Q6_K at ~14, the burst alone at ~46-52 and
//    ~50-67; bursts 2 and 3 super-blocks ahead read less (46 / 49, 40 / 40), no software prefetch 24 / 17. Decode
//    steps there (alternating rounds in one process): 1B Q4_K_M 1.46-1.55x the line walk, Q5_K_M 1.61x, 3B Q4_K_M
//    1.59x; a second K-quant stream 0.90x. For 1B Q8_0 two streams beat one (1.07x the line walk against 0.95x, 20
//    rounds); SmolLM2 and Gemma 3 270M: noise. The line prefetch is what the tiles of more rows need from DRAM: a
//    step of 8 sequences (1B Q4_K_M) ran 0.62-0.66x without it, 1.01x with it; with it, one-row decode ran 1.03x
//    the burst alone.
//  - "burst-32" (the burst for the 32-value block types only, the line walk for the K-quants and IQ4_XS): on an AMD
//    EPYC Zen 4 VM (family 25), decode steps alternating with the burst walk in one process (5 rounds each), 1B
//    Q4_K_M 1.08x (1.07-1.10), Qwen2.5-1.5B Q4_K_M 1.09-1.10x, Phi-4-mini Q4_K_M 1.08-1.09x, Qwen2.5-1.5B IQ4_XS
//    1.08x, where the line walk took 1B Q8_0 to 0.84x the burst's.
// The results are the same bits whatever the walk (prefetches only; every group's sums in one order).
struct DecodeWalk {
  int line_ahead = 2048;   // bytes on from each weight line read to the line prefetched with it (0: none)
  int kquant_burst = 0;    // bytes on from each step to the super-block prefetched whole before it (0: none), for the
                           // 256-value super-blocks (K-quants, IQ4_XS)
  int wide32_burst = 0;    // ... for the 32-value block types
  int kquant_streams = 2;  // groups each thread walks side by side (1 or 2): K-quants (256-value super-blocks)
  int wide32_streams = 2;  // ... the 32-value block types
  // the burst distance of a type whose blocks hold qk values
  int burst_for(int qk) const { return qk == 32 ? wide32_burst : kquant_burst; }
};
DecodeWalk g_walk;

// The scalar path's body: decode each weight block, then per group `group_dot(codes, activation codes, G)` (the exact
// integer dot of G values), summed with the group scales and mins as below. Every build's result for a type is the
// same bits whatever `group_dot` computes them with.
template <class T, int RW, int R, class GroupDot>
inline void decoded_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out,
                        GroupDot group_dot) {
  constexpr int QK = T::QK, G = T::G, NG = QK / G;
  alignas(16) int8_t q[QK];
  int isc[NG], imn[NG];
  float d, dm;
  float acc[RW * R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < RW; ++i) {
      T::decode(w[i] + b * T::SIZE, q, isc, imn, &d, &dm);
      for (int r = 0; r < R; ++r) {
        const auto& ab = a[r][b];
        int isum = 0;  // sum over groups of scale * (codes . activation codes), exact
        for (int g = 0; g < NG; ++g) isum += isc[g] * group_dot(q + g * G, ab.qs + g * G);
        if constexpr (QK == 32) {
          acc[i * R + r] += d * ab.d * static_cast<float>(isum) + dm * ab.s;  // ab.s = d_a * sum(codes)
        } else {
          acc[i * R + r] = kquant_step(acc[i * R + r], d, ab.d, isum);
          if constexpr (T::kMins) {
            int msum = 0;  // sum over groups of min * activation group sum
            for (int g = 0; g < NG; ++g)
              for (int k = g * (G / 16); k < (g + 1) * (G / 16); ++k) msum += imn[g] * ab.bsums[k];
            acc[i * R + r] = kquant_min_step(acc[i * R + r], -dm, ab.d, msum);  // decode gives dm = -dmin
          }
        }
      }
    }
  }
  for (int k = 0; k < RW * R; ++k) out[k] = acc[k];
}

template <class T, int RW, int R>
void scalar_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out) {
  decoded_dot<T, RW, R>(w, a, nb, out, [](const int8_t* q, const int8_t* x) {
    int s = 0;
    for (int j = 0; j < T::G; ++j) s += static_cast<int>(q[j]) * static_cast<int>(x[j]);
    return s;
  });
}

#if RUNLM_NEON
// The exact dot of n (a multiple of 16) int8 codes: SDOT where the target has the dotprod extension, else widening
// multiplies whose int16 products are pairwise added into int32 lanes.
inline int32_t neon_dot_i8(const int8_t* q, const int8_t* x, int n) {
  int32x4_t acc = vdupq_n_s32(0);
  for (int j = 0; j < n; j += 16) {
    const int8x16_t u = vld1q_s8(q + j), v = vld1q_s8(x + j);
#if defined(__ARM_FEATURE_DOTPROD)
    acc = vdotq_s32(acc, u, v);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(u), vget_low_s8(v)));
    acc = vpadalq_s16(acc, vmull_high_s8(u, v));
#endif
  }
  return vaddvq_s32(acc);
}

// The row layout's dot on NEON: the scalar path's decode and float steps, its integer dots in vectors.
template <class T, int RW, int R>
void neon_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out) {
  static_assert(T::G % 16 == 0, "groups of 16 values or more");
  decoded_dot<T, RW, R>(w, a, nb, out, [](const int8_t* q, const int8_t* x) { return neon_dot_i8(q, x, T::G); });
}
#endif

// What a type's dot runs where there is no AVX2 code for it: NEON on ARM, else the scalar path.
template <class T, int RW, int R>
inline void portable_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out) {
#if RUNLM_NEON
  neon_dot<T, RW, R>(w, a, nb, out);
#else
  scalar_dot<T, RW, R>(w, a, nb, out);
#endif
}

#if RUNLM_AVX2

inline __m256i ones16() { return _mm256_set1_epi16(1); }

// unsigned x signed byte dot products, 4 per int32 lane, added to acc (VNNI: one vpdpbusd; the same integers)
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) {
#if RUNLM_AVXVNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif RUNLM_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16()));
#endif
}

// unsigned x signed bytes -> 8 int32 sums of 4 products
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if RUNLM_VNNI
  return dot_bytes(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16());
#endif
}

// int32 acc += int16 pairs x int16 pairs, summed per pair
inline __m256i dot_words(__m256i acc, __m256i x, __m256i y) {
#if RUNLM_AVXVNNI
  return _mm256_dpwssd_avx_epi32(acc, x, y);
#elif RUNLM_VNNI
  return _mm256_dpwssd_epi32(acc, x, y);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, y));
#endif
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 4-row groups' prefetch on the line walk: the `bytes` of the group's super-block (or block) at blk, line_ahead
// bytes on, as the kernel reaches it. On the Xeon's avx2 build (decode steps, alternating rounds in one process) it
// was 1.09-1.11x the group prefetch below at 1B Q4_K_M (1.5-3.4 KiB on alike), 1.13x at 1B Q8_0 and 1.17x at 3B
// Q4_K_M. The burst walk keeps the group's bytes prefetched 1 KiB on before its kernel (gemm.h's prefetch_rows),
// what took a decode GEMV from ~14 to ~25 GB/s on the 2-core EPYC Zen 3 against no software prefetch; on an EPYC
// Zen 1 the line walk read 1.5-1.9x faster than it (2 threads, 18 MB Q4_K / Q6_K / Q8_0 GEMVs), so the 4-row builds
// take the line walk on every CPU (build.decode_walk_name).
inline void x4_prefetch(const uint8_t* blk, int bytes, int qk) {
  if (g_walk.burst_for(qk) || !g_walk.line_ahead) return;
  const char* ahead = reinterpret_cast<const char*>(blk + g_walk.line_ahead);
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
}

// 16 bytes of nibbles -> 32 bytes 0..15: low nibbles (elements 0..15) then high nibbles (16..31)
inline __m256i nibbles32(const uint8_t* p) {
  // the 16 bytes in both halves (a load, no shuffle), the upper half shifted down a nibble
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// 32 bits (little-endian) -> byte j is 0xFF where bit j is set
inline __m256i bits32(const uint8_t* p) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                          0x0303030303030303LL);
  const __m256i mask = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(u32(p))), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(b, mask), mask);
}

inline __m256i unpack_q5_0(const uint8_t* blk) {
  return _mm256_or_si256(nibbles32(blk + 6), _mm256_and_si256(bits32(blk + 2), _mm256_set1_epi8(0x10)));
}

inline __m256i unpack_q5_1(const uint8_t* blk) {
  return _mm256_or_si256(nibbles32(blk + 8), _mm256_and_si256(bits32(blk + 4), _mm256_set1_epi8(0x10)));
}

// Byte shuffles picking scale 2c eight times then 2c+1 eight times, for c = 0..7.
alignas(16) const uint8_t kScalePairShuffle[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};

// 16 signed scale bytes -> int16 x 16: [s(2c)] * 8, [s(2c+1)] * 8
inline __m256i scale_pair(__m128i sc8, int c) {
  const __m128i shuf = _mm_load_si128(reinterpret_cast<const __m128i*>(kScalePairShuffle[c]));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf));
}

// int32 += (unsigned q . signed a per 16-bit pair) * int16 scales (VNNI: the widening multiply-add is one vpdpwssd)
inline __m256i scaled_dot(__m256i sum, __m256i q, const int8_t* a, __m256i scales) {
  return dot_words(sum, _mm256_maddubs_epi16(q, load256(a)), scales);
}

inline __m256i prod_u8s8(__m256i q, __m256i a) { return dot_u8s8(q, a); }

// signed x signed: |w| (unsigned) times a carrying w's sign (activation codes stay within -127..127)
inline __m256i prod_s8s8(__m256i q, __m256i a) { return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)); }

// [sum p0, sum p1, sum p2, sum p3] in each 128-bit half (the two halves still to be added)
inline __m256i reduce4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

// 32-wide formats: result = sum_b dw * da * prod(q, a) + corr_mult * sum_b cw * (da * sum a), where q = unpack(blk)
// are the weight codes and cw is d (codes with an offset: corr_mult = -8 for Q4_0, -16 for Q5_0) or the block min
// m (corr_mult = 1 for Q4_1, Q5_1); Q8_0 has no correction.
template <int RW, int R, class Unpack, class Prod>
inline void dot32_avx(const uint8_t* const* w, const A32* const* a, int64_t nb, float* out, int size, Unpack unpack,
                      Prod prod, bool has_corr, bool has_min, float corr_mult) {
  if constexpr (RW == 4 && R == 1) {
    // Decode (one activation row): the 4 rows' block dots are reduced into one vector and their f16 scales
    // converted together, so the int->float conversion and scaling run once per block for all 4 rows.
    __m256 acc = _mm256_setzero_ps();
    __m128 accc = _mm_setzero_ps();
    const A32* ar = a[0];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* b0 = w[0] + b * size;
      const uint8_t* b1 = w[1] + b * size;
      const uint8_t* b2 = w[2] + b * size;
      const uint8_t* b3 = w[3] + b * size;
      const __m256i av = load256(ar[b].qs);
      const __m256i s = reduce4(prod(unpack(b0), av), prod(unpack(b1), av), prod(unpack(b2), av), prod(unpack(b3), av));
      // f16 fields (d, and m right after it) of the 4 blocks: [d0 m0 d1 m1 | d2 m2 d3 m3]
      const __m128i h = _mm_setr_epi32(static_cast<int>(u32(b0)), static_cast<int>(u32(b1)), static_cast<int>(u32(b2)),
                                       static_cast<int>(u32(b3)));
      const __m128 lo = _mm_cvtph_ps(h), hi = _mm_cvtph_ps(_mm_unpackhi_epi64(h, h));
      const __m128 d4 = _mm_shuffle_ps(lo, hi, 0x88);  // d0 d1 d2 d3
      const __m128 sd = _mm_mul_ps(d4, _mm_set1_ps(ar[b].d));
      acc = _mm256_fmadd_ps(_mm256_set_m128(sd, sd), _mm256_cvtepi32_ps(s), acc);
      if (has_corr) {
        const __m128 c4 = has_min ? _mm_shuffle_ps(lo, hi, 0xDD) : d4;  // m0 m1 m2 m3
        accc = _mm_fmadd_ps(c4, _mm_set1_ps(ar[b].s), accc);
      }
    }
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    _mm_storeu_ps(out, _mm_fmadd_ps(_mm_set1_ps(corr_mult), accc, t));
    return;
  }
  __m256 acc[RW * R];
  float corr[RW * R];
  for (int k = 0; k < RW * R; ++k) {
    acc[k] = _mm256_setzero_ps();
    corr[k] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < RW; ++i) {
      const uint8_t* blk = w[i] + b * size;
      const float dw = f16(blk);
      const float cw = has_min ? f16(blk + 2) : dw;
      const __m256i q = unpack(blk);
      for (int r = 0; r < R; ++r) {
        const A32& ab = a[r][b];
        const __m256 p = _mm256_cvtepi32_ps(prod(q, load256(ab.qs)));
        acc[i * R + r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab.d), p, acc[i * R + r]);
        if (has_corr) corr[i * R + r] += cw * ab.s;
      }
    }
  }
  for (int k = 0; k < RW * R; ++k) out[k] = hsum_ps(acc[k]) + corr_mult * corr[k];
}

// int32 [sum of v[0], ..., sum of v[R - 1]] (R <= 4; other lanes 0): the exact integer sums of R vectors at once
template <int R>
inline __m128i sum_each(const __m256i* v) {
  static_assert(R >= 1 && R <= 4, "up to 4 vectors");
  if constexpr (R == 1) return _mm_cvtsi32_si128(hsum_i32(v[0]));
  const __m256i z = _mm256_setzero_si256();
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], R > 1 ? v[1] : z),
                                      _mm256_hadd_epi32(R > 2 ? v[2] : z, R > 3 ? v[3] : z));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The exact sums of activation rows 4Q .. 4Q + 3 of R (those below R), lane r - 4Q: one quad of kquant_dot's lanes.
template <int R, int Q>
inline __m128i sum_quad(const __m256i* v) {
  return sum_each<(R - 4 * Q < 4 ? R - 4 * Q : 4)>(v + 4 * Q);
}

// The K-quant dot skeleton (Q2_K .. Q6_K, row layout): block(blk, b, sumi, mins) gives weight block `blk` (block
// index b) met by the R activation rows (up to 8) as int32 vectors whose lanes add up to the block's exact integer
// sums (mins: formats with mins); the rows' sums go to float together, four at a time, lane r % 4 of quad r / 4 in
// kquant_step's sequence. d (and dmin right after it) are the block's f16 scales at byte T::D_AT.
template <class T, int RW, int R, class Block>
inline void kquant_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out, Block block) {
  static_assert(R >= 1 && R <= 8, "up to 8 activation rows");
  constexpr int QUADS = (R + 3) / 4;
  __m128 acc[RW][QUADS];
  for (int i = 0; i < RW; ++i)
    for (int q = 0; q < QUADS; ++q) acc[i][q] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    auto act = [&](int r) { return r < R ? a[r][b].d : 0.f; };
    __m128 da[QUADS];
    for (int q = 0; q < QUADS; ++q) da[q] = _mm_setr_ps(act(4 * q), act(4 * q + 1), act(4 * q + 2), act(4 * q + 3));
    for (int i = 0; i < RW; ++i) {
      const uint8_t* blk = w[i] + b * T::SIZE;
      __m256i sumi[R], mins[R];
      block(blk, b, sumi, mins);
      const __m128 d = _mm_set1_ps(f16(blk + T::D_AT));
      acc[i][0] = _mm_fmadd_ps(_mm_mul_ps(d, da[0]), _mm_cvtepi32_ps(sum_quad<R, 0>(sumi)), acc[i][0]);
      if constexpr (R > 4)
        acc[i][1] = _mm_fmadd_ps(_mm_mul_ps(d, da[1]), _mm_cvtepi32_ps(sum_quad<R, 1>(sumi)), acc[i][1]);
      if constexpr (T::kMins) {
        const __m128 dmin = _mm_set1_ps(f16(blk + T::D_AT + 2));
        acc[i][0] = _mm_fnmadd_ps(_mm_mul_ps(dmin, da[0]), _mm_cvtepi32_ps(sum_quad<R, 0>(mins)), acc[i][0]);
        if constexpr (R > 4)
          acc[i][1] = _mm_fnmadd_ps(_mm_mul_ps(dmin, da[1]), _mm_cvtepi32_ps(sum_quad<R, 1>(mins)), acc[i][1]);
      }
    }
  }
  for (int i = 0; i < RW; ++i) {
    alignas(16) float o[4 * QUADS];
    for (int q = 0; q < QUADS; ++q) _mm_store_ps(o + 4 * q, acc[i][q]);
    for (int r = 0; r < R; ++r) out[i * R + r] = o[r];
  }
}

// group mins x activation group sums (mins16: one int16 min per 16 activation values), 8 int32 lanes
inline __m256i min_products(__m256i mins16, const AK& ab) { return _mm256_madd_epi16(mins16, load256(ab.bsums)); }

// sumi - 2^SHIFT * (group scales x activation group sums): codes stored with an offset of 2^SHIFT.
template <int SHIFT>
inline __m256i with_offset(__m256i sumi, __m256i sc16, const AK& ab) {
  const __m256i corr = _mm256_madd_epi16(sc16, load256(ab.bsums));
  return _mm256_sub_epi32(sumi, _mm256_slli_epi32(corr, SHIFT));
}

#endif

