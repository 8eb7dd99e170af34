// runlm kernels: gated MLPs, dense and mixture-of-experts. A part of kernels.cpp's one translation unit (included in
// order).
// ------------------------------------------------------------------------------------------------------------
// A block's MLP for R rows: down(act(gate) * up), act SiLU or tanh-GELU. A mixture of experts routes each row to
// its top-k experts and sums their MLPs' outputs by the router's weights.
//
// Experts run grouped: the rows that chose an expert go through its weights together (one GEMM per expert per call,
// so a batched decode step or a prompt reads each chosen expert's weights once). Each row's result stays its own,
// whatever else the call holds: the kernels compute a row the same at any row count, and a row's experts are summed
// in the order of their index.

// One MLP's weights: gate and up stacked along the output dimension (in one or two parts), and down; biases added
// to their outputs where the model has them.
struct MlpWeights {
  std::vector<Weight> gate_up;
  Weight down;
  const float* gate_up_bias = nullptr;
  const float* down_bias = nullptr;
};

// The gated MLPs' activations: act(gate) * up.
enum Activation : int64_t {
  kSilu = 0,
  kGeluTanh = 1,
  kSwigluOai = 2,  // gpt-oss: gate capped at 7, up clamped to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)
};

// rows [R, n] += bias [n], row by row.
void add_bias_rows(float* x, int64_t R, int64_t n, const float* bias) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) x[r * n + i] += bias[i];
}

// gpt-oss's clamped SwiGLU over n values.
void swiglu_oai(const float* g, const float* u, float* out, int64_t n) {
  constexpr float limit = 7.f, alpha = 1.702f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::min(g[i], limit), y = std::clamp(u[i], -limit, limit);
    out[i] = x / (1.f + std::exp(-alpha * x)) * (y + 1.f);
  }
}

// How a router's logits become the chosen experts' weights.
enum ExpertGating : int64_t {
  kSoftmaxTopK = 0,  // softmax over every expert, the top k kept (renormalized to sum 1 where `normalize`: Qwen3-MoE)
  kTopKSoftmax = 1,  // the top k logits, a softmax over just those (gpt-oss)
};

struct Experts {
  int64_t used = 0;  // experts per row (k)
  Weight router;  // [experts, hidden]
  const float* router_bias = nullptr;  // added to the router's logits, or none
  std::vector<MlpWeights> mlps;  // one per expert
  int64_t gating = kSoftmaxTopK;
  bool normalize = false;
  // a shared expert every row runs beside the routed ones, scaled by sigmoid(shared_gate . x) (Qwen2-MoE), if any
  bool has_shared = false;
  MlpWeights shared;
  Weight shared_gate;  // [1, hidden]
  // Gemma 4: the router reads its input RMS-normed without weights, times router_scale / sqrt(hidden), and each
  // chosen weight is multiplied by the expert's scale; null for neither
  const float* router_scale = nullptr;
  const float* expert_scales = nullptr;
  double router_eps = 1e-6;  // that norm's epsilon (the block's)
};

// x [R, hidden] through one MLP into out [R, hidden].
void mlp_rows(const MlpWeights& w, int64_t activation, const float* x, int64_t R, int64_t hidden, float* out) {
  int64_t gate_up_rows = 0;
  for (const Weight& part : w.gate_up) gate_up_rows += part.rows;
  const int64_t ffn = gate_up_rows / 2;
  std::vector<float> gate_up(R * gate_up_rows), act(R * ffn);
  linear_parts_rows(x, R, hidden, w.gate_up, gate_up.data());
  if (w.gate_up_bias != nullptr) add_bias_rows(gate_up.data(), R, gate_up_rows, w.gate_up_bias);
  const float* gu = gate_up.data();
  float* ap = act.data();
  parallel_for(0, R, row_grain(2 * ffn), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = gu + r * 2 * ffn;
      if (activation == kGeluTanh) {
        gated_activation<true>(gate, gate + ffn, ap + r * ffn, ffn);
      } else if (activation == kSwigluOai) {
        swiglu_oai(gate, gate + ffn, ap + r * ffn, ffn);
      } else {
        gated_activation<false>(gate, gate + ffn, ap + r * ffn, ffn);
      }
    }
  });
  linear_rows(act.data(), R, ffn, w.down, out);
  if (w.down_bias != nullptr) add_bias_rows(out, R, hidden, w.down_bias);
}

