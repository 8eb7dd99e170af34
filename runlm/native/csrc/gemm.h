// runlm kernels: the GEMM driver. A part of kernels.cpp's one translation unit (included in order).
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

// Software prefetch of the weight bytes `ahead` past rows [n, n + count) (rows are contiguous), not past end: with
// only hardware prefetching a decode GEMV reached ~14 GB/s from DRAM on the 2-core EPYC, ~25 GB/s with this.
template <class T>
inline void prefetch_rows(const Ctx<T>& c, int64_t n, int64_t count, const uint8_t* end,
                          int64_t ahead = kPrefetchBytes) {
#if RUNLM_AVX2
  const uint8_t* p = c.w + n * c.row_bytes + ahead;
  const int64_t bytes = std::min<int64_t>(count * c.row_bytes, end - p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
#endif
}

// Weight rows [n, n + RW) x activation rows [m0, m1), up to 4 activation rows per tile.
template <class T, int RW>
inline void activation_tiles(const Ctx<T>& c, int64_t n, int64_t m0, int64_t m1) {
  int64_t m = m0;
  // Q5_K's groups take 8 activation rows at a time: its codes (nibbles and fifth bits) are unpacked once per 8 rows
  // instead of 4. 16-row groups, interleaved A/B on an AMD EPYC Zen 5 (1B-shape GEMMs, M = 8-128): 1.02-1.21x; for
  // Q4_K and Q8_0 the same change was 0.74-0.85x, for Q6_K even. 4-row groups (AVX2), one EPYC Zen 4 thread, a
  // 2048 x 2048 weight: 65.5 -> 71 GMAC/s at M = 8, 65.5 -> 69 at M = 128 (Q4_K, Q4_0, Q4_1, Q8_0 even, Q6_K 1.03x).
  // IQ4_XS's rows (AVX2) likewise unpack their levels once per 8 rows: one EPYC Zen 4 thread, 2048 x 2048, M = 128:
  // 52 -> 56.5 GMAC/s. The results are the 4-row tiles' bit for bit.
  if constexpr (std::is_same_v<T, X4Layout<Q5_K>> || std::is_same_v<T, IQ4_XS>)
    for (; m + 8 <= m1; m += 8) tile<T, RW, 8>(c, n, m);
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
      // (16-row groups, up to 74 KB, are prefetched by their kernels a few super-blocks ahead instead; 4-row groups
      // too, on the line walk: x4_prefetch)
      if (m0 == 0 && T::ROWS == 4 && g_walk.burst_for(T::QK)) prefetch_rows(c, n, T::ROWS, end);
      activation_tiles<T, T::ROWS>(c, n, m0, m1);
    }
  } else if (m1 - m0 <= 2) {
    // few activation rows
    int64_t n = n0;
    if (m1 - m0 == 1) {
      // a GEMV: one weight row after another, so each thread's weights come as one sequential stream (4 rows side
      // by side with a software prefetch: Qwen2.5-1.5B IQ4_XS decoded at ~20 tok/s on an EPYC Zen 4's avx2 build;
      // one by one at ~25), each row's lines prefetched line_ahead on: the hardware prefetchers alone fed an Intel
      // Xeon core MXFP4's 17-byte blocks at 5.3 GMAC/s from DRAM against 18 from L2 (with the prefetch 18 from
      // DRAM; IQ4_XS 23.5 -> 26): gpt-oss-20b's shape decoded at 10.4 tok/s, now 18.4 (avx2)
      for (; n < n1; ++n) {
        if (g_walk.line_ahead) prefetch_rows(c, n, 1, end, g_walk.line_ahead);
        tile<T, 1, 1>(c, n, m0);
      }
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

#if !RUNLM_AVX512
// The 4-row groups' decode walk (M <= 4 activation rows), output rows [n0, n1): with two streams (DecodeWalk), the
// range's halves side by side, a group of each in turn, so the hardware prefetchers follow two far-apart walks; with
// one, group by group. The software prefetch is the walk's too (x4_prefetch).
template <class T>
void x4_stream_rows(const Ctx<T>& c, int64_t n0, int64_t n1, int64_t M) {
  constexpr int64_t unit = T::ROWS;
  const int streams = T::QK == 32 ? g_walk.wide32_streams : g_walk.kquant_streams;
  const int64_t groups = (n1 - n0) / unit, half = streams == 2 ? groups / 2 : 0;
  for (int64_t i = 0; i < half; ++i) {
    block_rows<T>(c, n0 + unit * i, n0 + unit * (i + 1), 0, M);
    block_rows<T>(c, n0 + unit * (half + i), n0 + unit * (half + i + 1), 0, M);
  }
  if (2 * half < groups) block_rows<T>(c, n0 + unit * 2 * half, n1, 0, M);
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
  if constexpr ((std::is_same_v<T, Q8_0> && kQ8_0InRows) || (TableCodes<T> && kTablesInRows)) {
    if (N % 4 == 0) return gemm<X4Rows<T>>(x, M, K, w, N, y);  // the x4 kernel, 4 rows at a time
  }
  using A = typename T::Act;
  constexpr int64_t AQK = std::is_base_of_v<A32, A> ? 32 : QK_K;
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
#else
  if constexpr (IsX4<T>::value) {
    if (M <= 4 && !tile_rows) {
      parallel_for(0, N / unit, std::max<int64_t>(1, grain),
                   [&](int64_t u0, int64_t u1) { x4_stream_rows<T>(c, u0 * unit, u1 * unit, M); });
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
      if constexpr (std::is_same_v<T, X4Rows<Q8_0>>) {
        // Q8_0 rows with many activation rows: the tile regrouped once, then the x4 kernels (one Xeon thread, a
        // 512-row weight: M = 64 55 GMAC/s against the gathering kernel's 51; M = 16 48 against 51, so fewer rows
        // gather; a 32768-row weight at M = 8 and 2 threads: 10.1 ms regrouped, 7.0 gathering)
        if (M > 16) {
          thread_local std::vector<uint8_t> tile_x4;
          tile_x4.resize(static_cast<size_t>((ne - nt) * row_bytes));
          q8_0_to_x4(w + nt * row_bytes, ne - nt, row_bytes, nbw, tile_x4.data());
          const Ctx<X4Layout<Q8_0>> x4{tile_x4.data(), row_bytes, nbw, act_p, nba, N, y + nt};
          for (int64_t mt = 0; mt < M; mt += kMTile) block_rows(x4, 0, ne - nt, mt, std::min(M, mt + kMTile));
          continue;
        }
      }
      for (int64_t mt = 0; mt < M; mt += kMTile) block_rows<T>(c, nt, ne, mt, std::min(M, mt + kMTile));
    }
  });
}

