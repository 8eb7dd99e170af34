// runlm kernels: the C interface (standalone build) and the PyTorch ops.
// A part of kernels.cpp's one translation unit, included in order.
// ------------------------------------------------------------------------------------------------------------
// A block reaches C one way in both builds: as an RlBlock (runlm.native.library.Block), checked and turned into
// BlockWeights by RlStack::add. The native runtime passes it to rl_stack_add_block, the PyTorch backend to
// BlockStack.add_block (its address, with the tensors its pointers are into).

// One weight as the kernels read it: GGUF blocks (type id, + X4 for the interleaved layout) of `rows` rows.
struct RlWeight {
  const uint8_t* data;
  int64_t type;
  int64_t rows;
};

// One transformer block, whole: what rl_stack_add_block takes (runlm.native.library.Block mirrors it field by field).
// Norms in the order they apply: two (pre-norm: before attention, before the MLP) or four (sandwich: before and
// after each; a null one is skipped, so post-norm blocks pass only the after-norms). q/k/v and gate/up may come in
// parts of different types, stacked along the output dimension.
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
  int64_t activation;  // the MLP's: moe.h's Activation
  int64_t rope;  // which RoPE table the block rotates with
  int64_t window;  // sliding-window length, 0 for full attention
  int64_t n_heads;
  int64_t n_kv_heads;
  double scale;  // attention's query scale
  const float* qkv_bias;  // added to the q/k/v projection (n_heads + 2 n_kv_heads) * head_dim values, or null
  int64_t qk_norm_whole;  // q / k norms span the whole projection (OLMo 2), not each head
  double residual_scale;  // each sublayer's output is scaled by this before the residual add (Granite; else 1)
  double attn_softcap;  // attention scores s become cap * tanh(s / cap) (Gemma 2); 0 for none
  // A mixture of experts in place of the dense MLP (gate_up / down unused) where n_experts > 0:
  int64_t n_experts;
  int64_t n_experts_used;  // per row
  RlWeight router;  // [n_experts, hidden]
  const RlWeight* expert_gate_up;  // n_experts * n_expert_gate_up parts, expert by expert
  int64_t n_expert_gate_up;  // parts per expert: 1 (gate and up stacked) or 2
  const RlWeight* expert_down;  // n_experts
  int64_t expert_gating;  // moe.h's ExpertGating
  int64_t expert_normalize;  // the kept weights renormalized to sum 1
  // Biases and sinks, each null where the model has none:
  const float* o_bias;  // [hidden]
  const float* sinks;  // [n_heads]: a logit per query head that joins attention's softmax with no value
  const float* gate_up_bias;  // the dense MLP's [gate_up rows], and down's [hidden]
  const float* down_bias;
  const float* router_bias;  // [n_experts]
  const float* expert_gate_up_bias;  // [n_experts, gate_up rows], expert by expert
  const float* expert_down_bias;  // [n_experts, hidden]
  // A shared expert beside the experts (n_shared_gate_up 0: none), scaled by sigmoid(shared_gate . x):
  RlWeight shared_gate_up[2];
  int64_t n_shared_gate_up;
  RlWeight shared_down;
  RlWeight shared_gate;  // [1, hidden]
  // Llama 4's attention temperature (Ministral 3): queries scaled by 1 + temp_scale * log(1 + floor(pos / temp_length))
  // after RoPE; temp_scale 0 for none.
  double attn_temp_scale;
  int64_t attn_temp_length;
  // Gemma 4: values taken from the key projection's output before its norm and RoPE (qkv then holds q and k only),
  // an RMSNorm without weights over each value head, and the block's whole output scaled by out_scale (1 for none).
  int64_t values_from_keys;
  int64_t value_norm;
  double out_scale;
  // Gemma 4 E2B / E4B: the block computes no keys or values and attends over block kv_source's cache (-1: its own),
  // and adds its per-layer input (ple_dim values per row; 0 for none) through ple_gate, ple_proj and ple_norm.
  int64_t kv_source;
  RlWeight ple_gate;
  RlWeight ple_proj;
  const float* ple_norm;
  int64_t ple_dim;
  // Gemma 4 26B-A4B: the experts beside the dense MLP (gate_up / down used too) where moe_norms[0] is set:
  // moe_norms = the experts' input norm, the dense MLP's output norm, the experts' output norm; the router reads
  // the block's residual, RMS-normed without weights and scaled by router_scale / sqrt(hidden); each chosen expert's
  // weight is multiplied by its expert_scales entry. Null where the model has none.
  const float* moe_norms[3];
  const float* router_scale;
  const float* expert_scales;
};

