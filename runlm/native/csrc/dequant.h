// runlm kernels: dequantization. A part of kernels.cpp's one translation unit (included in order).
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
    case T_MXFP4: *info = {MXFP4::QK, MXFP4::SIZE}; return true;
    case T_IQ4_NL: *info = {IQ4_NL::QK, IQ4_NL::SIZE}; return true;
    case T_IQ4_XS: *info = {IQ4_XS::QK, IQ4_XS::SIZE}; return true;
    case T_Q4_0 + X4: *info = {Q4_0::QK, Q4_0::SIZE}; return true;
    case T_Q4_1 + X4: *info = {Q4_1::QK, Q4_1::SIZE}; return true;
    case T_Q5_0 + X4: *info = {Q5_0::QK, Q5_0::SIZE}; return true;
    case T_Q5_1 + X4: *info = {Q5_1::QK, Q5_1::SIZE}; return true;
    case T_Q8_0 + X4: *info = {Q8_0::QK, Q8_0::SIZE}; return true;
    case T_Q4_K + X4: *info = {Q4_K::QK, Q4_K::SIZE}; return true;
    case T_Q5_K + X4: *info = {Q5_K::QK, Q5_K::SIZE}; return true;
    case T_Q6_K + X4: *info = {Q6_K::QK, Q6_K::SIZE}; return true;
#if RUNLM_AVX512  // IQ4_XS is regrouped for the 512-bit kernels only: on AVX2 4-row groups ran no faster
    case T_IQ4_XS + X4: *info = {IQ4_XS::QK, IQ4_XS::SIZE}; return true;
#endif
    case T_F32: *info = {1, 4}; return true;
    case T_F16: *info = {1, 2}; return true;
    case T_BF16: *info = {1, 2}; return true;
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
    case T_Q8_0: return kQ8_0InRows ? 0 : X4Fields<Q8_0>::ROWS;  // read in place by X4Rows
    case T_Q4_K: return X4Fields<Q4_K>::ROWS;
    case T_Q5_K: return X4Fields<Q5_K>::ROWS;
    case T_Q6_K: return X4Fields<Q6_K>::ROWS;
#if RUNLM_AVX512
    case T_IQ4_XS: return X4Fields<IQ4_XS>::ROWS;
#endif
    default: return 0;
  }
}

#if RUNLM_AVX512
#define RUNLM_IQ4_XS_X4_CASE(FN, ...) \
  case T_IQ4_XS + X4: FN<X4Layout<IQ4_XS>>(__VA_ARGS__); break;
#else
#define RUNLM_IQ4_XS_X4_CASE(FN, ...)
#endif

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
    case T_MXFP4: FN<MXFP4>(__VA_ARGS__); break;        \
    case T_IQ4_NL: FN<IQ4_NL>(__VA_ARGS__); break;      \
    case T_IQ4_XS: FN<IQ4_XS>(__VA_ARGS__); break;      \
    case T_Q4_0 + X4: FN<X4Layout<Q4_0>>(__VA_ARGS__); break; \
    case T_Q4_1 + X4: FN<X4Layout<Q4_1>>(__VA_ARGS__); break; \
    case T_Q5_0 + X4: FN<X4Layout<Q5_0>>(__VA_ARGS__); break; \
    case T_Q5_1 + X4: FN<X4Layout<Q5_1>>(__VA_ARGS__); break; \
    case T_Q8_0 + X4: FN<X4Layout<Q8_0>>(__VA_ARGS__); break; \
    case T_Q4_K + X4: FN<X4Layout<Q4_K>>(__VA_ARGS__); break; \
    case T_Q5_K + X4: FN<X4Layout<Q5_K>>(__VA_ARGS__); break; \
    case T_Q6_K + X4: FN<X4Layout<Q6_K>>(__VA_ARGS__); break; \
    RUNLM_IQ4_XS_X4_CASE(FN, __VA_ARGS__)                 \
    default: RUNLM_CHECK(false, #FN ": no kernel for GGML type id ", type); \
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
#if RUNLM_AVX512
    case T_IQ4_XS: relayout<IQ4_XS>(src, N, K, dst, to_plain); break;
#endif
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
void gguf_set_decode_walk(int64_t line_ahead, int64_t kquant_burst, int64_t wide32_burst, int64_t kquant_streams,
                          int64_t wide32_streams) {
  RUNLM_CHECK(line_ahead >= 0 && line_ahead <= (1 << 16) && line_ahead % 64 == 0,
              "line_ahead must be a multiple of 64 bytes from 0 to 65536, got ", line_ahead);
  for (const int64_t burst : {kquant_burst, wide32_burst})
    RUNLM_CHECK(burst >= 0 && burst <= (1 << 16), "a burst distance must be 0 to 65536 bytes, got ", burst);
  for (const int64_t streams : {kquant_streams, wide32_streams})
    RUNLM_CHECK(streams == 1 || streams == 2, "streams must be 1 or 2, got ", streams);
  g_walk = DecodeWalk{static_cast<int>(line_ahead), static_cast<int>(kquant_burst), static_cast<int>(wide32_burst),
                      static_cast<int>(kquant_streams), static_cast<int>(wide32_streams)};
}

std::vector<int64_t> gguf_decode_walk() {
  return {g_walk.line_ahead, g_walk.kquant_burst, g_walk.wide32_burst, g_walk.kquant_streams, g_walk.wide32_streams};
}

// The instruction set this build's kernels use (the extension is compiled for the CPU it runs on).
std::string gguf_isa() {
#if RUNLM_AMX
  if (amx_usable()) return "avx512-vnni+amx";
#endif
  return RUNLM_AVXVNNI ? "avx-vnni" : RUNLM_VNNI ? "avx512-vnni" : RUNLM_AVX2 ? "avx2" : "scalar";
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

// Gemma 2's attention soft cap, in place: s = cap * tanh(s / cap), each score alone (0: none).
inline void cap_scores(float* x, int64_t n, float cap) {
  if (cap > 0.f)
    for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
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

