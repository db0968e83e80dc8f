// Weight-only quantized linears: y = x @ W^T with W kept in GGUF's Q4_1 or Q8_0 blocks of 32, or
// Loom's Q8_16 (Q8_0 with a scale per 16 inputs: Q3_K's and Q6_K's) and Q8_M (Q8_0 with a min:
// Q5_1's and Q5_K's unsigned q), run
// llama.cpp's way: each activation row is quantized per block of 32 to int8 (d = amax / 127, round to
// nearest even) and multiplied with exact int8 dot products (qlinear_tiles.h: AVX-512 VNNI or AVX2).
//
// At load the GGUF blocks are repacked into tile-blocks of 16 output columns x 32 inputs (4
// consecutive inputs of one column per int32 lane; the same layout for every ISA); fp16 scales are
// kept as given. Batch invariance: the activation quantization is per row, and every row of
// every tile runs the same arithmetic whatever the row count, so a row's result is bit-identical at
// any batch size. There is one arithmetic for every row count (decode and prefill alike).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "qlinear_tiles.h"

namespace {

using namespace loom::qlinear;
namespace simd = loom::simd;

constexpr int64_t kRowChunk = 64;   // rows whose activations stay cached while the tiles stream by
constexpr int64_t kShareRows = 12;  // a chunk of more rows shares its Q4_1 tiles' split nibbles

enum class Format { kQ4_1, kQ8_0, kQ8_16, kQ8_M };

struct Layout {
  int64_t block_bytes;  // a raw block of 32 inputs, as given
  int64_t tile_bytes;   // a tile-block (qlinear_tiles.h)
  int64_t scale_count;  // fp16 scales per tile-block
};

Layout layout(Format format) {
  if (format == Format::kQ4_1) return {20, kQ4Bytes, 2 * kCols};
  if (format == Format::kQ8_0) return {34, kQ8Bytes, kCols};
  if (format == Format::kQ8_M) return {36, kQ8Bytes, 2 * kCols};  // fp16 d, fp16 m, 32 int8
  return {36, kQ816Bytes, 2 * kCols};                             // Q8_16: fp16 d0, fp16 d1, 32 int8
}

// The format of a packed weight, from its tile-block's bytes and scales.
Format format_of(int64_t tile_bytes, int64_t scale_count) {
  for (Format f : {Format::kQ4_1, Format::kQ8_0, Format::kQ8_16, Format::kQ8_M})
    if (layout(f).tile_bytes == tile_bytes && layout(f).scale_count == scale_count) return f;
  TORCH_CHECK(false, "qlinear: unknown packed tile-block (", tile_bytes, " bytes, ", scale_count, " scales)");
}

// ---------------------------------------------------------------------------- repacking (at load)

// GGUF Q4_1 block: fp16 d, fp16 m, 16 bytes (element j in the low nibble of byte j, j+16 high).
void repack_q4_1_block(const uint8_t* src, int64_t c, uint8_t* tile, at::Half* scales) {
  std::memcpy(&scales[c], src, 2);
  std::memcpy(&scales[kCols + c], src + 2, 2);
  uint8_t q[kBlock];
  for (int j = 0; j < 16; ++j) {
    q[j] = src[4 + j] & 0x0F;
    q[j + 16] = src[4 + j] >> 4;
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i)
      tile[64 * j + 4 * c + i] = static_cast<uint8_t>(q[4 * j + i] | (q[4 * (j + 4) + i] << 4));
}

// An int8 block: kScales fp16 scales, then 32 int8: GGUF's Q8_0 block (one scale, one part), Q8_16's
// (d0, d1: two parts) or Q8_M's (d, m: one part). Per part, -sum(q) (times 128 in the kernel) undoes
// the +128 on the activations.
template <int kParts, int kScales>
void repack_q8_block(const uint8_t* src, int64_t c, uint8_t* tile, at::Half* scales) {
  const uint8_t* q = src + 2 * kScales;
  for (int i = 0; i < kScales; ++i) std::memcpy(&scales[i * kCols + c], src + 2 * i, 2);
  for (int p = 0; p < kParts; ++p) {
    int32_t sum = 0;
    for (int k = p * kBlock / kParts; k < (p + 1) * kBlock / kParts; ++k) {
      tile[64 * (k / 4) + 4 * c + k % 4] = q[k];
      sum += static_cast<int8_t>(q[k]);
    }
    const auto correction = static_cast<int16_t>(-sum);  // |sum| <= 32 * 128
    std::memcpy(tile + 512 + 32 * p + 2 * c, &correction, 2);
  }
}

// raw: uint8 [N, K/32 * block_bytes] as in the GGUF file. Returns (packed [groups, nb, kTiles, bytes],
// scales [groups, nb, kTiles, 32 or 16] fp16); N is padded to a multiple of 16 * kTiles with zero columns.
std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& raw, int64_t in_features, Format format) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), "repack: uint8 [N, bytes]");
  TORCH_CHECK(in_features % kBlock == 0, "repack: in_features must be a multiple of 32");
  const int64_t nb = in_features / kBlock, n = raw.size(0), groups = (n + kTiles * kCols - 1) / (kTiles * kCols);
  const auto [block_bytes, tile_bytes, scale_count] = layout(format);
  TORCH_CHECK(raw.size(1) == nb * block_bytes, "repack: row size does not match in_features");
  auto packed = at::zeros({groups, nb, kTiles, tile_bytes}, raw.options());
  auto scales = at::zeros({groups, nb, kTiles, scale_count}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::Half* sc = scales.data_ptr<at::Half>();
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first * kTiles * kCols; row < std::min(n, last * kTiles * kCols); ++row) {
      const int64_t g = row / (kTiles * kCols), t = row / kCols % kTiles, c = row % kCols;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = src + row * nb * block_bytes + b * block_bytes;
        uint8_t* tile = dst + ((g * nb + b) * kTiles + t) * tile_bytes;
        at::Half* s = sc + ((g * nb + b) * kTiles + t) * scale_count;
        if (format == Format::kQ4_1) repack_q4_1_block(block, c, tile, s);
        else if (format == Format::kQ8_0) repack_q8_block<1, 1>(block, c, tile, s);
        else if (format == Format::kQ8_16) repack_q8_block<2, 2>(block, c, tile, s);
        else repack_q8_block<1, 2>(block, c, tile, s);
      }
    }
  });
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor> repack_q4_1(const at::Tensor& raw, int64_t in_features) {
  return repack(raw, in_features, Format::kQ4_1);
}
std::tuple<at::Tensor, at::Tensor> repack_q8_0(const at::Tensor& raw, int64_t in_features) {
  return repack(raw, in_features, Format::kQ8_0);
}
std::tuple<at::Tensor, at::Tensor> repack_q8_16(const at::Tensor& raw, int64_t in_features) {
  return repack(raw, in_features, Format::kQ8_16);
}
std::tuple<at::Tensor, at::Tensor> repack_q8_m(const at::Tensor& raw, int64_t in_features) {
  return repack(raw, in_features, Format::kQ8_M);
}

