// runlm kernels: per-type traits. A part of kernels.cpp's one translation unit (included in order).
// ------------------------------------------------------------------------------------------------------------
// Per-type traits: QK (values per block), SIZE (bytes per block), G (group size of the scalar decode),
// Act (activation block type), decode (scalar), dot<RW, R> (AVX2 or scalar).

struct Q4_0 {
  static constexpr int QK = 32, SIZE = 18, G = 32;
  using Act = A32;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>((b[2 + j] & 0x0F) - 8);
      q[j + 16] = static_cast<int8_t>((b[2 + j] >> 4) - 8);
    }
    isc[0] = 1, imn[0] = 0, *d = f16(b), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    dot32_avx<RW, R>(w, a, nb, out, SIZE, [](const uint8_t* blk) { return nibbles32(blk + 2); }, prod_u8s8, true, false,
                     -8.f);
#else
    portable_dot<Q4_0, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q4_1 {
  static constexpr int QK = 32, SIZE = 20, G = 32;
  using Act = A32;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(b[4 + j] & 0x0F);
      q[j + 16] = static_cast<int8_t>(b[4 + j] >> 4);
    }
    isc[0] = 1, imn[0] = 1, *d = f16(b), *dm = f16(b + 2);
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    dot32_avx<RW, R>(w, a, nb, out, SIZE, [](const uint8_t* blk) { return nibbles32(blk + 4); }, prod_u8s8, true, true,
                     1.f);
