// runlm kernels: the interleaved layouts (4-row groups) and their kernels.
// A part of kernels.cpp's one translation unit, included in order.
// ------------------------------------------------------------------------------------------------------------
// The 4-row interleaved layout ("x4") of the 32-wide types (AVX2 builds; AVX-512 builds group 16 rows, see
// "16-row groups"), made once at load by gguf_repack. Rows 4g..4g+3 form a
// group that takes the same bytes as the four rows did; block b of the group holds each field of the format (the f16
// scale, the f16 min, the 5th bits, the nibbles or bytes) for the 4 rows side by side: [d0 d1 d2 d3][m0 m1 m2 m3]...
// A decode GEMV then reads one stream, converts 4 scales with one instruction, and unpacks 2 rows per 256-bit
// register: [row0 16 bytes | row1 16 bytes] meets the activation's 16 bytes broadcast to both lanes. Q8_0's 32
// bytes are split into two 16-byte fields so every format yields the same pair registers.

struct Field {
  int offset, size;  // in the plain block
};

// Rows per interleaved group: 4, or 16 for the K-quants' 512-bit kernels (X4Fields<T>::ROWS).
struct FourRows {
  static constexpr int ROWS = 4;
};

template <class T>
struct X4Fields;
#if !RUNLM_AVX512
template <>
struct X4Fields<Q4_0> : FourRows {
  static constexpr int N = 2, M = -1, QH = -1, QS = 8;
  static constexpr Field f[N] = {{0, 2}, {2, 16}};
};
template <>
struct X4Fields<Q4_1> : FourRows {
  static constexpr int N = 3, M = 8, QH = -1, QS = 16;
  static constexpr Field f[N] = {{0, 2}, {2, 2}, {4, 16}};
};
template <>
struct X4Fields<Q5_0> : FourRows {
  static constexpr int N = 3, M = -1, QH = 8, QS = 24;
  static constexpr Field f[N] = {{0, 2}, {2, 4}, {6, 16}};
};
template <>
struct X4Fields<Q5_1> : FourRows {
  static constexpr int N = 4, M = 8, QH = 16, QS = 32;
  static constexpr Field f[N] = {{0, 2}, {2, 2}, {4, 4}, {8, 16}};
};
template <>
struct X4Fields<Q8_0> : FourRows {
  static constexpr int N = 3, M = -1, QH = -1, QS = 8;
  static constexpr Field f[N] = {{0, 2}, {2, 16}, {18, 16}};
};
#endif

// The K-quants in x4 (same bytes, one 256-value super-block of 4 rows after another): every field is cut into
// pieces and each piece is stored for the 4 rows side by side, like the 32-wide types. With pieces of 16 bytes a
// 256-bit load gives [row0 piece | row1 piece] (and [row2 | row3] 32 bytes on), which meets 16 activation codes
// broadcast to both lanes; Q4_K's / Q5_K's codes come in pieces of 8 bytes, so one load holds the piece of all 4
// rows.
// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins are cut into their three 32-bit words, so one 128-bit load holds
// word k of the 4 rows and the unpacking runs for 4 rows at once. [4 each]: the 4 rows' pieces side by side.
//   Q4_K (576 bytes): d[4] | dmin[4] | scale words 0, 1, 2 [4 each] | 16 nibble pieces of 8 (qs[8p..8p+8)) [4 each]
//   Q5_K (704 bytes): d[4] | dmin[4] | scale words [4 each] | 4 fifth-bit pieces of 8 (qh) | 16 nibble pieces of 8
//   Q6_K (840 bytes): 8 low-nibble pieces of 16 (ql) | 4 high-bit pieces of 16 (qh) | 2 scale pieces of 8 | d[4]
#if !RUNLM_AVX512
template <>
struct X4Fields<QK45<false>> : FourRows {
  static constexpr int N = 21, QH = -1;
  static constexpr Field f[N] = {{0, 2},   {2, 2},   {4, 4},   {8, 4},   {12, 4},  {16, 8},  {24, 8},
                                 {32, 8},  {40, 8},  {48, 8},  {56, 8},  {64, 8},  {72, 8},  {80, 8},
                                 {88, 8},  {96, 8},  {104, 8}, {112, 8}, {120, 8}, {128, 8}, {136, 8}};
};
#endif
#if !RUNLM_AVX512
template <>
struct X4Fields<QK45<true>> : FourRows {
  static constexpr int N = 25, QH = -1;
  static constexpr Field f[N] = {{0, 2},   {2, 2},   {4, 4},   {8, 4},   {12, 4},  {16, 8},   {24, 8},
                                 {32, 8},  {40, 8},  {48, 8},  {56, 8},  {64, 8},  {72, 8},   {80, 8},
                                 {88, 8},  {96, 8},  {104, 8}, {112, 8}, {120, 8}, {128, 8},  {136, 8},
                                 {144, 8}, {152, 8}, {160, 8}, {168, 8}};
};
#endif
#if !RUNLM_AVX512
template <>
struct X4Fields<Q6_K> : FourRows {
  static constexpr int N = 15, QH = -1;
  static constexpr Field f[N] = {{0, 16},   {16, 16},  {32, 16},  {48, 16},  {64, 16},  {80, 16}, {96, 16}, {112, 16},
                                 {128, 16}, {144, 16}, {160, 16}, {176, 16}, {192, 8}, {200, 8}, {208, 2}};
};
#else
// 16-row groups (the 512-bit kernels): every field cut into pieces of 4 bytes (2 for the f16 scales), each stored for
// the 16 rows side by side, so a 512-bit load holds one piece of all 16 rows: 32-bit lane i is row i's piece.
//   Q4_K (2304 bytes): d[16] | dmin[16] | scale words 0, 1, 2 [16 each] | 32 nibble pieces (qs[4p..4p+4)) [16 each]
//   Q6_K (3360 bytes): 4 scale pieces | for each quarter (half h, pieces c of 4): its 4 ql pieces of the low
//   nibbles' values, 4 of the high nibbles', 4 qh pieces | d[16]
struct SixteenRows {
  static constexpr int ROWS = 16, QH = -1;
};

