// Matrix x GGUF-block-matrix kernels for CPU: y[M, N] = x[M, K] @ W[N, K].T with W kept as raw GGML blocks.
//
// Same scheme as llama.cpp's CPU backend (written from the idea, not the code): every activation row is quantized
// once per call to 8-bit blocks (32 values + f32 scale + f32 scale*sum for the 32-wide types; 256 values + f32
// scale + int16 sums of 16 for the K-quants), then each weight block meets each activation block in an integer
// dot product (AVX2: vpmaddubsw unsigned weight x signed activation, vpmaddwd to int32; AVX-512 VNNI: vpdpbusd /
// vpdpwssd, the same integers) that is scaled into a f32 FMA accumulator. Offsets/mins of the weight format (-8,
// -16, -32, -4, or the per-block min) are applied through the activation block sums instead of per element.
//
// Work split: output rows N in parallel (parallel_for: torch's intra-op threads, or OpenMP's in the standalone
// build); inside a thread, tiles of weight rows (~32 KiB) x up to 64 activation rows; each weight block is unpacked
// once for up to 4 activation rows, and with 1-2 activation rows (decode) 4-2 weight rows run together so 4 accumulator chains are in flight
// (32-wide types, 1 row: the 4 rows' integer dots are reduced into one vector, so the f16 scales, the int->float
// conversion and the FMA run once per block for all 4).
//
// Ops (registered under TORCH_LIBRARY(runlm)): gguf_linear (above), gguf_dequantize (weight rows to float32),
// gguf_dequantize_rows (chosen rows only), gguf_relayout (and gguf_relayout_into a given buffer), gguf_simd (1 if
// AVX2 path), gguf_isa (the instruction set built for), rms_norm (a one-pass float32 RMSNorm), decode_attention
// (RoPE + cache write + attention for one new token of one sequence, the float32 reference path), transformer_block
// (a whole block for rows of one or more sequences, route-invariant: see "Route-invariant blocks").
//
// Two builds of this file: the PyTorch extension (runlm.quant.kernels: the ops above) and, with -DRUNLM_STANDALONE,
// a plain library with a C interface (runlm.lean.native: the same kernels and blocks, no torch in the process).
// Built with -march=native for the CPU it runs on (each build cached per CPU model and source):
// the AVX2/FMA/F16C path when the compiler targets it, with AVX-512 VNNI dot products where the CPU has them, the
// scalar path otherwise (or with -DRUNLM_SCALAR). All quantize activations identically, so they agree to float
// rounding.

// RUNLM_STANDALONE builds the same kernels without PyTorch, as a plain shared library with a C interface (the
// "C interface" section at the end), for runlm.lean's decode process: threads from OpenMP directly, float16 by its
// own conversions (IEEE round to nearest even, as c10's), no ops registered.
#ifndef RUNLM_STANDALONE
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#else
#include <omp.h>

#include <sstream>
#include <stdexcept>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(RUNLM_SCALAR)
#define RUNLM_AVX2 1
#include <immintrin.h>
#else
#define RUNLM_AVX2 0
#endif

// AVX-512 VNNI (with VL, on 256-bit vectors): one vpdpbusd does a byte dot product's multiply, pair sums and int32
// accumulation; the integer results are exactly those of the AVX2 maddubs / madd sequence it replaces.
#if RUNLM_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RUNLM_VNNI 1
#else
#define RUNLM_VNNI 0
#endif

// 512-bit vectors (F, BW, VNNI): the interleaved layout takes 16 rows instead of 4 (every type), so that one vpdpbusd
// meets 4 codes of 16 weight rows with 4 activation codes broadcast from memory (see "16-row groups").
#if RUNLM_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define RUNLM_AVX512 1
#else
#define RUNLM_AVX512 0
#endif

// AMX (tile registers and int8 tile dot products, Sapphire Rapids and later): the many-row calls (prefill) of the
// 16-row Q4_K / Q5_K / Q6_K / Q8_0 kernels run their integer dot products as 16 x 16 tiles (see "AMX tiles"), when the
// kernel lets the process use the tile state and RUNLM_AMX is not 0.
#if RUNLM_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RUNLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define RUNLM_AMX 0
#endif

namespace {

// A failed check: c10::Error (a RuntimeError in Python) in the extension, std::runtime_error in the standalone build
// (its C interface turns it into an error code and rl_last_error's text).
#ifndef RUNLM_STANDALONE
#define RUNLM_CHECK TORCH_CHECK
#else
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  throw std::runtime_error(text.str());
}
#define RUNLM_CHECK(cond, ...) \
  do {                         \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)
#endif

// Work over [begin, end) split into one contiguous range per thread, at least `grain` items each: torch's intra-op
// pool (at::parallel_for) in the extension, OpenMP with the same split in the standalone build. Calls from inside
// a parallel region run inline.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifndef RUNLM_STANDALONE
  at::parallel_for(begin, end, grain, f);
#else
  if (begin >= end) return;
  const int64_t most = omp_get_max_threads();
  if (end - begin <= grain || most == 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t threads = std::min<int64_t>(most, (end - begin + grain - 1) / std::max<int64_t>(grain, 1));
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t n = omp_get_num_threads(), chunk = (end - begin + n - 1) / n;
    const int64_t b = begin + omp_get_thread_num() * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  }
#endif
}

// IEEE float16 <-> float32, round to nearest even: F16C where the build has it, else in integer arithmetic.
#ifndef RUNLM_STANDALONE
using Half = c10::Half;
#else
struct Half {
  uint16_t x;
};
#endif

inline float half_to_float(uint16_t h) {
#if RUNLM_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: shift the leading one into the implicit bit
    uint32_t m = mantissa, shifts = 0;
    while (!(m & 0x400u)) m <<= 1, ++shifts;
    bits = sign | ((113 - shifts) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t float_to_half(float value) {
#if RUNLM_AVX2
  return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  bits &= 0x7fffffffu;
  uint16_t out;
  if (bits >= 0x47800000u) {  // >= 65536 (rounds to infinity), infinity or NaN
    out = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < 0x38800000u) {  // below 2^-14: a float add aligns the value to the subnormal grid, rounding
    const uint32_t magic_bits = 0x3f000000u;  // 0.5: its ulp is 2^-24, the subnormal step
    float magic, sum;
    std::memcpy(&magic, &magic_bits, 4);
    std::memcpy(&sum, &bits, 4);
    sum += magic;
    uint32_t sum_bits;
    std::memcpy(&sum_bits, &sum, 4);
    out = static_cast<uint16_t>(sum_bits - magic_bits);
  } else {  // rebias the exponent, round the 13 dropped bits to nearest even
    const uint32_t odd = (bits >> 13) & 1u;
    bits += 0xc8000fffu + odd;  // (15 - 127) << 23, plus just under half an ulp
    out = static_cast<uint16_t>(bits >> 13);
  }
  return static_cast<uint16_t>(out | sign);
#endif
}

// GGML type ids (gguf.GGMLQuantizationType values).
enum : int64_t {
  T_Q4_0 = 2,
  T_Q4_1 = 3,
  T_Q5_0 = 6,
  T_Q5_1 = 7,
  T_Q8_0 = 8,
  T_Q2_K = 10,
  T_Q3_K = 11,
  T_Q4_K = 12,
  T_Q5_K = 13,
  T_Q6_K = 14,
};
// A type id plus X4 names the same blocks in the interleaved layout (see X4 below; groups of 4 rows, 16 on AVX-512
// builds): the 32-wide types and Q4_K, Q5_K, Q6_K.
constexpr int64_t X4 = 256;

constexpr int QK_K = 256;

// Quantized activation blocks.
struct A32 {
  float d;  // scale: x ~= d * qs
  float s;  // d * sum(qs)
  int32_t off[2];  // 128 * sum(qs) over values {0-7, 16-23} and {8-15, 24-31}, for the 16-row Q8_0 kernel (AVX-512)
  int8_t qs[32];
};

// A32::off from its codes: the two halves of a block that the 16-row Q8_0 kernel sums in separate chains.
inline void set_half_offsets(A32& a) {
  int s0 = 0, s1 = 0;
  for (int j = 0; j < 8; ++j) {
    s0 += a.qs[j] + a.qs[16 + j];
    s1 += a.qs[8 + j] + a.qs[24 + j];
  }
  a.off[0] = 128 * s0, a.off[1] = 128 * s1;
}

struct AK {
  float d;
  int16_t bsums[16];  // sum of each 16 consecutive qs
  int8_t qs[QK_K];
};

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if RUNLM_AVX2
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 6-bit scales and mins of Q4_K / Q5_K (12 bytes -> 8 + 8).
inline void k4_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 16 signed 6-bit scales of Q3_K (12 bytes), already minus 32.
inline void k3_scales(const uint8_t* s, int8_t* sc) {
  for (int k = 0; k < 16; ++k) {
    const int low = (s[k % 8] >> (4 * (k / 8))) & 0x0F;
    const int high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    sc[k] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// ------------------------------------------------------------------------------------------------------------
// Activation quantization

inline void quantize_a32_scalar(const float* x, A32* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
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
    y[b].d = amax / 127.f;
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

#else

inline void quantize_a32(const float* x, A32* y, int64_t nb) { quantize_a32_scalar(x, y, nb); }
inline void quantize_ak(const float* x, AK* y, int64_t nb) { quantize_ak_scalar(x, y, nb); }

#endif

inline void quantize_row(const float* x, A32* y, int64_t nb) { quantize_a32(x, y, nb); }
inline void quantize_row(const float* x, AK* y, int64_t nb) { quantize_ak(x, y, nb); }

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

template <class T, int RW, int R>
void scalar_dot(const uint8_t* const* w, const typename T::Act* const* a, int64_t nb, float* out) {
  constexpr int QK = T::QK, G = T::G, NG = QK / G;
  int8_t q[QK];
  int isc[NG], imn[NG];
  float d, dm;
  float acc[RW * R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < RW; ++i) {
      T::decode(w[i] + b * T::SIZE, q, isc, imn, &d, &dm);
      for (int r = 0; r < R; ++r) {
        const auto& ab = a[r][b];
        int isum = 0;  // sum over groups of scale * (codes . activation codes), exact
        for (int g = 0; g < NG; ++g) {
          int s = 0;
          for (int j = g * G; j < g * G + G; ++j) s += static_cast<int>(q[j]) * static_cast<int>(ab.qs[j]);
          isum += isc[g] * s;
        }
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

#if RUNLM_AVX2

inline __m256i ones16() { return _mm256_set1_epi16(1); }

// unsigned x signed bytes -> 8 int32 sums of 4 products
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16()); }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 bytes 0..15: low nibbles (elements 0..15) then high nibbles (16..31)
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
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

// int32 += (unsigned q . signed a per 16-bit pair) * int16 scales
inline __m256i scaled_dot(__m256i sum, __m256i q, const int8_t* a, __m256i scales) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q, load256(a)), scales));
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

// The K-quant dot skeleton (Q2_K .. Q6_K, row layout): block(blk, b, sumi, mins) gives weight block `blk` (block
// index b) met by the R activation rows as int32 vectors whose lanes add up to the block's exact integer sums
// (mins: formats with mins); the R rows' sums go to float together, lane r in kquant_step's sequence. d (and dmin
// right after it) are the block's f16 scales at byte T::D_AT.
template <class T, int RW, int R, class Block>
inline void kquant_dot(const uint8_t* const* w, const AK* const* a, int64_t nb, float* out, Block block) {
  __m128 acc[RW];  // lane r: activation row r
  for (int i = 0; i < RW; ++i) acc[i] = _mm_setzero_ps();
  if constexpr (R == 1 && RW > 1) {  // one activation row (decode): the RW weight rows' sums go to float together
    __m128 y = _mm_setzero_ps();       // lane i: weight row i
    for (int64_t b = 0; b < nb; ++b) {
      __m256i sumi[RW], mins[RW];
      for (int i = 0; i < RW; ++i) block(w[i] + b * T::SIZE, b, sumi + i, mins + i);
      // the rows' f16 scales (built in registers: scalar stores read back as a vector would stall)
      auto scales = [&](int at) {
        auto h = [&](int i) { return i < RW ? f16(w[i] + b * T::SIZE + at) : 0.f; };
        return _mm_setr_ps(h(0), h(1), h(2), h(3));
      };
      const __m128 da = _mm_set1_ps(a[0][b].d);
      y = _mm_fmadd_ps(_mm_mul_ps(scales(T::D_AT), da), _mm_cvtepi32_ps(sum_each<RW>(sumi)), y);
      if constexpr (T::kMins)
        y = _mm_fnmadd_ps(_mm_mul_ps(scales(T::D_AT + 2), da), _mm_cvtepi32_ps(sum_each<RW>(mins)), y);
    }
    alignas(16) float o[4];
    _mm_store_ps(o, y);
    for (int i = 0; i < RW; ++i) out[i] = o[i];
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    auto act = [&](int r) { return r < R ? a[r][b].d : 0.f; };
    const __m128 da = _mm_setr_ps(act(0), act(1), act(2), act(3));  // lane r: activation row r
    for (int i = 0; i < RW; ++i) {
      const uint8_t* blk = w[i] + b * T::SIZE;
      __m256i sumi[R], mins[R];
      block(blk, b, sumi, mins);
      const __m128 d = _mm_set1_ps(f16(blk + T::D_AT));
      acc[i] = _mm_fmadd_ps(_mm_mul_ps(d, da), _mm_cvtepi32_ps(sum_each<R>(sumi)), acc[i]);
      if constexpr (T::kMins) {
        const __m128 dmin = _mm_set1_ps(f16(blk + T::D_AT + 2));
        acc[i] = _mm_fnmadd_ps(_mm_mul_ps(dmin, da), _mm_cvtepi32_ps(sum_each<R>(mins)), acc[i]);
      }
    }
  }
  for (int i = 0; i < RW; ++i) {
    alignas(16) float o[4];
    _mm_store_ps(o, acc[i]);
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
    scalar_dot<Q4_0, RW, R>(w, a, nb, out);
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
    scalar_dot<Q4_1, RW, R>(w, a, nb, out);
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
    scalar_dot<Q5_0, RW, R>(w, a, nb, out);
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
    scalar_dot<Q5_1, RW, R>(w, a, nb, out);
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
    scalar_dot<Q8_0, RW, R>(w, a, nb, out);
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
    scalar_dot<Q2_K, RW, R>(w, a, nb, out);
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
    scalar_dot<Q3_K, RW, R>(w, a, nb, out);
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
    scalar_dot<QK45<FIVE>, RW, R>(w, a, nb, out);
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
    scalar_dot<Q6_K, RW, R>(w, a, nb, out);
#endif
  }
};

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
//   Q6_K (3360 bytes): 32 low-nibble pieces (ql) | 16 high-bit pieces (qh) | 4 scale pieces | d[16]
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
template <>
struct X4Fields<Q6_K> : SixteenRows {
  static constexpr int N = 32 + 16 + 4 + 1;
  static constexpr std::array<Field, N> f = pieces_of_4<N>(210, 0, true);
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

template <class T>
struct X4Layout {
  static constexpr int QK = T::QK, SIZE = T::SIZE, G = T::G, ROWS = 4;
  using Act = A32;
  using Plain = T;

  // dot<4, R>: w[0] is the group's first byte (rows w[0..3] of the plain kernels' convention).
  template <int RW, int R>
  static void dot(const uint8_t* const* w, const Act* const* a, int64_t nb, float* out) {
    static_assert(RW == 4, "x4 groups are 4 rows");
#if RUNLM_AVX2
    using F = X4Fields<T>;
    constexpr bool kQ8 = std::is_same_v<T, Q8_0>, kMin = F::M >= 0, kQH = F::QH >= 0;
    constexpr bool kCorr = !kQ8;
    constexpr float kCorrMult = kMin ? 1.f : (kQH ? -16.f : -8.f);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    const __m256i shift_lo = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), shift_hi = _mm256_setr_epi32(4, 3, 2, 1, 4, 3, 2, 1);
    const __m256i dd_perm = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    __m256 acc[R];
    __m128 corr[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      corr[r] = _mm_setzero_ps();
    }
    const uint8_t* blk = w[0];
    for (int64_t b = 0; b < nb; ++b, blk += 4 * SIZE) {
      __m256i lo01, hi01, lo23, hi23;
      if constexpr (kQ8) {
        lo01 = load256(blk + F::QS), lo23 = load256(blk + F::QS + 32);
        hi01 = load256(blk + F::QS + 64), hi23 = load256(blk + F::QS + 96);
      } else {
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
      const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
      const __m256 dd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), dd_perm);
      __m128 c4 = d4;
      if constexpr (kMin) c4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + F::M)));
      for (int r = 0; r < R; ++r) {
        const A32& ab = a[r][b];
        const __m256i alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.qs)));
        const __m256i ahi =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab.qs + 16)));
        __m256i p01, p23;