namespace {
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

// A dense MLP's gate/up parts (gate and up rows alike) and down (giving hidden rows).
MlpWeights mlp_weights(const RlWeight* gate_up, int64_t n_gate_up, const RlWeight& down, int64_t hidden,
                       const float* gate_up_bias, const float* down_bias) {
  RUNLM_CHECK(n_gate_up >= 1 && n_gate_up <= 2, "one or two gate/up parts expected");
  MlpWeights w{weight_parts(gate_up, n_gate_up), weight_parts(&down, 1)[0], gate_up_bias, down_bias};
  int64_t rows = 0;
  for (const Weight& part : w.gate_up) rows += part.rows;
  RUNLM_CHECK(rows % 2 == 0 && w.down.rows == hidden, "gate and up must have rows alike, and down give hidden rows");
  return w;
}

Experts expert_weights(const RlBlock& in) {
  RUNLM_CHECK(in.n_experts_used >= 1 && in.n_experts_used <= in.n_experts, "a block with ", in.n_experts,
              " experts cannot use ", in.n_experts_used, " per row");
  RUNLM_CHECK(in.expert_gating == kSoftmaxTopK || in.expert_gating == kTopKSoftmax, "unknown expert gating ",
              in.expert_gating);
  RUNLM_CHECK(in.expert_gate_up != nullptr && in.expert_down != nullptr, "a block with experts needs their weights");
  Experts e;
  e.used = in.n_experts_used, e.gating = in.expert_gating, e.normalize = in.expert_normalize != 0;
  e.router = weight_parts(&in.router, 1)[0], e.router_bias = in.router_bias;
  e.router_scale = in.router_scale, e.expert_scales = in.expert_scales, e.router_eps = in.eps;
  RUNLM_CHECK(e.router.rows == in.n_experts, "the router must give one logit per expert");
  if (in.n_shared_gate_up > 0) {
    e.has_shared = true;
    e.shared = mlp_weights(in.shared_gate_up, in.n_shared_gate_up, in.shared_down, in.hidden, nullptr, nullptr);
    e.shared_gate = weight_parts(&in.shared_gate, 1)[0];
    RUNLM_CHECK(e.shared_gate.rows == 1, "a shared expert's gate is one row");
  }
  for (int64_t x = 0; x < in.n_experts; ++x) {
    const RlWeight* parts = in.expert_gate_up + x * in.n_expert_gate_up;
    int64_t rows = 0;
    for (int64_t i = 0; i < in.n_expert_gate_up; ++i) rows += parts[i].rows;
    e.mlps.push_back(mlp_weights(parts, in.n_expert_gate_up, in.expert_down[x], in.hidden,
                                 in.expert_gate_up_bias ? in.expert_gate_up_bias + x * rows : nullptr,
                                 in.expert_down_bias ? in.expert_down_bias + x * in.hidden : nullptr));
  }
  return e;
}

// The blocks of a model, in order, as both builds keep them.
struct RlStack {
  std::vector<BlockWeights> blocks;
  std::vector<int64_t> ropes;
  std::vector<int64_t> kv_sources;  // per block: the block whose cache it attends over, or -1 (its own)
  std::vector<int64_t> ple_dims;  // per block: its per-layer input's width (0: none)