#else
    portable_dot<Q4_1, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q5_0 {
  static constexpr int QK = 32, SIZE = 22, G = 32;
  using Act = A32;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    const uint32_t qh = u32(b + 2);
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
      q[j + 16] = static_cast<int8_t>(((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
    isc[0] = 1, imn[0] = 0, *d = f16(b), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    dot32_avx<RW, R>(w, a, nb, out, SIZE, unpack_q5_0, prod_u8s8, true, false, -16.f);
#else
    portable_dot<Q5_0, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q5_1 {
  static constexpr int QK = 32, SIZE = 24, G = 32;
  using Act = A32;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    const uint32_t qh = u32(b + 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>((b[8 + j] & 0x0F) | (((qh >> j) & 1) << 4));
      q[j + 16] = static_cast<int8_t>((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    isc[0] = 1, imn[0] = 1, *d = f16(b), *dm = f16(b + 2);
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    dot32_avx<RW, R>(w, a, nb, out, SIZE, unpack_q5_1, prod_u8s8, true, true, 1.f);
#else
    portable_dot<Q5_1, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q8_0 {
  static constexpr int QK = 32, SIZE = 34, G = 32;
  using Act = A32;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    std::memcpy(q, b + 2, 32);
    isc[0] = 1, imn[0] = 0, *d = f16(b), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    dot32_avx<RW, R>(w, a, nb, out, SIZE, [](const uint8_t* blk) { return load256(blk + 2); }, prod_s8s8, false, false,
                     0.f);
#else
    portable_dot<Q8_0, RW, R>(w, a, nb, out);
#endif
  }
};

// MXFP4 (gpt-oss's experts): 32 4-bit E2M1 codes sharing one power-of-two scale, an E8M0 exponent byte. The codes'
// values are kept doubled as integers ({0, 1, 2, 3, 4, 6, 8, 12} and their negatives), the scale halved.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): the E8M0 scale, halved for the doubled code values (e 0 and 1 are subnormal floats).
constexpr float e8m0_half(uint8_t e) {
  return std::bit_cast<float>(e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23);
}

// e8m0_half of every exponent byte: a block's scale is one load that broadcasts, not bit assembly per block.
constexpr std::array<float, 256> kE8m0Half = [] {
  std::array<float, 256> t{};
  for (int e = 0; e < 256; ++e) t[e] = e8m0_half(static_cast<uint8_t>(e));
  return t;
}();

// IQ4_NL: 32 4-bit codes picking one of 16 non-uniform levels (llama.cpp's kvalues_iq4nl), one float16 scale. Run
// as MXFP4 is: a byte shuffle turns the codes into their levels, which meet the 8-bit activations.
constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The 32-value types whose codes index a table of 16 signed levels: `Scale` reads a block's scale. With `Lift` (the
// levels' largest magnitude, small enough that (level + Lift) * 127 pairs stay in int16), builds without VNNI take
// the activation with its pair offsets (A32Pairs) and skip the sign trick.
template <const int8_t* Table, float (*Scale)(const uint8_t*), int Size, int Lift = 0>
struct TableType {
  static constexpr int QK = 32, SIZE = Size, G = 32, kLift = Lift;
  static constexpr bool kLifted = Lift > 0 && RUNLM_AVX2 && !RUNLM_VNNI;
  static constexpr const int8_t* kLevels = Table;
  using Act = std::conditional_t<kLifted, A32Pairs, A32>;
  static float scale(const uint8_t* b) { return Scale(b); }
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    const uint8_t* codes = b + SIZE - 16;
    for (int j = 0; j < 16; ++j) {
      q[j] = Table[codes[j] & 0x0F];
      q[j + 16] = Table[codes[j] >> 4];
    }
    isc[0] = 1, imn[0] = 0, *d = Scale(b), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    // each (weight row, activation row) pair: one float chain of block sums, whatever the tile
    __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Table)));
    if constexpr (kLifted) table = _mm256_add_epi8(table, _mm256_set1_epi8(Lift));
    __m256 acc[RW * R];
    for (int k = 0; k < RW * R; ++k) acc[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      for (int i = 0; i < RW; ++i) {
        const uint8_t* blk = w[i] + b * SIZE;
        const __m256i q = _mm256_shuffle_epi8(table, nibbles32(blk + SIZE - 16));
        const __m256 dw = _mm256_set1_ps(Scale(blk));
        for (int r = 0; r < R; ++r) {  // dw * da as the scalar product, in a vector (broadcasts are loads)
          const Act& ab = a[r][b];
          __m256i sums;
          if constexpr (kLifted) {  // (level + Lift) * a pairs, less Lift * a pairs: level * a pairs
            sums = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q, load256(ab.qs)),
                                                      load256(reinterpret_cast<const uint8_t*>(ab.pair_offsets))),
                                     ones16());
          } else {
            sums = prod_s8s8(q, load256(ab.qs));
          }
          const __m256 p = _mm256_cvtepi32_ps(sums);
          acc[i * R + r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(&ab.d)), p, acc[i * R + r]);
        }
      }
    }
    for (int k = 0; k < RW * R; ++k) out[k] = hsum_ps(acc[k]);
#else
    portable_dot<TableType, RW, R>(w, a, nb, out);
#endif
  }
};

inline float mxfp4_scale(const uint8_t* b) { return kE8m0Half[b[0]]; }
inline float f16_scale(const uint8_t* b) { return f16(b); }

using MXFP4 = TableType<kMxfp4Values, mxfp4_scale, 17, kMxfp4Lift>;
using IQ4_NL = TableType<kIq4NlValues, f16_scale, 18>;

// The types whose 4-bit codes index a table of signed levels (TableType).
template <class T>
concept TableCodes = requires { T::kLevels; };

