// runlm kernels: 16-row groups (the 512-bit kernels) and AMX tiles.
// A part of kernels.cpp's one translation unit, included in order.
// (DecodeWalk, the decode walk these kernels follow: dot.h)

#if RUNLM_AVX512
// 16-row groups: the 512-bit K-quant kernels. A 512-bit load of a piece holds 4 codes (4 bytes) of each of the 16
// rows (lane i: row i), so one vpdpbusd with the activation's 4 codes broadcast from memory gives 16 rows' partial
// dot products, one row per lane: no shuffles, and the lanes never need reducing. A sub-block's lane sums are exact
// int32; each is multiplied by its row's sub-block scale (vpmulld) into the super-block's integer sum, which goes to
// float in kquant_step's sequence like every other layout (bit-identical results, route invariance).

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

// 4 activation codes at p in every 32-bit lane (the compiler folds it into vpdpbusd's broadcast memory operand)
inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 16 rows' f16 at p as float
inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(load256(p)); }

// The 16-row kernels' weight loads (the vector kernels' and the AMX tiles'): each 64-byte line read comes with a
// prefetch of the line g_walk.line_ahead bytes on where the walk spreads its prefetches that way (DecodeWalk). On
// the Xeon the tiles' prefill, which had kept a burst, ran as fast with this alone (1.00x / 1.02x, 1B Q4_K_M / Q8_0).
inline __m512i load_ahead(const uint8_t* p) {
  if (g_walk.line_ahead) _mm_prefetch(reinterpret_cast<const char*>(p + g_walk.line_ahead), _MM_HINT_T0);
  return load512(p);
}

// The burst walk's prefetch: all of the first 16-row super-block at least the walk's burst distance for blocks of qk
// values after blk (of `size` bytes): the next one for the K-quants, a few on for the 32-wide types' small blocks.
inline void prefetch_burst(const uint8_t* blk, int size, int qk) {
  const int ahead = g_walk.burst_for(qk);
  if (!ahead) return;
  const uint8_t* p = blk + (ahead + size - 1) / size * size;
  for (int o = 0; o < size; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// 16 rows' super-block sums to float (lane i: weight row i), as kquant_step4 does for 4.
inline __m512 kquant_step16(__m512 y, __m512 d, float da, __m512i isum) {
  return _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(da)), _mm512_cvtepi32_ps(isum), y);
}

template <int R>
inline void store_rows16(const __m512* y, float* out) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float o[16];
    _mm512_store_ps(o, y[r]);
    for (int i = 0; i < 16; ++i) out[i * R + r] = o[i];
  }
}

// The 16-row layouts' dot products over S groups at once (g[s]: a group's first byte; out[s]: its 16 x R results):
// super-block b of every group, then b + 1. One group is the plain GEMV; two far-apart groups keep two DRAM streams
// in flight from one core, which a decode GEMV needs on some CPUs to get near a core's read bandwidth (stream_rows). A
// layout L gives its float accumulator chains per activation row (kChains), its super-block step (block: the codes
// of one super-block against R activation rows into the chains) and how the chains end in R results per row
// (finish). Each group's sums run in the same order whatever S is, so the results do not depend on it. kDecode: a
// decode GEMV's walk (stream_rows) with the burst walk's prefetch; the tiles of more activation rows go without it
// (prefill re-reads their weights from cache: the burst cost it 0.92-1.00x) and keep the line prefetch.
template <class L, int R, int S, bool kDecode = false>
inline void dot16(const uint8_t* const* g, const typename L::Act* const* a, int64_t nb, float* const* out) {
  __m512 acc[S][R * L::kChains];
  for (int s = 0; s < S; ++s)
    for (int k = 0; k < R * L::kChains; ++k) acc[s][k] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 1  // one copy of the (large) step: S inlined copies ran slower
    for (int s = 0; s < S; ++s) {
      const uint8_t* blk = g[s] + b * 16 * L::SIZE;
      if constexpr (kDecode) prefetch_burst(blk, 16 * L::SIZE, L::QK);
      L::template block<R>(acc[s], blk, a, b);
    }
  }
  for (int s = 0; s < S; ++s) L::template finish<R>(acc[s], out[s]);
}

// What every 16-row layout L shares: the one-group dot product the drivers call, and the ending of a single chain
// per row (layouts with more chains have their own finish).
template <class L>
struct Rows16 {
  template <int R>
  static void finish(const __m512* y, float* out) { store_rows16<R>(y, out); }

  template <int RW, int R, class Act>  // Act: L::Act (L is not complete where this is declared)
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 16, "these groups are 16 rows here");
    dot16<L, R, 1>(w, a, nb, &out);
  }
};

// Byte shuffle (per 32-bit lane [b0 b1 b2 b3]) to int16 [b(2k) b(2k + 1)] zero-extended, for k = 0 and k = 1; the
// high bytes of the result are zero (0x80 picks nothing).
inline __m512i byte_pair_shuffle(int k) {
  const int8_t z = -128, x = static_cast<int8_t>(2 * k), y = static_cast<int8_t>(2 * k + 1);
  return _mm512_broadcast_i32x4(_mm_setr_epi8(x, z, y, z, x + 4, z, y + 4, z, x + 8, z, y + 8, z, x + 12, z, y + 12, z));
}