// The fields of a plain block [0, bytes) cut into pieces of 4 bytes after `f16s` leading f16 values (pieces of 2),
// or, with `tail_f16`, before one trailing f16 value.
template <int N>
constexpr std::array<Field, N> pieces_of_4(int bytes, int f16s, bool tail_f16) {
  std::array<Field, N> f{};
  int k = 0, at = 0;
  for (; k < f16s; ++k, at += 2) f[k] = {at, 2};
  for (; at < bytes - (tail_f16 ? 2 : 0); ++k, at += 4) f[k] = {at, 4};
  if (tail_f16) f[k] = {at, 2};
  return f;
}

template <>
struct X4Fields<QK45<false>> : SixteenRows {
  static constexpr int N = 2 + 3 + 32;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(144, 2, false);
};
//   Q5_K (2816 bytes): as Q4_K, with 8 fifth-bit pieces (qh[4p..4p+4)) [16 each] before the nibbles
template <>
struct X4Fields<QK45<true>> : SixteenRows {
  static constexpr int N = 2 + 3 + 8 + 32;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(176, 2, false);
};
// Q6_K's pieces in the order its kernel reads them, so a decode GEMV streams each super-block front to back: from
// memory 1.2-1.35x the plain field order's speed on an EPYC Zen 4, whose prefetchers lost the four interleaved walks.
template <>
struct X4Fields<Q6_K> : SixteenRows {
  static constexpr int N = 4 + 32 + 16 + 1;
  static constexpr std::array<Field, N> f = [] {
    std::array<Field, N> fields{};
    int k = 0;
    for (int q = 0; q < 4; ++q) fields[k++] = {192 + 4 * q, 4};  // scales
    for (int quarter = 0; quarter < 4; ++quarter) {  // half h = quarter / 2, pieces c = 4 (quarter % 2) .. + 3
      const int h = quarter / 2, c0 = 4 * (quarter % 2);
      for (int c = c0; c < c0 + 4; ++c) fields[k++] = {4 * (16 * h + c), 4};      // ql, low nibbles' values
      for (int c = c0; c < c0 + 4; ++c) fields[k++] = {4 * (16 * h + 8 + c), 4};  // ql, high nibbles' values
      for (int c = c0; c < c0 + 4; ++c) fields[k++] = {128 + 4 * (8 * h + c), 4};  // qh
    }
    fields[k] = {208, 2};  // d
    return fields;
  }();
};
// The 32-wide types: their f16 values [16 each], then pieces of 4 bytes; Q5_0 / Q5_1's fifth bits are one piece,
// reordered as in the 4-row layout (qh_x4_bit).
//   Q4_0 (288 bytes): d[16] | 4 nibble pieces (qs[4p..4p+4)) [16 each]
//   Q4_1 (320 bytes): d[16] | m[16] | 4 nibble pieces [16 each]
//   Q5_0 (352 bytes): d[16] | qh [16] | 4 nibble pieces [16 each]
//   Q5_1 (384 bytes): d[16] | m[16] | qh [16] | 4 nibble pieces [16 each]
//   Q8_0 (544 bytes): d[16] | 8 code pieces (qs[4p..4p+4)) [16 each]
template <>
struct X4Fields<Q4_0> : SixteenRows {
  static constexpr int N = 1 + 4;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(18, 1, false);
};
template <>
struct X4Fields<Q4_1> : SixteenRows {
  static constexpr int N = 2 + 4;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(20, 2, false);
};
template <>
struct X4Fields<Q5_0> : SixteenRows {
  static constexpr int N = 1 + 1 + 4, QH = 32;  // QH: the fifth bits' offset in the 16 rows' block
  static constexpr std::array<Field, N> f = pieces_of_4<N>(22, 1, false);
};
template <>
struct X4Fields<Q5_1> : SixteenRows {
  static constexpr int N = 2 + 1 + 4, QH = 64;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(24, 2, false);
};
template <>
struct X4Fields<Q8_0> : SixteenRows {
  static constexpr int N = 1 + 8;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(34, 1, false);
};
//   IQ4_XS (2176 bytes): d[16] | scales_h[16] | scales_l [16] | 32 code pieces (qs[4p..4p+4)) [16 each]
template <>
struct X4Fields<IQ4_XS> : SixteenRows {
  static constexpr int N = 3 + 32;
  static constexpr std::array<Field, N> f = [] {
    std::array<Field, N> fields{};
    fields[0] = {0, 2}, fields[1] = {2, 2}, fields[2] = {4, 4};
    for (int p = 0; p < 32; ++p) fields[3 + p] = {8 + 4 * p, 4};
    return fields;
  }();
};
#endif

// The x4 layout reorders the 32 fifth bits of Q5_0 / Q5_1 so that 32-bit variable shifts put each one at bit 4 of
// its element's byte: element e < 16 (d = e / 4, j = e % 4) moves to bit 8j + d + 4, read by a right shift by d;
// element 16 + e moves to bit 8j + d, read by a left shift by 4 - d.
inline int qh_x4_bit(int e) {
  const int lo = e < 16, k = lo ? e : e - 16, d = k / 4, j = k % 4;
  return 8 * j + d + (lo ? 4 : 0);
}

inline uint32_t qh_move(uint32_t v, bool to_plain) {
  uint32_t out = 0;
  for (int e = 0; e < 32; ++e) {
    const int from = to_plain ? qh_x4_bit(e) : e, to = to_plain ? e : qh_x4_bit(e);
    out |= ((v >> from) & 1u) << to;
  }
  return out;
}

// Where field k starts in an x4 block: after every earlier field's pieces for all the group's rows.
template <class T>
constexpr int x4_field_base(int k) {
  int base = 0;
  for (int j = 0; j < k; ++j) base += X4Fields<T>::ROWS * X4Fields<T>::f[j].size;
  return base;
}