#if RUNLM_VNNI
        const __m256i zero = _mm256_setzero_si256();
        if constexpr (kQ8) {  // |w| (unsigned) times a carrying w's sign
          p01 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, _mm256_sign_epi8(lo01, lo01), _mm256_sign_epi8(alo, lo01)),
                                    _mm256_sign_epi8(hi01, hi01), _mm256_sign_epi8(ahi, hi01));
          p23 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, _mm256_sign_epi8(lo23, lo23), _mm256_sign_epi8(alo, lo23)),
                                    _mm256_sign_epi8(hi23, hi23), _mm256_sign_epi8(ahi, hi23));
        } else {
          p01 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, lo01, alo), hi01, ahi);
          p23 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, lo23, alo), hi23, ahi);
        }
#else
        if constexpr (kQ8) {
          p01 = _mm256_add_epi32(prod_s8s8(lo01, alo), prod_s8s8(hi01, ahi));
          p23 = _mm256_add_epi32(prod_s8s8(lo23, alo), prod_s8s8(hi23, ahi));
        } else {  // codes <= 31: the two 16-bit pair sums cannot overflow
          p01 = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo01, alo), _mm256_maddubs_epi16(hi01, ahi)), ones16());
          p23 = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo23, alo), _mm256_maddubs_epi16(hi23, ahi)), ones16());
        }
#endif
        // lanes: [r0 r0 r2 r2 | r1 r1 r3 r3] partial sums, scaled by [d0 d0 d2 d2 | d1 d1 d3 d3]
        const __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(p01, p23));
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
    x4_portable_dot<T, R>(w[0], a, nb, out);
#endif
  }
};

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

// unsigned x signed byte dot products, 4 per int32 lane, added to acc
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) {
#if RUNLM_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

// int32 acc += int16 pairs x int16 pairs, summed per pair
inline __m256i dot_words(__m256i acc, __m256i x, __m256i y) {
#if RUNLM_VNNI
  return _mm256_dpwssd_epi32(acc, x, y);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, y));
#endif
}

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
// so it fits 16 bits): two sub-blocks' sums are packed to int16 and multiplied by their scales in one vpmaddwd /
// vpdpwssd, leaving lanes [r0 r1 r0 r1 | r2 r3 r2 r3] (sub-block 2j, then 2j + 1).
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
          __m256i u_lo = _mm256_setzero_si256(), u_hi = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            u_lo = dot_bytes(u_lo, lo[k], bcast8(aq + 8 * k));
            u_hi = dot_bytes(u_hi, hi[k], bcast8(aq + 32 + 8 * k));
          }
          acc[r] = dot_words(acc[r], _mm256_packs_epi32(u_lo, u_hi), scj);
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
          const __m256i z = _mm256_setzero_si256();
          const __m256i l01 = dot_bytes(dot_bytes(z, lo[0], bcast8(aq)), lo[1], bcast8(aq + 8));
          const __m256i l23 = dot_bytes(dot_bytes(z, lo[2], bcast8(aq + 16)), lo[3], bcast8(aq + 24));
          const __m256i h01 = dot_bytes(dot_bytes(z, hi[0], bcast8(aq + 32)), hi[1], bcast8(aq + 40));
          const __m256i h23 = dot_bytes(dot_bytes(z, hi[2], bcast8(aq + 48)), hi[3], bcast8(aq + 56));
          acc[r] = dot_words(dot_words(acc[r], _mm256_packs_epi32(l01, l23), s_lo), _mm256_packs_epi32(h01, h23), s_hi);
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
              const __m256i zero = _mm256_setzero_si256();
              const __m256i t = _mm256_packs_epi32(dot_bytes(zero, q[0], bcast16(aq)), dot_bytes(zero, q[1], bcast16(aq + 16)));
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

// How the 16-row kernels prefetch and walk a decode GEMV's weights (set once per process, gguf_set_decode_walk).
// What reads DRAM fastest differs by CPU, measured on the 1B Q4_K_M shape's Q4_K / Q6_K weights with two threads:
//  - "line" (line_ahead 2048, burst_ahead 0, streams 2 / 2): each 64-byte weight line read comes with a prefetch of the
//    line 2 KiB on, and each thread walks two far-apart groups side by side. On an Intel Xeon (Sapphire Rapids
//    class) the decode GEMV sequence went 22.3 -> 26.4 GB/s against a burst two super-blocks ahead (1.20x), and
//    two streams gave another 1.06-1.20x; distances 768 B-3 KiB: 1.06-1.22x, 2 KiB best.
//  - "burst" (line_ahead 2048, burst_ahead 2048, streams 1 / 2): before each super-block step of a decode GEMV (up
//    to 4 activation rows), the whole first super-block at least 2 KiB on (the next one for the K-quants) is
//    prefetched at once; one group per thread for the K-quants, two for the 32-wide types; the line prefetch stays
//    on. On an AMD EPYC Zen 5 VM the line walk read Q4_K at ~29 GB/s and Q6_K at ~14, the burst alone at ~46-52 and
//    ~50-67; bursts 2 and 3 super-blocks ahead read less (46 / 49, 40 / 40), no software prefetch 24 / 17. Decode
//    steps there (alternating rounds in one process): 1B Q4_K_M 1.46-1.55x the line walk, Q5_K_M 1.61x, 3B Q4_K_M
//    1.59x; a second K-quant stream 0.90x. For 1B Q8_0 two streams beat one (1.07x the line walk against 0.95x, 20
//    rounds); SmolLM2 and Gemma 3 270M: noise. The line prefetch is what the tiles of more rows need from DRAM: a
//    step of 8 sequences (1B Q4_K_M) ran 0.62-0.66x without it, 1.01x with it; with it, one-row decode ran 1.03x
//    the burst alone.
// The results are the same bits whatever the walk (prefetches only; every group's sums in one order).
struct DecodeWalk {
  int line_ahead = 2048;  // bytes on from each weight line read to the line prefetched with it (0: none)
  int burst_ahead = 0;    // bytes on from each step to the super-block prefetched whole before it (0: none)
  int kquant_streams = 2;  // groups each thread walks side by side (1 or 2): K-quants (256-value super-blocks)
  int wide32_streams = 2;  // ... the 32-value block types
};
DecodeWalk g_walk;

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

