// runlm kernels: route-invariant transformer blocks. A part of kernels.cpp's one translation unit (included in order).
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
// in slot p % cap, cap at least the window, else position p in row p), all with elements of type T. out:
// [R, n_heads * D]. A sequence whose first_pos lies past its rows reads every key from its cache (a block that
// attends over another block's cache, which already holds this call's keys: Gemma 4's shared KV).
template <typename T>
void attention_rows(const float* q, const T* knew, const T* vnew, const std::vector<SeqRows>& seqs,
                    const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos, int64_t window,
                    bool ring, int64_t n_heads, int64_t n_kv, int64_t D, float* out, float softcap = 0.f,
                    const float* sinks = nullptr) {
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
#if RUNLM_AVX512
      std::vector<float> gathered_q(kRowBlock * rep * D), gathered_scores(kRowBlock * rep * kKeyChunk),
          gathered_max(kRowBlock * rep), gathered_sum(kRowBlock * rep), gathered_out(kRowBlock * rep * D);
      std::vector<int64_t> gathered_slot(kRowBlock * rep);
#endif
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
            const int64_t slot = ring ? t % sq.cap : t;
            keys[t - u0] = kv_row(static_cast<const T*>(sq.k), g * sq.cap + slot, D);
            values[t - u0] = kv_row(static_cast<const T*>(sq.v), g * sq.cap + slot, D);
          }
        }
        // A decode row's next chunk of cached keys and values (this thread's next item, as a rule): asked for now,
        // they come while this chunk is scored instead of each row's lines missing in turn (a block of prompt rows
        // spends long enough on each chunk that the cache keeps up). SmolLM2 at 4000 positions (avx2, Xeon): 74 ->
        // 87 tok/s.
        if (rb1 - rb0 == 1 && item + 1 < end) {
          const int64_t t_end = std::min(sq.first_pos, std::min(row_pos[rb1 - 1] + 1, u1 + kKeyChunk));
          for (int64_t t = u1; t < t_end; ++t) {
            const int64_t slot = ring ? t % sq.cap : t;
            prefetch_kv_row(kv_row(static_cast<const T*>(sq.k), g * sq.cap + slot, D), D);
            prefetch_kv_row(kv_row(static_cast<const T*>(sq.v), g * sq.cap + slot, D), D);
          }
        }
        auto slot_of = [&](int64_t r) { return (item_start[r - r0] + g * n_chunks[r] + (c - first_chunk[r])) * rep; };
        auto attend_alone = [&](int64_t r, int64_t t0, int64_t t1, const auto* ks, const auto* vs) {
          const int64_t slot = slot_of(r);
          attend_chunk(q + (r * n_heads + g * rep) * D, rep, ks + (t0 - u0), vs + (t0 - u0), t1 - t0, D, scores.data(),
                       kKeyChunk, part_max.data() + slot, part_sum.data() + slot, part_out.data() + slot * D,
                       softcap);
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
                          kKeyChunk, gathered_max.data(), gathered_sum.data(), gathered_out.data(), softcap);
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
    parallel_for(r0, r1, row_grain(n_heads * D), [&](int64_t b0, int64_t b1) {
      for (int64_t r = b0; r < b1; ++r) {
        const int64_t k = r - r0;
        for (int64_t h = 0; h < n_heads; ++h) {
          const int64_t g = h / rep;
          merge_chunks(part_max.data(), part_sum.data(), part_out.data(),
                       (item_start[k] + g * n_chunks[r]) * rep + h % rep, rep, n_chunks[r], D,
                       out + (r * n_heads + h) * D, sinks == nullptr ? -INFINITY : sinks[h]);
        }
      }
    });
    r0 = r1;
  }
}