// One field of row i between an x4 block and a plain block; offsets and sizes are compile-time constants, so
// each copy is a single move (a load regroups every weight byte through here).
template <class T, bool TO_PLAIN, int K>
inline void x4_move_field(uint8_t* x4, int i, uint8_t* plain) {
  constexpr Field f = X4Fields<T>::f[K];
  constexpr int base = x4_field_base<T>(K);
  uint8_t* a = x4 + base + i * f.size;
  if constexpr (base == X4Fields<T>::QH) {  // 4 bytes of fifth bits, reordered
    const uint32_t v = qh_move(u32(TO_PLAIN ? a : plain + f.offset), TO_PLAIN);
    std::memcpy(TO_PLAIN ? plain + f.offset : a, &v, 4);
  } else if constexpr (TO_PLAIN) {
    std::memcpy(plain + f.offset, a, f.size);
  } else {
    std::memcpy(a, plain + f.offset, f.size);
  }
}

template <class T, bool TO_PLAIN, int... K>
inline void x4_move_fields(uint8_t* x4, int i, uint8_t* plain, std::integer_sequence<int, K...>) {
  (x4_move_field<T, TO_PLAIN, K>(x4, i, plain), ...);
}

// Copy row i (0..ROWS - 1) of x4 block `x4` back into a plain block, or the reverse.
template <class T, bool TO_PLAIN>
inline void x4_move(uint8_t* x4, int i, uint8_t* plain) {
  x4_move_fields<T, TO_PLAIN>(x4, i, plain, std::make_integer_sequence<int, X4Fields<T>::N>{});
}

// The x4 kernels' portable path: rebuild the 4 rows in the row layout and run the row layout's kernel on them, so
// the results are the row layout's.
template <class T, int R>
void x4_portable_dot(const uint8_t* group, const typename T::Act* const* a, int64_t nb, float* out) {
  thread_local std::vector<uint8_t> plain;
  plain.resize(static_cast<size_t>(4 * nb * T::SIZE));
  const uint8_t* rows[4];
  for (int i = 0; i < 4; ++i) {
    uint8_t* row = plain.data() + i * nb * T::SIZE;
    for (int64_t b = 0; b < nb; ++b) x4_move<T, true>(const_cast<uint8_t*>(group) + b * 4 * T::SIZE, i, row + b * T::SIZE);
    rows[i] = row;
  }
  T::template dot<4, R>(rows, a, nb, out);
}

#if RUNLM_AVX2
// [16 bytes at low | 16 bytes at high]
inline __m256i load_pair(const uint8_t* low, const uint8_t* high) {
  return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(high), reinterpret_cast<const __m128i*>(low));
}
#endif

// The float16 scales of 4 Q8_0 blocks, side by side as the x4 layout stores them.
inline uint64_t q8_0_scales4(const uint8_t* const* blocks) {
  uint64_t d = 0;
  for (int i = 0; i < 4; ++i) d |= uint64_t{u32(blocks[i]) & 0xFFFFu} << (16 * i);
  return d;
}

// The 32-wide types' 4-row kernel: w[0] is an x4 group's first byte, or with kRows (Q8_0, and the table types' codes)
// w[0..3] are 4 rows of GGUF's row layout, whose pieces each block's loads gather into the registers the group's loads
// give (for Q8_0 the x4 layout's sums, bit for bit).
template <class T, int R, bool kRows>
void x4_dot32(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out) {
  constexpr int QK = T::QK, SIZE = T::SIZE;
#if RUNLM_AVX2
  using F = X4Fields<T>;
  constexpr bool kQ8 = std::is_same_v<T, Q8_0>, kTable = TableCodes<T>;
  constexpr bool kSigned = kQ8 || kTable;  // codes that are signed values: no offset or min to take off
  static_assert(kSigned || !kRows, "only Q8_0 and table codes are read from rows as groups");
  static_assert(!kTable || kRows, "table codes are read from rows");
  constexpr bool kLifted = [] {  // MXFP4's levels without VNNI: lifted into unsigned bytes (TableType::kLifted)
    if constexpr (kTable) return T::kLifted;
    else return false;
  }();
  constexpr bool kMin = [] {
    if constexpr (kSigned) return false;
    else return X4Fields<T>::M >= 0;
  }();
  constexpr bool kQH = [] {
    if constexpr (kSigned) return false;
    else return X4Fields<T>::QH >= 0;
  }();
  constexpr bool kCorr = !kSigned;
  constexpr float kCorrMult = kMin ? 1.f : (kQH ? -16.f : -8.f);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
  const __m256i shift_lo = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), shift_hi = _mm256_setr_epi32(4, 3, 2, 1, 4, 3, 2, 1);
  const __m256i dd_perm = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  // table codes: the levels, each lifted by kLift where the kernel takes them unsigned (unused by the other types)
  const __m256i levels = [] {
    if constexpr (kTable) {
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(T::kLevels)));
      return kLifted ? _mm256_add_epi8(table, _mm256_set1_epi8(T::kLift)) : table;
    } else {
      return _mm256_setzero_si256();
    }
  }();
  __m256 acc[R];
  __m128 corr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    corr[r] = _mm_setzero_ps();
  }
  const uint8_t* blk = w[0];
  for (int64_t b = 0; b < nb; ++b, blk += 4 * SIZE) {
    __m256i lo01, hi01, lo23, hi23;
    __m128 d4;
    if constexpr (kRows) {
      const uint8_t* r[4];
      for (int i = 0; i < 4; ++i) r[i] = w[i] + b * SIZE;
      // the next group's same blocks, a line every other block: a prefetch a fixed distance on (x4_prefetch) would
      // land inside these rows, which are short (a 2048-wide row is 2176 bytes)
      if (g_walk.line_ahead && (b & 1) == 0)
        for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(r[i] + 4 * nb * SIZE), _MM_HINT_T0);
      if constexpr (kTable) {  // a block's 16 code bytes end it: low nibbles are values 0-15, high ones 16-31
        const __m256i v01 = load_pair(r[0] + SIZE - 16, r[1] + SIZE - 16);
        const __m256i v23 = load_pair(r[2] + SIZE - 16, r[3] + SIZE - 16);
        lo01 = _mm256_shuffle_epi8(levels, _mm256_and_si256(v01, m4));
        hi01 = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v01, 4), m4));
        lo23 = _mm256_shuffle_epi8(levels, _mm256_and_si256(v23, m4));
        hi23 = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v23, 4), m4));
        d4 = _mm_setr_ps(T::scale(r[0]), T::scale(r[1]), T::scale(r[2]), T::scale(r[3]));
      } else {
        lo01 = load_pair(r[0] + 2, r[1] + 2), lo23 = load_pair(r[2] + 2, r[3] + 2);
        hi01 = load_pair(r[0] + 18, r[1] + 18), hi23 = load_pair(r[2] + 18, r[3] + 18);
        d4 = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(q8_0_scales4(r))));
      }
    } else if constexpr (kQ8) {
      x4_prefetch(blk, 4 * SIZE, QK);
      lo01 = load256(blk + F::QS), lo23 = load256(blk + F::QS + 32);
      hi01 = load256(blk + F::QS + 64), hi23 = load256(blk + F::QS + 96);
    } else {
      x4_prefetch(blk, 4 * SIZE, QK);
      const __m256i v01 = load256(blk + F::QS), v23 = load256(blk + F::QS + 32);
      lo01 = _mm256_and_si256(v01, m4), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), m4);
      lo23 = _mm256_and_si256(v23, m4), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), m4);
      if constexpr (kQH) {
        // fifth bits (reordered by the repack, see qh_x4_bit): lane k of q01 holds row k's 32 bits
        const __m256i qh = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::QH)));
        const __m256i q01 = _mm256_permutevar8x32_epi32(qh, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        const __m256i q23 = _mm256_permutevar8x32_epi32(qh, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
        lo01 = _mm256_or_si256(lo01, _mm256_and_si256(_mm256_srlv_epi32(q01, shift_lo), m16));
        hi01 = _mm256_or_si256(hi01, _mm256_and_si256(_mm256_sllv_epi32(q01, shift_hi), m16));
        lo23 = _mm256_or_si256(lo23, _mm256_and_si256(_mm256_srlv_epi32(q23, shift_lo), m16));
        hi23 = _mm256_or_si256(hi23, _mm256_and_si256(_mm256_sllv_epi32(q23, shift_hi), m16));
      }
    }
    if constexpr (!kRows) d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), dd_perm);
    __m128 c4 = d4;
    if constexpr (kMin) c4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + F::M)));
    for (int r = 0; r < R; ++r) {
      const auto& ab = a[r][b];
      const __m256i alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.qs)));
      const __m256i ahi =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.qs + 16)));
      // lanes: [r0 r0 r2 r2 | r1 r1 r3 r3] partial sums, scaled by [d0 d0 d2 d2 | d1 d1 d3 d3]
      __m256i sums;