// The burst walk's prefetch: all of the first 16-row super-block at least g_walk.burst_ahead bytes after blk (of
// `size` bytes): the next one for the K-quants, a few on for the 32-wide types' small blocks.
inline void prefetch_burst(const uint8_t* blk, int size) {
  if (!g_walk.burst_ahead) return;
  const uint8_t* p = blk + (g_walk.burst_ahead + size - 1) / size * size;
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
      if constexpr (kDecode) prefetch_burst(blk, 16 * L::SIZE);
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

// Q6_K in 16-row groups. Half h of a super-block (128 values) comes from ql pieces 16h..16h + 15 and qh pieces
// 8h..8h + 7: value 128h + 32m + 4c + t is the low (m = 0, 1) or high (m = 2, 3) nibble of byte t of ql piece
// 16h + 8 (m % 2) + c, with bits 2m of byte t of qh piece 8h + c above it; so codes of the 16-value sub-block
// 8h + 2m + c / 4. A lane's sum over a sub-block is at most 16 * 63 * 127, times the signed 8-bit scale. The codes'
// offset of 32 comes off through the activation's sums of 16 (vpdpwssd on int16 pairs of -32 * scale).
template <>
struct X4Layout<Q6_K> : Rows16<X4Layout<Q6_K>> {
  using Plain = Q6_K;
  static constexpr int QK = QK_K, SIZE = Plain::SIZE, G = Plain::G, ROWS = 16;
  static constexpr int QL = 0, QH = 2048, SC = 3072, D = 3328;  // offsets in the 16 rows' super-block
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
    const __m512i lo = load_ahead(blk + QL + 64 * (16 * h + c)), hi = load_ahead(blk + QL + 64 * (16 * h + 8 + c));
    const __m512i bits = load_ahead(blk + QH + 64 * (8 * h + c));
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

// ------------------------------------------------------------------------------------------------------------
// Driver

constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kNTileBytes = 32 * 1024;  // weight bytes per tile of output rows

template <class T>
struct Ctx {
  const uint8_t* w;
  int64_t row_bytes, nbw;     // weight: bytes and blocks per row
  const typename T::Act* act;  // quantized activation rows
  int64_t nba;                 // activation blocks per row
  int64_t N;
  float* y;
  const void* arranged = nullptr;  // the activation as the type's tiles take it, where they rearrange it
};

template <class T, int RW, int R>
inline void tile(const Ctx<T>& c, int64_t n, int64_t m) {
  float o[RW * R];
  const uint8_t* wp[RW];
  const typename T::Act* ap[R];
  for (int i = 0; i < RW; ++i) wp[i] = c.w + (n + i) * c.row_bytes;
  for (int r = 0; r < R; ++r) ap[r] = c.act + (m + r) * c.nba;
  T::template dot<RW, R>(wp, ap, c.nbw, o);
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < R; ++r) c.y[(m + r) * c.N + n + i] = o[i * R + r];
}

// Output rows [n0, n1) x activation rows [m0, m1).
// Software prefetch of the weight bytes kPrefetchBytes past rows [n, n + count) (rows are contiguous): with
// only hardware prefetching a decode GEMV reached ~14 GB/s from DRAM on the 2-core EPYC, ~25 GB/s with this.
template <class T>
inline void prefetch_rows(const Ctx<T>& c, int64_t n, int64_t count, const uint8_t* end) {
#if RUNLM_AVX2
  const uint8_t* p = c.w + n * c.row_bytes + kPrefetchBytes;
  const int64_t bytes = std::min<int64_t>(count * c.row_bytes, end - p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
#endif
}

// Weight rows [n, n + RW) x activation rows [m0, m1), up to 4 activation rows per tile.
template <class T, int RW>
inline void activation_tiles(const Ctx<T>& c, int64_t n, int64_t m0, int64_t m1) {
  int64_t m = m0;
#if RUNLM_AVX512
  // Q5_K's 16-row groups take 8 activation rows at a time: its codes (nibbles and fifth bits) are unpacked once per
  // 8 rows instead of 4. Interleaved A/B on the Zen 5 VM (session 19, 1B-shape GEMMs, M = 8-128): 1.02-1.21x;
  // for Q4_K and Q8_0 the same change was 0.74-0.85x, for Q6_K even. The results are the 4-row tiles' bit for bit.
  if constexpr (std::is_same_v<T, X4Layout<Q5_K>>)
    for (; m + 8 <= m1; m += 8) tile<T, RW, 8>(c, n, m);
#endif
  for (; m + 4 <= m1; m += 4) tile<T, RW, 4>(c, n, m);
  switch (m1 - m) {
    case 3: tile<T, RW, 3>(c, n, m); break;
    case 2: tile<T, RW, 2>(c, n, m); break;
    case 1: tile<T, RW, 1>(c, n, m); break;
    default: break;
  }
}

// Output rows [n0, n1) x activation rows [m0, m1).
template <class T>
void block_rows(const Ctx<T>& c, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const uint8_t* end = c.w + n1 * c.row_bytes;
#if RUNLM_AMX
  if constexpr (HasTiles<T>::value) {  // 16 activation rows at a time through the tiles, the rest as below
    const int64_t tiled = (m1 - m0) / 16 * 16;
    if (tiled && amx_usable()) {
      using Tiles = typename HasTiles<T>::Tiles;
      Tiles::configure();
      for (int64_t n = n0; n < n1; n += 16) {
        if constexpr (std::is_same_v<Tiles, Q8_0Tiles>) {
          Tiles::group_rows(c.w + n * c.row_bytes, c.nbw, *static_cast<const Q8_0Tiles::Arranged*>(c.arranged), m0,
                            tiled, c.y + m0 * c.N + n, c.N);
        } else {
          Tiles::group_rows(c.w + n * c.row_bytes, c.nbw, c.act + m0 * c.nba, c.nba, tiled, c.y + m0 * c.N + n, c.N);
        }
        if (m0 + tiled < m1) activation_tiles<T, 16>(c, n, m0 + tiled, m1);
      }
      _tile_release();
      return;
    }
  }
#endif
  if constexpr (IsX4<T>::value) {  // n0, n1: whole groups; one group meets up to 4 activation rows at a time
    for (int64_t n = n0; n < n1; n += T::ROWS) {
      // (16-row groups, up to 74 KB, are prefetched by their kernels a few super-blocks ahead instead)
      if (m0 == 0 && T::ROWS == 4) prefetch_rows(c, n, T::ROWS, end);
      activation_tiles<T, T::ROWS>(c, n, m0, m1);
    }
  } else if (m1 - m0 <= 2) {
    // few activation rows: several weight rows at a time keep 4 accumulator chains busy
    int64_t n = n0;
    if (m1 - m0 == 1) {
      for (; n + 4 <= n1; n += 4) {
        prefetch_rows(c, n, 4, end);
        tile<T, 4, 1>(c, n, m0);
      }
      for (; n < n1; ++n) tile<T, 1, 1>(c, n, m0);
    } else {
      for (; n + 2 <= n1; n += 2) {
        prefetch_rows(c, n, 2, end);
        tile<T, 2, 2>(c, n, m0);
      }
      for (; n < n1; ++n) tile<T, 1, 2>(c, n, m0);
    }
  } else {
    for (int64_t n = n0; n < n1; ++n) {
      if (m0 == 0) prefetch_rows(c, n, 1, end);
      activation_tiles<T, 1>(c, n, m0, m1);
    }
  }
}

#if RUNLM_AVX512
// Layouts whose groups dot16 walks (the 16-row layouts).
template <class T>
concept Streamed = requires { T::kChains; };

// Groups a decode GEMV walks at once per thread, at most (DecodeWalk's streams). On the Xeon one sequential walk
// reached ~75% of a plain read's DRAM bandwidth per core (two threads, 1B Q4_K_M shape's weights: 16.3 GB/s against
// a 25 GB/s read); two far-apart walks keep more reads in flight: 1.06-1.20x on the 1B and 3B shapes' GEMV
// sequences (alternating rounds). Three and four were no better than two. On the Zen 5 VM two cost the K-quants.
constexpr int kStreams = 2;

// Groups n[0..S) against activation rows [0, R) into c.y.
template <class T, int R, int S>
inline void stream_tile(const Ctx<T>& c, const int64_t* n) {
  float o[S][16 * R];
  const uint8_t* g[S];
  float* outs[S];
  const typename T::Act* ap[R];
  for (int s = 0; s < S; ++s) g[s] = c.w + n[s] * c.row_bytes, outs[s] = o[s];
  for (int r = 0; r < R; ++r) ap[r] = c.act + r * c.nba;
  dot16<T, R, S, true>(g, ap, c.nbw, outs);
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < 16; ++i)
      for (int r = 0; r < R; ++r) c.y[r * c.N + n[s] + i] = o[s][i * R + r];
}

template <class T, int S>
inline void stream_tile(const Ctx<T>& c, const int64_t* n, int64_t M) {
  switch (M) {
    case 1: stream_tile<T, 1, S>(c, n); break;
    case 2: stream_tile<T, 2, S>(c, n); break;
    case 3: stream_tile<T, 3, S>(c, n); break;
    case 4: stream_tile<T, 4, S>(c, n); break;
    default: break;
  }
}

// Output rows [n0, n1) (whole groups) for M <= 4 activation rows: with two streams the range's first and second halves
// side by side, a group of each at a time (kStreams), and an odd group last on its own; with one, group by group.
template <class T>
void stream_rows(const Ctx<T>& c, int64_t n0, int64_t n1, int64_t M) {
  const int streams = T::QK == 32 ? g_walk.wide32_streams : g_walk.kquant_streams;
  const int64_t groups = (n1 - n0) / 16, len = streams == kStreams ? groups / kStreams : 0;
  for (int64_t i = 0; i < len; ++i) {
    int64_t n[kStreams];
    for (int s = 0; s < kStreams; ++s) n[s] = n0 + 16 * (s * len + i);
    stream_tile<T, kStreams>(c, n, M);
  }
  for (int64_t g = kStreams * len; g < groups; ++g) {
    const int64_t n = n0 + 16 * g;
    stream_tile<T, 1>(c, &n, M);
  }
}
#endif

// Rows of kernel type T that stay together: an interleaved group, or 1.
template <class T>
constexpr int64_t group_of() {
  if constexpr (IsX4<T>::value) {
    return T::ROWS;
  } else {
    return 1;
  }
}

// Activation rows per pass of the AMX tiles for an M-row call (a multiple of 16; the last pass takes the rest), or
// 0 where T has no tiles, they are off, or M is below one tile.
template <class T>
int64_t tile_pass_rows(int64_t M, int64_t nba) {
#if RUNLM_AMX
  if constexpr (HasTiles<T>::value) {
    if (M < 16 || !amx_usable()) return 0;
    const int64_t fit = kTileActBytes / (nba * static_cast<int64_t>(sizeof(typename T::Act))) / 16 * 16;
    const int64_t rows = std::clamp<int64_t>(fit, 16, kTileMaxRows);
    // passes of even size: 256 rows where 112 fit go as 96 + 96 + 64, not 112 + 112 + 32
    const int64_t passes = (M + rows - 1) / rows;
    return std::min(rows, (M / passes + 15) / 16 * 16);
  }
#endif
  return 0;
}

template <class T>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  using A = typename T::Act;
  constexpr int64_t AQK = std::is_same_v<A, A32> ? 32 : QK_K;
  const int64_t nba = K / AQK, nbw = K / T::QK, row_bytes = nbw * T::SIZE;
  std::vector<A> act(static_cast<size_t>(M * nba));
  A* act_p = act.data();
  // ~4K values a piece: the rows of a small batch go over all threads
  parallel_for(0, M, std::max<int64_t>(1, (1 << 12) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, act_p + m * nba, nba);
  });
  Ctx<T> c{w, row_bytes, nbw, act_p, nba, N, y};
  const int64_t tile_rows = tile_pass_rows<T>(M, nba);
#if RUNLM_AMX
  Q8_0Tiles::Arranged arranged;
  if constexpr (std::is_same_v<T, X4Layout<Q8_0>>) {
    if (tile_rows) {
      arranged = Q8_0Tiles::arrange(act_p, M, nba);
      c.arranged = &arranged;
    }
  }
#endif
  constexpr int64_t unit = group_of<T>();  // rows that stay together (an interleaved group)
  const int64_t n_tile = std::max<int64_t>(std::max<int64_t>(4, unit), kNTileBytes / row_bytes) / unit * unit;
  // at least ~64K multiply-adds per thread
  const int64_t grain = std::max<int64_t>(4, (1 << 16) / (K * M)) / unit;
#if RUNLM_AVX512
  if constexpr (Streamed<T>) {
    if (M <= 4) {
      parallel_for(0, N / unit, std::max<int64_t>(1, grain),
                       [&](int64_t u0, int64_t u1) { stream_rows<T>(c, u0 * unit, u1 * unit, M); });
      return;
    }
  }
#endif
  parallel_for(0, N / unit, std::max<int64_t>(1, grain), [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * unit, n1 = u1 * unit;
    if (tile_rows) {  // AMX: pass by pass over the rows, each pass over all of this thread's weights
      for (int64_t mt = 0; mt < M; mt += tile_rows)
        for (int64_t nt = n0; nt < n1; nt += n_tile)
          block_rows<T>(c, nt, std::min(n1, nt + n_tile), mt, std::min(M, mt + tile_rows));
      return;
    }
    for (int64_t nt = n0; nt < n1; nt += n_tile) {
      const int64_t ne = std::min(n1, nt + n_tile);
      for (int64_t mt = 0; mt < M; mt += kMTile) block_rows<T>(c, nt, ne, mt, std::min(M, mt + kMTile));
    }
  });
}

// Dequantization (the large-M path: float32 GEMM on dequantized weights). Values equal ggml's (and
// runlm.quant.dequantize's): every product below is exact in float32, so fma and mul+add round alike.

template <class T>
struct FastDequant {
  static constexpr bool kOn = false;
  static void run(const uint8_t*, float*) {}
};

#if RUNLM_AVX2

// out[0..15] = s0 * code + c0, out[16..31] = s1 * code + c1 for 32 int8 codes
inline void store32(float* out, __m256i q, __m256 s0, __m256 c0, __m256 s1, __m256 c1) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), c0));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), c0));
  _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), c1));
  _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), c1));
}

inline void store32(float* out, __m256i q, float s, float c) {
  const __m256 sv = _mm256_set1_ps(s), cv = _mm256_set1_ps(c);
  store32(out, q, sv, cv, sv, cv);
}

template <>
struct FastDequant<Q4_0> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) { store32(out, nibbles32(b + 2), f16(b), -8.f * f16(b)); }
};

template <>
struct FastDequant<Q4_1> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) { store32(out, nibbles32(b + 4), f16(b), f16(b + 2)); }
};

template <>
struct FastDequant<Q5_0> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) { store32(out, unpack_q5_0(b), f16(b), -16.f * f16(b)); }
};

template <>
struct FastDequant<Q5_1> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) { store32(out, unpack_q5_1(b), f16(b), f16(b + 2)); }
};

template <>
struct FastDequant<Q8_0> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) { store32(out, load256(b + 2), f16(b), 0.f); }
};

template <bool FIVE>
struct FastDequant<QK45<FIVE>> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scale_min(b + 4, sc, mn);
    __m256i hb = FIVE ? load256(b + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = load256(b + QK45<FIVE>::QS + 32 * j);
      __m256i ql = _mm256_and_si256(bits, m4);
      __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      if (FIVE) {
        ql = _mm256_or_si256(ql, _mm256_and_si256(_mm256_slli_epi16(hb, 4), m16));
        qh = _mm256_or_si256(qh, _mm256_and_si256(_mm256_slli_epi16(hb, 3), m16));
        hb = _mm256_srli_epi16(hb, 2);
      }
      store32(out + 64 * j, ql, d * static_cast<float>(sc[2 * j]), -(dmin * static_cast<float>(mn[2 * j])));
      store32(out + 64 * j + 32, qh, d * static_cast<float>(sc[2 * j + 1]),
              -(dmin * static_cast<float>(mn[2 * j + 1])));
    }
  }
};

