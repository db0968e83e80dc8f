// RMS normalisation over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight.
// One row per task; the sum of squares runs over fixed 16-wide float32 lanes combined in a
// fixed order, so a row's result does not depend on how many rows are normalised with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "common.h"

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    std::vector<float> w(hidden);
    for (int64_t i = 0; i < hidden; ++i) w[i] = loom::to_float(weight[i]);
    for (int64_t r = first; r < last; ++r) {
      const T* row = x + r * hidden;
      float lanes[loom::kLanes] = {0};
      for (int64_t i = 0; i < hidden; ++i) {
        float v = loom::to_float(row[i]);
        lanes[i % loom::kLanes] += v * v;
      }
      float scale = 1.0f / std::sqrt(loom::sum_lanes(lanes) / static_cast<float>(hidden) + static_cast<float>(eps));
      T* dst = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = loom::from_float<T>(loom::to_float(row[i]) * scale * w[i]);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [hidden]");
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(x);
  int64_t hidden = x.size(-1), rows = hidden == 0 ? 0 : x.numel() / hidden;
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, hidden, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32 only");
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, eps);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("rms_norm", &rms_norm); }