#if RUNLM_VNNI
      const __m256i zero = _mm256_setzero_si256();
      if constexpr (kSigned) {  // |w| (unsigned) times a carrying w's sign
        const __m256i p01 = dot_bytes(dot_bytes(zero, _mm256_sign_epi8(lo01, lo01), _mm256_sign_epi8(alo, lo01)),
                                      _mm256_sign_epi8(hi01, hi01), _mm256_sign_epi8(ahi, hi01));
        const __m256i p23 = dot_bytes(dot_bytes(zero, _mm256_sign_epi8(lo23, lo23), _mm256_sign_epi8(alo, lo23)),
                                      _mm256_sign_epi8(hi23, hi23), _mm256_sign_epi8(ahi, hi23));
        sums = _mm256_hadd_epi32(p01, p23);
      } else {
        sums = _mm256_hadd_epi32(dot_bytes(dot_bytes(zero, lo01, alo), hi01, ahi),
                                 dot_bytes(dot_bytes(zero, lo23, alo), hi23, ahi));
      }
#else
      if constexpr (kSigned && !kLifted) {  // Q8_0's codes, IQ4_NL's levels (up to 127: the sign trick)
        sums = _mm256_hadd_epi32(_mm256_add_epi32(prod_s8s8(lo01, alo), prod_s8s8(hi01, ahi)),
                                 _mm256_add_epi32(prod_s8s8(lo23, alo), prod_s8s8(hi23, ahi)));
      } else if constexpr (kLifted) {
        // (level + kLift) x a pairs, less kLift x a pairs (the activation's pair_offsets, low and high values'
        // together): level x a over 4 values, exact in int16 (at most 4 * 24 * 127 before the offsets come off); the
        // lanes then sum the values the VNNI builds' lanes sum, so every build gets the same integers
        const __m256i off = _mm256_add_epi16(
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.pair_offsets))),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.pair_offsets + 8))));
        const __m256i x01 = _mm256_sub_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo01, alo), _mm256_maddubs_epi16(hi01, ahi)), off);
        const __m256i x23 = _mm256_sub_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo23, alo), _mm256_maddubs_epi16(hi23, ahi)), off);
        sums = _mm256_madd_epi16(_mm256_hadd_epi16(x01, x23), ones16());
      } else {
        // codes <= 31: the pair sums of low and high codes added (4 products) and those added in pairs (8, at most
        // 8 * 31 * 127 = 31496) stay within int16, so one vpmaddwd widens what two and a vphaddd summed (the
        // same integers: 1.1x the 8-stream steps of SmolLM2's Q4_1 on an EPYC Zen 1)
        const __m256i x01 = _mm256_add_epi16(_mm256_maddubs_epi16(lo01, alo), _mm256_maddubs_epi16(hi01, ahi));
        const __m256i x23 = _mm256_add_epi16(_mm256_maddubs_epi16(lo23, alo), _mm256_maddubs_epi16(hi23, ahi));
        sums = _mm256_madd_epi16(_mm256_hadd_epi16(x01, x23), ones16());
      }
#endif
      const __m256 f = _mm256_cvtepi32_ps(sums);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dd, _mm256_set1_ps(ab.d)), f, acc[r]);
      if constexpr (kCorr) corr[r] = _mm_fmadd_ps(c4, _mm_set1_ps(ab.s), corr[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 h = _mm_hadd_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));  // r0 r2 r1 r3
    __m128 v = _mm_shuffle_ps(h, h, _MM_SHUFFLE(3, 1, 2, 0));
    if constexpr (kCorr) v = _mm_fmadd_ps(_mm_set1_ps(kCorrMult), corr[r], v);
    alignas(16) float o[4];
    _mm_store_ps(o, v);
    for (int i = 0; i < 4; ++i) out[i * R + r] = o[i];
  }