template <>
struct FastDequant<Q6_K> {
  static constexpr bool kOn = true;
  static void run(const uint8_t* b, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(b + 64 * h), l1 = load256(b + 64 * h + 32), hb = load256(b + 128 + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)),
      };
      for (int k = 0; k < 4; ++k) {
        const int c = 4 * h + k;
        const float s0 = d * static_cast<float>(sc[2 * c]), s1 = d * static_cast<float>(sc[2 * c + 1]);
        store32(out + 32 * c, q[k], _mm256_set1_ps(s0), _mm256_set1_ps(-32.f * s0), _mm256_set1_ps(s1),
                _mm256_set1_ps(-32.f * s1));
      }
    }
  }
};

#endif

// Weight rows [n0, n1) to float32 out[(n - n0) * K + k].
template <class T>
void dequant_rows(const uint8_t* w, int64_t nbw, int64_t n0, int64_t n1, float* out) {
  constexpr int QK = T::QK, G = T::G, NG = QK / G;
  alignas(32) int8_t q[QK];
  int isc[NG], imn[NG];
  float d, dm;
  const int64_t row_bytes = nbw * T::SIZE;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* o = out + (n - n0) * nbw * QK;
    for (int64_t b = 0; b < nbw; ++b, o += QK) {
      if constexpr (FastDequant<T>::kOn) {
        FastDequant<T>::run(wr + b * T::SIZE, o);
      } else {
        T::decode(wr + b * T::SIZE, q, isc, imn, &d, &dm);
        for (int g = 0; g < NG; ++g) {
          const float gs = d * static_cast<float>(isc[g]), gm = dm * static_cast<float>(imn[g]);
          for (int j = 0; j < G; ++j) o[g * G + j] = gs * static_cast<float>(q[g * G + j]) + gm;
        }
      }
    }
  }
}

template <class T>
void dequant_x4_rows(const uint8_t* w, int64_t nbw, int64_t n0, int64_t n1, float* out) {
  constexpr int ROWS = X4Fields<T>::ROWS;
  uint8_t plain[T::SIZE];
  const int64_t row_bytes = nbw * T::SIZE;
  for (int64_t n = n0; n < n1; ++n) {
    uint8_t* group = const_cast<uint8_t*>(w) + (n / ROWS) * ROWS * row_bytes;
    for (int64_t b = 0; b < nbw; ++b) {
      x4_move<T, true>(group + b * ROWS * T::SIZE, static_cast<int>(n % ROWS), plain);
      // GCC 12 at -O3 lost x4_move's stores into this local block before FastDequant<Q6_K>'s vector loads read
      // it (garbage out; right at -O2, or with this fence): keep the compiler from moving or dropping them.
      std::atomic_signal_fence(std::memory_order_seq_cst);
      dequant_rows<T>(plain, 1, 0, 1, out + ((n - n0) * nbw + b) * T::QK);
    }
  }
}

// Weight rows [n0, n1) of either layout to float32 out[(n - n0) * K + k].
template <class T>
void dequant_span(const uint8_t* w, int64_t nbw, int64_t n0, int64_t n1, float* out) {
  if constexpr (IsX4<T>::value) {
    dequant_x4_rows<typename T::Plain>(w, nbw, n0, n1, out);
  } else {
    dequant_rows<T>(w, nbw, n0, n1, out);
  }
}

template <class T>
void dequant(const uint8_t* w, int64_t N, int64_t K, float* out) {
  parallel_for(0, N, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t n0, int64_t n1) {
    dequant_span<T>(w, K / T::QK, n0, n1, out + n0 * K);
  });
}

// Rows ids[0..n) of W to float32 out[i * K + k]: a tied LM head serves the embedding lookup from its own blocks.
template <class T>
void dequant_picked(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
  parallel_for(0, n, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_span<T>(w, K / T::QK, ids[i], ids[i] + 1, out + i * K);
  });
}

struct TypeInfo {
  int qk;
  int size;
};

bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case T_Q4_0: *info = {Q4_0::QK, Q4_0::SIZE}; return true;
    case T_Q4_1: *info = {Q4_1::QK, Q4_1::SIZE}; return true;
    case T_Q5_0: *info = {Q5_0::QK, Q5_0::SIZE}; return true;
    case T_Q5_1: *info = {Q5_1::QK, Q5_1::SIZE}; return true;
    case T_Q8_0: *info = {Q8_0::QK, Q8_0::SIZE}; return true;
    case T_Q2_K: *info = {Q2_K::QK, Q2_K::SIZE}; return true;
    case T_Q3_K: *info = {Q3_K::QK, Q3_K::SIZE}; return true;
    case T_Q4_K: *info = {Q4_K::QK, Q4_K::SIZE}; return true;
    case T_Q5_K: *info = {Q5_K::QK, Q5_K::SIZE}; return true;
    case T_Q6_K: *info = {Q6_K::QK, Q6_K::SIZE}; return true;
    case T_Q4_0 + X4: *info = {Q4_0::QK, Q4_0::SIZE}; return true;
    case T_Q4_1 + X4: *info = {Q4_1::QK, Q4_1::SIZE}; return true;
    case T_Q5_0 + X4: *info = {Q5_0::QK, Q5_0::SIZE}; return true;
    case T_Q5_1 + X4: *info = {Q5_1::QK, Q5_1::SIZE}; return true;
    case T_Q8_0 + X4: *info = {Q8_0::QK, Q8_0::SIZE}; return true;
    case T_Q4_K + X4: *info = {Q4_K::QK, Q4_K::SIZE}; return true;
    case T_Q5_K + X4: *info = {Q5_K::QK, Q5_K::SIZE}; return true;
    case T_Q6_K + X4: *info = {Q6_K::QK, Q6_K::SIZE}; return true;
    default: return false;
  }
}

// Rows per group of GGML type `type`'s interleaved layout in this build (0: it has none).
int64_t group_rows(int64_t type) {
  switch (type) {
    case T_Q4_0: return X4Fields<Q4_0>::ROWS;
    case T_Q4_1: return X4Fields<Q4_1>::ROWS;
    case T_Q5_0: return X4Fields<Q5_0>::ROWS;
    case T_Q5_1: return X4Fields<Q5_1>::ROWS;
    case T_Q8_0: return X4Fields<Q8_0>::ROWS;
    case T_Q4_K: return X4Fields<Q4_K>::ROWS;
    case T_Q5_K: return X4Fields<Q5_K>::ROWS;
    case T_Q6_K: return X4Fields<Q6_K>::ROWS;
    default: return 0;
  }
}

#define RUNLM_DISPATCH(type, FN, ...)                   \
  switch (type) {                                       \
    case T_Q4_0: FN<Q4_0>(__VA_ARGS__); break;          \
    case T_Q4_1: FN<Q4_1>(__VA_ARGS__); break;          \
    case T_Q5_0: FN<Q5_0>(__VA_ARGS__); break;          \
    case T_Q5_1: FN<Q5_1>(__VA_ARGS__); break;          \
    case T_Q8_0: FN<Q8_0>(__VA_ARGS__); break;          \
    case T_Q2_K: FN<Q2_K>(__VA_ARGS__); break;          \
    case T_Q3_K: FN<Q3_K>(__VA_ARGS__); break;          \
    case T_Q4_K: FN<Q4_K>(__VA_ARGS__); break;          \
    case T_Q5_K: FN<Q5_K>(__VA_ARGS__); break;          \
    case T_Q6_K: FN<Q6_K>(__VA_ARGS__); break;          \
    case T_Q4_0 + X4: FN<X4Layout<Q4_0>>(__VA_ARGS__); break; \
    case T_Q4_1 + X4: FN<X4Layout<Q4_1>>(__VA_ARGS__); break; \
    case T_Q5_0 + X4: FN<X4Layout<Q5_0>>(__VA_ARGS__); break; \
    case T_Q5_1 + X4: FN<X4Layout<Q5_1>>(__VA_ARGS__); break; \
    case T_Q8_0 + X4: FN<X4Layout<Q8_0>>(__VA_ARGS__); break; \
    case T_Q4_K + X4: FN<X4Layout<Q4_K>>(__VA_ARGS__); break; \
    case T_Q5_K + X4: FN<X4Layout<Q5_K>>(__VA_ARGS__); break; \
    case T_Q6_K + X4: FN<X4Layout<Q6_K>>(__VA_ARGS__); break; \
    default: break;                                     \
  }

#ifndef RUNLM_STANDALONE
int64_t check_weight(const char* op, const at::Tensor& w, int64_t type, int64_t out_features, int64_t in_features) {
  TypeInfo info{};
  TORCH_CHECK(type_info(type, &info), op, ": unsupported GGML type id ", type);
  TORCH_CHECK(w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(w.scalar_type() == at::kByte, op, ": w must be uint8 block bytes, got ", w.scalar_type());
  TORCH_CHECK(in_features > 0 && in_features % info.qk == 0, op, ": in_features ", in_features,
              " is not a positive multiple of the block size ", info.qk);
  TORCH_CHECK(out_features >= 0, op, ": negative out_features");
  TORCH_CHECK(type < X4 || out_features % group_rows(type - X4) == 0, op, ": the interleaved layout needs "
              "out_features a multiple of ", group_rows(type - X4));
  const int64_t row_bytes = in_features / info.qk * info.size;
  TORCH_CHECK(w.numel() == out_features * row_bytes, op, ": w has ", w.numel(), " bytes, expected ", out_features,
              " rows x ", row_bytes);
  return row_bytes;
}

// y[..., N] = x[..., K] @ W.T, W given as GGUF blocks uint8 [N, row_bytes], through the 8-bit activation kernels.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out_features,
                       int64_t in_features) {
  check_weight("runlm::gguf_linear", w, type, out_features, in_features);
  TORCH_CHECK(x.device().is_cpu(), "runlm::gguf_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "runlm::gguf_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, "runlm::gguf_linear: x must be [..., ", in_features,
              "], got ", x.sizes());
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = out_features;
  const at::Tensor xc = x.reshape({-1, in_features}).contiguous();
  const at::Tensor wc = w.contiguous();
  const int64_t M = xc.size(0), K = in_features, N = out_features;
  at::Tensor y = at::empty(out_sizes, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  RUNLM_DISPATCH(type, gemm, xp, M, K, wp, N, yp)
  return y;
}

// W as float32 [N, K], bit-identical to ggml's / runlm.quant.dequantize's dequantization.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t out_features, int64_t in_features) {
  check_weight("runlm::gguf_dequantize", w, type, out_features, in_features);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({out_features, in_features}, wc.options().dtype(at::kFloat));
  if (out_features == 0) return out;
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  RUNLM_DISPATCH(type, dequant, wp, out_features, in_features, op)
  return out;
}

// The rows `ids` (int64, any shape) of W as float32 [ids.numel(), K]; the same values gguf_dequantize gives them.
at::Tensor gguf_dequantize_rows(const at::Tensor& w, int64_t type, int64_t out_features, int64_t in_features,
                                const at::Tensor& ids) {
  check_weight("runlm::gguf_dequantize_rows", w, type, out_features, in_features);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(), "runlm::gguf_dequantize_rows: ids must be "
              "int64 on the CPU, got ", ids.scalar_type());
  const at::Tensor wc = w.contiguous(), ic = ids.reshape(-1).contiguous();
  const int64_t n = ic.numel();
  const int64_t* idp = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < out_features, "runlm::gguf_dequantize_rows: row ", idp[i],
                " is out of range for ", out_features, " rows");
  at::Tensor out = at::empty({n, in_features}, wc.options().dtype(at::kFloat));
  if (n == 0) return out;
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  RUNLM_DISPATCH(type, dequant_picked, wp, in_features, idp, n, op)
  return out;
}

#endif  // RUNLM_STANDALONE

template <class T>
void relayout(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, bool to_plain) {
  constexpr int ROWS = X4Fields<T>::ROWS;
  const int64_t nbw = K / T::QK, row_bytes = nbw * T::SIZE;
  parallel_for(0, N / ROWS, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nbw; ++b)
        for (int i = 0; i < ROWS; ++i) {
          const int64_t plain_at = (ROWS * g + i) * row_bytes + b * T::SIZE;
          const int64_t x4_at = (ROWS * g * nbw + ROWS * b) * T::SIZE;
          if (to_plain) {
            x4_move<T, true>(const_cast<uint8_t*>(src) + x4_at, i, dst + plain_at);
          } else {
            x4_move<T, false>(dst + x4_at, i, const_cast<uint8_t*>(src) + plain_at);
          }
        }
  });
}