  // The next block, checked (a block may attend over the cache of one before it).
  void add(const RlBlock& in) {
    RUNLM_CHECK(in.n_norms == 2 || in.n_norms == 4, "two (pre-norm) or four (sandwich) norms expected");
    RUNLM_CHECK(in.norms[1] != nullptr && (in.n_norms == 2 ? in.norms[0] != nullptr : in.norms[3] != nullptr),
                "only a sandwich block's before-norms may be left out");
    RUNLM_CHECK(in.residual_scale > 0 && std::isfinite(in.residual_scale), "bad residual scale");
    RUNLM_CHECK(in.n_qkv >= 1 && in.n_qkv <= 3, "one to three q/k/v parts expected");
    RUNLM_CHECK(in.n_kv_heads > 0 && in.n_heads % in.n_kv_heads == 0, "heads must group evenly");
    BlockWeights b;
    b.norms.assign(in.norms, in.norms + in.n_norms);
    b.hidden = in.hidden, b.eps = in.eps, b.q_norm = in.q_norm, b.k_norm = in.k_norm, b.scale = in.scale;
    b.qkv = weight_parts(in.qkv, in.n_qkv);
    RUNLM_CHECK(in.o.rows == in.hidden, "o must give hidden rows");
    b.o = weight_parts(&in.o, 1)[0];
    if (in.n_experts > 0) {
      b.experts = expert_weights(in);
      if (in.moe_norms[0] != nullptr) {  // and the dense MLP beside them
        RUNLM_CHECK(in.moe_norms[1] != nullptr && in.moe_norms[2] != nullptr && in.n_norms == 4,
                    "experts beside a dense MLP need their three norms, in a sandwich block");
        b.moe_norms.assign(in.moe_norms, in.moe_norms + 3);
        b.mlp = mlp_weights(in.gate_up, in.n_gate_up, in.down, in.hidden, in.gate_up_bias, in.down_bias);
      }
    } else {
      b.mlp = mlp_weights(in.gate_up, in.n_gate_up, in.down, in.hidden, in.gate_up_bias, in.down_bias);
    }
    b.qkv_bias = in.qkv_bias, b.qk_norm_whole = in.qk_norm_whole != 0;
    b.residual_scale = static_cast<float>(in.residual_scale);
    RUNLM_CHECK(in.attn_softcap >= 0 && std::isfinite(in.attn_softcap), "bad attention soft cap");
    b.attn_softcap = static_cast<float>(in.attn_softcap);
    RUNLM_CHECK(std::isfinite(in.attn_temp_scale) && (in.attn_temp_scale == 0 || in.attn_temp_length > 0),
                "bad attention temperature");
    b.attn_temp_scale = static_cast<float>(in.attn_temp_scale);
    b.attn_temp_length = in.attn_temp_length;
    RUNLM_CHECK(in.activation >= kSilu && in.activation <= kSwigluOai, "unknown activation ", in.activation);
    b.activation = in.activation, b.o_bias = in.o_bias, b.sinks = in.sinks;
    b.window = in.window, b.n_heads = in.n_heads, b.n_kv_heads = in.n_kv_heads;
    RUNLM_CHECK(in.out_scale > 0 && std::isfinite(in.out_scale), "bad output scale");
    b.values_from_keys = in.values_from_keys != 0, b.value_norm = in.value_norm != 0;
    b.out_scale = static_cast<float>(in.out_scale);
    const int64_t index = static_cast<int64_t>(blocks.size());
    RUNLM_CHECK(in.kv_source == -1 || (0 <= in.kv_source && in.kv_source < index &&
                                       kv_sources[in.kv_source] == -1),
                "a block shares the cache of a block before it that has one of its own, or none");
    b.shared_kv = in.kv_source >= 0;
    if (b.shared_kv) {
      const BlockWeights& source = blocks[in.kv_source];
      RUNLM_CHECK(source.n_kv_heads == in.n_kv_heads && source.window == in.window && in.k_norm == nullptr,
                  "a block that shares a cache must have its heads and window, and no keys of its own");
    }
    if (in.ple_dim > 0) {
      RUNLM_CHECK(in.ple_norm != nullptr && in.ple_gate.rows == in.ple_dim && in.ple_proj.rows == in.hidden,
                  "a per-layer input needs its gate (ple_dim rows), projection (hidden rows) and norm");
      b.ple_gate = weight_parts(&in.ple_gate, 1)[0], b.ple_proj = weight_parts(&in.ple_proj, 1)[0];
      b.ple_norm = in.ple_norm, b.ple_dim = in.ple_dim;
    }
    const int64_t projected_heads = in.n_heads + (b.shared_kv ? 0 : b.values_from_keys ? 1 : 2) * in.n_kv_heads;
    int64_t qkv_width = 0;
    for (const Weight& w : b.qkv) qkv_width += w.rows;
    b.head_dim = qkv_width / projected_heads;
    RUNLM_CHECK(b.head_dim > 0 && qkv_width == projected_heads * b.head_dim,
                "qkv projection width does not match the heads");
    if (b.shared_kv) b.head_dim = blocks[in.kv_source].head_dim == b.head_dim ? b.head_dim : -1;
    RUNLM_CHECK(b.head_dim > 0, "a block that shares a cache must have its heads' size");
    blocks.push_back(std::move(b));
    ropes.push_back(in.rope);
    kv_sources.push_back(in.kv_source);
    ple_dims.push_back(in.ple_dim);
  }
};

}  // namespace