// Q4_K and Q5_K in 16-row groups. Sub-blocks 2j and 2j + 1 are the low and high nibbles of pieces 8j..8j + 7 (Q5_K:
// with bits 2j and 2j + 1 of the bytes of qh pieces 0..7 above them); a lane's sum over a sub-block is at most
// 32 * 31 * 127 (exact in int32), times the 6-bit scale. The mins meet the activation's sums of 32 through vpdpwssd on
// int16 pairs (min(2k), min(2k + 1)) x (sum(2k), sum(2k + 1)).
template <bool kFifth>
struct KQuant16 : Rows16<KQuant16<kFifth>> {
  using Plain = QK45<kFifth>;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 16;
  // offsets in the 16 rows' super-block
  static constexpr int D = 0, DMIN = 32, SC = 64, QH = 256, QS = kFifth ? 768 : 256;
  using Act = AK;

  // k4_scale_min for 16 rows: scales 0-3 / 4-7 of row i in lane i's bytes (sc), and the mins as int16 pairs
  // (min(2k), min(2k + 1)) per lane, k = 0 .. 3 (mins)
  [[gnu::always_inline]] static void scales(const uint8_t* blk, __m512i* sc, __m512i* mins) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F), low2 = _mm512_set1_epi8(0x03);
    const __m512i w0 = load_ahead(blk + SC), w1 = load_ahead(blk + SC + 64), w2 = load_ahead(blk + SC + 128);
    sc[0] = _mm512_and_si512(w0, m6);
    sc[1] = _mm512_or_si512(_mm512_and_si512(w2, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), low2), 4));
    const __m512i mn_lo = _mm512_and_si512(w1, m6);
    const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), m4),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), low2), 4));
    const __m512i pair01 = byte_pair_shuffle(0), pair23 = byte_pair_shuffle(1);
    mins[0] = _mm512_shuffle_epi8(mn_lo, pair01), mins[1] = _mm512_shuffle_epi8(mn_lo, pair23);
    mins[2] = _mm512_shuffle_epi8(mn_hi, pair01), mins[3] = _mm512_shuffle_epi8(mn_hi, pair23);
  }

  // The codes of piece 8j + c: sub-block 2j's (low nibbles) in lo, 2j + 1's (high nibbles) in hi; Q5_K: bits 2j and
  // 2j + 1 of each qh byte moved to bit 4 of the code.
  [[gnu::always_inline]] static void codes(const uint8_t* blk, int j, int c, __m512i& lo, __m512i& hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
    const __m512i v = load_ahead(blk + QS + 64 * (8 * j + c));
    lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if constexpr (kFifth) {
      const __m512i bits = j == 0 ? load_ahead(blk + QH + 64 * c) : load512(blk + QH + 64 * c);  // read for every j
      lo = _mm512_or_si512(lo, _mm512_and_si512(j < 2 ? _mm512_slli_epi32(bits, 4 - 2 * j)
                                                      : _mm512_srli_epi32(bits, 2 * j - 4), m16));
      hi = _mm512_or_si512(hi, _mm512_and_si512(j < 2 ? _mm512_slli_epi32(bits, 3 - 2 * j)
                                                      : _mm512_srli_epi32(bits, 2 * j - 3), m16));
    }
  }

  // One activation row's super-block to float: its integer sum, then the mins against the activation's sums of 32,
  // in kquant_step's sequence.
  [[gnu::always_inline]] static __m512 step(__m512 y, __m512 d, __m512 dmin, const __m512i* mins, const AK& ab, __m512i isum) {
    alignas(16) int16_t s32[8];  // the activation's sums over each 32-value sub-block
    _mm_store_si128(reinterpret_cast<__m128i*>(s32), _mm256_castsi256_si128(sums32(ab)));
    __m512i msum = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) msum = _mm512_dpwssd_epi32(msum, mins[k], bcast4(s32 + 2 * k));
    y = kquant_step16(y, d, ab.d, isum);
    return _mm512_fnmadd_ps(_mm512_mul_ps(dmin, _mm512_set1_ps(ab.d)), _mm512_cvtepi32_ps(msum), y);
  }

  static constexpr int kChains = 1;

  // Super-block b (at blk) against activation rows a[0..R), into y[r].
  template <int R>
  [[gnu::always_inline]] static void block(__m512* y, const uint8_t* blk, const Act* const* a, int64_t b) {
    const __m512i byte0 = _mm512_set1_epi32(0xFF);
    __m512i sc[2], mins[4];
    scales(blk, sc, mins);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
      const __m512i s_lo = _mm512_and_si512(_mm512_srli_epi32(sc[j / 2], 16 * (j % 2)), byte0);
      const __m512i s_hi = _mm512_and_si512(_mm512_srli_epi32(sc[j / 2], 16 * (j % 2) + 8), byte0);
      __m512i lo[8], hi[8];
      for (int c = 0; c < 8; ++c) codes(blk, j, c, lo[c], hi[c]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* aq = a[r][b].qs + 64 * j;
        __m512i u_lo = _mm512_setzero_si512(), u_hi = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
          u_lo = _mm512_dpbusd_epi32(u_lo, lo[c], bcast4(aq + 4 * c));
          u_hi = _mm512_dpbusd_epi32(u_hi, hi[c], bcast4(aq + 32 + 4 * c));
        }
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(u_lo, s_lo), _mm512_mullo_epi32(u_hi, s_hi)));
      }
    }
    const __m512 d = f16x16(blk + D), dmin = f16x16(blk + DMIN);
    for (int r = 0; r < R; ++r) y[r] = step(y[r], d, dmin, mins, a[r][b], isum[r]);
  }
};

template <>
struct X4Layout<Q4_K> : KQuant16<false> {};
template <>
struct X4Layout<Q5_K> : KQuant16<true> {};

