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

// One MLP's weights: gate and up stacked along the output dimension (in one or two parts), and down.
struct MlpWeights {
  std::vector<Weight> gate_up;
  Weight down;
};

// How a router's logits become the chosen experts' weights.
enum ExpertGating : int64_t {
  kSoftmaxTopK = 0,  // softmax over every expert, the top k kept (renormalized to sum 1 where `normalize`: Qwen3-MoE)
  kTopKSoftmax = 1,  // the top k logits, a softmax over just those (gpt-oss)
};

struct Experts {
  int64_t used = 0;  // experts per row (k)
  Weight router;  // [experts, hidden]
  std::vector<MlpWeights> mlps;  // one per expert
  int64_t gating = kSoftmaxTopK;
  bool normalize = false;
};

// x [R, hidden] through one MLP into out [R, hidden].
void mlp_rows(const MlpWeights& w, bool gelu, const float* x, int64_t R, int64_t hidden, float* out) {
  int64_t gate_up_rows = 0;
  for (const Weight& part : w.gate_up) gate_up_rows += part.rows;
  const int64_t ffn = gate_up_rows / 2;
  std::vector<float> gate_up(R * gate_up_rows), act(R * ffn);
  linear_parts_rows(x, R, hidden, w.gate_up, gate_up.data());
  const float* gu = gate_up.data();
  float* ap = act.data();
  parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (gelu) {
        gated_activation<true>(gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, ap + r * ffn, ffn);
      } else {
        gated_activation<false>(gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, ap + r * ffn, ffn);
      }
    }
  });
  linear_rows(act.data(), R, ffn, w.down, out);
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

// x [R, hidden] through the mixture of experts into out [R, hidden].
void experts_rows(const Experts& e, bool gelu, const float* x, int64_t R, int64_t hidden, float* out) {
  const int64_t n = static_cast<int64_t>(e.mlps.size()), k = e.used;
  std::vector<float> logits(R * n), weights(R * k);
  std::vector<int64_t> chosen(R * k);
  linear_rows(x, R, hidden, e.router, logits.data());
  for (int64_t r = 0; r < R; ++r) choose_experts(logits.data() + r * n, n, e, chosen.data() + r * k, weights.data() + r * k);
  // each expert's rows, in row order, with the weight the row gives it
  std::vector<std::vector<std::pair<int64_t, float>>> rows_of(n);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < k; ++j) rows_of[chosen[r * k + j]].push_back({r, weights[r * k + j]});
  std::fill(out, out + R * hidden, 0.f);
  std::vector<float> gathered, result;
  for (int64_t expert = 0; expert < n; ++expert) {
    const auto& rows = rows_of[expert];
    const int64_t m = static_cast<int64_t>(rows.size());
    if (m == 0) continue;
    gathered.resize(m * hidden), result.resize(m * hidden);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(gathered.data() + i * hidden, x + rows[i].first * hidden, sizeof(float) * hidden);
    mlp_rows(e.mlps[expert], gelu, gathered.data(), m, hidden, result.data());
    for (int64_t i = 0; i < m; ++i) {
      float* o = out + rows[i].first * hidden;
      const float* y = result.data() + i * hidden;
      const float w = rows[i].second;
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
    }
  }
}