// ---------------------------------------------------------------------------- activations

// Up to 16 blocks of 32 activations (count of them, from x) -> int8 q as llama.cpp's Q8_0 (d = amax / 127,
// q = round(x / d), ties to even), stored XOR `flip` (0x80: q + 128 as u8, for the int8 formats'
// signed weights); d and s = d * sum(q) per block. The 16 blocks' amax and sum(q) reduce across
// lanes together (one transposing tree, simd::reduce16_halves) rather than one block's lanes at a
// time; a max and an integer sum are exact in any order, and d, 1 / d and s are the same IEEE
// operations per lane as one at a time, so every value is the same as block by block. Where
// count < 16 the last block stands in for the missing ones (computed, not stored).
template <typename T>
void quantize_blocks(const T* x, int64_t count, uint8_t* q, float* d, float* s, uint8_t flip) {
  auto block = [&](int j) { return x + std::min<int64_t>(j, count - 1) * kBlock; };
  auto amax = [](const T* b) { return simd::max(simd::abs(simd::load(b)), simd::abs(simd::load(b + kBlock / 2))); };
  simd::F16 half[8];
  for (int j = 0; j < 8; ++j) half[j] = simd::fold_pair(amax(block(j)), amax(block(j + 8)), simd::MaxLanes{});
  const simd::F16 scale = simd::div(simd::reduce16_halves(half, simd::MaxLanes{}), simd::set1(127.0f));
  alignas(64) float inverse[16];
  simd::store(inverse, simd::where_nonzero(scale, simd::div(simd::set1(1.0f), scale)));
  auto quantize = [&](int j) {  // block j's q; its int32 lanes that sum to sum(q)
    const T* b = block(j);
    const simd::F16 to_q = simd::set1(inverse[j]);
    const auto q0 = to_int(simd::mul(simd::load(b), to_q)), q1 = to_int(simd::mul(simd::load(b + kBlock / 2), to_q));
    if (j < count) store_q8(q + j * kBlock, q0, q1, flip);
    return int_lanes(q0, q1);
  };
  for (int j = 0; j < 8; ++j) half[j] = simd::fold_pair(quantize(j), quantize(j + 8), simd::AddIntLanes{});
  const simd::F16 sums = int_to_float(simd::reduce16_halves(half, simd::AddIntLanes{}));
  alignas(64) float out[2][16];
  simd::store(out[0], scale);
  simd::store(out[1], simd::mul(scale, sums));
  std::memcpy(d, out[0], count * sizeof(float));
  std::memcpy(s, out[1], count * sizeof(float));
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, Format format, uint8_t* q, float* d, float* s) {
  const int64_t nb = k / kBlock;
  const uint8_t flip = format == Format::kQ4_1 ? 0x00 : 0x80;
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t i = first * nb; i < last * nb; i += 16) {  // blocks i.. of the flattened rows
      const int64_t count = std::min<int64_t>(16, last * nb - i);
      quantize_blocks(x + i * kBlock, count, q + i * kBlock, d + i, s + i, flip);
    }
  });
}

