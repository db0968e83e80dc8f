// The decoder layers of a Llama-family model whose projections are Loom's quantized or dense linears
// (with the LoRA deltas of a batch that names adapters), in one call from Python: the same kernels
// (loom::rms_norm, add_rms_norm, qlinear, linear, rotary, paged_attention, silu_mul, lora_shrink,
// lora_expand_) and ATen ops, in the same order and on the same shapes, as the modules
// (layers/decoder.py, lora/linear.py), so the result is bit-identical to them. What goes is the
// Python between the ~15 ops of each layer (module calls, views, dispatch), which a second thread
// does not shorten: a batch-1 decode step of the embedded model went 6.6 -> 4.1 ms at 2 threads
// (bench/BENCHMARKS.md).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "activation.h"
#include "common.h"

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kPerLayer = 14;  // tensors per layer in `weights`, in the order below
constexpr int64_t kLoraPerLayer = 11;  // tensors per layer in `lora`

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features,
                   const c10::optional<at::Tensor>& bias = c10::nullopt) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("qlinear"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(x, packed, scales, out_features, bias);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("linear"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(x, packed, out_features, bias);
}

// A projection as its module runs it: QuantLinear's loom::qlinear, or where `scales` is empty
// PackedLinear's loom::linear (a dense weight: safetensors, or a GGUF format not kept quantized).
at::Tensor project(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features,
                   const c10::optional<at::Tensor>& bias = c10::nullopt) {
  if (scales.numel() == 0) return linear(x, packed, out_features, bias);
  return qlinear(x, packed, scales, out_features, bias);
}

// The qkv projection, whose packed weights are up to three parts: those of q, k and v, where a
// part's packed weight is empty when it runs with the part before it (one part: the fused qkv;
// more: a GGUF that quantizes them in different kinds, SplitLinear). `bounds`: where q, k and v
// start, and the end. Parts run without the bias, which is added to their outputs side by side,
// as SplitLinear.forward does.
at::Tensor project_qkv(const at::Tensor& x, const at::Tensor* w, const int64_t (&bounds)[4],
                       const c10::optional<at::Tensor>& bias) {
  if (w[2].numel() == 0 && w[4].numel() == 0) return project(x, w[0], w[1], bounds[3], bias);
  std::vector<at::Tensor> outs;
  for (int p = 0; p < 3; ++p) {
    if (w[2 * p].numel() == 0) continue;
    int end = p + 1;
    while (end < 3 && w[2 * end].numel() == 0) ++end;
    outs.push_back(project(x, w[2 * p], w[2 * p + 1], bounds[end] - bounds[p]));
  }
  at::Tensor qkv = at::cat(outs, 1);
  return bias && bias->defined() ? qkv + bias->to(qkv.scalar_type()) : qkv;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("rms_norm"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), weight, eps);
}

// (x + residual, its rms_norm): bit-identical to torch's add, then rms_norm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("add_rms_norm"), "").typed<
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), residual.contiguous(), weight, eps);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("rotary"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(x, positions, cos, sin);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& query_starts, const at::Tensor& num_cached) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("paged_attention"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
      double, const c10::optional<at::Tensor>&)>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));  // Llama's: no window, cap or sinks
  return op.call(q, kv_layer, block_tables, query_starts, num_cached, scale, 0, 0.0, c10::nullopt);
}

// Which adapter slot each token uses (-1: the base model) and each slot's adapter's rank.
struct LoraSlots {
  const c10::optional<at::Tensor>& token_slot;
  const c10::optional<at::Tensor>& slot_ranks;
};

// A projection's output plus its LoRA deltas (lora.cpp), as LoraLinear.forward adds them: `factors`
// is the projection's A and its parts' B; no factors, the output as it is.
at::Tensor with_lora(at::Tensor out, const at::Tensor& x, at::ArrayRef<at::Tensor> factors, const LoraSlots& slots) {
  if (factors.empty()) return out;
  static auto shrink = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("lora_shrink"), "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  static auto expand = c10::Dispatcher::singleton().findSchemaOrThrow(LOOM_OP("lora_expand_"), "").typed<at::Tensor(
      at::Tensor, const at::Tensor&, at::TensorList, const at::Tensor&, const at::Tensor&)>();
  const int64_t parts = static_cast<int64_t>(factors.size()) - 1;
  const at::Tensor h = shrink.call(x, factors[0], *slots.token_slot, *slots.slot_ranks, parts);
  return expand.call(out, h, factors.slice(1), *slots.token_slot, *slots.slot_ranks);
}

// Each token's K and V [num_tokens, kv_heads, head_dim] (rows of a wider tensor) into its slot of
// the layer's cache [2, slots, kv_heads, head_dim]: index_copy_'s copies without its per-call cost
// (at a batch-32 decode, two calls per layer took ~50x the time of the bytes they move).
void write_kv(const at::Tensor& flat, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const int64_t num_slots = flat.size(1), row = flat.size(2) * flat.size(3), bytes = row * flat.element_size();
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == flat.scalar_type() && t->stride(2) == 1 && t->stride(1) == flat.size(3),
                "decoder_layers: K/V rows must be contiguous heads in the cache's dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(flat.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decoder_layers: slot ", slot[t], " out of range");
    std::memcpy(dst + slot[t] * bytes, k_src + t * k_stride, bytes);
    std::memcpy(dst + (num_slots + slot[t]) * bytes, v_src + t * v_stride, bytes);
  }
}