// The same weight in the other layout: plain GGUF rows (`type`) <-> x4 groups (`type` + X4), N x K values from
// src into dst (as many bytes); N must be a multiple of group_rows.
void relayout_bytes(const uint8_t* src, int64_t type, int64_t N, int64_t K, uint8_t* dst) {
  const bool to_plain = type >= X4;
  switch (to_plain ? type - X4 : type) {
    case T_Q4_0: relayout<Q4_0>(src, N, K, dst, to_plain); break;
    case T_Q4_1: relayout<Q4_1>(src, N, K, dst, to_plain); break;
    case T_Q5_0: relayout<Q5_0>(src, N, K, dst, to_plain); break;
    case T_Q5_1: relayout<Q5_1>(src, N, K, dst, to_plain); break;
    case T_Q4_K: relayout<Q4_K>(src, N, K, dst, to_plain); break;
    case T_Q5_K: relayout<Q5_K>(src, N, K, dst, to_plain); break;
    case T_Q6_K: relayout<Q6_K>(src, N, K, dst, to_plain); break;
    default: relayout<Q8_0>(src, N, K, dst, to_plain); break;
  }
}

#ifndef RUNLM_STANDALONE
// relayout_bytes of a weight tensor into `out` (contiguous, as many bytes as w).
void relayout_to(const char* op, const at::Tensor& w, at::Tensor& out, int64_t type, int64_t out_features,
                 int64_t in_features) {
  check_weight(op, w, type, out_features, in_features);
  const int64_t base = type >= X4 ? type - X4 : type;
  TORCH_CHECK(group_rows(base) > 0, op, ": no interleaved layout for GGML type ", base);
  TORCH_CHECK(out_features % group_rows(base) == 0, op, ": out_features must be a multiple of ", group_rows(base));
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == w.numel(), op,
              ": out must be contiguous uint8 bytes, as many as the weight's");
  const at::Tensor wc = w.contiguous();
  relayout_bytes(wc.data_ptr<uint8_t>(), type, out_features, in_features, out.data_ptr<uint8_t>());
}

at::Tensor gguf_relayout(const at::Tensor& w, int64_t type, int64_t out_features, int64_t in_features) {
  at::Tensor out = at::empty({w.numel()}, w.options().dtype(at::kByte)).view(w.sizes());
  relayout_to("runlm::gguf_relayout", w, out, type, out_features, in_features);
  return out;
}

// gguf_relayout into a given buffer (the load regroups a weight chunk by chunk straight into its module's memory).
void gguf_relayout_into(const at::Tensor& w, at::Tensor& out, int64_t type, int64_t out_features,
                        int64_t in_features) {
  relayout_to("runlm::gguf_relayout_into", w, out, type, out_features, in_features);
}
#endif  // RUNLM_STANDALONE

int64_t gguf_simd() { return RUNLM_AVX2 ? 1 : 0; }

// Sets the decode walk (DecodeWalk) for this process; call it before any kernel runs, not while one does.
void gguf_set_decode_walk(int64_t line_ahead, int64_t burst_ahead, int64_t kquant_streams, int64_t wide32_streams) {
  RUNLM_CHECK(line_ahead >= 0 && line_ahead <= (1 << 16) && line_ahead % 64 == 0,
              "line_ahead must be a multiple of 64 bytes from 0 to 65536, got ", line_ahead);
  RUNLM_CHECK(burst_ahead >= 0 && burst_ahead <= (1 << 16), "burst_ahead must be 0 to 65536 bytes, got ", burst_ahead);
  for (const int64_t streams : {kquant_streams, wide32_streams})
    RUNLM_CHECK(streams == 1 || streams == 2, "streams must be 1 or 2, got ", streams);
  g_walk = DecodeWalk{static_cast<int>(line_ahead), static_cast<int>(burst_ahead), static_cast<int>(kquant_streams),
                      static_cast<int>(wide32_streams)};
}

std::vector<int64_t> gguf_decode_walk() {
  return {g_walk.line_ahead, g_walk.burst_ahead, g_walk.kquant_streams, g_walk.wide32_streams};
}

// The instruction set this build's kernels use (the extension is compiled for the CPU it runs on).
std::string gguf_isa() {
#if RUNLM_AMX
  if (amx_usable()) return "avx512-vnni+amx";
#endif
  return RUNLM_VNNI ? "avx512-vnni" : RUNLM_AVX2 ? "avx2" : "scalar";
}

constexpr int64_t kAttnChunk = 64;      // decode attention: positions per work item, at least
constexpr int64_t kAttnMaxChunks = 16;  // ... and at most this many items per kv head

// Float dot product; four explicit 8-wide partial sums (the compiler will not reorder a float reduction by itself,
// and one accumulator chain would wait on the FMA latency).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if RUNLM_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if RUNLM_AVX2
// The vector steps exp_lanes needs, 8 lanes wide (and 16 below): one definition of e^x serves both widths, so a
// value gets the same bits whichever width computes it.
struct Lanes8 {
  using V = __m256;
  static V set(float v) { return _mm256_set1_ps(v); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V scale2(V p, V k) {  // p * 2^k for integral k, added into the exponent bits
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23)));
  }
};
#if RUNLM_AVX512
struct Lanes16 {
  using V = __m512;
  static V set(float v) { return _mm512_set1_ps(v); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V scale2(V p, V k) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(k), 23)));
  }
};
#endif

// e^x lane by lane: x = k ln2 + r with |r| <= ln2 / 2, e^r from its degree-6 Taylor polynomial (relative error
// ~2e-7), 2^k added into the exponent bits. Inputs are clamped to [-87, 88] (e^-87 stands in for 0).
template <class L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::min(L::max(x, L::set(-87.f)), L::set(88.f));
  const typename L::V k = L::round(L::mul(x, L::set(1.44269504088896341f)));
  typename L::V r = L::fnmadd(k, L::set(0.693145751953125f), x);  // ln2 split in a high and a low part
  r = L::fnmadd(k, L::set(1.428606765330187e-06f), r);
  typename L::V p = L::set(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = L::fmadd(p, r, L::set(c));
  return L::scale2(p, k);
}
inline __m256 exp_ps(__m256 x) { return exp_lanes<Lanes8>(x); }
#if RUNLM_AVX512
inline __m512 exp_ps512(__m512 x) { return exp_lanes<Lanes16>(x); }
#endif
#endif

// The largest of x[0..n) (n > 0); the order of a max does not matter, so any vector width gives the same value.
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
#if RUNLM_AVX512
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    best = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// x[i] = e^(x[i] - shift) in place; returns their sum.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if RUNLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 s = _mm256_set1_ps(shift);
#if RUNLM_AVX512
  // 16 at a time; the sum still goes 8 lanes wide in index order (low half, then high half)
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps512(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift)));
    _mm512_storeu_ps(x + i, e);
    acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum_ps(acc);
#endif
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - shift));
  return total;
}

// out[i] = g[i] * sigmoid(c * g'[i]) * u[i] where g' = g (SiLU: c = 1) or g + 0.044715 g^3 (tanh-approximated GELU,
// c = 2 sqrt(2 / pi): 0.5 (1 + tanh(z)) = sigmoid(2z)). The gated MLPs' activation, one pass over the gate/up rows.
template <bool GELU>
inline void gated_activation(const float* g, const float* u, float* out, int64_t n) {
  constexpr float c = GELU ? 1.5957691216057308f : 1.f, cubic = 0.044715f;
  int64_t i = 0;
#if RUNLM_AVX2
  const __m256 one = _mm256_set1_ps(1.f), neg_c = _mm256_set1_ps(-c), k3 = _mm256_set1_ps(cubic);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    __m256 z = gv;
    if (GELU) z = _mm256_fmadd_ps(_mm256_mul_ps(k3, gv), _mm256_mul_ps(gv, gv), gv);
    const __m256 den = _mm256_add_ps(one, exp_ps(_mm256_mul_ps(neg_c, z)));
    _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), den));
  }
#endif
  for (; i < n; ++i) {
    const float z = GELU ? g[i] + cubic * g[i] * g[i] * g[i] : g[i];
    out[i] = g[i] * u[i] / (1.f + std::exp(-c * z));
  }
}

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
                         float* scores, int64_t stride, float* part_max, float* part_sum, float* part_out) {
  score_rows_shared<H>(q, keys, n, D, scores, stride);
  for (int h = 0; h < H; ++h) {
    float* sr = scores + h * stride;
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
                         int64_t D, float* scores, int64_t stride, float* part_max, float* part_sum, float* part_out) {
  int64_t j = 0;
#if RUNLM_AVX2
  for (; D % 16 == 0 && rep - j >= 2; j += std::min<int64_t>(4, rep - j)) {
    const int64_t heads = std::min<int64_t>(4, rep - j);
    const float* qj = q + j * D;
    float *sj = scores + j * stride, *mj = part_max + j, *zj = part_sum + j, *oj = part_out + j * D;
    if (heads == 4) attend_heads<4>(qj, keys, values, n, D, sj, stride, mj, zj, oj);
    else if (heads == 3) attend_heads<3>(qj, keys, values, n, D, sj, stride, mj, zj, oj);
    else attend_heads<2>(qj, keys, values, n, D, sj, stride, mj, zj, oj);
  }
#endif
  for (; j < rep; ++j) {
    float* sr = scores + j * stride;
    score_rows(q + j * D, keys, n, D, sr);
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
                            float* part_out) {
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
inline void merge_chunks(const float* part_max, const float* part_sum, const float* part_out, int64_t first,
                         int64_t step, int64_t n_chunks, int64_t D, float* o) {
  float best = -INFINITY, total = 0.f;
  for (int64_t c = 0; c < n_chunks; ++c) best = std::max(best, part_max[first + c * step]);
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
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xr[i]) * xr[i];
      const float scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
      for (int64_t i = 0; i < n; ++i) orow[i] = (xr[i] * scale) * wp[i];
    }
  };
  if (rows >= 64) {
    parallel_for(0, rows, 16, body);
  } else {
    body(0, rows);
  }
}

// A GGUF weight as the blocks take it: `rows` rows of blocks of GGML type `type` (+ X4 for the interleaved layout).
struct Weight {
  const uint8_t* data = nullptr;
  int64_t type = 0, rows = 0;
};