// Q4_0, Q4_1, Q5_0 and Q5_1 in 16-row groups. Piece c of a block holds values 4c..4c + 3 (low nibbles) and
// 16 + 4c..16 + 4c + 3 (high nibbles) of each row, the fifth bits come from the row's reordered qh (lane i: row i's 32
// bits, so the 4-row layout's shifts apply lane by lane). The codes are unsigned, so they meet the activation in
// vpdpbusd as they are; the offset (-8, -16) or the min comes in through the activation's sum (A32::s), and values
// {0-7, 16-23} and {8-15, 24-31} go to float in two chains per row, as in the 4-row layout: the same results.
template <class T, int M, int QH, int QS>
struct Nibbles16 : Rows16<Nibbles16<T, M, QH, QS>> {
  using Plain = T;
  static constexpr int QK = 32, SIZE = T::SIZE, G = T::G, ROWS = 16;
  static constexpr float kCorrMult = M >= 0 ? 1.f : (QH >= 0 ? -16.f : -8.f);
  using Act = A32;

  static constexpr int kChains = 3;  // per row: two halves, the correction

  template <int R>
  [[gnu::always_inline]] static void block(__m512* y, const uint8_t* blk, const Act* const* a, int64_t b) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = load_ahead(blk + QS + 64 * c);
      lo[c] = _mm512_and_si512(v, m4), hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if constexpr (QH >= 0) {
      const __m512i qh = load_ahead(blk + QH);
      for (int c = 0; c < 4; ++c) {
        lo[c] = _mm512_or_si512(lo[c], _mm512_and_si512(_mm512_srli_epi32(qh, c), m16));
        hi[c] = _mm512_or_si512(hi[c], _mm512_and_si512(_mm512_slli_epi32(qh, 4 - c), m16));
      }
    }
    const __m512 d = f16x16(blk);
    const __m512 c16 = M >= 0 ? f16x16(blk + M) : d;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const A32& ab = a[r][b];
      __m512i u0 = _mm512_setzero_si512(), u1 = _mm512_setzero_si512();
      for (int c : {0, 1}) {
        u0 = _mm512_dpbusd_epi32(u0, lo[c], bcast4(ab.qs + 4 * c));
        u0 = _mm512_dpbusd_epi32(u0, hi[c], bcast4(ab.qs + 16 + 4 * c));
      }
      for (int c : {2, 3}) {
        u1 = _mm512_dpbusd_epi32(u1, lo[c], bcast4(ab.qs + 4 * c));
        u1 = _mm512_dpbusd_epi32(u1, hi[c], bcast4(ab.qs + 16 + 4 * c));
      }
      const __m512 sv = _mm512_mul_ps(d, _mm512_set1_ps(ab.d));
      __m512* yr = y + 3 * r;
      yr[0] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(u0), yr[0]);
      yr[1] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(u1), yr[1]);
      yr[2] = _mm512_fmadd_ps(c16, _mm512_set1_ps(ab.s), yr[2]);
    }
  }

  template <int R>
  static void finish(const __m512* y, float* out) {
    __m512 sum[R];
    for (int r = 0; r < R; ++r)
      sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(kCorrMult), y[3 * r + 2], _mm512_add_ps(y[3 * r], y[3 * r + 1]));
    store_rows16<R>(sum, out);
  }
};
template <>
struct X4Layout<Q4_0> : Nibbles16<Q4_0, -1, -1, 32> {};
template <>
struct X4Layout<Q4_1> : Nibbles16<Q4_1, 32, -1, 64> {};
template <>
struct X4Layout<Q5_0> : Nibbles16<Q5_0, -1, 32, 96> {};
template <>
struct X4Layout<Q5_1> : Nibbles16<Q5_1, 32, 64, 128> {};

// Q8_0 in 16-row groups. The codes are signed, and vpdpbusd takes its first operand unsigned: flipping a code's sign
// bit gives code + 128, so each lane's sum carries 128 * (the activation codes' sum), which comes off as A32::off.
// Values {0-7, 16-23} and {8-15, 24-31} of a block go to float in two chains per row, summed at the end, as the
// 4-row layout and the row layout do (bit-identical results).
template <>
struct X4Layout<Q8_0> : Rows16<X4Layout<Q8_0>> {
  using Plain = Q8_0;
  static constexpr int QK = 32, SIZE = Plain::SIZE, G = Plain::G, ROWS = 16;
  static constexpr int D = 0, QS = 32;  // offsets in the 16 rows' block
  using Act = A32;

  static constexpr int kChains = 2;  // per row: values {0-7, 16-23}, {8-15, 24-31}

  template <int R>
  [[gnu::always_inline]] static void block(__m512* y, const uint8_t* blk, const Act* const* a, int64_t b) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i q[8];  // piece p: codes 4p..4p + 3 of the 16 rows, plus 128
    for (int c = 0; c < 8; ++c) q[c] = _mm512_xor_si512(load_ahead(blk + QS + 64 * c), flip);
    const __m512 d = f16x16(blk + D);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const A32& ab = a[r][b];
      __m512i u0 = _mm512_set1_epi32(-ab.off[0]), u1 = _mm512_set1_epi32(-ab.off[1]);
      for (int c : {0, 1, 4, 5}) u0 = _mm512_dpbusd_epi32(u0, q[c], bcast4(ab.qs + 4 * c));
      for (int c : {2, 3, 6, 7}) u1 = _mm512_dpbusd_epi32(u1, q[c], bcast4(ab.qs + 4 * c));
      const __m512 sv = _mm512_mul_ps(d, _mm512_set1_ps(ab.d));
      y[2 * r] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(u0), y[2 * r]);
      y[2 * r + 1] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(u1), y[2 * r + 1]);
    }
  }

  template <int R>
  static void finish(const __m512* y, float* out) {
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_add_ps(y[2 * r], y[2 * r + 1]);
    store_rows16<R>(sum, out);
  }
};