// x [num_tokens, hidden] (the embeddings); weights: per layer input_layernorm.weight, qkv packed
// and scales for each of its parts q, k, v (project_qkv), o packed, o scales,
// post_attention_layernorm.weight, gate_up packed, gate_up scales, down packed, down scales (a
// projection with empty scales runs loom::linear); qkv_biases: per
// layer its qkv projection's bias (Qwen2) or none; kv_cache [layers, 2, blocks, block_size,
// kv_heads, head_dim].
// lora: empty, or per layer the LoRA slots of qkv (A, B_q, B_k, B_v), o (A, B), gate_up (A, B_gate,
// B_up) and down (A, B), with token_slot each token's adapter slot (-1: the base model) and
// slot_ranks each slot's adapter's rank.
// Returns the final hidden states [num_tokens, hidden] (before the final norm), as LlamaModel.forward;
// with keep_rows (token indices), only those rows' [len(keep_rows), hidden], in keep_rows' order.
at::Tensor decoder_layers(at::Tensor x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& qkv_biases,
                          const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& positions,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& block_tables,
                          const at::Tensor& query_starts, const at::Tensor& num_cached, int64_t num_heads,
                          int64_t num_kv_heads, int64_t intermediate_size, double eps, at::TensorList lora,
                          const c10::optional<at::Tensor>& token_slot, const c10::optional<at::Tensor>& slot_ranks,
                          const c10::optional<at::Tensor>& keep_rows) {
  const int64_t num_layers = kv_cache.size(0), head_dim = kv_cache.size(5);
  TORCH_CHECK(kv_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == x.size(0),
              "decoder_layers: a contiguous cache and one int64 slot per token");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kPerLayer &&
                  static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decoder_layers: expected ", kPerLayer, " weight tensors and one qkv bias (or none) per layer");
  TORCH_CHECK(lora.empty() || (static_cast<int64_t>(lora.size()) == num_layers * kLoraPerLayer && token_slot &&
                                slot_ranks),
              "decoder_layers: expected ", kLoraPerLayer, " LoRA tensors per layer with the token and slot ranks, or none");
  TORCH_CHECK(!keep_rows || (keep_rows->scalar_type() == at::kLong && keep_rows->dim() == 1),
              "decoder_layers: keep_rows must be int64 token indices");
  // The last layer's output projection and MLP run on the kept rows alone: their rows' values do
  // not depend on the other rows (every linear is row-invariant), and the other rows' only use
  // past this point is the final norm and the LM head, which read the kept rows only.
  const c10::optional<at::Tensor> kept_slots =
      keep_rows && token_slot ? c10::optional<at::Tensor>(token_slot->index_select(0, *keep_rows)) : token_slot;
  const LoraSlots lora_slots{token_slot, slot_ranks}, kept_lora_slots{kept_slots, slot_ranks};
  const int64_t num_tokens = x.size(0), hidden = x.size(1), qk_heads = num_heads + num_kv_heads;
  const int64_t bounds[4] = {0, num_heads * head_dim, qk_heads * head_dim, (qk_heads + num_kv_heads) * head_dim};
  // Each residual add runs with the norm after it (the last layer's add stays alone: the model's
  // final norm runs outside). normed: the input of the layer's attention.
  at::Tensor normed = num_layers > 0 ? rms_norm(x, weights[0], eps) : x;
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    const at::ArrayRef<at::Tensor> l = lora.empty() ? lora : lora.slice(i * kLoraPerLayer, kLoraPerLayer);
    auto factors = [&](int64_t first, int64_t count) { return l.empty() ? l : l.slice(first, count); };
    const at::Tensor& kv_layer = kv_cache[i];
    // Attention (Attention.forward, paged_attention).
    at::Tensor qkv = with_lora(project_qkv(normed, w + 1, bounds, qkv_biases.get(i)), normed, factors(0, 4), lora_slots)
                         .view({num_tokens, qk_heads + num_kv_heads, head_dim});
    at::Tensor qk = rotary(qkv.slice(1, 0, qk_heads), positions, cos, sin);
    std::vector<at::Tensor> q_k = qk.split_with_sizes({num_heads, num_kv_heads}, 1);
    at::Tensor v = qkv.slice(1, qk_heads);
    write_kv(kv_layer.view({2, kv_layer.size(1) * kv_layer.size(2), num_kv_heads, head_dim}), q_k[1], v, slot_mapping);
    at::Tensor attended =
        paged_attention(q_k[0], kv_layer, block_tables, query_starts, num_cached).reshape({num_tokens, -1});
    const bool last = i + 1 == num_layers;
    if (last && keep_rows) {
      attended = attended.index_select(0, *keep_rows);
      x = x.index_select(0, *keep_rows);
    }
    const LoraSlots& slots = last ? kept_lora_slots : lora_slots;
    at::Tensor normed_mlp;
    std::tie(x, normed_mlp) =
        add_rms_norm(x, with_lora(project(attended, w[7], w[8], hidden), attended, factors(4, 2), slots), w[9], eps);
    // Feed-forward (GatedMLP.forward).
    at::Tensor gate_up = with_lora(project(normed_mlp, w[10], w[11], 2 * intermediate_size), normed_mlp, factors(6, 3),
                                   slots);
    const at::Tensor act = loom::silu_mul(gate_up, intermediate_size);
    const at::Tensor down = with_lora(project(act, w[12], w[13], hidden), act, factors(9, 2), slots);
    if (last)
      x = x + down;
    else
      std::tie(x, normed) = add_rms_norm(x, down, w[kPerLayer], eps);
  }
  return num_layers == 0 && keep_rows ? x.index_select(0, *keep_rows) : x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, Tensor?[] qkv_biases, Tensor kv_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor block_tables, Tensor query_starts, Tensor num_cached, "
        "int num_heads, int num_kv_heads, int intermediate_size, float eps, Tensor[] lora, Tensor? token_slot, Tensor? slot_ranks, "
        "Tensor? keep_rows) -> Tensor");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