// IQ4_XS: IQ4_NL's levels in 256-value super-blocks: one f16 scale d, then for each 32 values a 6-bit scale stored
// with an offset of 32 (low 4 bits in scales_l, high 2 in scales_h), then the codes, 16 bytes per 32 values as
// IQ4_NL lays them out. Run as a K-quant: per-32 integer scales times signed level x activation sums.
struct IQ4_XS {
  static constexpr int QK = QK_K, SIZE = 136, G = 32, D_AT = 0;
  static constexpr bool kMins = false;
#if RUNLM_AVX2
  using Act = AKI;
#else
  using Act = AK;
#endif
  static int sub_scale(const uint8_t* b, int ib) {  // the signed scale of values 32 ib .. 32 ib + 31
    const int low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    const int high = ((b[2] | (b[3] << 8)) >> (2 * ib)) & 3;
    return (low | (high << 4)) - 32;
  }
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    for (int ib = 0; ib < 8; ++ib) {
      const uint8_t* codes = b + 8 + 16 * ib;
      for (int j = 0; j < 16; ++j) {
        q[32 * ib + j] = kIq4NlValues[codes[j] & 0x0F];
        q[32 * ib + 16 + j] = kIq4NlValues[codes[j] >> 4];
      }
      isc[ib] = sub_scale(b, ib);
      imn[ib] = 0;
    }
    *d = f16(b), *dm = 0.f;
  }
#if RUNLM_AVX2
  // The 8 sub_scale values of a super-block as int16, [s0 .. s7] in each 128-bit half (so an unpack and an immediate
  // shuffle spread any one of them): a few vector operations where taking each one out in scalar code cost ten a
  // chunk.
  static __m256i sub_scales16(const uint8_t* b) {
    uint32_t low;
    std::memcpy(&low, b + 4, 4);
    const int high = b[2] | (b[3] << 8);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)),
                                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m256i s32 = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    // packs gives [s0..s3 s0..s3 | s4..s7 s4..s7]; quads 0 and 2 into each half
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(s32, s32), _MM_SHUFFLE(2, 0, 2, 0));
  }
  // pshufb controls: int16 [s(2p) x 8 | s(2p + 1) x 8] from sub_scales16's [s0 .. s7] in each half
  static __m256i pair_scales(__m256i scales, int p) {
    const int lo = 0x0100 * (4 * p + 1) + 4 * p, hi = lo + 0x0202;
    return _mm256_shuffle_epi8(scales, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
  }
#endif
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    kquant_dot<IQ4_XS, RW, R>(w, a, nb, out, [&](const uint8_t* blk, int64_t b, __m256i* sums, __m256i* /*mins*/) {
      __m256i sumi[R];  // kept here, not in *sums, so it can stay in registers
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      const __m256i scales = sub_scales16(blk);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // sub-blocks 2p and 2p + 1: one 32-byte load, the low nibbles then the high
        const __m256i codes = load256(blk + 8 + 32 * p);
        const __m256i q_lo = _mm256_shuffle_epi8(table, _mm256_and_si256(codes, m4));
        const __m256i q_hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(codes, 4), m4));
        const __m256i scv = pair_scales(scales, p);
        // the levels' magnitudes (once for the R rows), the activation codes' signs moved onto the levels
        const __m256i mag_lo = _mm256_sign_epi8(q_lo, q_lo), mag_hi = _mm256_sign_epi8(q_hi, q_hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* aq = a[r][b].qs + 64 * p;
          const __m256i lo = _mm256_maddubs_epi16(mag_lo, _mm256_sign_epi8(load256(aq), q_lo));
          const __m256i hi = _mm256_maddubs_epi16(mag_hi, _mm256_sign_epi8(load256(aq + 32), q_hi));
          sumi[r] = dot_words(dot_words(sumi[r], lo, scv), hi, scv);  // VNNI: vpdpwssd, the same integers
        }
        if constexpr (R > 1)  // (else GCC keeps each row's products for sums at the end, spilling them)
          for (int r = 0; r < R; ++r) asm("" : "+x"(sumi[r]));
      }
      for (int r = 0; r < R; ++r) sums[r] = sumi[r];
    });