// attention_rows over caches of element type T, then this call's keys / values into the caches (slot p, or
// p % cap for a ring that keeps the newest). The new keys / values are first stored as T (rounded for float16,
// quantized for q8_0): the rows of this call attend over exactly the values later calls read back from the cache.
template <typename T>
void attend_and_store(const float* q, const std::vector<float>& knew, const std::vector<float>& vnew,
                      const std::vector<SeqRows>& seqs, const std::vector<int64_t>& row_seq,
                      const std::vector<int64_t>& row_pos, int64_t window, bool ring, int64_t n_heads, int64_t n_kv,
                      int64_t D, float* out, float softcap = 0.f, const float* sinks = nullptr) {
  const int64_t R = static_cast<int64_t>(row_seq.size()), kv_width = n_kv * D;
  std::vector<T> k_typed, v_typed;
  const T* kt;
  const T* vt;
  if constexpr (std::is_same_v<T, float>) {
    kt = knew.data(), vt = vnew.data();
  } else {
    k_typed.resize(R * n_kv * kv_row_units<T>(D)), v_typed.resize(R * n_kv * kv_row_units<T>(D));
    parallel_for(0, R, row_grain(2 * kv_width), [&](int64_t r0, int64_t r1) {
      kv_store(knew.data() + r0 * kv_width, kv_row(k_typed.data(), r0 * n_kv, D), (r1 - r0) * kv_width);
      kv_store(vnew.data() + r0 * kv_width, kv_row(v_typed.data(), r0 * n_kv, D), (r1 - r0) * kv_width);
    });
    kt = k_typed.data(), vt = v_typed.data();
  }
  attention_rows(q, kt, vt, seqs, row_seq, row_pos, window, ring, n_heads, n_kv, D, out, softcap, sinks);
  for (int64_t r = 0; r < R; ++r) {
    const SeqRows& sq = seqs[row_seq[r]];
    const int64_t slot = ring ? row_pos[r] % sq.cap : row_pos[r];
    T* kc = static_cast<T*>(sq.k);
    T* vc = static_cast<T*>(sq.v);
    for (int64_t g = 0; g < n_kv; ++g) {
      std::memcpy(kv_row(kc, g * sq.cap + slot, D), kv_row(kt, r * n_kv + g, D), kv_row_bytes<T>(D));
      std::memcpy(kv_row(vc, g * sq.cap + slot, D), kv_row(vt, r * n_kv + g, D), kv_row_bytes<T>(D));
    }
  }
}

// Rows [R, width] viewed as [R * heads, D]: RMSNorm of every head row (Qwen3 / Gemma q and k norms), in place;
// without weights where wp is null (Gemma 4's value norm).
void norm_heads(float* x, int64_t R, int64_t stride, int64_t offset, int64_t heads, int64_t D, const float* wp,
                double eps) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* row = x + r * stride + offset + h * D;
      double sum = 0.0;
      for (int64_t i = 0; i < D; ++i) sum += static_cast<double>(row[i]) * row[i];
      const float s = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(D) + eps));
      if (wp == nullptr) {
        for (int64_t i = 0; i < D; ++i) row[i] *= s;
      } else {
        for (int64_t i = 0; i < D; ++i) row[i] = (row[i] * s) * wp[i];
      }
    }
}

// RMSNorm of x's rows into out, or x copied where the block has no such norm (a post-norm block's inputs).
void norm_or_copy(const float* x, int64_t R, int64_t n, const float* w, double eps, float* out) {
  if (w != nullptr) {
    rms_norm_rows(x, R, n, w, eps, out);
  } else {
    std::memcpy(out, x, sizeof(float) * R * n);
  }
}

// h += scale * sublayer; a scale of 1 adds exactly what it always did.
void add_residual(float* h, const float* sublayer, int64_t n, float scale) {
  if (scale == 1.f) {
    for (int64_t i = 0; i < n; ++i) h[i] += sublayer[i];
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] += scale * sublayer[i];
  }
}