#else
  if constexpr (kRows) {
    T::template dot<4, R>(w, a, nb, out);
  } else {
    x4_portable_dot<T, R>(w[0], a, nb, out);
  }
#endif
}

// x4_dot32 as a kernel type: dot<4, R> on 4 rows of the row layout (kRows) or, else, on an x4 group (w[0] is the
// group's first byte; rows w[0..3] of the plain kernels' convention).
template <class T, bool kRows>
struct X4Dot32 {
  static constexpr int QK = T::QK, SIZE = T::SIZE, G = T::G, ROWS = 4;
  using Act = typename T::Act;
  using Plain = T;

  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 4, "4 rows at a time");
    x4_dot32<T, R, kRows>(w, a, nb, out);
  }
};

template <class T>
struct X4Layout : X4Dot32<T, false> {};

// Q8_0 weights in GGUF's row layout run by the x4 kernel, 4 rows at a time: the x4 layout's results, with the weights
// read where the file maps them instead of regrouped into a copy at load. The 4-row builds keep Q8_0 so (group_rows
// 0): on an Intel Xeon (avx2, 2 threads) the 1B Q8_0 shape loaded in 0.18 s against 0.6 regrouped (most of that the
// first touches of the copy's fresh pages), decoded at 15.8-16.3 tok/s against 15.0-15.2, and its GEMMs of many rows
// regroup each tile as they go (gemm), at 0.98x the regrouped weights' speed.
constexpr bool kQ8_0InRows = RUNLM_AVX2 && !RUNLM_AVX512;

// The table types (MXFP4, gpt-oss's experts; IQ4_NL) read the same way, in every vector build: 4 rows' codes side by
// side meet an activation block in one pass, where the row kernel (TableType::dot) converts, scales and adds each
// (row, activation row) pair's sums alone. Their blocks are left in the file's layout, which llama.cpp reads too.
constexpr bool kTablesInRows = RUNLM_AVX2;

// Q8_0 rows [0, rows) (a multiple of 4; rows row_bytes apart, nb blocks each) into the x4 layout at out.
inline void q8_0_to_x4(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t nb, uint8_t* out) {
  constexpr int S = Q8_0::SIZE;
  for (int64_t g = 0; g < rows; g += 4) {
    const uint8_t* r[4];
    for (int i = 0; i < 4; ++i) r[i] = w + (g + i) * row_bytes;
    uint8_t* o = out + g * row_bytes;
    for (int64_t b = 0; b < nb; ++b, o += 4 * S) {
#if RUNLM_AVX2
      const uint64_t d = q8_0_scales4(r);
      std::memcpy(o, &d, 8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8), load_pair(r[0] + 2, r[1] + 2));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 40), load_pair(r[2] + 2, r[3] + 2));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 72), load_pair(r[0] + 18, r[1] + 18));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 104), load_pair(r[2] + 18, r[3] + 18));
#else
      for (int i = 0; i < 4; ++i) x4_move<Q8_0, false>(o, i, const_cast<uint8_t*>(r[i]));
#endif
      for (int i = 0; i < 4; ++i) r[i] += S;
    }
  }
}

template <class T>
struct X4Rows : X4Dot32<T, true> {};

// The K-quants' x4 kernels. Each 256-bit register holds one piece of the 4 rows' codes (Q4_K, Q5_K: 8 codes of
// each row; Q6_K: 16 codes of two rows) and meets the activation codes of those positions broadcast to match. Byte
// dot products (vpdpbusd with AVX-512 VNNI) are packed to int16 while they fit and scaled per sub-block by int16
// pair sums (vpdpwssd; vpmaddwd + vpaddd otherwise: the same integers). A super-block's integer sums per (weight
// row, activation row) are exact, and go to float once in kquant_step's sequence: results do not depend on how
// many activation rows a call has (route invariance) and equal the row layout's bit for bit.

#if RUNLM_AVX2

// 16 bytes at p in both 128-bit lanes
inline __m256i bcast16(const void* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes at p in every 64 bits
inline __m256i bcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// The 4 rows' f16 at p as float [x0 x1 x2 x3]
inline __m128 f16x4(const uint8_t* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// int32 [r0 r1 r2 r3] from lanes [r0 r0 r2 r2 | r1 r1 r3 r3] (exact: integer sums)
inline __m128i rows4_from_pairs(__m256i x) {
  const __m128i t = _mm_hadd_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));  // r0 r2 r1 r3
  return _mm_shuffle_epi32(t, _MM_SHUFFLE(3, 1, 2, 0));
}

// int32 [r0 r1 r2 r3] from lanes [r0 x 4 | r1 x 4] and [r2 x 4 | r3 x 4]
inline __m128i rows4(__m256i x01, __m256i x23) { return rows4_from_pairs(_mm256_hadd_epi32(x01, x23)); }

// The 4 rows' super-block sums to float in kquant_step's sequence (lane i: weight row i): y = fma(d * da, isum, y),
// then, with mins, y = fma(-(dmin * da), msum, y), the same operations as the row layout's kernels.
inline __m128 kquant_step4(__m128 y, __m128 d, float da, __m128i isum) {
  return _mm_fmadd_ps(_mm_mul_ps(d, _mm_set1_ps(da)), _mm_cvtepi32_ps(isum), y);
}
inline __m128 kquant_min_step4(__m128 y, __m128 dmin, float da, __m128i msum) {
  return _mm_fnmadd_ps(_mm_mul_ps(dmin, _mm_set1_ps(da)), _mm_cvtepi32_ps(msum), y);
}

template <int R>
inline void store_rows4(const __m128* y, float* out) {
  for (int r = 0; r < R; ++r) {
    alignas(16) float o[4];
    _mm_store_ps(o, y[r]);
    for (int i = 0; i < 4; ++i) out[i * R + r] = o[i];
  }
}