// y [M, N] = x [M, K] @ W.T on the 8-bit activation kernels.
void linear_rows(const float* x, int64_t M, int64_t K, const Weight& w, float* y) {
  if (M == 0 || w.rows == 0) return;
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

// ------------------------------------------------------------------------------------------------------------
// Route-invariant blocks: rows of one or more sequences through a whole transformer block in one call.
//
// A row's result depends only on the row and its sequence's cache, never on the other rows of the call: prefill
// (T rows of one sequence), one decode step (1 row) and a batched decode step (1 row from each of B sequences)
// give bit-identical outputs for the same token at the same position. That holds because every stage is per row:
// RMSNorm and RoPE row by row; the GGUF kernels quantize each activation row alone and reduce each (weight row,
// activation row) pair the same way for any number of rows (the x4 layout and the K-quants; checked by the
// tests); attention splits a query's key positions into chunks fixed by absolute position (kKeyChunk), scores
// each key with one fixed reduction (score_rows), and merges the chunks in position order. With a float16 or q8_0
// cache, this call's keys / values are stored in that type before attention reads them, so a key has the same value
// whether it comes from this call or from the cache.

constexpr int64_t kKeyChunk = 64;  // attention chunk k covers absolute key positions [64k, 64k + 64)
constexpr int64_t kAttnScratchFloats = int64_t{1} << 22;  // partial attention outputs held at once (16 MiB)
constexpr int64_t kRowBlock = 16; // prompt rows of one sequence that share each chunk's widened keys and values

// Where each sequence's rows of this call sit: rows [first_row, first_row + count) hold positions
// [first_pos, first_pos + count); earlier positions are in the sequence's cache.
struct SeqRows {
  int64_t first_row = -1, first_pos = 0, count = 0;
  void* k = nullptr;  // the caches' elements: float, Half or KvQ8Block
  void* v = nullptr;
  int64_t cap = 0;
};

// softmax(q K^T) V for every row and query head over the last `window` positions (all when window is 0).
// q: [R, n_heads, D] (roped, scaled); knew / vnew: [R, n_kv] rows of D values, this call's keys and values; older
// positions come from the caches ([1, n_kv, cap] rows; with `ring`, a ring of `window` slots where position p sits
// in slot p % window, else position p in row p), all with elements of type T. out: [R, n_heads * D].
template <typename T>
void attention_rows(const float* q, const T* knew, const T* vnew, const std::vector<SeqRows>& seqs,
                    const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos, int64_t window,
                    bool ring, int64_t n_heads, int64_t n_kv, int64_t D, float* out) {
  const int64_t R = static_cast<int64_t>(row_seq.size()), rep = n_heads / n_kv;
  // work items (row, kv head, chunk), chunks fixed by absolute position
  std::vector<int64_t> first_chunk(R), n_chunks(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = row_pos[r], lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    first_chunk[r] = lo / kKeyChunk;
    n_chunks[r] = p / kKeyChunk - first_chunk[r] + 1;
  }
  // Rows go in blocks whose partial results fit kAttnScratchFloats (a long prompt at a long context would
  // otherwise hold every row's per-chunk outputs at once); each row is computed the same in any block.
  std::vector<float> part_out, part_max, part_sum;
  std::vector<int64_t> item_start;
  for (int64_t r0 = 0; r0 < R;) {
    int64_t r1 = r0, items = 0;
    item_start.assign(1, 0);
    while (r1 < R && (r1 == r0 || (items + n_chunks[r1] * n_kv) * rep * D <= kAttnScratchFloats)) {
      items += n_chunks[r1] * n_kv;
      item_start.push_back(items);
      ++r1;
    }
    part_out.resize(items * rep * D), part_max.resize(items * rep), part_sum.resize(items * rep);
    // Work items are (block of up to kRowBlock consecutive rows of one sequence, kv head, chunk): a block's rows
    // read the chunk's keys and values widened to float32 once, from this thread's cache. Each row's partial
    // result is computed as it would be alone (the same values, the same chains) into its own slot.
    std::vector<int64_t> block_first{r0}, block_items{0};
    for (int64_t r = r0 + 1; r <= r1; ++r) {
      const int64_t b0 = block_first.back();
      if (r == r1 || row_seq[r] != row_seq[b0] || r - b0 == kRowBlock) {
        block_items.push_back(block_items.back() + n_kv * (row_pos[r - 1] / kKeyChunk - first_chunk[b0] + 1));
        if (r < r1) block_first.push_back(r);
      }
    }
    block_first.push_back(r1);
    const int64_t block_work = block_items.back();
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> scores(rep * kKeyChunk), widened_k, widened_v;
      std::vector<const T*> keys(kKeyChunk), values(kKeyChunk);
      std::vector<const float*> keys_f(kKeyChunk), values_f(kKeyChunk);
      std::vector<float> gathered_q(kRowBlock * rep * D), gathered_scores(kRowBlock * rep * kKeyChunk),
          gathered_max(kRowBlock * rep), gathered_sum(kRowBlock * rep), gathered_out(kRowBlock * rep * D);
      std::vector<int64_t> gathered_slot(kRowBlock * rep);
      int64_t b = std::upper_bound(block_items.begin(), block_items.end(), begin) - block_items.begin() - 1;
      for (int64_t item = begin; item < end; ++item) {
        while (item >= block_items[b + 1]) ++b;
        const int64_t rb0 = block_first[b], rb1 = block_first[b + 1], first = first_chunk[rb0];
        const int64_t span = row_pos[rb1 - 1] / kKeyChunk - first + 1, local = item - block_items[b];
        const int64_t g = local / span, c = first + local % span;
        const SeqRows& sq = seqs[row_seq[rb0]];
        auto range = [&](int64_t r) {  // row r's key positions in chunk c (empty when it sees none of them)
          const int64_t p = row_pos[r], lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
          return std::pair<int64_t, int64_t>{std::max(lo, c * kKeyChunk), std::min(p + 1, (c + 1) * kKeyChunk)};
        };
        int64_t u0 = INT64_MAX, u1 = 0, seeing = 0;
        for (int64_t r = rb0; r < rb1; ++r) {
          const auto [t0, t1] = range(r);
          if (t0 < t1) u0 = std::min(u0, t0), u1 = std::max(u1, t1), ++seeing;
        }
        if (seeing == 0) continue;
        for (int64_t t = u0; t < u1; ++t) {
          if (t >= sq.first_pos) {
            const int64_t row = sq.first_row + (t - sq.first_pos);
            keys[t - u0] = kv_row(knew, row * n_kv + g, D);
            values[t - u0] = kv_row(vnew, row * n_kv + g, D);
          } else {
            const int64_t slot = ring ? t % window : t;
            keys[t - u0] = kv_row(static_cast<const T*>(sq.k), g * sq.cap + slot, D);
            values[t - u0] = kv_row(static_cast<const T*>(sq.v), g * sq.cap + slot, D);
          }
        }
        auto slot_of = [&](int64_t r) { return (item_start[r - r0] + g * n_chunks[r] + (c - first_chunk[r])) * rep; };
        auto attend_alone = [&](int64_t r, int64_t t0, int64_t t1, const auto* ks, const auto* vs) {
          const int64_t slot = slot_of(r);
          attend_chunk(q + (r * n_heads + g * rep) * D, rep, ks + (t0 - u0), vs + (t0 - u0), t1 - t0, D, scores.data(),
                       kKeyChunk, part_max.data() + slot, part_sum.data() + slot, part_out.data() + slot * D);
        };
#if RUNLM_AVX512
        if (seeing > 1 && D % 16 == 0) {
          // the rows that see the whole union go together (all but the causal diagonal's, and a window's edge)
          widened_k.resize((u1 - u0 + 7) / 8 * 8 * D), widened_v.resize((u1 - u0) * D);
          widen_key_pairs(keys.data(), u1 - u0, D, widened_k.data());
          for (int64_t t = 0; t < u1 - u0; ++t) {
            kv_widen(values[t], widened_v.data() + t * D, D);
            values_f[t] = widened_v.data() + t * D;
          }
          int64_t m = 0;
          for (int64_t r = rb0; r < rb1; ++r) {
            const auto [t0, t1] = range(r);
            if (t0 == u0 && t1 == u1) {
              std::memcpy(gathered_q.data() + m * D, q + (r * n_heads + g * rep) * D, sizeof(float) * rep * D);
              for (int64_t j = 0; j < rep; ++j) gathered_slot[m + j] = slot_of(r) + j;
              m += rep;
            } else if (t0 < t1) {
              attend_alone(r, t0, t1, keys.data(), values.data());
            }
          }
          attend_gathered(gathered_q.data(), m, widened_k.data(), values_f.data(), u1 - u0, D, gathered_scores.data(),
                          kKeyChunk, gathered_max.data(), gathered_sum.data(), gathered_out.data());
          for (int64_t v = 0; v < m; ++v) {
            const int64_t slot = gathered_slot[v];
            part_max[slot] = gathered_max[v], part_sum[slot] = gathered_sum[v];
            std::memcpy(part_out.data() + slot * D, gathered_out.data() + v * D, sizeof(float) * D);
          }
          continue;
        }
#endif
        const bool widen = seeing > 1 && !std::is_same_v<T, float>;
        if (widen) {
          widened_k.resize((u1 - u0) * D), widened_v.resize((u1 - u0) * D);
          for (int64_t t = 0; t < u1 - u0; ++t) {
            kv_widen(keys[t], widened_k.data() + t * D, D), kv_widen(values[t], widened_v.data() + t * D, D);
            keys_f[t] = widened_k.data() + t * D, values_f[t] = widened_v.data() + t * D;
          }
        }
        for (int64_t r = rb0; r < rb1; ++r) {
          const auto [t0, t1] = range(r);
          if (t0 >= t1) continue;
          if (widen) {
            attend_alone(r, t0, t1, keys_f.data(), values_f.data());
          } else {
            attend_alone(r, t0, t1, keys.data(), values.data());
          }
        }
      }
    };
    if (block_work > 1 && items * rep * kKeyChunk * D >= (1 << 16)) {
      parallel_for(0, block_work, 1, work);
    } else {
      work(0, block_work);
    }
    parallel_for(r0, r1, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t r = b0; r < b1; ++r) {
        const int64_t k = r - r0;
        for (int64_t h = 0; h < n_heads; ++h) {
          const int64_t g = h / rep;
          merge_chunks(part_max.data(), part_sum.data(), part_out.data(),
                       (item_start[k] + g * n_chunks[r]) * rep + h % rep, rep, n_chunks[r], D,
                       out + (r * n_heads + h) * D);
        }
      }
    });
    r0 = r1;
  }
}

// attention_rows over caches of element type T, then this call's keys / values into the caches (slot p, or
// p % window for a ring that keeps the newest). The new keys / values are first stored as T (rounded for float16,
// quantized for q8_0): the rows of this call attend over exactly the values later calls read back from the cache.
template <typename T>
void attend_and_store(const float* q, const std::vector<float>& knew, const std::vector<float>& vnew,
                      const std::vector<SeqRows>& seqs, const std::vector<int64_t>& row_seq,
                      const std::vector<int64_t>& row_pos, int64_t window, bool ring, int64_t n_heads, int64_t n_kv,
                      int64_t D, float* out) {
  const int64_t R = static_cast<int64_t>(row_seq.size()), kv_width = n_kv * D;
  std::vector<T> k_typed, v_typed;
  const T* kt;
  const T* vt;
  if constexpr (std::is_same_v<T, float>) {
    kt = knew.data(), vt = vnew.data();
  } else {
    k_typed.resize(R * n_kv * kv_row_units<T>(D)), v_typed.resize(R * n_kv * kv_row_units<T>(D));
    parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
      kv_store(knew.data() + r0 * kv_width, kv_row(k_typed.data(), r0 * n_kv, D), (r1 - r0) * kv_width);
      kv_store(vnew.data() + r0 * kv_width, kv_row(v_typed.data(), r0 * n_kv, D), (r1 - r0) * kv_width);
    });
    kt = k_typed.data(), vt = v_typed.data();
  }
  attention_rows(q, kt, vt, seqs, row_seq, row_pos, window, ring, n_heads, n_kv, D, out);
  for (int64_t r = 0; r < R; ++r) {
    const SeqRows& sq = seqs[row_seq[r]];
    const int64_t slot = ring ? row_pos[r] % window : row_pos[r];
    T* kc = static_cast<T*>(sq.k);
    T* vc = static_cast<T*>(sq.v);
    for (int64_t g = 0; g < n_kv; ++g) {
      std::memcpy(kv_row(kc, g * sq.cap + slot, D), kv_row(kt, r * n_kv + g, D), kv_row_bytes<T>(D));
      std::memcpy(kv_row(vc, g * sq.cap + slot, D), kv_row(vt, r * n_kv + g, D), kv_row_bytes<T>(D));
    }
  }
}

// Rows [R, width] viewed as [R * heads, D]: RMSNorm of every head row (Qwen3 / Gemma q and k norms), in place.
void norm_heads(float* x, int64_t R, int64_t stride, int64_t offset, int64_t heads, int64_t D, const float* wp,
                double eps) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* row = x + r * stride + (offset + h) * D;
      double sum = 0.0;
      for (int64_t i = 0; i < D; ++i) sum += static_cast<double>(row[i]) * row[i];
      const float s = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(D) + eps));
      for (int64_t i = 0; i < D; ++i) row[i] = (row[i] * s) * wp[i];
    }
}

// One block's weights and shape, as block_rows reads them: the torch op and BlockStack point them into tensors, the
// C interface into the lean image.
struct BlockWeights {
  std::vector<const float*> norms;  // [attn, ffn] (pre-norm) or [pre_attn, post_attn, pre_mlp, post_mlp] (sandwich)
  int64_t hidden = 0;
  double eps = 0, scale = 0;
  const float* q_norm = nullptr;  // per-head norms of head_dim values, or none
  const float* k_norm = nullptr;
  int64_t head_dim = 0;
  std::vector<Weight> qkv, gate_up;
  Weight o, down;
  bool gelu = false;
  int64_t window = 0, n_heads = 0, n_kv_heads = 0;
};

// Where each sequence's rows sit (row r: sequence row_seq[r] at position row_pos[r]), checked: a sequence's rows are
// consecutive, at consecutive positions that fit its cache (k / v / cap per sequence).
std::vector<SeqRows> seq_rows(const char* op, const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos,
                              const std::vector<void*>& k, const std::vector<void*>& v, const std::vector<int64_t>& caps,
                              int64_t window, bool ring) {
  const int64_t n_seq = static_cast<int64_t>(k.size()), R = static_cast<int64_t>(row_seq.size());
  RUNLM_CHECK(static_cast<int64_t>(row_pos.size()) == R, op, ": one sequence index and position per row");
  std::vector<SeqRows> seqs(n_seq);
  for (int64_t r = 0; r < R; ++r) {
    RUNLM_CHECK(0 <= row_seq[r] && row_seq[r] < n_seq && row_pos[r] >= 0, op, ": bad row sequence / position");
    SeqRows& sq = seqs[row_seq[r]];
    if (sq.first_row < 0) {
      sq.first_row = r, sq.first_pos = row_pos[r];
    } else {
      RUNLM_CHECK(sq.first_row + sq.count == r && sq.first_pos + sq.count == row_pos[r], op,
                  ": a sequence's rows must be consecutive, at consecutive positions");
    }
    ++sq.count;
  }
  for (int64_t s = 0; s < n_seq; ++s) {
    SeqRows& sq = seqs[s];
    sq.k = k[s], sq.v = v[s], sq.cap = caps[s];
    RUNLM_CHECK(ring ? window > 0 && sq.cap == window : sq.first_pos + sq.count <= sq.cap, op, ": cache ", s,
                " is too small for its positions");
  }
  return seqs;
}