// IQ4_XS in 16-row groups. Piece 4c + k holds codes 4k..4k + 3 of sub-block c (low nibbles: values 32c + 4k + t,
// high nibbles: 32c + 16 + 4k + t). A byte shuffle turns a code into its level plus 128 (the level with its sign bit
// flipped), the unsigned operand vpdpbusd takes; each lane's sum over a sub-block starts at -128 x the activation's
// sum over those 32 values, so it ends as the exact signed sum the row layout's kernel has, times the 6-bit scale
// (vpmulld) into the super-block's integer sum, which goes to float in kquant_step's sequence (bit-identical).
template <>
struct X4Layout<IQ4_XS> : Rows16<X4Layout<IQ4_XS>> {
  using Plain = IQ4_XS;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 16;
  static constexpr int D = 0, SH = 32, SL = 64, QS = 128;  // offsets in the 16 rows' super-block
  using Act = AK;

  static constexpr int kChains = 1;

  template <int R>
  [[gnu::always_inline]] static void block(__m512* y, const uint8_t* blk, const Act* const* a, int64_t b) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), low4 = _mm512_set1_epi32(0x0F), low2 = _mm512_set1_epi32(3);
    const __m512i table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues))),
        _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i sh = _mm512_cvtepu16_epi32(load256(blk + SH)), sl = load_ahead(blk + SL);
    alignas(16) int16_t s32[R][8];  // each activation row's sums over the 8 sub-blocks
    for (int r = 0; r < R; ++r)
      _mm_store_si128(reinterpret_cast<__m128i*>(s32[r]), _mm256_castsi256_si128(sums32(a[r][b])));
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int c = 0; c < 8; ++c) {
      const __m512i scale = _mm512_sub_epi32(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * c), low4),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * c), low2), 4)),
          _mm512_set1_epi32(32));
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        const __m512i v = load_ahead(blk + QS + 64 * (4 * c + k));
        lo[k] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
        hi[k] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* aq = a[r][b].qs + 32 * c;
        __m512i u = _mm512_set1_epi32(-128 * s32[r][c]);
        for (int k = 0; k < 4; ++k) {
          u = _mm512_dpbusd_epi32(u, lo[k], bcast4(aq + 4 * k));
          u = _mm512_dpbusd_epi32(u, hi[k], bcast4(aq + 16 + 4 * k));
        }
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(u, scale));
      }
    }
    const __m512 d = f16x16(blk + D);
    for (int r = 0; r < R; ++r) y[r] = kquant_step16(y[r], d, a[r][b].d, isum[r]);
  }
};

// Q6_K in 16-row groups. Half h of a super-block (128 values) comes from ql pieces 16h..16h + 15 and qh pieces
// 8h..8h + 7: value 128h + 32m + 4c + t is the low (m = 0, 1) or high (m = 2, 3) nibble of byte t of ql piece
// 16h + 8 (m % 2) + c, with bits 2m of byte t of qh piece 8h + c above it; so codes of the 16-value sub-block
// 8h + 2m + c / 4. A lane's sum over a sub-block is at most 16 * 63 * 127, times the signed 8-bit scale. The codes'
// offset of 32 comes off through the activation's sums of 16 (vpdpwssd on int16 pairs of -32 * scale).
template <>
struct X4Layout<Q6_K> : Rows16<X4Layout<Q6_K>> {
  using Plain = Q6_K;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 16;
  // offsets in the 16 rows' super-block (repack.h): the scales, each quarter's 12 code pieces, d
  static constexpr int SC = 0, QUARTERS = 256, QUARTER = 768, D = 3328;
  using Act = AK;

