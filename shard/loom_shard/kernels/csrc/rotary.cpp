// Rotary position embedding, half-split layout (Llama's rotate_half), for q and k together:
//   out[i]        = x[i] * cos[p, i] - x[i + half] * sin[p, i]
//   out[i + half] = x[i + half] * cos[p, i] + x[i] * sin[p, i]       (i < half, p = position)
// over the first 2 * half dims of each head (half = the table's width); the others pass through
// (partial rotary, as Phi-4-mini's).
// One pass over x reading the float32 cos/sin table rows of each token's position, in place of
// torch's per-step table gathers and per-layer roll + mul + addcmul. Math in float32, rounded
// once. Each (token, head) row is computed alone, so its result never depends on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace {

struct Layout {
  int64_t num_tokens, num_heads, head_dim, half;  // half: rotated pairs per head
  int64_t token_stride, head_stride;  // of x, in elements (its last dimension is contiguous)
};

template <typename T>
void rotate_rows(const T* x, const int64_t* positions, const float* cos, const float* sin, T* out,
                 const Layout& l) {
  const int64_t half = l.half;
  // A decode step has ~12 rows of 64: grain keeps that on the calling thread.
  at::parallel_for(0, l.num_tokens * l.num_heads, 64, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t token = row / l.num_heads, head = row % l.num_heads;
      const T* src = x + token * l.token_stride + head * l.head_stride;
      const float* c = cos + positions[token] * half;
      const float* s = sin + positions[token] * half;
      T* dst = out + row * l.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = loom::to_float(src[i]), b = loom::to_float(src[i + half]);
        dst[i] = loom::from_float<T>(a * c[i] - b * s[i]);
        dst[i + half] = loom::from_float<T>(b * c[i] + a * s[i]);
      }
      for (int64_t i = 2 * half; i < l.head_dim; ++i) dst[i] = src[i];
    }
  });
}

// x [num_tokens, num_heads, head_dim] (any token/head strides, last dim contiguous);
// positions [num_tokens] int64; cos, sin [table_len, rotary_dim / 2] float32, contiguous,
// rotary_dim <= head_dim.
// Returns a new contiguous [num_tokens, num_heads, head_dim] tensor of x's dtype.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary: x must be CPU [tokens, heads, dim] with a contiguous last dim");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0),
              "rotary: positions must be int64 [num_tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) > 0 &&
                  2 * cos.size(1) <= x.size(2),
              "rotary: cos and sin must be contiguous float32 [table_len, rotary_dim / 2], rotary_dim <= head_dim");
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)  // a scalar loop: no extra tensor ops per layer
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rotary: position ", p[t], " is outside the cos/sin table");
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  Layout l{x.size(0), x.size(1), x.size(2), cos.size(1), x.stride(0), x.stride(1)};
  if (x.scalar_type() == at::kBFloat16) {
    rotate_rows(x.data_ptr<at::BFloat16>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                out.data_ptr<at::BFloat16>(), l);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary: bfloat16 or float32 only");
    rotate_rows(x.data_ptr<float>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                out.data_ptr<float>(), l);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) { m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor"); }
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("rotary", &rotary); }
