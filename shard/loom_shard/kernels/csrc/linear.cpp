// Dense linears y = x W^T (+ bias) with W in bfloat16 or float32, for CPUs and shapes where no
// library GEMM keeps a row's result independent of the batch (packed_linear.py decides).
//
// Every output is one chain of float32 FMAs over k = 0, 1, ..., K-1 from zero, then + bias, rounded
// once to x's dtype: the same arithmetic whatever the row count, the register tiling, the thread
// or the ISA (simd.h), so a row is bit-identical at any batch size by construction.
//
// At load W [N, K] is repacked into tiles of 16 output columns, [tiles, K, 16] (its own dtype, the
// last tile zero-padded), so each tile streams from memory in one sequential pass.
//
// bfloat16 x and W on a CPU with AVX-512 BF16 (`linear_repack_pairs`): W is packed as pairs of k,
// [tiles, K/2, 16, 2], and each output is one chain of `vdpbf16ps` over the pairs (k = 0 and 1, then
// 2 and 3, ...), from zero: twice the products per instruction of the FMA chain, the same fixed
// order at every row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "parallel.h"
#include "simd.h"

namespace {

using loom::simd::F16;

constexpr int64_t kCols = 16;       // output columns per tile
constexpr int64_t kRowChunk = 64;   // rows whose activations stay cached while the tiles stream by
#if defined(__AVX512F__)
constexpr int kRows = 4, kTileCols = 4;  // register tile: 16 accumulators of 32 zmm registers
#else
constexpr int kRows = 2, kTileCols = 2;  // 8 of 16 ymm registers (an F16 is two)
#endif

at::Tensor linear_repack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "linear_repack: weight must be bfloat16 or float32 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1), tiles = (n + kCols - 1) / kCols;
  at::Tensor padded = at::zeros({tiles * kCols, k}, weight.options());
  padded.slice(0, 0, n).copy_(weight);
  return padded.view({tiles, kCols, k}).transpose(1, 2).contiguous();  // [tiles, K, 16]
}

at::Tensor linear_repack_pairs(const at::Tensor& weight) {
#if defined(__AVX512F__)
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "linear_repack_pairs: weight must be bfloat16 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1), tiles = (n + kCols - 1) / kCols, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({tiles * kCols, 2 * pairs}, weight.options());
  padded.slice(0, 0, n).slice(1, 0, k).copy_(weight);
  return padded.view({tiles, kCols, pairs, 2}).transpose(1, 2).contiguous();  // [tiles, K/2, 16, 2]
#else
  TORCH_CHECK(false, "linear_repack_pairs: this build has no bfloat16 dot products (AVX-512 BF16)");
#endif
}

struct Problem {
  const float* x;         // [m, k] float32 (the FMA chain)
  const uint32_t* pairs;  // [m, k / 2] pairs of bfloat16 (the dot-product chain; k even)
  int64_t m, k, n;
  const float* bias;  // [n] or null
};

// A register tile's outputs: + bias, rounded once to the output's dtype.
template <int R, int C>
void store_tile(const Problem& p, F16 (&acc)[R][C], int64_t first_tile, int64_t r0, at::BFloat16* out_bf16,
                float* out_f32) {
  alignas(64) float v[kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      loom::simd::store(v, acc[r][c]);
      const int64_t col0 = (first_tile + c) * kCols, count = std::min<int64_t>(kCols, p.n - col0);
      for (int64_t j = 0; j < count; ++j) {
        const float y = p.bias ? v[j] + p.bias[col0 + j] : v[j];
        if (out_bf16) out_bf16[(r0 + r) * p.n + col0 + j] = static_cast<at::BFloat16>(y);
        else out_f32[(r0 + r) * p.n + col0 + j] = y;
      }
    }
}

template <typename TW>
struct FmaTiles {
  using W = TW;
  template <int R, int C>
  static void run(const Problem& p, const TW* w, int64_t first_tile, int64_t r0, at::BFloat16* ob, float* of) {
    F16 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = loom::simd::zero();
    const TW* tile = w + first_tile * p.k * kCols;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      F16 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = loom::simd::load(tile + (c * p.k + kk) * kCols);
      for (int r = 0; r < R; ++r) {
        const F16 xb = loom::simd::set1(p.x[(r0 + r) * p.k + kk]);
        for (int c = 0; c < C; ++c) acc[r][c] = loom::simd::fma(xb, wv[c], acc[r][c]);
      }
    }
    store_tile<R, C>(p, acc, first_tile, r0, ob, of);
  }
};

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
struct PairTiles {
  using W = uint32_t;
  template <int R, int C>
  static void run(const Problem& p, const uint32_t* w, int64_t first_tile, int64_t r0, at::BFloat16* ob, float* of) {
    const int64_t pairs = p.k / 2;
    F16 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = loom::simd::zero();
    const uint32_t* tile = w + first_tile * pairs * kCols;
    for (int64_t i = 0; i < pairs; ++i) {
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + (c * pairs + i) * kCols));
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(p.pairs[(r0 + r) * pairs + i])));
        for (int c = 0; c < C; ++c) acc[r][c].v = _mm512_dpbf16_ps(acc[r][c].v, xb, wv[c]);
      }
    }
    store_tile<R, C>(p, acc, first_tile, r0, ob, of);
  }
};
#pragma GCC pop_options
#endif

