// runlm kernels: includes, build switches, threads, float16, activation block types.
// A part of kernels.cpp's one translation unit, included in order.
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
// once for up to 4 activation rows; with one activation row (decode) the weight rows go one after another, a
// sequential stream per thread, and with two, two at a time.
//
// Ops (registered under TORCH_LIBRARY(runlm)): gguf_linear (above), gguf_dequantize (weight rows to float32),
// gguf_dequantize_rows (chosen rows only), gguf_relayout (and gguf_relayout_into a given buffer), gguf_simd (1 if
// AVX2 path), gguf_isa (the instruction set built for), rms_norm (a one-pass float32 RMSNorm), decode_attention
// (RoPE + cache write + attention for one new token of one sequence, the float32 reference path), and the class
// BlockStack (whole blocks for rows of one or more sequences, route-invariant: see "Route-invariant blocks"; a block
// comes in as the native runtime's do, an RlBlock).
//
// Two builds: the PyTorch extension (runlm.quant.kernels: the ops above) and, with -DRUNLM_STANDALONE, a plain
// library with a C interface (the native runtime, runlm.native.library: the same kernels and blocks, no torch in the
// process). Each is built per instruction-set variant (runlm.quant.build.ISA_VARIANTS: the install builds them all,
// the CPU's best is loaded): the AVX2/FMA/F16C path when the compiler targets it, with AVX-512 VNNI dot products and
// 16-row groups in the avx512 variant, AMX tiles in the amx one, the scalar path otherwise (or with -DRUNLM_SCALAR).
// All quantize activations identically, so they agree to float rounding.

// RUNLM_STANDALONE builds the same kernels without PyTorch, as a plain shared library with a C interface (api.h),
// for the native runtime: threads from OpenMP directly, float16 by its own conversions (IEEE round to nearest even,
// as c10's), no ops registered.
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
#include <bit>
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

// ARM: NEON integer dot products (SDOT where the target has the dotprod extension) under the scalar path's decode.
#if defined(__ARM_NEON) && defined(__aarch64__) && !defined(RUNLM_SCALAR)
#define RUNLM_NEON 1
#include <arm_neon.h>
#else
#define RUNLM_NEON 0
#endif

// VNNI on 256-bit vectors: one vpdpbusd does a byte dot product's multiply, pair sums and int32 accumulation; the
// integer results are exactly those of the AVX2 maddubs / madd sequence it replaces. Two encodings: AVX-512 VNNI with
// VL (EVEX), and AVX-VNNI (VEX: Intel since Alder Lake, AMD since Zen 5, on CPUs without AVX-512 too), the avxvnni
// build's, which keeps AVX2's 4-row groups.
#if RUNLM_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RUNLM_VNNI 1
#define RUNLM_AVXVNNI 0
#elif RUNLM_AVX2 && defined(__AVXVNNI__)
#define RUNLM_VNNI 1
#define RUNLM_AVXVNNI 1
#else
#define RUNLM_VNNI 0
#define RUNLM_AVXVNNI 0
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

// Rows per thread at least, for a row-wise pass over rows of `width` values: enough that a thread's share is worth a
// fork (~1 us), one row never split. A batched decode step's 8 rows then go over both threads instead of one.
constexpr int64_t row_grain(int64_t width, int64_t values = 2048) {
  return std::max<int64_t>(1, values / std::max<int64_t>(1, width));
}

// f(i) for every i in [0, n), spread over the threads one task at a time as they come free (tasks of uneven cost:
// a mixture's experts). Calls made from inside run on the calling thread, as parallel_for's do.
template <class F>
inline void parallel_tasks(int64_t n, const F& f) {
#ifndef RUNLM_STANDALONE
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i);
  });
#else
  if (n <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(std::min<int64_t>(n, omp_get_max_threads())))
  for (int64_t i = 0; i < n; ++i) f(i);
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
  T_F32 = 0,
  T_F16 = 1,
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
  T_IQ4_NL = 20,
  T_IQ4_XS = 23,
  T_BF16 = 30,
  T_MXFP4 = 39,
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

// A32 with what MXFP4's AVX2 kernel takes off each pair of products: 12 * (a[2j] + a[2j + 1]), vpmaddubsw's pairs.
// The kernel then meets the activation with the codes' levels plus 12 (0..24, unsigned bytes) instead of the sign
// trick's two vpsignb, and gets the same int16 pairs exactly (|each pair| <= 2 * 24 * 127).
constexpr int kMxfp4Lift = 12;  // MXFP4's largest |level| (doubled)
struct A32Pairs : A32 {
  int16_t pair_offsets[16];
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

// AK's codes as the AVX2 IQ4_XS row kernel takes them: each 64 values in the order a 32-byte load of two sub-blocks'
// IQ4_XS codes unpacks to (values 0-15 and 32-47, then 16-31 and 48-63), arranged once per activation row where
// the natural order cost a shuffle for every weight row. 32-byte aligned: no load splits a cache line.
struct alignas(32) AKI {
  int8_t qs[QK_K];
  float d;
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