#else
    portable_dot<IQ4_XS, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q2_K {
  static constexpr int QK = QK_K, SIZE = 84, G = 16, D_AT = 80;  // D_AT: f16 d, then dmin
  static constexpr bool kMins = true;
  using Act = AK;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) q[128 * h + 32 * s + l] = static_cast<int8_t>((b[16 + 32 * h + l] >> (2 * s)) & 3);
    for (int g = 0; g < 16; ++g) {
      isc[g] = b[g] & 0x0F;
      imn[g] = b[g] >> 4;
    }
    *d = f16(b + 80), *dm = -f16(b + 82);
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    const __m256i m3 = _mm256_set1_epi8(3);
    kquant_dot<Q2_K, RW, R>(w, a, nb, out, [&](const uint8_t* blk, int64_t b, __m256i* sums, __m256i* mins) {
      const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
      const __m128i sc8 = _mm_and_si128(sm, _mm_set1_epi8(0x0F));
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0x0F)));
      __m256i sumi[R];  // kept here, not in *sums, so it can stay in registers
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i bits = load256(blk + 16 + 32 * h);
        for (int s = 0; s < 4; ++s) {
          const int c = 4 * h + s;
          const __m256i q = _mm256_and_si256(bits, m3);
          bits = _mm256_srli_epi16(bits, 2);
          const __m256i scv = scale_pair(sc8, c);
          for (int r = 0; r < R; ++r) sumi[r] = scaled_dot(sumi[r], q, a[r][b].qs + 32 * c, scv);
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = sumi[r], mins[r] = min_products(mins16, a[r][b]);
    });
#else
    portable_dot<Q2_K, RW, R>(w, a, nb, out);
#endif
  }
};

struct Q3_K {
  static constexpr int QK = QK_K, SIZE = 110, G = 16, D_AT = 108;
  static constexpr bool kMins = false;
  using Act = AK;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    int8_t sc[16];
    k3_scales(b + 96, sc);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int low = (b[32 + 32 * h + l] >> (2 * s)) & 3;
          const int hb = (b[l] >> (4 * h + s)) & 1;
          q[128 * h + 32 * s + l] = static_cast<int8_t>(low + 4 * hb - 4);
        }
    for (int g = 0; g < 16; ++g) {
      isc[g] = sc[g];
      imn[g] = 0;
    }
    *d = f16(b + 108), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    kquant_dot<Q3_K, RW, R>(w, a, nb, out, [&](const uint8_t* blk, int64_t b, __m256i* sums, __m256i* /*mins*/) {
      alignas(16) int8_t sc[16];
      k3_scales(blk + 96, sc);
      const __m128i sc8 = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
      __m256i hm = load256(blk);
      __m256i sumi[R];  // kept here, not in *sums, so it can stay in registers
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i bits = load256(blk + 32 + 32 * h);
        for (int s = 0; s < 4; ++s) {
          const int c = 4 * h + s;
          // q' = low2 | high << 2 in 0..7; the weight code is q' - 4
          const __m256i q =
              _mm256_or_si256(_mm256_and_si256(bits, m3), _mm256_and_si256(_mm256_slli_epi16(hm, 2), m4));
          bits = _mm256_srli_epi16(bits, 2);
          hm = _mm256_srli_epi16(hm, 1);
          const __m256i scv = scale_pair(sc8, c);
          for (int r = 0; r < R; ++r) sumi[r] = scaled_dot(sumi[r], q, a[r][b].qs + 32 * c, scv);
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      for (int r = 0; r < R; ++r) sums[r] = with_offset<2>(sumi[r], sc16, a[r][b]);  // codes are q' - 4
    });
#else
    portable_dot<Q3_K, RW, R>(w, a, nb, out);
#endif
  }
};