// The 6-bit scales and mins of a Q4_K / Q5_K x4 super-block (k4_scale_min for the 4 rows at once, one 32-bit word
// of each row per lane): row i's 8 scales in sc_lo / sc_hi byte lane i (scales 0-3 / 4-7), mins alike.
struct K4Scales {
  __m128i sc_lo, sc_hi, mn_lo, mn_hi;
  explicit K4Scales(const uint8_t* p) {
    const __m128i m6 = _mm_set1_epi8(0x3F), low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
    const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    const __m128i w2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
    sc_lo = _mm_and_si128(w0, m6), mn_lo = _mm_and_si128(w1, m6);
    sc_hi = _mm_or_si128(_mm_and_si128(w2, low4), _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w0, 6), low2), 4));
    mn_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(w2, 4), low4),
                         _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w1, 6), low2), 4));
  }
  // int16 [row 2p: 8 values | row 2p + 1: 8 values] of the scales (or the mins)
  static __m256i pair16(__m128i lo, __m128i hi, int p) {
    return _mm256_cvtepu8_epi16(p == 0 ? _mm_unpacklo_epi32(lo, hi) : _mm_unpackhi_epi32(lo, hi));
  }
};

// The activation's sums over each 32-value sub-block (int16, s0..s7) in both lanes.
inline __m256i sums32(const AK& ab) {
  const __m256i s32 = _mm256_madd_epi16(load256(ab.bsums), ones16());
  return _mm256_broadcastsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1)));
}

// Byte shuffles for Q4_K x4 sub-blocks 2j and 2j + 1 from [row 0 scales, row 1 scales] (rows 2 / 3 in the other
// lane): int16 [s0(2j) s0(2j) s1(2j) s1(2j) s0(2j+1) s0(2j+1) s1(2j+1) s1(2j+1)], zero-extended.
alignas(16) const uint8_t kQ4KScaleShuffle[4][16] = {
    {0, 0x80, 0, 0x80, 8, 0x80, 8, 0x80, 1, 0x80, 1, 0x80, 9, 0x80, 9, 0x80},
    {2, 0x80, 2, 0x80, 10, 0x80, 10, 0x80, 3, 0x80, 3, 0x80, 11, 0x80, 11, 0x80},
    {4, 0x80, 4, 0x80, 12, 0x80, 12, 0x80, 5, 0x80, 5, 0x80, 13, 0x80, 13, 0x80},
    {6, 0x80, 6, 0x80, 14, 0x80, 14, 0x80, 7, 0x80, 7, 0x80, 15, 0x80, 15, 0x80},
};


// What the Q4_K and Q5_K x4 kernels share of a super-block of 4 rows (blk; its 6-bit scales at byte `scales_at`):
// the f16 scales, the 6-bit scales for the 4 rows and the mins, and the end of each activation row's part.
struct K4X4Block {
  __m128 d, dmin;
  __m256i sc;     // [row 0 scales, row 1 scales | row 2 scales, row 3 scales]
  __m256i mn[2];  // the mins as int16, for the activation's sums

  K4X4Block(const uint8_t* blk, int scales_at) : d(f16x4(blk)), dmin(f16x4(blk + 8)) {
    const K4Scales ks(blk + scales_at);
    sc = _mm256_set_m128i(_mm_unpackhi_epi32(ks.sc_lo, ks.sc_hi), _mm_unpacklo_epi32(ks.sc_lo, ks.sc_hi));
    mn[0] = K4Scales::pair16(ks.mn_lo, ks.mn_hi, 0), mn[1] = K4Scales::pair16(ks.mn_lo, ks.mn_hi, 1);
  }

  // y (lane i: weight row i) plus this super-block's part for activation block ab, from acc's scaled integer sums
  // in lanes [r0 r1 r0 r1 | r2 r3 r2 r3]: exact isum and msum, then kquant's float steps.
  __m128 finish(__m128 y, __m256i acc, const AK& ab) const {
    const __m256i bs = sums32(ab);
    const __m128i lo = _mm256_castsi256_si128(acc), hi = _mm256_extracti128_si256(acc, 1);
    const __m128i isum = _mm_add_epi32(_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi));
    const __m128i msum = rows4(_mm256_madd_epi16(mn[0], bs), _mm256_madd_epi16(mn[1], bs));
    return kquant_min_step4(kquant_step4(y, d, ab.d, isum), dmin, ab.d, msum);
  }
};

#endif

#if !RUNLM_AVX512
// Q4_K x4: its nibbles come in pieces of 8 bytes, so one 256-bit load holds [r0 | r1 | r2 | r3] 8 bytes each and
// one vpdpbusd meets all 4 rows with 8 activation codes broadcast to every 64 bits. The four loads of a 32-value
// sub-block sum into lanes [r0 r0 r1 r1 | r2 r2 r3 r3], each a sum of 16 products (at most 16 * 15 * 127 = 30480,
// so it fits 16 bits): two sub-blocks' sums are packed to int16 (plain AVX2: vpmaddubsw's pair sums added up and
// then in pairs, in int16 all the way) and multiplied by their scales in one vpmaddwd / vpdpwssd, leaving lanes
// [r0 r1 r0 r1 | r2 r3 r2 r3] (sub-block 2j, then 2j + 1). The plain AVX2 Q5_K and Q6_K kernels keep their products
// in int16 the same way: on an EPYC Zen 1 (one thread, weights in cache, 4-8 rows) Q4_K ran at ~22 GMAC/s either way,
// Q5_K went 12.8 -> 17.6 and Q6_K 12.0 -> 14.4 (no vpmaddwd widens one load's products on their own).
template <>
struct X4Layout<Q4_K> {
  using Plain = Q4_K;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 4;
  static constexpr int SC = 16, QS = 64;  // offsets in the 4 rows' super-block
  using Act = AK;

  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 4, "x4 groups are 4 rows");