// ---------------------------------------------------------------------------- the matmul

template <typename T>
inline void store(T* out, int64_t n_total, int64_t col0, const float* bias, simd::F16 acc) {
  alignas(64) float v[kCols];
  simd::store(v, acc);
  const int64_t count = std::min<int64_t>(kCols, n_total - col0);
  for (int64_t c = 0; c < count; ++c) out[col0 + c] = static_cast<T>(bias ? v[c] + bias[col0 + c] : v[c]);
}

template <typename T, int R, int C>
void run_tile(Format format, const QTiles& w, const QRows& x, int64_t r0, int64_t n, const float* bias, T* out) {
  simd::F16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = simd::zero();
  if (format == Format::kQ4_1) q4_1_tile<R, C>(w, x, r0, acc);
  else if (format == Format::kQ8_0) q8_tile<R, C, 1, false>(w, x, r0, acc);
  else if (format == Format::kQ8_16) q8_tile<R, C, 2, false>(w, x, r0, acc);
  else q8_tile<R, C, 1, true>(w, x, r0, acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + (r0 + r) * n, n, (w.group * kTiles + w.first_tile + c) * kCols, bias, acc[r][c]);
}

// Fewer rows at the end: smaller register tiles, the same per-row arithmetic.
template <typename T, int R = kRows>
void run_rows(Format format, const QTiles& w, const QRows& x, int64_t r0, int rows, int64_t n, const float* bias, T* out) {
  if constexpr (R > 1) {
    if (rows < R) return run_rows<T, R - 1>(format, w, x, r0, rows, n, bias, out);
  }
  run_tile<T, R, kTileCols>(format, w, x, r0, n, bias, out);
}

