// A mixture-of-experts layer's experts when their weights are Loom's quantized linears (a GGUF's
// experts in a format kept quantized), in one call from Python: the same ATen ops and
// loom::qlinear calls, in the same order, as loom_shard/layers/moe.py's MoE.forward over
// QuantExperts, so the result is bit-identical to it. What goes is the Python around each expert (a batch-1 decode step of a
// small MoE spent more time there than in the experts' weights).
//
// Picks (token t's k-th expert, index t * k + j) are grouped by expert in token order; each expert
// runs two GEMMs over its rows; each token sums its picks' outputs in rank order. Experts run side
// by side, one thread each (handed out dynamically), rather than each GEMM split over the threads:
// a decode's experts have a few rows each, too few for a GEMM to keep two threads busy. A thread
// never changes a result (each GEMM reduces in a fixed order).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <vector>

#include "activation.h"
#include "common.h"
#include "parallel.h"

namespace {

constexpr double kSwigluAlpha = 1.702, kSwigluLimit = 7.0;  // gpt-oss's clamped SwiGLU

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("qlinear"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(x, packed, scales, out_features, c10::nullopt);
}

// [rows, 2 * intermediate] (gate, then up) -> [rows, intermediate]; activation 0: silu(gate) * up,
// 1: gpt-oss's clamped SwiGLU (layers/moe.py's expert_activation).
at::Tensor activate(const at::Tensor& gate_up, int64_t intermediate, int64_t activation) {
  if (activation == 0) return loom::silu_mul(gate_up, intermediate);
  std::vector<at::Tensor> parts = gate_up.split(intermediate, -1);
  at::Tensor gate = parts[0].clamp_max(kSwigluLimit);
  at::Tensor up = parts[1].clamp(-kSwigluLimit, kSwigluLimit);
  return (up + 1) * (gate * at::sigmoid(gate * kSwigluAlpha));
}

// x [tokens, hidden]; ids [tokens, k] int64 global expert ids; weights [tokens, k] float32;
// per local expert (global id expert_start + e): its gate/up and down QuantLinear's packed tensor
// and float16 scales. Picks of experts held elsewhere (tensor parallelism) add zeros.
// Returns [tokens, hidden] in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, at::TensorList up_packed,
                       at::TensorList up_scales, at::TensorList down_packed, at::TensorList down_scales,
                       int64_t expert_start, int64_t intermediate, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0),
              "moe_experts: x [tokens, hidden], ids and weights [tokens, k]");
  const int64_t num_experts = static_cast<int64_t>(up_packed.size());
  TORCH_CHECK(static_cast<int64_t>(up_scales.size()) == num_experts &&
                  static_cast<int64_t>(down_packed.size()) == num_experts &&
                  static_cast<int64_t>(down_scales.size()) == num_experts,
              "moe_experts: one packed tensor and scales per expert and projection");
  const int64_t tokens = x.size(0), k = ids.size(1), hidden = x.size(1);
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> picks(num_experts);  // each expert's picks, in token order
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int64_t local = id[p] - expert_start;
    if (local >= 0 && local < num_experts) picks[local].push_back(p);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (!picks[e].empty()) active.push_back(e);
  std::vector<at::Tensor> rows(num_experts), outs(num_experts);
  auto run = [&](int64_t e) {
    rows[e] = at::tensor(picks[e], at::kLong);
    const at::Tensor h = activate(qlinear(x.index_select(0, at::floor_divide(rows[e], k)), up_packed[e], up_scales[e],
                                          2 * intermediate), intermediate, activation);
    outs[e] = qlinear(h, down_packed[e], down_scales[e], hidden);
  };
  const int64_t num_active = static_cast<int64_t>(active.size());
  if (num_active <= 1 || at::get_num_threads() == 1) {
    for (int64_t e : active) run(e);  // one expert: its GEMMs use every thread
  } else {
    loom::parallel_dynamic(num_active, [&](int64_t i) { run(active[i]); });
  }
  at::Tensor y = at::zeros({tokens * k, hidden}, x.options());
  for (int64_t e : active) y.index_copy_(0, rows[e], outs[e]);
  y = y.view({tokens, k, hidden});
  const at::Tensor w = weights.to(x.scalar_type());
  at::Tensor out = y.select(1, 0) * w.slice(1, 0, 1);
  for (int64_t j = 1; j < k; ++j) out.add_(y.select(1, j) * w.slice(1, j, j + 1));  // a fixed order over the picks
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] up_packed, Tensor[] up_scales, "
        "Tensor[] down_packed, Tensor[] down_scales, int expert_start, int intermediate, int activation) -> Tensor");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("moe_experts", &moe_experts); }