#if RUNLM_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m128 y[R];  // lane i: weight row i
    for (int r = 0; r < R; ++r) y[r] = _mm_setzero_ps();
    const uint8_t* blk = w[0];
    for (int64_t b = 0; b < nb; ++b, blk += 4 * SIZE) {
      x4_prefetch(blk, 4 * SIZE, QK);
      const K4X4Block kb(blk, SC);
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
        const __m256i scj = _mm256_shuffle_epi8(kb.sc, bcast16(kQ4KScaleShuffle[j]));
        __m256i lo[4], hi[4];  // elements 8k..8k + 7 of the two sub-blocks
        for (int k = 0; k < 4; ++k) {
          const __m256i v = load256(blk + QS + 32 * (4 * j + k));
          lo[k] = _mm256_and_si256(v, m4), hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* aq = a[r][b].qs + 64 * j;
#if RUNLM_VNNI
          __m256i u_lo = _mm256_setzero_si256(), u_hi = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            u_lo = dot_bytes(u_lo, lo[k], bcast8(aq + 8 * k));
            u_hi = dot_bytes(u_hi, hi[k], bcast8(aq + 32 + 8 * k));
          }
          acc[r] = dot_words(acc[r], _mm256_packs_epi32(u_lo, u_hi), scj);
#else
          // int16 lanes [r0 x 4, r1 x 4 | r2 x 4, r3 x 4], each a sum of 8 products (at most 8 * 15 * 127 = 15240),
          // then added in pairs (16 products, at most 30480): lanes [r0 r0 r1 r1 (2j), r0 r0 r1 r1 (2j + 1) | ...],
          // the packed sums VNNI has, scaled the same way
          __m256i p_lo = _mm256_maddubs_epi16(lo[0], bcast8(aq)), p_hi = _mm256_maddubs_epi16(hi[0], bcast8(aq + 32));
          for (int k = 1; k < 4; ++k) {
            p_lo = _mm256_add_epi16(p_lo, _mm256_maddubs_epi16(lo[k], bcast8(aq + 8 * k)));
            p_hi = _mm256_add_epi16(p_hi, _mm256_maddubs_epi16(hi[k], bcast8(aq + 32 + 8 * k)));
          }
          acc[r] = dot_words(acc[r], _mm256_hadd_epi16(p_lo, p_hi), scj);
#endif
        }
      }
      for (int r = 0; r < R; ++r) y[r] = kb.finish(y[r], acc[r], a[r][b]);
    }
    store_rows4<R>(y, out);
#else
    x4_portable_dot<Plain, R>(w[0], a, nb, out);
#endif
  }
};

#endif

#if !RUNLM_AVX512  // the 4-row Q5_K kernel (16 rows with 512-bit vectors: KQuant16)
#if RUNLM_AVX2
// Byte shuffles for one Q5_K x4 sub-block s from [row 0 scales, row 1 scales] (rows 2 / 3 in the other lane):
// int16 [s0(s) s0(s) s1(s) s1(s)] twice, zero-extended.
alignas(16) const uint8_t kQ5KScaleShuffle[8][16] = {
    {0, 0x80, 0, 0x80, 8, 0x80, 8, 0x80, 0, 0x80, 0, 0x80, 8, 0x80, 8, 0x80},
    {1, 0x80, 1, 0x80, 9, 0x80, 9, 0x80, 1, 0x80, 1, 0x80, 9, 0x80, 9, 0x80},
    {2, 0x80, 2, 0x80, 10, 0x80, 10, 0x80, 2, 0x80, 2, 0x80, 10, 0x80, 10, 0x80},
    {3, 0x80, 3, 0x80, 11, 0x80, 11, 0x80, 3, 0x80, 3, 0x80, 11, 0x80, 11, 0x80},
    {4, 0x80, 4, 0x80, 12, 0x80, 12, 0x80, 4, 0x80, 4, 0x80, 12, 0x80, 12, 0x80},
    {5, 0x80, 5, 0x80, 13, 0x80, 13, 0x80, 5, 0x80, 5, 0x80, 13, 0x80, 13, 0x80},
    {6, 0x80, 6, 0x80, 14, 0x80, 14, 0x80, 6, 0x80, 6, 0x80, 14, 0x80, 14, 0x80},
    {7, 0x80, 7, 0x80, 15, 0x80, 15, 0x80, 7, 0x80, 7, 0x80, 15, 0x80, 15, 0x80},
};
#endif

// Q5_K x4: as Q4_K (pieces of 8 bytes, one vpdpbusd for the 4 rows), but codes up to 31 let only two loads' products
// share a lane within 16 bits (8 * 31 * 127 = 31496): a sub-block's two halves are packed to int16 side by side and
// scaled by one vpmaddwd / vpdpwssd, leaving lanes [r0 r1 r0 r1 | r2 r3 r2 r3] like Q4_K.
template <>
struct X4Layout<Q5_K> {
  using Plain = Q5_K;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 4;
  static constexpr int SC = 16, QH = 64, QS = 192;  // offsets in the 4 rows' super-block
  using Act = AK;

  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 4, "x4 groups are 4 rows");
#if RUNLM_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    __m128 y[R];  // lane i: weight row i
    for (int r = 0; r < R; ++r) y[r] = _mm_setzero_ps();
    const uint8_t* blk = w[0];
    for (int64_t b = 0; b < nb; ++b, blk += 4 * SIZE) {
      x4_prefetch(blk, 4 * SIZE, QK);
      const K4X4Block kb(blk, SC);
      __m256i hb[4];  // fifth bits of elements 8k..8k + 7 (bit 2j: sub-block 2j, bit 2j + 1: sub-block 2j + 1)
      for (int k = 0; k < 4; ++k) hb[k] = load256(blk + QH + 32 * k);
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
        const __m256i s_lo = _mm256_shuffle_epi8(kb.sc, bcast16(kQ5KScaleShuffle[2 * j]));
        const __m256i s_hi = _mm256_shuffle_epi8(kb.sc, bcast16(kQ5KScaleShuffle[2 * j + 1]));
        __m256i lo[4], hi[4];  // elements 8k..8k + 7 of the two sub-blocks
        for (int k = 0; k < 4; ++k) {
          const __m256i v = load256(blk + QS + 32 * (4 * j + k));
          const __m256i qh = _mm256_srli_epi16(hb[k], 2 * j);
          lo[k] = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m16));
          hi[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                  _mm256_and_si256(_mm256_slli_epi16(qh, 3), m16));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* aq = a[r][b].qs + 64 * j;