// One block's weights and shape, as block_rows reads them (made from an RlBlock by RlStack::add): pointers into the
// native runtime's arrays, or into the PyTorch backend's tensors.
struct BlockWeights {
  std::vector<const float*> norms;  // [attn, ffn] (pre-norm) or [pre_attn, post_attn, pre_mlp, post_mlp] (sandwich)
  int64_t hidden = 0;
  double eps = 0, scale = 0;
  const float* q_norm = nullptr;  // per-head norms of head_dim values, or none
  const float* k_norm = nullptr;
  const float* qkv_bias = nullptr;  // added to the q/k/v projection, or none
  bool qk_norm_whole = false;  // q / k norms over the whole projection rather than per head
  float residual_scale = 1.f;
  float attn_softcap = 0.f;  // Gemma 2's cap on attention scores, 0 for none
  const float* sinks = nullptr;  // a sink logit per query head (gpt-oss), or none
  float attn_temp_scale = 0.f;  // Llama 4's query temperature over position (0: none), in steps of attn_temp_length
  int64_t attn_temp_length = 0;
  bool values_from_keys = false;  // values are the key projection's output before its norm and RoPE (Gemma 4)
  bool value_norm = false;  // an RMSNorm without weights over each value head (Gemma 4)
  float out_scale = 1.f;  // the block's output (the whole residual stream) scaled by this (Gemma 4's layer scalar)
  bool shared_kv = false;  // no keys or values of its own: it attends over another block's cache (Gemma 4)
  // Gemma 4's per-layer input: h += norm(proj(gelu(gate(h)) * input)), input the call's [R, ple_dim] rows for it
  Weight ple_gate, ple_proj;
  const float* ple_norm = nullptr;
  int64_t ple_dim = 0;
  int64_t head_dim = 0;
  std::vector<Weight> qkv;
  Weight o;
  const float* o_bias = nullptr;  // added to o's output, or none
  MlpWeights mlp;  // the dense MLP, or none where the block has experts only
  Experts experts;
  // Gemma 4 26B-A4B: experts beside the dense MLP; their input norm, the dense MLP's and the experts' output norms
  std::vector<const float*> moe_norms;
  int64_t activation = kSilu;
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
    RUNLM_CHECK(ring ? window > 0 && sq.cap >= window : sq.first_pos + sq.count <= sq.cap, op, ": cache ", s,
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
                const std::vector<int64_t>& rpos, const float* ple_inputs = nullptr, int64_t ple_stride = 0) {
  const bool sandwich = b.norms.size() == 4;
  const int64_t hidden = b.hidden, n_heads = b.n_heads, n_kv_heads = b.n_kv_heads;
  const int64_t q_width = n_heads * D, kv_width = b.shared_kv ? 0 : n_kv_heads * D;
  const int64_t stride = q_width + (b.values_from_keys ? 1 : 2) * kv_width;
  int64_t qkv_rows = 0;
  for (const Weight& w : b.qkv) qkv_rows += w.rows;
  RUNLM_CHECK(qkv_rows == stride, "runlm block: qkv projection width does not match the heads");
  std::vector<float> normed(R * hidden), xqkv(R * stride);
  norm_or_copy(hp, R, hidden, b.norms[0], b.eps, normed.data());
  linear_parts_rows(normed.data(), R, hidden, b.qkv, xqkv.data());
  float* xp = xqkv.data();
  if (b.qkv_bias != nullptr) add_bias_rows(xp, R, stride, b.qkv_bias);
  // the values: their own rows of the projection, or the keys' rows before the keys' norm and RoPE
  std::vector<float> vnew(R * kv_width);
  const int64_t v_offset = b.values_from_keys ? q_width : q_width + kv_width;
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(vnew.data() + r * kv_width, xp + r * stride + v_offset, sizeof(float) * kv_width);
  if (b.value_norm && !b.shared_kv) norm_heads(vnew.data(), R, kv_width, 0, n_kv_heads, D, nullptr, b.eps);
  if (b.qk_norm_whole) {
    if (b.q_norm != nullptr) norm_heads(xp, R, stride, 0, 1, q_width, b.q_norm, b.eps);
    if (b.k_norm != nullptr) norm_heads(xp, R, stride, q_width, 1, kv_width, b.k_norm, b.eps);
  } else {
    if (b.q_norm != nullptr) norm_heads(xp, R, stride, 0, n_heads, D, b.q_norm, b.eps);
    if (b.k_norm != nullptr) norm_heads(xp, R, stride, q_width, n_kv_heads, D, b.k_norm, b.eps);
  }
  std::vector<float> q(R * q_width), knew(R * kv_width);
  const int64_t half = D / 2;
  const float scale = static_cast<float>(b.scale);
  parallel_for(0, R, row_grain(q_width + kv_width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * D;
      const float* sn = sp + r * D;
      auto rope = [&](const float* in, float* o, float mult) {
        for (int64_t i = 0; i < half; ++i) o[i] = (in[i] * c[i] + in[i + half] * sn[i]) * mult;
        for (int64_t i = half; i < D; ++i) o[i] = (in[i] * c[i] + in[i - half] * sn[i]) * mult;
      };
      const float* row = xp + r * stride;
      const float temperature =  // 1 + beta log(1 + floor(pos / length)), as transformers' and llama.cpp's Ministral 3
          b.attn_temp_scale == 0.f
              ? 1.f
              : 1.f + b.attn_temp_scale * std::log(static_cast<float>(rpos[r] / b.attn_temp_length) + 1.f);
      for (int64_t hh = 0; hh < n_heads; ++hh)
        rope(row + hh * D, q.data() + r * q_width + hh * D, scale * temperature);
      for (int64_t g = 0; g < n_kv_heads && !b.shared_kv; ++g)
        rope(row + q_width + g * D, knew.data() + r * kv_width + g * D, 1.f);
    }
  });
  std::vector<float> attended(R * q_width), projected(R * hidden);
  with_kv_type(kv_type, [&](auto element) {
    using T = decltype(element);
    if (b.shared_kv) {  // every key, this call's too, is in the other block's cache already
      std::vector<SeqRows> cached = seqs;
      for (SeqRows& sq : cached) {
        RUNLM_CHECK(!ring || sq.count == 0 || sq.count + b.window - 1 <= sq.cap, "runlm block: ", sq.count,
                    " rows of a sequence do not fit the shared ring of ", sq.cap, " beside its window of ", b.window);
        sq.first_pos = INT64_MAX;
      }
      attention_rows<T>(q.data(), nullptr, nullptr, cached, rseq, rpos, b.window, ring, n_heads, b.n_kv_heads, D,
                        attended.data(), b.attn_softcap, b.sinks);
    } else {
      attend_and_store<T>(q.data(), knew, vnew, seqs, rseq, rpos, b.window, ring, n_heads, n_kv_heads, D,
                          attended.data(), b.attn_softcap, b.sinks);
    }
  });
  linear_rows(attended.data(), R, q_width, b.o, projected.data());
  if (b.o_bias != nullptr) add_bias_rows(projected.data(), R, hidden, b.o_bias);
  if (sandwich) rms_norm_rows(projected.data(), R, hidden, b.norms[1], b.eps, projected.data());
  add_residual(hp, projected.data(), R * hidden, b.residual_scale);
  for (auto* done : {&xqkv, &q, &knew, &vnew, &attended}) std::vector<float>().swap(*done);  // before the MLP's own
  norm_or_copy(hp, R, hidden, b.norms[sandwich ? 2 : 1], b.eps, normed.data());
  if (b.experts.mlps.empty()) {
    mlp_rows(b.mlp, b.activation, normed.data(), R, hidden, projected.data());
  } else if (!b.moe_norms.empty()) {  // Gemma 4: the dense MLP and the experts, each normed, summed
    mlp_rows(b.mlp, b.activation, normed.data(), R, hidden, projected.data());
    rms_norm_rows(projected.data(), R, hidden, b.moe_norms[1], b.eps, projected.data());
    std::vector<float> expert_in(R * hidden), expert_out(R * hidden);
    rms_norm_rows(hp, R, hidden, b.moe_norms[0], b.eps, expert_in.data());
    experts_rows(b.experts, b.activation, expert_in.data(), R, hidden, expert_out.data(), hp);
    rms_norm_rows(expert_out.data(), R, hidden, b.moe_norms[2], b.eps, expert_out.data());
    for (int64_t i = 0; i < R * hidden; ++i) projected[i] += expert_out[i];
  } else {
    experts_rows(b.experts, b.activation, normed.data(), R, hidden, projected.data());
  }
  if (sandwich) rms_norm_rows(projected.data(), R, hidden, b.norms[3], b.eps, projected.data());
  add_residual(hp, projected.data(), R * hidden, b.residual_scale);
  if (b.ple_dim > 0) {
    RUNLM_CHECK(ple_inputs != nullptr, "runlm block: a block with per-layer inputs was given none");
    std::vector<float> gate(R * b.ple_dim), gated(R * b.ple_dim);
    linear_rows(hp, R, hidden, b.ple_gate, gate.data());
    for (int64_t r = 0; r < R; ++r)
      gated_activation<true>(gate.data() + r * b.ple_dim, ple_inputs + r * ple_stride, gated.data() + r * b.ple_dim,
                             b.ple_dim);
    linear_rows(gated.data(), R, b.ple_dim, b.ple_proj, projected.data());
    rms_norm_rows(projected.data(), R, hidden, b.ple_norm, b.eps, projected.data());
    add_residual(hp, projected.data(), R * hidden, 1.f);
  }
  if (b.out_scale != 1.f)
    for (int64_t i = 0; i < R * hidden; ++i) hp[i] *= b.out_scale;
}

#ifndef RUNLM_STANDALONE
// block_rows over tensors: h [R, hidden] float32; the caches of the call's sequences (float32, float16 or q8_0, all
// alike, [1, n_kv_heads, capacity, row]: see kv_cache_row).
at::Tensor run_block(const BlockWeights& b, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                     at::TensorList k_caches, at::TensorList v_caches, bool ring, const std::vector<int64_t>& rseq,
                     const std::vector<int64_t>& rpos) {
  const char* op = "runlm::BlockStack.run";
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

#endif  // RUNLM_STANDALONE

}  // namespace

