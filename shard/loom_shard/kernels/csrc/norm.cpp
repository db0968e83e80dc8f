// RMS normalisation over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight, and the same
// after a residual add (s = x + y rounded to x's dtype, as torch's add rounds it; then s normalised),
// one pass over a row where a decoder layer had two ops. The sum of squares runs over 16 float32
// lanes (element i into lane i % 16) combined by sum_lanes' tree, so a row's result does not depend
// on how many rows are normalised with it, nor on the ISA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "common.h"
#include "simd.h"

namespace {

using loom::simd::F16;
namespace simd = loom::simd;

// The sum of squares of row[0, n) in lanes (each lane's running sum), then sum_lanes' tree.
template <typename T>
float sum_of_squares(const T* row, int64_t n) {
  F16 acc = simd::zero();
  int64_t i = 0;
  for (; i + loom::kLanes <= n; i += loom::kLanes) {
    const F16 v = simd::load(row + i);
    acc = simd::add(acc, simd::mul(v, v));
  }
  alignas(64) float lanes[loom::kLanes];
  simd::store(lanes, acc);
  for (; i < n; ++i) {
    const float v = loom::to_float(row[i]);
    lanes[i % loom::kLanes] += v * v;
  }
  return loom::sum_lanes(lanes);
}

// dst = row * scale * weight, rounded once to T.
template <typename T>
void scale_row(const T* row, const T* weight, float scale, int64_t n, T* dst) {
  const F16 s = simd::set1(scale);
  int64_t i = 0;
  for (; i + loom::kLanes <= n; i += loom::kLanes)
    simd::store(dst + i, simd::mul(simd::mul(simd::load(row + i), s), simd::load(weight + i)));
  for (; i < n; ++i) dst[i] = loom::from_float<T>(loom::to_float(row[i]) * scale * loom::to_float(weight[i]));
}

// dst = a + b, each sum rounded to T as torch's add rounds it.
template <typename T>
void add_row(const T* a, const T* b, int64_t n, T* dst) {
  int64_t i = 0;
  for (; i + loom::kLanes <= n; i += loom::kLanes)
    simd::store(dst + i, simd::add(simd::load(a + i), simd::load(b + i)));
  for (; i < n; ++i) dst[i] = loom::from_float<T>(loom::to_float(a[i]) + loom::to_float(b[i]));
}

// Normalises each row of x (rows of `hidden`) into out; with `residual`, x + residual first,
// written to `sum` and normalised from there.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const at::Tensor& weight, T* sum, T* out, int64_t rows,
                   int64_t hidden, double eps) {
  const T* w = weight.data_ptr<T>();
  // A decode batch's rows take a few microseconds: less than waking a second thread costs.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* row = x + r * hidden;
      if (residual != nullptr) {
        add_row(row, residual + r * hidden, hidden, sum + r * hidden);
        row = sum + r * hidden;
      }
      const float mean = sum_of_squares(row, hidden) / static_cast<float>(hidden);
      scale_row(row, w, 1.0f / std::sqrt(mean + static_cast<float>(eps)), hidden, out + r * hidden);
    }
  });
}

// The weight in x's dtype (a bfloat16 model's weight rounds to bfloat16); no copy when it is.
at::Tensor weight_as_x(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32 only");
  return weight.to(x.scalar_type()).contiguous();
}

void run(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, const at::Tensor& sum,
         const at::Tensor& out, double eps) {
  const at::Tensor w = weight_as_x(x, weight);
  const int64_t hidden = x.size(-1), rows = hidden == 0 ? 0 : x.numel() / hidden;
  if (x.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    rms_norm_rows(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, w,
                  residual ? sum.data_ptr<T>() : nullptr, out.data_ptr<T>(), rows, hidden, eps);
  } else {
    rms_norm_rows(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, w,
                  residual ? sum.data_ptr<float>() : nullptr, out.data_ptr<float>(), rows, hidden, eps);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  run(x, nullptr, weight, at::Tensor(), out, eps);
  return out;
}

// (x + residual, rms_norm(x + residual)): the residual stream and the next block's input.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: the residual must be contiguous, of x's shape and dtype");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  run(x, &residual, weight, sum, out, eps);
  return {sum, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
