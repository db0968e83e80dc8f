// Greedy sampling's reductions over each row of float32 logits, in one call: the index of the
// largest logit (the first of equals, NaN winning, as torch.argmax) and the terms of the row's
// log-softmax, its max and log(sum(exp(x - max))), so that a token's logprob is
// (x - max) - log_sum as torch's log_softmax computes it, without writing the [rows, vocab]
// log-softmax. A row is reduced over fixed 16-wide lanes in a fixed order (simd.h), so its values
// do not depend on the batch, the thread count or which ISA's build runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "common.h"
#include "simd.h"

namespace {

namespace simd = loom::simd;

struct RowStats {
  int64_t argmax;
  float max;
  float log_sum;
};

// The first index whose value equals `max` or is NaN; n if none.
int64_t first_max(const float* x, int64_t n, float max) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const int lane = simd::first_max_lane(simd::load(x + i), max);
    if (lane < 16) return i + lane;
  }
  for (; i < n; ++i)
    if (x[i] == max || std::isnan(x[i])) return i;
  return n;
}

RowStats row_stats(const float* x, int64_t n) {
  const int64_t body = n / 16 * 16;
  const float inf = std::numeric_limits<float>::infinity();
  // max(v, m) keeps m where v is NaN: the max of the numbers. The sum turns NaN at a NaN.
  simd::F16 m = simd::set1(-inf), probe = simd::zero();
  for (int64_t i = 0; i < body; i += 16) {
    const simd::F16 v = simd::load(x + i);
    m = simd::max(v, m);
    probe = simd::add(probe, v);
  }
  float max = simd::max_first(m, 16), sum = simd::sum(probe);
  for (int64_t i = body; i < n; ++i) {
    if (!std::isnan(x[i])) max = std::max(max, x[i]);
    sum += x[i];
  }
  if (std::isnan(sum)) {  // a NaN wins, as in torch.argmax (or +inf and -inf met: no NaN is found)
    const int64_t nan = first_max(x, n, std::numeric_limits<float>::quiet_NaN());
    if (nan < n) return {nan, x[nan], x[nan]};
  }
  const int64_t argmax = first_max(x, n, max);
  const simd::F16 shift = simd::set1(max);
  simd::F16 exps = simd::zero();
  for (int64_t i = 0; i < body; i += 16) exps = simd::add(exps, simd::exp(simd::sub(simd::load(x + i), shift)));
  float total = simd::sum(exps);
  for (int64_t i = body; i < n; ++i) total += simd::exp1(x[i] - max);
  return {argmax < n ? argmax : 0, max, std::log(total)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_logprob_terms(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "greedy_logprob_terms: logits must be float32 [rows, vocab] on CPU");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor argmax = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor max = at::empty({rows}, x.options()), log_sum = at::empty({rows}, x.options());
  const float* data = x.data_ptr<float>();
  int64_t* a = argmax.data_ptr<int64_t>();
  float* m = max.data_ptr<float>();
  float* l = log_sum.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const RowStats s = row_stats(data + r * vocab, vocab);
      a[r] = s.argmax;
      m[r] = s.max;
      l[r] = s.log_sum;
    }
  });
  return {argmax, max, log_sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) { m.def("greedy_logprob_terms(Tensor logits) -> (Tensor, Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("greedy_logprob_terms", &greedy_logprob_terms); }