// A whole transformer block for R rows (see the section comment), in place on h [R, hidden]:
//   pre-norm (2 norms):        h += o(attn(qkv(n0(h))));       h += down(act(gate_up(n1(h))))
//   sandwich (4 norms, Gemma): h += n1(o(attn(qkv(n0(h)))));   h += n3(down(act(gate_up(n2(h)))))
// with optional per-head q / k norms before RoPE, act = SiLU or tanh-GELU gated. cos / sin: [R, D] (rotate-half,
// sign in sin). The caches (elements of kv_type, all alike) take the new keys / values after attention.
void block_rows(const BlockWeights& b, float* hp, int64_t R, const float* cp, const float* sp, int64_t D,
                const std::vector<SeqRows>& seqs, int64_t kv_type, bool ring, const std::vector<int64_t>& rseq,
                const std::vector<int64_t>& rpos) {
  const bool sandwich = b.norms.size() == 4;
  const int64_t hidden = b.hidden, n_heads = b.n_heads, n_kv_heads = b.n_kv_heads;
  const int64_t q_width = n_heads * D, kv_width = n_kv_heads * D, stride = q_width + 2 * kv_width;
  int64_t qkv_rows = 0, gate_up_rows = 0;
  for (const Weight& w : b.qkv) qkv_rows += w.rows;
  for (const Weight& w : b.gate_up) gate_up_rows += w.rows;
  RUNLM_CHECK(qkv_rows == stride, "runlm block: qkv projection width does not match the heads");
  std::vector<float> normed(R * hidden), xqkv(R * stride);
  rms_norm_rows(hp, R, hidden, b.norms[0], b.eps, normed.data());
  linear_parts_rows(normed.data(), R, hidden, b.qkv, xqkv.data());
  float* xp = xqkv.data();
  if (b.q_norm != nullptr) norm_heads(xp, R, stride, 0, n_heads, D, b.q_norm, b.eps);
  if (b.k_norm != nullptr) norm_heads(xp, R, stride, n_heads, n_kv_heads, D, b.k_norm, b.eps);
  std::vector<float> q(R * q_width), knew(R * kv_width), vnew(R * kv_width);
  const int64_t half = D / 2;
  const float scale = static_cast<float>(b.scale);
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * D;
      const float* sn = sp + r * D;
      auto rope = [&](const float* in, float* o, float mult) {
        for (int64_t i = 0; i < half; ++i) o[i] = (in[i] * c[i] + in[i + half] * sn[i]) * mult;
        for (int64_t i = half; i < D; ++i) o[i] = (in[i] * c[i] + in[i - half] * sn[i]) * mult;
      };
      const float* row = xp + r * stride;
      for (int64_t hh = 0; hh < n_heads; ++hh) rope(row + hh * D, q.data() + r * q_width + hh * D, scale);
      for (int64_t g = 0; g < n_kv_heads; ++g) {
        rope(row + q_width + g * D, knew.data() + r * kv_width + g * D, 1.f);
        std::memcpy(vnew.data() + r * kv_width + g * D, row + q_width + kv_width + g * D, sizeof(float) * D);
      }
    }
  });
  std::vector<float> attended(R * q_width), projected(R * hidden);
  with_kv_type(kv_type, [&](auto element) {
    attend_and_store<decltype(element)>(q.data(), knew, vnew, seqs, rseq, rpos, b.window, ring, n_heads, n_kv_heads,
                                        D, attended.data());
  });
  linear_rows(attended.data(), R, q_width, b.o, projected.data());
  if (sandwich) rms_norm_rows(projected.data(), R, hidden, b.norms[1], b.eps, projected.data());
  for (int64_t i = 0; i < R * hidden; ++i) hp[i] += projected[i];
  for (auto* done : {&xqkv, &q, &knew, &vnew, &attended}) std::vector<float>().swap(*done);  // before the MLP's own
  std::vector<float> gate_up(R * gate_up_rows);
  rms_norm_rows(hp, R, hidden, b.norms[sandwich ? 2 : 1], b.eps, normed.data());
  linear_parts_rows(normed.data(), R, hidden, b.gate_up, gate_up.data());
  const int64_t ffn = gate_up_rows / 2;
  std::vector<float> act(R * ffn);
  const float* gu = gate_up.data();
  float* ap = act.data();
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (b.gelu) {
        gated_activation<true>(gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, ap + r * ffn, ffn);
      } else {
        gated_activation<false>(gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, ap + r * ffn, ffn);
      }
    }
  });
  linear_rows(act.data(), R, ffn, b.down, projected.data());
  if (sandwich) rms_norm_rows(projected.data(), R, hidden, b.norms[3], b.eps, projected.data());
  for (int64_t i = 0; i < R * hidden; ++i) hp[i] += projected[i];
}

#ifndef RUNLM_STANDALONE
std::vector<Weight> weights_of(at::TensorList ws, at::IntArrayRef types, at::IntArrayRef rows, int64_t in_features) {
  TORCH_CHECK(ws.size() == types.size() && ws.size() == rows.size() && !ws.empty(),
              "runlm::transformer_block: one type and row count per weight part");
  std::vector<Weight> out;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight("runlm::transformer_block", ws[i], types[i], rows[i], in_features);
    TORCH_CHECK(ws[i].is_contiguous(), "runlm::transformer_block: weights must be contiguous");
    out.push_back(Weight{ws[i].data_ptr<uint8_t>(), types[i], rows[i]});
  }
  return out;
}

const float* float_values(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "runlm::transformer_block: ",
              what, " must be ", n, " contiguous float32 values");
  return t.data_ptr<float>();
}

// A block's weight tensors as block_rows reads them (pointers into the tensors: they must outlive the result).
BlockWeights block_weights(at::TensorList norms, double eps, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, at::TensorList qkv_ws, at::IntArrayRef qkv_types,
                           at::IntArrayRef qkv_rows, const at::Tensor& o_w, int64_t o_type, at::TensorList gate_up_ws,
                           at::IntArrayRef gate_up_types, at::IntArrayRef gate_up_rows, const at::Tensor& down_w,
                           int64_t down_type, bool gelu, int64_t window, int64_t n_heads, int64_t n_kv_heads,
                           double scale) {
  const char* op = "runlm::transformer_block";
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, op, ": two (pre-norm) or four (sandwich) norms expected");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, op, ": heads must group evenly");
  int64_t qkv_width = 0;
  for (const int64_t rows : qkv_rows) qkv_width += rows;
  const int64_t D = qkv_width / (n_heads + 2 * n_kv_heads);
  TORCH_CHECK(D > 0 && qkv_width == (n_heads + 2 * n_kv_heads) * D, op, ": qkv projection width does not match the "
              "heads");
  BlockWeights b;
  b.hidden = norms[0].numel();
  for (const at::Tensor& n : norms) b.norms.push_back(float_values(n, b.hidden, "the norms"));
  b.eps = eps, b.scale = scale, b.gelu = gelu, b.window = window, b.n_heads = n_heads, b.n_kv_heads = n_kv_heads;
  b.head_dim = D;
  if (q_norm.has_value()) b.q_norm = float_values(*q_norm, D, "q_norm");
  if (k_norm.has_value()) b.k_norm = float_values(*k_norm, D, "k_norm");
  b.qkv = weights_of(qkv_ws, qkv_types, qkv_rows, b.hidden);
  b.o = weights_of({o_w}, {o_type}, {b.hidden}, n_heads * D)[0];
  b.gate_up = weights_of(gate_up_ws, gate_up_types, gate_up_rows, b.hidden);
  int64_t ffn = 0;
  for (const Weight& w : b.gate_up) ffn += w.rows;
  TORCH_CHECK(ffn % 2 == 0, op, ": gate_up must be gate and up rows alike");
  b.down = weights_of({down_w}, {down_type}, {b.hidden}, ffn / 2)[0];
  return b;
}

// block_rows over tensors: h [R, hidden] float32; the caches of the call's sequences (float32, float16 or q8_0, all
// alike, [1, n_kv_heads, capacity, row]: see kv_cache_row).
at::Tensor run_block(const BlockWeights& b, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                     at::TensorList k_caches, at::TensorList v_caches, bool ring, const std::vector<int64_t>& rseq,
                     const std::vector<int64_t>& rpos) {
  const char* op = "runlm::transformer_block";
  const int64_t R = h.size(0), D = cos.size(-1);
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.size(1) == b.hidden, op,
              ": h must be float [R, hidden]");
  TORCH_CHECK(static_cast<int64_t>(rseq.size()) == R, op, ": one sequence index and position per row");
  TORCH_CHECK(cos.numel() == R * D && sin.numel() == R * D && D % 8 == 0, op,
              ": cos / sin must be [R, D], D a multiple of 8");
  TORCH_CHECK(b.head_dim == D, op, ": heads of ", b.head_dim, " values (the qkv projection's), RoPE tables of ", D);
  TORCH_CHECK(k_caches.size() == v_caches.size() && !k_caches.empty(), op, ": one k and v cache per sequence");
  const int64_t kv_type = kv_type_of(k_caches[0]);
  TORCH_CHECK(kv_type != kKvQ8 || D % kQ8Values == 0, op, ": a q8_0 cache needs a head dim that is a multiple "
              "of 32, got ", D);
  std::vector<void*> ks, vs;
  std::vector<int64_t> caps;
  for (size_t s = 0; s < k_caches.size(); ++s) {
    const at::Tensor& kc = k_caches[s];
    const at::Tensor& vc = v_caches[s];
    TORCH_CHECK(kv_cache_type_ok(kc, vc) && kv_type_of(kc) == kv_type, op, ": cache ", s,
                " must be float32, float16 or q8_0 (uint8), as every other cache of the call");
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.size(1) == b.n_kv_heads &&
                    kc.size(3) == kv_cache_row(kc, D) && kc.sizes() == vc.sizes(),
                op, ": cache ", s, " must be [1, n_kv_heads, capacity, head_dim] (q8_0: head_dim / 32 * 34 bytes), "
                "contiguous");
    ks.push_back(kc.data_ptr()), vs.push_back(vc.data_ptr()), caps.push_back(kc.size(2));
  }
  const std::vector<SeqRows> seqs = seq_rows(op, rseq, rpos, ks, vs, caps, b.window, ring);
  at::Tensor out = h.contiguous().clone();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  block_rows(b, out.data_ptr<float>(), R, cc.data_ptr<float>(), sc.data_ptr<float>(), D, seqs, kv_type, ring, rseq,
             rpos);
  return out;
}

at::Tensor transformer_block(const at::Tensor& h, at::TensorList norms, double eps, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, at::TensorList qkv_ws, at::IntArrayRef qkv_types,
                      at::IntArrayRef qkv_rows, const at::Tensor& o_w, int64_t o_type, at::TensorList gate_up_ws,
                      at::IntArrayRef gate_up_types, at::IntArrayRef gate_up_rows, const at::Tensor& down_w,
                      int64_t down_type, bool gelu, const at::Tensor& cos, const at::Tensor& sin,
                      at::TensorList k_caches, at::TensorList v_caches, int64_t window, bool ring,
                      at::IntArrayRef row_seq,
                      at::IntArrayRef row_pos, int64_t n_heads, int64_t n_kv_heads, double scale) {
  const BlockWeights b = block_weights(norms, eps, q_norm, k_norm, qkv_ws, qkv_types, qkv_rows, o_w, o_type,
                                       gate_up_ws, gate_up_types, gate_up_rows, down_w, down_type, gelu, window,
                                       n_heads, n_kv_heads, scale);
  return run_block(b, h, cos, sin, k_caches, v_caches, ring, row_seq.vec(), row_pos.vec());
}

// Every block of a model in one call. The blocks' weight arguments are kept here once, at load: a small model's
// decode step otherwise pays one dispatch from Python per block (argument conversion, the KV bookkeeping around
// it: ~40-80 us each on this VM), while the other threads wait. Each block runs exactly as transformer_block runs
// it, so the results are its results.
struct BlockStack : torch::CustomClassHolder {
  struct Block {
    std::vector<at::Tensor> tensors;  // what `weights` points into, held
    BlockWeights weights;
    int64_t rope = 0;
  };
  std::vector<Block> blocks;