// Fewer rows or tiles at the edges: smaller register tiles, the same per-output arithmetic.
template <typename Tiles, int R = kRows, int C = kTileCols>
void run_edge(const Problem& p, const typename Tiles::W* w, int64_t first_tile, int64_t r0, int rows, int cols,
              at::BFloat16* ob, float* of) {
  if constexpr (R > 1) {
    if (rows < R) return run_edge<Tiles, R - 1, C>(p, w, first_tile, r0, rows, cols, ob, of);
  }
  if constexpr (C > 1) {
    if (cols < C) return run_edge<Tiles, R, C - 1>(p, w, first_tile, r0, rows, cols, ob, of);
  }
  Tiles::template run<R, C>(p, w, first_tile, r0, ob, of);
}

template <typename Tiles>
void matmul(const Problem& p, const typename Tiles::W* w, int64_t tiles, at::BFloat16* ob, float* of) {
  const int64_t groups = (tiles + kTileCols - 1) / kTileCols;
  loom::parallel_column_groups(groups, p.m >= kRowChunk, [&](int64_t first, int64_t last) {
    for (int64_t chunk = 0; chunk < p.m; chunk += kRowChunk)
      for (int64_t g = first; g < last; ++g) {
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, tiles - g * kTileCols));
        for (int64_t r0 = chunk; r0 < std::min(p.m, chunk + kRowChunk); r0 += kRows)
          run_edge<Tiles>(p, w, g * kTileCols, r0, static_cast<int>(std::min<int64_t>(kRows, p.m - r0)), cols, ob, of);
      }
  });
}

// x [m, k] bfloat16 as pairs of k (a zero after an odd k's last element).
at::Tensor x_pairs(const at::Tensor& x2d, int64_t pairs) {
  TORCH_CHECK(x2d.scalar_type() == at::kBFloat16, "linear: a weight packed in pairs takes bfloat16 x");
  if (x2d.size(1) == 2 * pairs) return x2d.contiguous();
  at::Tensor padded = at::zeros({x2d.size(0), 2 * pairs}, x2d.options());
  padded.slice(1, 0, x2d.size(1)).copy_(x2d);
  return padded;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear: bfloat16 or float32 x");
  const bool in_pairs = packed.dim() == 4;  // linear_repack_pairs
  TORCH_CHECK((packed.dim() == 3 || (in_pairs && packed.size(3) == 2)) && packed.size(2) == kCols && packed.is_contiguous(),
              "linear: packed [tiles, K, 16] or [tiles, K/2, 16, 2]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat, "linear: bfloat16 or float32 weight");
  const int64_t k = x.size(-1), tiles = packed.size(0);
  TORCH_CHECK((in_pairs ? packed.size(1) == (k + 1) / 2 : packed.size(1) == k) && out_features <= tiles * kCols &&
              out_features > (tiles - 1) * kCols, "linear: shapes do not match the packed weight");
  const at::Tensor xp = in_pairs ? x_pairs(x.reshape({-1, k}), packed.size(1)) : at::Tensor();
  const at::Tensor xf = in_pairs ? at::Tensor() : x.reshape({-1, k}).to(at::kFloat).contiguous();  // exact
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, x.options());
  at::Tensor bias_f;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "linear: bias must have out_features elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (out.numel() == 0) return out;
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::BFloat16* ob = x.scalar_type() == at::kBFloat16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* of = ob ? nullptr : out.data_ptr<float>();
  if (in_pairs) {
#if defined(__AVX512F__)
    const Problem p{nullptr, reinterpret_cast<const uint32_t*>(xp.data_ptr<at::BFloat16>()), xp.size(0), xp.size(1),
                    out_features, bias_ptr};
    matmul<PairTiles>(p, reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), tiles, ob, of);
#else
    TORCH_CHECK(false, "linear: this build has no bfloat16 dot products (AVX-512 BF16)");
#endif
    return out;
  }
  const Problem p{xf.data_ptr<float>(), nullptr, xf.size(0), k, out_features, bias_ptr};
  if (packed.scalar_type() == at::kBFloat16) matmul<FmaTiles<at::BFloat16>>(p, packed.data_ptr<at::BFloat16>(), tiles, ob, of);
  else matmul<FmaTiles<float>>(p, packed.data_ptr<float>(), tiles, ob, of);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("linear_repack(Tensor weight) -> Tensor");
  m.def("linear_repack_pairs(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) {
  m.impl("linear_repack", &linear_repack);
  m.impl("linear_repack_pairs", &linear_repack_pairs);
  m.impl("linear", &linear);
}