  // The codes' offset for sub-blocks 4q + 2k and 4q + 2k + 1 (sp: scale piece q): -32 x their scales, as int16 pairs
  // per lane, to meet the activation's sums of 16 in vpdpwssd.
  template <int k>
  [[gnu::always_inline]] static __m512i offset_pair(__m512i sp) {
    const __m512i shuffle = byte_pair_shuffle(k);
    const __m512i pair = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_shuffle_epi8(sp, shuffle), 8), 8);
    return _mm512_mullo_epi16(pair, _mm512_set1_epi16(-32));
  }

  // The codes of pieces c of half h: q[m][col] holds value 128h + 32m + 4c + t of each row in lane byte t.
  [[gnu::always_inline]] static void codes(const uint8_t* blk, int h, int c, __m512i (&q)[4][4], int col) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const uint8_t* quarter = blk + QUARTERS + QUARTER * (2 * h + c / 4) + 64 * (c % 4);
    const __m512i lo = load_ahead(quarter), hi = load_ahead(quarter + 256), bits = load_ahead(quarter + 512);
    q[0][col] = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(_mm512_slli_epi16(bits, 4), m30));
    q[1][col] = _mm512_or_si512(_mm512_and_si512(hi, m4), _mm512_and_si512(_mm512_slli_epi16(bits, 2), m30));
    q[2][col] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4), _mm512_and_si512(bits, m30));
    q[3][col] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hi, 4), m4),
                                _mm512_and_si512(_mm512_srli_epi16(bits, 2), m30));
  }

  static constexpr int kChains = 1;

  template <int R>
  [[gnu::always_inline]] static void block(__m512* y, const uint8_t* blk, const Act* const* a, int64_t b) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    __m512i sp[4];  // scale piece q: row i's scales 4q..4q + 3 (int8) in lane i
    for (int q = 0; q < 4; ++q) {
      sp[q] = load_ahead(blk + SC + 64 * q);
      // the offset: -32 * scale . activation sums of 16, scales as sign-extended int16 pairs
      for (int k = 0; k < 2; ++k) {
        const __m512i offset = k ? offset_pair<1>(sp[q]) : offset_pair<0>(sp[q]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpwssd_epi32(isum[r], offset, bcast4(a[r][b].bsums + 4 * q + 2 * k));
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // pieces c = 4 half .. 4 half + 3: sub-blocks 8h + 2m + half
        __m512i q[4][4];  // [m][c - 4 half]
        for (int cc = 0; cc < 4; ++cc) codes(blk, h, 4 * half + cc, q, cc);
        __m512i scale[4];  // sub-block 8h + 2m + half = scale piece 2h + m / 2, byte 2 (m % 2) + half
        for (int m = 0; m < 4; ++m)
          scale[m] = _mm512_srai_epi32(_mm512_slli_epi32(sp[2 * h + m / 2], 24 - 8 * (2 * (m % 2) + half)), 24);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* aq = a[r][b].qs + 128 * h + 16 * half;
          for (int m = 0; m < 4; ++m) {
            __m512i u = _mm512_setzero_si512();
            for (int cc = 0; cc < 4; ++cc) u = _mm512_dpbusd_epi32(u, q[m][cc], bcast4(aq + 32 * m + 4 * cc));
            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(u, scale[m]));
          }
        }
      }
    }
    const __m512 d = f16x16(blk + D);
    for (int r = 0; r < R; ++r) y[r] = kquant_step16(y[r], d, a[r][b].d, isum[r]);
  }
};
#endif

constexpr int64_t kMTile = 64;              // activation rows per tile (their quantized blocks stay in L2)
// The tiles' activation rows per pass over the weights: as many as keep their quantized blocks within ~1 MiB (L2),
// up to a prefill chunk. Each pass unpacks every super-block's scaled codes once for all its rows, so 64-row passes
// unpacked them 4 times for a 256-row chunk, and a 16-row group that met all 256 rows (2.4 MB of activation blocks
// at K = 8192) read them from L3 for every group: Q6_K 2048 x 8192 at 256 rows ran at 60% of its 64-row speed.
constexpr int64_t kTileMaxRows = 256;
constexpr int64_t kTileActBytes = 1 << 20;

#if RUNLM_AMX
// AMX tiles: the integer sums of a 16-row group's super-blocks for 16 activation rows at a time. The 6-bit scale of
// each sub-block splits as 8 * hi + lo (hi, lo < 8), and the codes are multiplied by them before they reach the
// tiles: code * lo and code * hi are at most 31 * 7 = 217, so they are unsigned bytes, and then the scaled sum over
// the whole super-block is one tile product per factor instead of one per sub-block:
//   isum = sum_s scale_s sum_{k in s} q_k a_k = sum_k (q_k lo_s(k)) a_k + 8 sum_k (q_k hi_s(k)) a_k,
// exactly the integers KQuant16 sums (an identity of integers, none of them rounded). tdpbsud takes 16 activation
// rows' codes (16 x 64 signed bytes) against 64 values of the 16 weight rows (16 x 64 unsigned bytes: 4 codes of
// each row side by side, as the 16-row layout already lies), into 16 x 16 int32: row r, lane i is (activation row r,
// weight row i). From the sums on it is KQuant16's arithmetic (mins by vpdpwssd, kquant_step16 in the same
// sequence), so the results are bit for bit the dot kernel's (route invariance).

