// Gated activations shared by the decoder and the experts' kernels.
#pragma once
#include <ATen/ATen.h>

namespace loom {

// gate_up [rows, 2 * intermediate] (gate, then up) -> silu(gate) * up [rows, intermediate], in
// float32 and rounded once to gate_up's dtype (bfloat16 or float32).
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate);

}  // namespace loom
