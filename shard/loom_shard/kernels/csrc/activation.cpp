// SwiGLU's activation, silu(gate) * up, in one pass where torch takes two (silu, then mul_), each
// element computed alone: the same lane-wise arithmetic on every ISA (simd::exp), so a row's value
// depends on nothing else in the batch, nor on the build.
#include "activation.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "simd.h"

namespace {

using loom::simd::F16;
namespace simd = loom::simd;

// gate / (1 + exp(-gate)) * up.
inline F16 silu_mul16(F16 gate, F16 up) {
  const F16 sigmoid_denominator = simd::add(simd::set1(1.0f), simd::exp(simd::sub(simd::zero(), gate)));
  return simd::mul(simd::div(gate, sigmoid_denominator), up);
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t n, T* out) {
  int64_t i = 0;
  for (; i + loom::kLanes <= n; i += loom::kLanes)
    simd::store(out + i, silu_mul16(simd::load(gate + i), simd::load(up + i)));
  if (i == n) return;
  T g[loom::kLanes]{}, u[loom::kLanes]{}, o[loom::kLanes];  // the tail through the same vector code
  std::copy(gate + i, gate + n, g);
  std::copy(up + i, up + n, u);
  simd::store(o, silu_mul16(simd::load(g), simd::load(u)));
  std::copy(o, o + (n - i), out + i);
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t intermediate, T* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(intermediate, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* row = gate_up + r * 2 * intermediate;
      silu_mul_row(row, row + intermediate, intermediate, out + r * intermediate);
    }
  });
}

}  // namespace

namespace loom {

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) == 2 * intermediate,
              "silu_mul: gate_up must be a CPU tensor [rows, 2 * intermediate]");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kFloat,
              "silu_mul: bfloat16 or float32 only");
  const at::Tensor x = gate_up.contiguous();
  at::Tensor out = at::empty({x.size(0), intermediate}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows(x.data_ptr<at::BFloat16>(), x.size(0), intermediate, out.data_ptr<at::BFloat16>());
  else
    silu_mul_rows(x.data_ptr<float>(), x.size(0), intermediate, out.data_ptr<float>());
  return out;
}

}  // namespace loom

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) { m.def("silu_mul(Tensor gate_up, int intermediate) -> Tensor"); }
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("silu_mul", &loom::silu_mul); }