// Q4_K / Q5_K share everything but the fifth bit.
template <bool FIVE>
struct QK45 {
  static constexpr int QK = QK_K, SIZE = FIVE ? 176 : 144, G = 32, D_AT = 0;
  static constexpr bool kMins = true;
  static constexpr int QS = FIVE ? 48 : 16;  // offset of the nibbles
  using Act = AK;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    uint8_t sc[8], mn[8];
    k4_scale_min(b + 4, sc, mn);
    const uint8_t* qs = b + QS;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * j + l] & 0x0F, hi = qs[32 * j + l] >> 4;
        if (FIVE) {
          lo |= ((b[16 + l] >> (2 * j)) & 1) << 4;
          hi |= ((b[16 + l] >> (2 * j + 1)) & 1) << 4;
        }
        q[64 * j + l] = static_cast<int8_t>(lo);
        q[64 * j + 32 + l] = static_cast<int8_t>(hi);
      }
    for (int g = 0; g < 8; ++g) {
      isc[g] = sc[g];
      imn[g] = mn[g];
    }
    *d = f16(b), *dm = -f16(b + 2);
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    kquant_dot<QK45<FIVE>, RW, R>(w, a, nb, out, [&](const uint8_t* blk, int64_t b, __m256i* sums, __m256i* mins) {
      alignas(16) uint8_t sc[8], mn[8];
      k4_scale_min(blk + 4, sc, mn);
      const __m128i mn8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn));
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // m0 m0 m1 m1 ... per 16
      __m256i hb = FIVE ? load256(blk + 16) : _mm256_setzero_si256();
      __m256i sumi[R];  // kept here, not in *sums, so it can stay in registers
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = load256(blk + QS + 32 * j);
        __m256i ql = _mm256_and_si256(bits, m4);
        __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if (FIVE) {
          ql = _mm256_or_si256(ql, _mm256_and_si256(_mm256_slli_epi16(hb, 4), m16));
          qh = _mm256_or_si256(qh, _mm256_and_si256(_mm256_slli_epi16(hb, 3), m16));
          hb = _mm256_srli_epi16(hb, 2);
        }
        const __m256i scl = _mm256_set1_epi16(sc[2 * j]), sch = _mm256_set1_epi16(sc[2 * j + 1]);
        for (int r = 0; r < R; ++r) {
          const int8_t* aq = a[r][b].qs + 64 * j;
          sumi[r] = scaled_dot(scaled_dot(sumi[r], ql, aq, scl), qh, aq + 32, sch);
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = sumi[r], mins[r] = min_products(mins16, a[r][b]);
    });
#else
    portable_dot<QK45<FIVE>, RW, R>(w, a, nb, out);
#endif
  }
};
using Q4_K = QK45<false>;
using Q5_K = QK45<true>;

struct Q6_K {
  static constexpr int QK = QK_K, SIZE = 210, G = 16, D_AT = 208;
  static constexpr bool kMins = false;
  using Act = AK;
  static void decode(const uint8_t* b, int8_t* q, int* isc, int* imn, float* d, float* dm) {
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int low = (b[64 * h + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0x0F;
          const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
          q[128 * h + 32 * k + l] = static_cast<int8_t>((low | (high << 4)) - 32);
        }
    for (int g = 0; g < 16; ++g) {
      isc[g] = static_cast<int8_t>(b[192 + g]);
      imn[g] = 0;
    }
    *d = f16(b + 208), *dm = 0.f;
  }
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
#if RUNLM_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    kquant_dot<Q6_K, RW, R>(w, a, nb, out, [&](const uint8_t* blk, int64_t b, __m256i* sums, __m256i* /*mins*/) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      __m256i sumi[R];  // kept here, not in *sums, so it can stay in registers
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load256(blk + 64 * h), l1 = load256(blk + 64 * h + 32);
        const __m256i hb = load256(blk + 128 + 32 * h);
        // element 128h + 32k + l: low nibble k/2 of ql[64h + 32(k%2) + l], bits 2k..2k+1 of qh[32h + l]
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)),
        };
        for (int k = 0; k < 4; ++k) {
          const int c = 4 * h + k;
          const __m256i scv = scale_pair(sc8, c);
          for (int r = 0; r < R; ++r) sumi[r] = scaled_dot(sumi[r], q[k], a[r][b].qs + 32 * c, scv);
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      for (int r = 0; r < R; ++r) sums[r] = with_offset<5>(sumi[r], sc16, a[r][b]);  // codes are q - 32
    });
#else
    portable_dot<Q6_K, RW, R>(w, a, nb, out);
#endif
  }
};