#if RUNLM_VNNI
          const __m256i z = _mm256_setzero_si256();
          const __m256i l01 = dot_bytes(dot_bytes(z, lo[0], bcast8(aq)), lo[1], bcast8(aq + 8));
          const __m256i l23 = dot_bytes(dot_bytes(z, lo[2], bcast8(aq + 16)), lo[3], bcast8(aq + 24));
          const __m256i h01 = dot_bytes(dot_bytes(z, hi[0], bcast8(aq + 32)), hi[1], bcast8(aq + 40));
          const __m256i h23 = dot_bytes(dot_bytes(z, hi[2], bcast8(aq + 48)), hi[3], bcast8(aq + 56));
          acc[r] = dot_words(dot_words(acc[r], _mm256_packs_epi32(l01, l23), s_lo), _mm256_packs_epi32(h01, h23), s_hi);
#else
          // two loads' pair sums added (4 products), then in pairs (8, at most 31496) within int16: the lanes the
          // packed int32 sums have with VNNI, without widening each load's products on their own
          const auto two = [&](const __m256i* q, int at) {  // loads q[0], q[1] against activation codes at, at + 8
            return _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast8(aq + at)),
                                    _mm256_maddubs_epi16(q[1], bcast8(aq + at + 8)));
          };
          const auto pairs = [&](const __m256i* q, int at) { return _mm256_hadd_epi16(two(q, at), two(q + 2, at + 16)); };
          acc[r] = dot_words(dot_words(acc[r], pairs(lo, 0), s_lo), pairs(hi, 32), s_hi);
#endif
        }
      }
      for (int r = 0; r < R; ++r) y[r] = kb.finish(y[r], acc[r], a[r][b]);
    }
    store_rows4<R>(y, out);
#else
    x4_portable_dot<Plain, R>(w[0], a, nb, out);
#endif
  }
};
#endif  // !RUNLM_AVX512

#if !RUNLM_AVX512
#if RUNLM_AVX2
// Byte shuffles for Q6_K x4 sub-blocks 8h + 2k and 8h + 2k + 1 from int16 [row's 8 scales of half h | row + 1's]:
// int16 [s(2k) x 4, s(2k+1) x 4] in each lane.
alignas(16) const uint8_t kQ6KScaleShuffle[4][16] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15},
};
#endif

// Q6_K x4: a 16-value sub-block of a row pair meets its activation codes in one vpdpbusd (lanes [row x 4 | row + 1
// x 4], each a sum of 4 products, at most 4 * 63 * 127 = 32004, so it fits 16 bits); two sub-blocks' results are
// packed to int16 and multiplied by their scales in one vpmaddwd / vpdpwssd. The codes' offset of 32 comes off
// through the activation's sums of 16.
template <>
struct X4Layout<Q6_K> {
  using Plain = Q6_K;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 4;
  static constexpr int QL = 0, QH = 512, SC = 768, D = 832;  // offsets in the 4 rows' super-block
  using Act = AK;

  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 4, "x4 groups are 4 rows");
#if RUNLM_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m128 y[R];  // lane i: weight row i
    for (int r = 0; r < R; ++r) y[r] = _mm_setzero_ps();
    const uint8_t* blk = w[0];
    for (int64_t b = 0; b < nb; ++b, blk += 4 * SIZE) {
      x4_prefetch(blk, 4 * SIZE, QK);
      __m256i acc[2][R];  // [pair][activation row]: lanes [row x 4 | row + 1 x 4]
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {  // rows 2p, 2p + 1
        for (int r = 0; r < R; ++r) acc[p][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // elements 128h .. 128h + 127: scales 8h .. 8h + 7
          const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + SC + 32 * h + 16 * p)));
          // the codes' offset of 32: -32 * scales . activation sums of 16 (|32 * scale| <= 4096 fits 16 bits)
          const __m256i offset = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 5));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[p][r] = dot_words(acc[p][r], offset, bcast16(a[r][b].bsums + 8 * h));
          // element 128h + 32k + 16s + l: low nibble k / 2 of ql piece 4h + 2 (k % 2) + s, bits 2k of qh piece 2h + s
          __m256i ql[2][2], qh[2];
          for (int s = 0; s < 2; ++s) {
            qh[s] = load256(blk + QH + 64 * (2 * h + s) + 32 * p);
            for (int k2 = 0; k2 < 2; ++k2) ql[k2][s] = load256(blk + QL + 64 * (4 * h + 2 * k2 + s) + 32 * p);
          }
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) {
            __m256i q[2];  // sub-blocks 8h + 2k + s, s = 0, 1
            for (int s = 0; s < 2; ++s) {
              const __m256i low = k < 2 ? ql[k][s] : _mm256_srli_epi16(ql[k - 2][s], 4);
              const __m256i high = k == 0   ? _mm256_slli_epi16(qh[s], 4)
                                   : k == 1 ? _mm256_slli_epi16(qh[s], 2)
                                   : k == 2 ? qh[s]
                                            : _mm256_srli_epi16(qh[s], 2);
              q[s] = _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m30));
            }
            const __m256i scv = _mm256_shuffle_epi8(sc, bcast16(kQ6KScaleShuffle[k]));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const int8_t* aq = a[r][b].qs + 128 * h + 32 * k;
#if RUNLM_VNNI
              const __m256i zero = _mm256_setzero_si256();
              const __m256i t = _mm256_packs_epi32(dot_bytes(zero, q[0], bcast16(aq)), dot_bytes(zero, q[1], bcast16(aq + 16)));
#else
              // vpmaddubsw's pair sums added in pairs within int16 (4 products, at most 4 * 63 * 127 = 32004): the
              // lanes the packed int32 sums have with VNNI, one multiply fewer than widening them (the same integers)
              const __m256i t = _mm256_hadd_epi16(_mm256_maddubs_epi16(q[0], bcast16(aq)),
                                                  _mm256_maddubs_epi16(q[1], bcast16(aq + 16)));
#endif
              acc[p][r] = dot_words(acc[p][r], t, scv);
            }
          }
        }
      }
      const __m128 d = f16x4(blk + D);
      for (int r = 0; r < R; ++r) y[r] = kquant_step4(y[r], d, a[r][b].d, rows4(acc[0][r], acc[1][r]));
    }
    store_rows4<R>(y, out);
#else
    x4_portable_dot<Plain, R>(w[0], a, nb, out);
#endif
  }
};

#endif