  void add_block(std::vector<at::Tensor> norms, double eps, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, std::vector<at::Tensor> qkv_ws, std::vector<int64_t> qkv_types,
                 std::vector<int64_t> qkv_rows, at::Tensor o_w, int64_t o_type, std::vector<at::Tensor> gate_up_ws,
                 std::vector<int64_t> gate_up_types, std::vector<int64_t> gate_up_rows, at::Tensor down_w,
                 int64_t down_type, bool gelu, int64_t rope, int64_t window, int64_t n_heads, int64_t n_kv_heads,
                 double scale) {
    Block block;
    block.weights = block_weights(norms, eps, q_norm, k_norm, qkv_ws, qkv_types, qkv_rows, o_w, o_type, gate_up_ws,
                                  gate_up_types, gate_up_rows, down_w, down_type, gelu, window, n_heads, n_kv_heads,
                                  scale);
    block.rope = rope;
    for (auto* list : {&norms, &qkv_ws, &gate_up_ws}) block.tensors.insert(block.tensors.end(), list->begin(), list->end());
    for (const auto& t : {q_norm, k_norm})
      if (t.has_value()) block.tensors.push_back(*t);
    block.tensors.push_back(o_w), block.tensors.push_back(down_w);
    blocks.push_back(std::move(block));
  }

  // h [R, hidden] through every block. cos / sin: one table pair per RoPE (a block's `rope` indexes them); k / v
  // caches block-major (block b's caches of the S sequences at b * S ...); rings: per block, whether its caches
  // are rings of its window.
  at::Tensor run(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                 std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<int64_t> rings,
                 std::vector<int64_t> row_seq, std::vector<int64_t> row_pos) {
    const int64_t n = static_cast<int64_t>(blocks.size());
    TORCH_CHECK(n > 0 && static_cast<int64_t>(rings.size()) == n && k_caches.size() == v_caches.size() &&
                    !k_caches.empty() && static_cast<int64_t>(k_caches.size()) % n == 0 && cos.size() == sin.size(),
                "runlm::BlockStack.run: one ring flag per block and the same number of k / v caches per block");
    const int64_t seqs = static_cast<int64_t>(k_caches.size()) / n;
    for (int64_t b = 0; b < n; ++b) {
      const Block& k = blocks[b];
      TORCH_CHECK(k.rope >= 0 && k.rope < static_cast<int64_t>(cos.size()), "runlm::BlockStack.run: block ", b,
                  " has no RoPE table");
      const at::TensorList ks(k_caches.data() + b * seqs, seqs), vs(v_caches.data() + b * seqs, seqs);
      h = run_block(k.weights, h, cos[k.rope], sin[k.rope], ks, vs, rings[b] != 0, row_seq, row_pos);
    }
    return h;
  }
};
#endif  // RUNLM_STANDALONE

}  // namespace

#ifdef RUNLM_STANDALONE
// ------------------------------------------------------------------------------------------------------------
// C interface of the standalone build (runlm.lean calls it through ctypes). Pointers are the caller's, valid for the
// call (a stack's weights: for the stack's life). Each function returns 0, or -1 with rl_last_error() saying why.

// One weight as the kernels read it: GGUF blocks (type id, + X4 for the interleaved layout) of `rows` rows.
struct RlWeight {
  const uint8_t* data;
  int64_t type;
  int64_t rows;
};

// One transformer block, whole: what rl_stack_add_block takes (runlm.native.library.Block mirrors it field by field).
// Norms in the order they apply: two (pre-norm: before attention, before the MLP) or four (sandwich: before and
// after each). q/k/v and gate/up may come in parts of different types, stacked along the output dimension.
struct RlBlock {
  const float* norms[4];
  int64_t n_norms;
  int64_t hidden;
  double eps;
  const float* q_norm;  // per-head RMSNorm weights, or null
  const float* k_norm;
  RlWeight qkv[3];
  int64_t n_qkv;
  RlWeight o;
  RlWeight gate_up[2];
  int64_t n_gate_up;
  RlWeight down;
  int64_t gelu;  // the MLP's activation: GELU (tanh) when set, else SiLU
  int64_t rope;  // which RoPE table the block rotates with
  int64_t window;  // sliding-window length, 0 for full attention
  int64_t n_heads;
  int64_t n_kv_heads;
  double scale;  // attention's query scale
};

namespace {
thread_local std::string g_error;

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

std::vector<Weight> weight_parts(const RlWeight* parts, int64_t n) {
  std::vector<Weight> out;
  for (int64_t i = 0; i < n; ++i) {
    TypeInfo info{};
    RUNLM_CHECK(type_info(parts[i].type, &info), "unsupported GGML type id ", parts[i].type);
    RUNLM_CHECK(parts[i].data != nullptr && parts[i].rows > 0, "a weight part has no data or no rows");
    out.push_back(Weight{parts[i].data, parts[i].type, parts[i].rows});
  }
  return out;
}
}  // namespace

extern "C" {

const char* rl_last_error() { return g_error.c_str(); }

// What this library was built from (runlm.quant.build.source_key), set by the install's build: the loader refuses a
// library of another source or flags. Empty in a build made at first use (its cache name carries the key instead).
#ifndef RUNLM_SOURCE_KEY
#define RUNLM_SOURCE_KEY ""
#endif
const char* rl_source_key() { return RUNLM_SOURCE_KEY; }

const char* rl_isa() {
  static const std::string isa = gguf_isa();
  return isa.c_str();
}

int64_t rl_group_rows(int64_t type) { return group_rows(type); }

int64_t rl_simd() { return gguf_simd(); }

int rl_set_threads(int threads) {
  return guarded([&] {
    RUNLM_CHECK(threads > 0, "threads must be positive, got ", threads);
    omp_set_num_threads(threads);
  });
}

int rl_set_decode_walk(int64_t line_ahead, int64_t burst_ahead, int64_t kquant_streams, int64_t wide32_streams) {
  return guarded([&] { gguf_set_decode_walk(line_ahead, burst_ahead, kquant_streams, wide32_streams); });
}

int rl_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t N, float* y) {
  return guarded([&] {
    TypeInfo info{};
    RUNLM_CHECK(type_info(type, &info) && K % info.qk == 0, "unsupported GGML type id ", type, " or width ", K);
    linear_rows(x, M, K, Weight{w, type, N}, y);
  });
}

int rl_dequantize_rows(const uint8_t* w, int64_t type, int64_t N, int64_t K, const int64_t* ids, int64_t n,
                       float* out) {
  return guarded([&] {
    for (int64_t i = 0; i < n; ++i) RUNLM_CHECK(ids[i] >= 0 && ids[i] < N, "row ", ids[i], " is out of range for ", N);
    RUNLM_DISPATCH(type, dequant_picked, w, K, ids, n, out)
  });
}

int rl_rms_norm(const float* x, int64_t rows, int64_t n, const float* w, double eps, float* out) {
  return guarded([&] { rms_norm_rows(x, rows, n, w, eps, out); });
}

int rl_relayout(const uint8_t* src, int64_t type, int64_t N, int64_t K, uint8_t* dst) {
  return guarded([&] {
    const int64_t base = type >= X4 ? type - X4 : type;
    RUNLM_CHECK(group_rows(base) > 0 && N % group_rows(base) == 0, "no interleaved layout of ", N, " rows for type ",
                base);
    relayout_bytes(src, type, N, K, dst);
  });
}

struct RlStack {
  std::vector<BlockWeights> blocks;
  std::vector<int64_t> ropes;
};

void* rl_stack_new() { return new RlStack(); }

void rl_stack_free(void* stack) { delete static_cast<RlStack*>(stack); }

int rl_stack_add_block(void* stack, const RlBlock* block) {
  return guarded([&] {
    const RlBlock& in = *block;
    RUNLM_CHECK(in.n_norms == 2 || in.n_norms == 4, "two (pre-norm) or four (sandwich) norms expected");
    RUNLM_CHECK(in.n_qkv >= 1 && in.n_qkv <= 3 && in.n_gate_up >= 1 && in.n_gate_up <= 2,
                "one to three q/k/v parts and one or two gate/up parts expected");
    RUNLM_CHECK(in.n_kv_heads > 0 && in.n_heads % in.n_kv_heads == 0, "heads must group evenly");
    BlockWeights b;
    b.norms.assign(in.norms, in.norms + in.n_norms);
    b.hidden = in.hidden, b.eps = in.eps, b.q_norm = in.q_norm, b.k_norm = in.k_norm, b.scale = in.scale;
    b.qkv = weight_parts(in.qkv, in.n_qkv);
    RUNLM_CHECK(in.o.rows == in.hidden && in.down.rows == in.hidden, "o and down must give hidden rows");
    b.o = weight_parts(&in.o, 1)[0];
    b.gate_up = weight_parts(in.gate_up, in.n_gate_up);
    b.down = weight_parts(&in.down, 1)[0];
    b.gelu = in.gelu != 0, b.window = in.window, b.n_heads = in.n_heads, b.n_kv_heads = in.n_kv_heads;
    int64_t qkv_width = 0;
    for (const Weight& w : b.qkv) qkv_width += w.rows;
    b.head_dim = qkv_width / (in.n_heads + 2 * in.n_kv_heads);
    RUNLM_CHECK(b.head_dim > 0 && qkv_width == (in.n_heads + 2 * in.n_kv_heads) * b.head_dim,
                "qkv projection width does not match the heads");
    static_cast<RlStack*>(stack)->blocks.push_back(std::move(b));
    static_cast<RlStack*>(stack)->ropes.push_back(in.rope);
  });
}

// h [R, hidden] through every block, in place. cos / sin [R, D] per RoPE; k / v caches block-major (block b's caches
// of the n_seqs sequences at b * n_seqs ...), capacities per sequence and rings per block.
int rl_stack_run(void* stack, float* h, int64_t R, const float* const* cos, const float* const* sin, int64_t n_ropes,
                 int64_t D, void* const* k_caches, void* const* v_caches, const int64_t* caps, const int64_t* rings,
                 int64_t n_seqs, int64_t kv_type, const int64_t* row_seq, const int64_t* row_pos) {
  return guarded([&] {
    const RlStack& s = *static_cast<RlStack*>(stack);
    RUNLM_CHECK(D % 8 == 0 && (kv_type != kKvQ8 || D % kQ8Values == 0), "bad head dim ", D, " for cache type ",
                kv_type);
    const std::vector<int64_t> rseq(row_seq, row_seq + R), rpos(row_pos, row_pos + R);
    for (size_t b = 0; b < s.blocks.size(); ++b) {
      RUNLM_CHECK(s.ropes[b] >= 0 && s.ropes[b] < n_ropes, "block ", b, " has no RoPE table");
      RUNLM_CHECK(s.blocks[b].head_dim == D, "block ", b, " has heads of ", s.blocks[b].head_dim, " values, not ", D);
      const std::vector<void*> ks(k_caches + b * n_seqs, k_caches + (b + 1) * n_seqs);
      const std::vector<void*> vs(v_caches + b * n_seqs, v_caches + (b + 1) * n_seqs);
      const std::vector<int64_t> cs(caps + b * n_seqs, caps + (b + 1) * n_seqs);
      const bool ring = rings[b] != 0;
      const std::vector<SeqRows> seqs = seq_rows("rl_stack_run", rseq, rpos, ks, vs, cs, s.blocks[b].window, ring);
      block_rows(s.blocks[b], h, R, cos[s.ropes[b]], sin[s.ropes[b]], D, seqs, kv_type, ring, rseq, rpos);
    }
  });
}

}  // extern "C"
#else

TORCH_LIBRARY(runlm, m) {
  m.class_<BlockStack>("BlockStack")
      .def(torch::init<>())
      .def("add_block", &BlockStack::add_block)
      .def("run", &BlockStack::run);
  m.def("gguf_linear(Tensor x, Tensor w, int type, int out_features, int in_features) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int type, int out_features, int in_features) -> Tensor");
  m.def("gguf_dequantize_rows(Tensor w, int type, int out_features, int in_features, Tensor ids) -> Tensor");
  m.def("gguf_relayout(Tensor w, int type, int out_features, int in_features) -> Tensor");
  m.def("gguf_relayout_into(Tensor w, Tensor(a!) out, int type, int out_features, int in_features) -> ()");
  m.def("gguf_simd() -> int", &gguf_simd);
  m.def("gguf_set_decode_walk(int line_ahead, int burst_ahead, int kquant_streams, int wide32_streams) -> ()",
        &gguf_set_decode_walk);
  m.def("gguf_decode_walk() -> int[]", &gguf_decode_walk);
  m.def("gguf_group_rows(int type) -> int", &group_rows);
  m.def("gguf_isa() -> str", &gguf_isa);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, "
      "int n_heads, int n_kv_heads, float scale) -> Tensor");
  m.def(
      "transformer_block(Tensor h, Tensor[] norms, float eps, Tensor? q_norm, Tensor? k_norm, Tensor[] qkv_ws, "
      "int[] qkv_types, int[] qkv_rows, Tensor o_w, int o_type, Tensor[] gate_up_ws, int[] gate_up_types, "
      "int[] gate_up_rows, Tensor down_w, int down_type, bool gelu, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, int window, bool ring, int[] row_seq, int[] row_pos, int n_heads, int n_kv_heads, "
      "float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(runlm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
  m.impl("gguf_relayout", &gguf_relayout);
  m.impl("gguf_relayout_into", &gguf_relayout_into);
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
  m.impl("transformer_block", &transformer_block);
}
#endif  // RUNLM_STANDALONE