// A row's chosen experts and their weights from its router logits (k of them, in order of preference; ties to the
// lower index).
void choose_experts(const float* logits, int64_t n, const Experts& e, int64_t* chosen, float* weights) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + e.used, order.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const float top = logits[order[0]];
  if (e.gating == kTopKSoftmax) {
    float sum = 0.f;
    for (int64_t j = 0; j < e.used; ++j) sum += weights[j] = std::exp(logits[order[j]] - top);
    for (int64_t j = 0; j < e.used; ++j) chosen[j] = order[j], weights[j] /= sum;
    return;
  }
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += std::exp(logits[i] - top);
  float kept = 0.f;
  for (int64_t j = 0; j < e.used; ++j) {
    chosen[j] = order[j];
    kept += weights[j] = std::exp(logits[order[j]] - top) / total;
  }
  if (e.normalize)
    for (int64_t j = 0; j < e.used; ++j) weights[j] /= kept;
}

// x [R, hidden] through the mixture of experts into out [R, hidden]. The experts the rows chose are tasks spread over
// the threads (each expert's GEMMs then run on one thread): a decode step's few-row GEMMs would otherwise each pay a
// fork and join of every thread, two per expert and layer.
// `routed`: what the router reads, where that is not x (Gemma 4's router reads the block's residual).
void experts_rows(const Experts& e, int64_t activation, const float* x, int64_t R, int64_t hidden, float* out,
                  const float* routed = nullptr) {
  const int64_t n = static_cast<int64_t>(e.mlps.size()), k = e.used;
  std::vector<float> logits(R * n), weights(R * k);
  std::vector<int64_t> chosen(R * k);
  routed = routed != nullptr ? routed : x;
  std::vector<float> scaled;
  if (e.router_scale != nullptr) {
    scaled.resize(R * hidden);
    const double root = 1.0 / std::sqrt(static_cast<double>(hidden));
    for (int64_t r = 0; r < R; ++r) {
      const float* row = routed + r * hidden;
      double sum = 0.0;
      for (int64_t i = 0; i < hidden; ++i) sum += static_cast<double>(row[i]) * row[i];
      const float s = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(hidden) + e.router_eps));
      for (int64_t i = 0; i < hidden; ++i)
        scaled[r * hidden + i] = row[i] * s * e.router_scale[i] * static_cast<float>(root);
    }
    routed = scaled.data();
  }
  linear_rows(routed, R, hidden, e.router, logits.data());
  if (e.router_bias != nullptr) add_bias_rows(logits.data(), R, n, e.router_bias);
  for (int64_t r = 0; r < R; ++r) choose_experts(logits.data() + r * n, n, e, chosen.data() + r * k, weights.data() + r * k);
  if (e.expert_scales != nullptr)
    for (int64_t c = 0; c < R * k; ++c) weights[c] *= e.expert_scales[chosen[c]];
  // each expert's choices (row * k + j: row's j-th choice), in row order
  std::vector<std::vector<int64_t>> choices_of(n);
  for (int64_t c = 0; c < R * k; ++c) choices_of[chosen[c]].push_back(c);
  std::vector<int64_t> active;
  for (int64_t expert = 0; expert < n; ++expert)
    if (!choices_of[expert].empty()) active.push_back(expert);
  std::vector<float> results(R * k * hidden);  // each choice's expert output
  parallel_tasks(static_cast<int64_t>(active.size()), [&](int64_t task) {
    const int64_t expert = active[task];
    const std::vector<int64_t>& choices = choices_of[expert];
    const int64_t m = static_cast<int64_t>(choices.size());
    std::vector<float> gathered(m * hidden), result(m * hidden);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(gathered.data() + i * hidden, x + choices[i] / k * hidden, sizeof(float) * hidden);
    mlp_rows(e.mlps[expert], activation, gathered.data(), m, hidden, result.data());
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(results.data() + choices[i] * hidden, result.data() + i * hidden, sizeof(float) * hidden);
  });
  // each row's experts weighed and summed in the order of their index
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> order(k);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < k; ++j) order[j] = r * k + j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
      float* o = out + r * hidden;
      std::fill(o, o + hidden, 0.f);
      for (const int64_t c : order) {
        const float* y = results.data() + c * hidden;
        const float w = weights[c];
        for (int64_t i = 0; i < hidden; ++i) o[i] += w * y[i];
      }
    }
  });
  if (!e.has_shared) return;
  std::vector<float> shared(R * hidden), gate(R);
  mlp_rows(e.shared, activation, x, R, hidden, shared.data());
  linear_rows(x, R, hidden, e.shared_gate, gate.data());
  for (int64_t r = 0; r < R; ++r) {
    const float g = 1.f / (1.f + std::exp(-gate[r]));
    for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] += g * shared[r * hidden + i];
  }
}