template <typename T>
void matmul(Format format, const QTiles& w, const QRows& x, int64_t m, int64_t n, int64_t groups, const float* bias, T* out) {
  static_assert(kTiles % kTileCols == 0, "register tiles cover a group's tiles");
  // A thread computes column groups [first, last) whole. Rows go in chunks so that a chunk's
  // activations stay in L2 while the thread's tiles stream by; a group's first row tile
  // prefetches the thread's next group.
  // A chunk of more than kShareRows rows shares what its register tiles would each derive from a
  // Q4_1 tile's packed bytes (share_q4_1_nibbles: the split nibbles, on AVX2); with fewer rows,
  // splitting in registers per tile measured faster (up to 1.17x at 3-6 rows, level at 12).
  auto compute = [&](int64_t first, int64_t last) {
    std::vector<uint8_t> shared;
    for (int64_t chunk = 0; chunk < m; chunk += kRowChunk) {
      const int64_t end = std::min(m, chunk + kRowChunk);
      for (int64_t g = first; g < last; ++g)
        for (int tile = 0; tile < kTiles; tile += kTileCols) {
          QTiles wg = w;
          wg.group = g;
          wg.first_tile = tile;
          if (format == Format::kQ4_1 && end - chunk > kShareRows) share_q4_1_nibbles(wg, shared);
          for (int64_t r0 = chunk; r0 < end; r0 += kRows) {
            wg.prefetch = tile == 0 && r0 == chunk && g + 1 < last;
            run_rows<T>(format, wg, x, r0, static_cast<int>(std::min<int64_t>(kRows, m - r0)), n, bias, out);
          }
        }
    }
  };
  loom::parallel_column_groups(groups, m >= kRowChunk, compute);  // the router shares these cores
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "qlinear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "qlinear: bfloat16 or float32 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTiles && packed.is_contiguous() && scales.is_contiguous(),
              "qlinear: packed [groups, nb, tiles, bytes]");
  const int64_t k = x.size(-1), nb = packed.size(1), groups = packed.size(0);
  TORCH_CHECK(k == nb * kBlock && out_features <= groups * kTiles * kCols, "qlinear: shapes do not match the packed weight");
  TORCH_CHECK(scales.dim() == 4, "qlinear: scales [groups, nb, tiles, count]");
  const Format format = format_of(packed.size(3), scales.size(3));
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  auto out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  auto q = at::empty({m, k}, x2.options().dtype(at::kByte));
  auto d = at::empty({m, nb}, x2.options().dtype(at::kFloat)), s = at::empty_like(d);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x2.data_ptr<float>(), m, k, format, q.data_ptr<uint8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  else
    quantize_rows(x2.data_ptr<at::BFloat16>(), m, k, format, q.data_ptr<uint8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  const QTiles w{packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), nb, 0, 0, false};
  QRows rows{q.data_ptr<uint8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), k, nb};
  std::vector<uint8_t> planes;
  if (format != Format::kQ4_1) split_q8_0_rows(rows, m, planes);
  if (x.scalar_type() == at::kFloat) matmul<float>(format, w, rows, m, out_features, groups, bp, out.data_ptr<float>());
  else matmul<at::BFloat16>(format, w, rows, m, out_features, groups, bp, out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("qlinear_repack_q4_1(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear_repack_q8_0(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear_repack_q8_16(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear_repack_q8_m(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) {
  m.impl("qlinear_repack_q4_1", &repack_q4_1);
  m.impl("qlinear_repack_q8_0", &repack_q8_0);
  m.impl("qlinear_repack_q8_16", &repack_q8_16);
  m.impl("qlinear_repack_q8_m", &repack_q8_m);
  m.impl("qlinear", &qlinear);
}