inline bool amx_usable() {
  static const bool usable = [] {
    const char* env = std::getenv("RUNLM_AMX");
    if (env && std::string(env) == "0") return false;
    // Linux hands out the tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes (what each one holds: KQuantTiles and Q6KTiles).
inline void amx_configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

template <bool kFifth>
struct KQuantTiles {
  using K = KQuant16<kFifth>;
  static void configure() { amx_configure(); }
  static constexpr int64_t kChunkBytes = 1024;               // 64 values of the 16 rows: one tile
  static constexpr int64_t kBlockBytes = 2 * 4 * kChunkBytes;  // a super-block: (lo, hi) x 4 chunks

  // Super-block `blk`'s codes (of the 16 rows) times the low and the high part of their sub-block's scale:
  // [lo, hi][chunk j: 16 tile rows of 64 bytes], chunk j holding values 64j .. 64j + 63 (the low nibbles of pieces
  // 8j .. 8j + 7, then their high nibbles, Q5_K's fifth bits as KQuant16 adds them).
  static void unpack(const uint8_t* blk, const __m512i* sc, uint8_t* out) {
    const __m512i byte0 = _mm512_set1_epi32(0xFF), seven = _mm512_set1_epi32(7);
    for (int j = 0; j < 4; ++j) {
      __m512i lo_f[2], hi_f[2];  // sub-blocks 2j, 2j + 1: the scale's low and high 3 bits, in both 16-bit halves
      for (int h = 0; h < 2; ++h) {
        const int sb = 2 * j + h;
        const __m512i scale = _mm512_and_si512(_mm512_srli_epi32(sc[sb / 4], 8 * (sb % 4)), byte0);
        const __m512i lo = _mm512_and_si512(scale, seven), hi = _mm512_srli_epi32(scale, 3);
        lo_f[h] = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));
        hi_f[h] = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
      }
      for (int c = 0; c < 8; ++c) {
        __m512i q[2];
        K::codes(blk, j, c, q[0], q[1]);
        for (int h = 0; h < 2; ++h) {  // a byte times a factor < 8 stays within its byte of the 16-bit product
          uint8_t* row = out + j * kChunkBytes + 64 * (8 * h + c);
          _mm512_storeu_si512(row, _mm512_mullo_epi16(q[h], lo_f[h]));
          _mm512_storeu_si512(row + 4 * kChunkBytes, _mm512_mullo_epi16(q[h], hi_f[h]));
        }
      }
    }
  }

  // y[r * ldy + i] for activation rows r < rows (a multiple of 16, at most kTileMaxRows; blocks act[r * nba + b]) and
  // the 16 rows of the group at `group`. Super-block by super-block: its scaled codes are made once (and stay in
  // L1) for all the activation rows.
  // Tiles 0, 1: activation codes; 2-5: scaled weight codes (lo, hi; two chunks in flight); 6, 7: the sums (lo, hi).
  static void group_rows(const uint8_t* group, int64_t nb, const AK* act, int64_t nba, int64_t rows, float* y,
                         int64_t ldy) {
    const int64_t stride = nba * static_cast<int64_t>(sizeof(AK));
    alignas(64) uint8_t codes[kBlockBytes];
    alignas(64) int32_t sums[2][16][16];  // lo, hi: [activation row][weight row]
    alignas(64) float acc[kTileMaxRows][16];
    for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    const uint8_t* blk = group;
    for (int64_t b = 0; b < nb; ++b, blk += 16 * K::SIZE) {
      __m512i sc[2], mins[4];
      K::scales(blk, sc, mins);
      unpack(blk, sc, codes);
      const __m512 d = f16x16(blk + K::D), dmin = f16x16(blk + K::DMIN);
      for (int64_t m = 0; m < rows; m += 16) {
        const AK* tile_act = act + m * nba + b;
        _tile_zero(6);
        _tile_zero(7);
        for (int j = 0; j < 4; j += 2) {  // two chunks in flight: tiles (0, 2, 3) and (1, 4, 5)
          _tile_loadd(0, tile_act->qs + 64 * j, stride);
          _tile_loadd(2, codes + j * kChunkBytes, 64);
          _tile_loadd(3, codes + (4 + j) * kChunkBytes, 64);
          _tile_loadd(1, tile_act->qs + 64 * (j + 1), stride);
          _tile_loadd(4, codes + (j + 1) * kChunkBytes, 64);
          _tile_loadd(5, codes + (5 + j) * kChunkBytes, 64);
          _tile_dpbsud(6, 0, 2);
          _tile_dpbsud(7, 0, 3);
          _tile_dpbsud(6, 1, 4);
          _tile_dpbsud(7, 1, 5);
        }
        _tile_stored(6, sums[0], 64);
        _tile_stored(7, sums[1], 64);
        for (int r = 0; r < 16; ++r) {
          const __m512i isum = _mm512_add_epi32(load512(sums[0][r]), _mm512_slli_epi32(load512(sums[1][r]), 3));
          _mm512_store_ps(acc[m + r], K::step(_mm512_load_ps(acc[m + r]), d, dmin, mins, tile_act[r * nba], isum));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(acc[r]));
  }
};

// Q6_K on the tiles. Its scales are signed bytes: scale = u0 + 4 u1 + 16 u2 + 64 (u3 - 2) with u = scale + 128 =
// u0 + 4 u1 + 16 u2 + 64 u3 (2-bit digits). Each factor is folded into the codes: code x u0..u2 <= 63 x 3 = 189
// (unsigned bytes), code x (u3 - 2) in -126..63 (signed bytes), so
//   sum_s scale_s sum_{k in s} q_k a_k = sum_p 4^p sum_k (q_k f_p,s(k)) a_k
// is four tile products a super-block instead of sixteen sub-block sums each scaled by a vpmulld; the codes' offset
// of 32 comes off through the activation's sums of 16 as in the vector kernel (X4Layout<Q6_K>), whose float steps
// follow.
struct Q6KTiles {
  using K = X4Layout<Q6_K>;
  static void configure() { amx_configure(); }
  static constexpr int64_t kChunkBytes = 1024;             // 64 values of the 16 rows: one tile
  static constexpr int64_t kParts = 4;                     // codes x u0, u1, u2 (unsigned), x (u3 - 2) (signed)
  static constexpr int64_t kBlockBytes = kParts * 4 * kChunkBytes;

  // Super-block `blk`'s codes as [part][chunk j: 16 tile rows of 64 bytes], chunk j holding values 64j .. 64j + 63:
  // tile row k of chunk j is X4Layout<Q6_K>'s code vector q[m][c] of half h = j / 2, m = 2 (j % 2) + k / 8, c = k % 8.
  static void unpack(const uint8_t* blk, uint8_t* out) {
    const __m512i flip = _mm512_set1_epi32(0x80), byte0 = _mm512_set1_epi32(0xFF), two_bits = _mm512_set1_epi32(3);
    __m512i u[16];  // sub-block s: scale + 128 of each row, in its lane
    for (int q = 0; q < 4; ++q) {
      const __m512i sp = load512(blk + K::SC + 64 * q);
      for (int t = 0; t < 4; ++t) u[4 * q + t] = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi32(sp, 8 * t), byte0), flip);
    }
    for (int h = 0; h < 2; ++h) {
      for (int c4 = 0; c4 < 2; ++c4) {  // pieces c = 4 c4 .. 4 c4 + 3: sub-blocks 8h + 2m + c4
        __m512i factor[4][4];  // [m][p]: factor p of the sub-block's u, in both 16-bit halves of each lane
        for (int m = 0; m < 4; ++m) {
          for (int p = 0; p < 4; ++p) {
            const __m512i f = _mm512_and_si512(_mm512_srli_epi32(u[8 * h + 2 * m + c4], 2 * p), two_bits);
            factor[m][p] = _mm512_or_si512(f, _mm512_slli_epi32(f, 16));
          }
        }
        for (int c = 4 * c4; c < 4 * c4 + 4; ++c) {
          __m512i codes[4][4];  // column 0 used
          K::codes(blk, h, c, codes, 0);
          for (int m = 0; m < 4; ++m) {
            uint8_t* dst = out + (2 * h + m / 2) * kChunkBytes + 64 * (8 * (m % 2) + c);
            // a byte times a factor < 4 stays within its byte of the 16-bit product; the last one less twice
            // the code, byte by byte, is code x (u3 - 2)
            for (int p = 0; p < 3; ++p)
              _mm512_storeu_si512(dst + p * 4 * kChunkBytes, _mm512_mullo_epi16(codes[m][0], factor[m][p]));
            const __m512i top = _mm512_mullo_epi16(codes[m][0], factor[m][3]);
            _mm512_storeu_si512(dst + 3 * 4 * kChunkBytes, _mm512_sub_epi8(top, _mm512_add_epi8(codes[m][0], codes[m][0])));
          }
        }
      }
    }
  }

  static void group_rows(const uint8_t* group, int64_t nb, const AK* act, int64_t nba, int64_t rows, float* y,
                         int64_t ldy) {
    const int64_t stride = nba * static_cast<int64_t>(sizeof(AK));
    alignas(64) uint8_t codes[kBlockBytes];
    alignas(64) int32_t sums[kParts][16][16];  // per part: [activation row][weight row]
    alignas(64) float acc[kTileMaxRows][16];
    for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    const uint8_t* blk = group;
    for (int64_t b = 0; b < nb; ++b, blk += 16 * K::SIZE) {
      unpack(blk, codes);
      __m512i offset[8];  // -32 x (scale 2k, scale 2k + 1) as int16 pairs, k = 0 .. 7 (X4Layout<Q6_K>'s offsets)
      for (int q = 0; q < 4; ++q) {
        const __m512i sp = load512(blk + K::SC + 64 * q);
        offset[2 * q] = K::offset_pair<0>(sp), offset[2 * q + 1] = K::offset_pair<1>(sp);
      }
      const __m512 d = f16x16(blk + K::D);
      for (int64_t m = 0; m < rows; m += 16) {
        const AK* tile_act = act + m * nba + b;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
// Chunk j (values 64j .. 64j + 63) of the 16 activation rows in tile A against the four parts' codes (tiles 2, 3),
// added to the parts' sums (tiles 4-7; the last part signed). A macro: the tile intrinsics take literal tile numbers.
#define RUNLM_Q6K_CHUNK(A, j)                                          \
  _tile_loadd(A, tile_act->qs + 64 * (j), stride);                     \
  _tile_loadd(2, codes + (0 * 4 + (j)) * kChunkBytes, 64);             \
  _tile_loadd(3, codes + (1 * 4 + (j)) * kChunkBytes, 64);             \
  _tile_dpbsud(4, A, 2);                                               \
  _tile_dpbsud(5, A, 3);                                               \
  _tile_loadd(2, codes + (2 * 4 + (j)) * kChunkBytes, 64);             \
  _tile_loadd(3, codes + (3 * 4 + (j)) * kChunkBytes, 64);             \
  _tile_dpbsud(6, A, 2);                                               \
  _tile_dpbssd(7, A, 3);
        RUNLM_Q6K_CHUNK(0, 0)  // chunks alternate between activation tiles 0 and 1
        RUNLM_Q6K_CHUNK(1, 1)
        RUNLM_Q6K_CHUNK(0, 2)
        RUNLM_Q6K_CHUNK(1, 3)
#undef RUNLM_Q6K_CHUNK
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        _tile_stored(6, sums[2], 64);
        _tile_stored(7, sums[3], 64);
        for (int r = 0; r < 16; ++r) {
          const AK& ab = tile_act[r * nba];
          __m512i isum = load512(sums[0][r]);
          for (int p = 1; p < 4; ++p) isum = _mm512_add_epi32(isum, _mm512_slli_epi32(load512(sums[p][r]), 2 * p));
          for (int k = 0; k < 8; ++k) isum = _mm512_dpwssd_epi32(isum, offset[k], bcast4(ab.bsums + 2 * k));
          _mm512_store_ps(acc[m + r], kquant_step16(_mm512_load_ps(acc[m + r]), d, ab.d, isum));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(acc[r]));
  }
};

// Q8_0 on the tiles: its signed codes meet the signed activation codes in tdpbssd, a whole block (32 values) per
// product. The vector kernel sums each block's values {0-7, 16-23} and {8-15, 24-31} in two chains; here the same
// two integers come from two copies of the 16 rows' codes, each with the other half's pieces zeroed, against the
// block's 32 activation bytes as they lie in A32 (no flip, so no 128 x sum to take off: the same sums). From the sums
// on it is the vector kernel's float arithmetic, so the results are its own, bit for bit.
struct Q8_0Tiles {
  using K = X4Layout<Q8_0>;

  // Tiles 0, 1: 16 activation rows' block (32 bytes each); 2, 3: the weights' halves (8 pieces of 64 bytes);
  // 4-7: sums (16 x 16 int32: two halves for each of two 16-row activation tiles).
  static void configure() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.colsb[0] = cfg.colsb[1] = 32;
    cfg.rows[2] = cfg.rows[3] = 8;
    _tile_loadconfig(&cfg);
  }

  // The activation blocks rearranged once per call: block b's codes of all M rows side by side (a 16-row tile is 512
  // contiguous bytes, and a pass's tiles follow each other), then their scales. In A32 order a tile's 16 rows lie
  // K / 32 x 48 bytes apart, and a block of them is too little work to hide that.
  struct Arranged {
    std::vector<int8_t> qs;  // [nb][M][32]
    std::vector<float> d;    // [nb][M]
    int64_t M = 0;
  };
  static Arranged arrange(const A32* act, int64_t M, int64_t nba) {
    Arranged a{std::vector<int8_t>(static_cast<size_t>(nba * M * 32)), std::vector<float>(static_cast<size_t>(nba * M)), M};
    parallel_for(0, nba, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t m = 0; m < M; ++m) {
          std::memcpy(a.qs.data() + (b * M + m) * 32, act[m * nba + b].qs, 32);
          a.d[b * M + m] = act[m * nba + b].d;
        }
    });
    return a;
  }

  // y[r * ldy + i] for activation rows m0 + r, r < rows (a multiple of 16, at most kTileMaxRows), and the 16 rows of
  // the group at `group`.
  static void group_rows(const uint8_t* group, int64_t nb, const Arranged& act, int64_t m0, int64_t rows, float* y,
                         int64_t ldy) {
    alignas(64) uint8_t halves[2][8][64] = {};  // [half][piece]: piece c of the 16 rows in its half, zeros in the other
    alignas(64) int32_t sums[2][2][16][16];  // [activation tile][half][activation row][weight row]
    alignas(64) float acc[kTileMaxRows][2][16];  // the two chains of each activation row, side by side
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_store_ps(acc[r][0], _mm512_setzero_ps());
      _mm512_store_ps(acc[r][1], _mm512_setzero_ps());
    }
    const uint8_t* blk = group;
    for (int64_t b = 0; b < nb; ++b, blk += 16 * K::SIZE) {
      for (int c = 0; c < 8; ++c)  // piece c holds values 4c .. 4c + 3: half 1 for c = 2, 3, 6, 7
        _mm512_store_si512(halves[(c >> 1) & 1][c], load_ahead(blk + K::QS + 64 * c));
      _tile_loadd(2, halves[0], 64);
      _tile_loadd(3, halves[1], 64);
      const __m512 d = f16x16(blk + K::D);
      const int8_t* qs = act.qs.data() + (b * act.M + m0) * 32;
      const float* da = act.d.data() + b * act.M + m0;
      // One 16-row activation tile a step, its sums in tiles 4, 5 or 6, 7 by turns; the float steps of a tile's sums
      // come after the next tile's products are issued, so the vector units work while the tile unit does.
      const auto floats = [&](int64_t m, int t) {
        for (int r = 0; r < 16; ++r) {
          const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(da[m + r]));
          for (int h = 0; h < 2; ++h)
            _mm512_store_ps(acc[m + r][h], _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(load512(sums[t][h][r])),
                                                           _mm512_load_ps(acc[m + r][h])));
        }
      };