#ifdef RUNLM_STANDALONE
// C interface of the standalone build (runlm.native.library calls it through ctypes). Pointers are the caller's, valid
// for the call (a stack's weights: for the stack's life). Each function returns 0, or -1 with rl_last_error() saying
// why.
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
}  // namespace

extern "C" {

const char* rl_last_error() { return g_error.c_str(); }

// What this library was built from (runlm.quant.build.source_key), set by every build: the loader refuses a library
// of another source or flags, and rebuilds one under runlm's home that does not carry its key.
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

int rl_set_decode_walk(int64_t line_ahead, int64_t kquant_burst, int64_t wide32_burst, int64_t kquant_streams,
                       int64_t wide32_streams) {
  return guarded(
      [&] { gguf_set_decode_walk(line_ahead, kquant_burst, wide32_burst, kquant_streams, wide32_streams); });
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

void* rl_stack_new() { return new RlStack(); }

void rl_stack_free(void* stack) { delete static_cast<RlStack*>(stack); }

int rl_stack_add_block(void* stack, const RlBlock* block) {
  return guarded([&] { static_cast<RlStack*>(stack)->add(*block); });
}

// h [R, hidden] through every block, in place. cos / sin [R, widths[i]] per RoPE i (a block's width is its head
// dim); k / v caches block-major (block b's caches of the n_seqs sequences at b * n_seqs ...; a block that shares
// another's cache has none of its own: its entries are not read), capacities per sequence and rings per block.
// per_layer: the blocks' per-layer inputs [R, sum of their widths], block by block, or null where none has one.
int rl_stack_run(void* stack, float* h, int64_t R, const float* const* cos, const float* const* sin, int64_t n_ropes,
                 const int64_t* widths, void* const* k_caches, void* const* v_caches, const int64_t* caps,
                 const int64_t* rings, int64_t n_seqs, int64_t kv_type, const int64_t* row_seq,
                 const int64_t* row_pos, const float* per_layer) {
  return guarded([&] {
    const RlStack& s = *static_cast<RlStack*>(stack);
    const std::vector<int64_t> rseq(row_seq, row_seq + R), rpos(row_pos, row_pos + R);
    int64_t ple_stride = 0;
    for (const int64_t dim : s.ple_dims) ple_stride += dim;
    RUNLM_CHECK(ple_stride == 0 || per_layer != nullptr, "the blocks take per-layer inputs, and none were given");
    for (size_t b = 0, ple_offset = 0; b < s.blocks.size(); ple_offset += s.ple_dims[b], ++b) {
      RUNLM_CHECK(s.ropes[b] >= 0 && s.ropes[b] < n_ropes, "block ", b, " has no RoPE table");
      const int64_t D = s.blocks[b].head_dim;
      RUNLM_CHECK(widths[s.ropes[b]] == D, "block ", b, " has heads of ", D, " values, its RoPE table ",
                  widths[s.ropes[b]]);
      RUNLM_CHECK(D % 8 == 0 && (kv_type != kKvQ8 || D % kQ8Values == 0), "bad head dim ", D, " for cache type ",
                  kv_type);
      const size_t c = s.kv_sources[b] >= 0 ? static_cast<size_t>(s.kv_sources[b]) : b;  // whose caches
      const std::vector<void*> ks(k_caches + c * n_seqs, k_caches + (c + 1) * n_seqs);
      const std::vector<void*> vs(v_caches + c * n_seqs, v_caches + (c + 1) * n_seqs);
      const std::vector<int64_t> cs(caps + c * n_seqs, caps + (c + 1) * n_seqs);
      const bool ring = rings[c] != 0;
      const std::vector<SeqRows> seqs = seq_rows("rl_stack_run", rseq, rpos, ks, vs, cs, s.blocks[b].window, ring);
      block_rows(s.blocks[b], h, R, cos[s.ropes[b]], sin[s.ropes[b]], D, seqs, kv_type, ring, rseq, rpos,
                 s.ple_dims[b] ? per_layer + ple_offset : nullptr, ple_stride);
    }
  });
}

}  // extern "C"
#else
// Every block of a model in one call (the PyTorch backend's fused path). The blocks come as the native runtime's do,
// RlBlocks, with the tensors their pointers are into, which the stack holds; `run` takes tensors and checks them.
struct BlockStack : torch::CustomClassHolder {
  RlStack stack;
  std::vector<at::Tensor> kept;

  // block: an RlBlock's address (runlm.native.library.Block, read during the call)
  void add_block(int64_t block, std::vector<at::Tensor> tensors) {
    stack.add(*reinterpret_cast<const RlBlock*>(block));
    kept.insert(kept.end(), tensors.begin(), tensors.end());
  }

  // h [R, hidden] through every block. cos / sin: one table pair per RoPE (a block's `rope` indexes them); k / v
  // caches block-major (block b's caches of the S sequences at b * S ...); rings: per block, whether its caches
  // are rings of its window.
  at::Tensor run(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                 std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<int64_t> rings,
                 std::vector<int64_t> row_seq, std::vector<int64_t> row_pos) {
    const int64_t n = static_cast<int64_t>(stack.blocks.size());
    TORCH_CHECK(n > 0 && static_cast<int64_t>(rings.size()) == n && k_caches.size() == v_caches.size() &&
                    !k_caches.empty() && static_cast<int64_t>(k_caches.size()) % n == 0 && cos.size() == sin.size(),
                "runlm::BlockStack.run: one ring flag per block and the same number of k / v caches per block");
    const int64_t seqs = static_cast<int64_t>(k_caches.size()) / n;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t rope = stack.ropes[b];
      TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos.size()), "runlm::BlockStack.run: block ", b,
                  " has no RoPE table");
      TORCH_CHECK(stack.kv_sources[b] < 0 && stack.ple_dims[b] == 0, "runlm::BlockStack.run: block ", b,
                  " shares a cache or takes per-layer inputs, which the native runtime alone runs");
      const at::TensorList ks(k_caches.data() + b * seqs, seqs), vs(v_caches.data() + b * seqs, seqs);
      h = run_block(stack.blocks[b], h, cos[rope], sin[rope], ks, vs, rings[b] != 0, row_seq, row_pos);
    }
    return h;
  }
};

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
  m.def("gguf_set_decode_walk(int line_ahead, int kquant_burst, int wide32_burst, int kquant_streams, "
        "int wide32_streams) -> ()",
        &gguf_set_decode_walk);
  m.def("gguf_decode_walk() -> int[]", &gguf_decode_walk);
  m.def("gguf_group_rows(int type) -> int", &group_rows);
  m.def("gguf_isa() -> str", &gguf_isa);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, "
      "int n_heads, int n_kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(runlm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
  m.impl("gguf_relayout", &gguf_relayout);
  m.impl("gguf_relayout_into", &gguf_relayout_into);
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
}
#endif  // RUNLM_STANDALONE