// Activation rows m .. m + 15 in tile A against the halves (tiles 2, 3), sums through tiles C0, C1 into sums[t].
// A macro: the tile intrinsics take literal tile numbers.
#define RUNLM_Q8_0_TILE(A, C0, C1, t)      \
  _tile_loadd(A, qs + m * 32, 32);         \
  _tile_zero(C0);                          \
  _tile_zero(C1);                          \
  _tile_dpbssd(C0, A, 2);                  \
  _tile_dpbssd(C1, A, 3);                  \
  _tile_stored(C0, sums[t][0], 64);        \
  _tile_stored(C1, sums[t][1], 64);
      for (int64_t m = 0; m < rows; m += 16) {
        const int t = static_cast<int>((m >> 4) & 1);
        if (t == 0) {
          RUNLM_Q8_0_TILE(0, 4, 5, 0)
        } else {
          RUNLM_Q8_0_TILE(1, 6, 7, 1)
        }
        if (m) floats(m - 16, 1 - t);
      }
#undef RUNLM_Q8_0_TILE
      floats(rows - 16, static_cast<int>(((rows - 16) >> 4) & 1));
    }
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(_mm512_load_ps(acc[r][0]), _mm512_load_ps(acc[r][1])));
  }
};

template <class T>
struct HasTiles : std::false_type {};
template <>
struct HasTiles<X4Layout<Q4_K>> : std::true_type {
  using Tiles = KQuantTiles<false>;
};
template <>
struct HasTiles<X4Layout<Q5_K>> : std::true_type {
  using Tiles = KQuantTiles<true>;
};
template <>
struct HasTiles<X4Layout<Q6_K>> : std::true_type {
  using Tiles = Q6KTiles;
};
template <>
struct HasTiles<X4Layout<Q8_0>> : std::true_type {
  using Tiles = Q8_0Tiles;
};
#endif

template <class T>
struct IsX4 : std::false_type {};
template <class T>
struct IsX4<X4Layout<T>> : std::true_type {};
template <class T>
struct IsX4<X4Rows<T>> : std::true_type {};

