// The previous dpbf16 kernel, kept as `loom::qlinear_bf16` only so that bench/bench_qlinear.py can
// compare it with the VNNI int8 kernel (qlinear.cpp) in one process; the model does not use it.
// Weight-only quantized linears: y = x @ W^T with W kept in GGUF's Q4_1 or Q8_0 blocks of 32.
//
// At load the GGUF blocks are repacked into tiles of 16 output columns x one block of 32 inputs, laid
// out for AVX-512 BF16 `dpbf16_ps`: pair p of a tile holds (column c, inputs 2p and 2p+1) in lane c.
// Q4_1 nibbles become bf16 by OR-ing them into the bits of 128.0 (128 + q is exact in bf16), so the
// dot products run on exact integers and the block's scale d and offset m are applied once per block
// in float32: sum_k x_k (d q_k + m) = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k.
// Every output element is reduced block by block in the same order whatever the number of rows:
// rows are tiled up to kRows at a time, but each row keeps its own accumulators and sees the same
// sequence of instructions, so a row's result is bit-identical at any batch size (issue 14).
// float32 activations are split into a bf16 high part and a bf16 remainder (x = hi + lo to ~16 bits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kBlock = 32;      // inputs per quantization block (GGUF)
constexpr int64_t kCols = 16;       // output columns per tile: one zmm of float32 accumulators
constexpr int kRows = 16;           // rows sharing one dequantized weight vector
constexpr int64_t kRowChunk = 64;   // rows whose activations stay cached while the tiles stream by
constexpr int64_t kQ4Bytes = 256;   // packed nibbles of one tile-block (16 cols x 32 inputs / 2)
constexpr int64_t kQ8Bytes = 512;   // packed int8 of one tile-block

enum class Format { kQ4_1, kQ8_0 };

// ---------------------------------------------------------------------------- repacking (at load)

// GGUF Q4_1 block: fp16 d, fp16 m, 16 bytes (element j in the low nibble of byte j, j+16 high).
// Packed tile-block: 8 chunks of 32 bytes; byte 2c+s of chunk j holds (col c, input 2j+s) in its
// low nibble and (col c, input 2(j+8)+s) in its high nibble. Scales: d[16] then m[16], fp16.
void repack_q4_1_block(const uint8_t* src, int64_t c, uint8_t* tile, at::Half* scales) {
  std::memcpy(&scales[c], src, 2);
  std::memcpy(&scales[kCols + c], src + 2, 2);
  uint8_t q[kBlock];
  for (int j = 0; j < 16; ++j) {
    q[j] = src[4 + j] & 0x0F;
    q[j + 16] = src[4 + j] >> 4;
  }
  for (int j = 0; j < 8; ++j)
    for (int s = 0; s < 2; ++s)
      tile[j * 32 + 2 * c + s] = static_cast<uint8_t>(q[2 * j + s] | (q[2 * (j + 8) + s] << 4));
}

// GGUF Q8_0 block: fp16 d, 32 int8. Packed tile-block: 16 pairs of 32 bytes (byte 2c+s of pair p is
// col c, input 2p+s). Scales: d[16], fp16.
void repack_q8_0_block(const uint8_t* src, int64_t c, uint8_t* tile, at::Half* scales) {
  std::memcpy(&scales[c], src, 2);
  for (int p = 0; p < 16; ++p)
    for (int s = 0; s < 2; ++s) tile[p * 32 + 2 * c + s] = src[2 + 2 * p + s];
}

// raw: uint8 [N, K/32 * block_bytes] as in the GGUF file. Returns (packed, scales); N is padded to
// a multiple of 16 with zero columns.
std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& raw, int64_t in_features, Format format) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), "repack: uint8 [N, bytes]");
  TORCH_CHECK(in_features % kBlock == 0, "repack: in_features must be a multiple of 32");
  const int64_t nb = in_features / kBlock, n = raw.size(0), tiles = (n + kCols - 1) / kCols;
  const int64_t block_bytes = format == Format::kQ4_1 ? 20 : 34;
  const int64_t tile_bytes = format == Format::kQ4_1 ? kQ4Bytes : kQ8Bytes;
  const int64_t scale_count = format == Format::kQ4_1 ? 2 * kCols : kCols;
  TORCH_CHECK(raw.size(1) == nb * block_bytes, "repack: row size does not match in_features");
  auto packed = at::zeros({tiles, nb, tile_bytes}, raw.options());
  auto scales = at::zeros({tiles, nb, scale_count}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::Half* sc = scales.data_ptr<at::Half>();
  at::parallel_for(0, n, 64, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t t = row / kCols, c = row % kCols;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = src + row * nb * block_bytes + b * block_bytes;
        uint8_t* tile = dst + (t * nb + b) * tile_bytes;
        at::Half* s = sc + (t * nb + b) * scale_count;
        if (format == Format::kQ4_1) repack_q4_1_block(block, c, tile, s);
        else repack_q8_0_block(block, c, tile, s);
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

// ---------------------------------------------------------------------------- the matmul

// The activations of up to kRows rows as bf16 pairs (and their float32 remainders), plus each row's
// per-block sums (float32, summed in index order) for Q4_1's offsets.
struct Rows {
  const uint32_t* hi;   // [rows, K/2] bf16 pairs
  const uint32_t* lo;   // same, the float32 remainder; only read when kSplit
  const float* sums;    // [rows, K/32]
  int64_t pairs;        // K/2
  int64_t nb;           // K/32
};

inline __m512 bcast(const uint32_t* pair) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(*pair))); }

template <int R, bool kSplit>
inline void dot_pair(__m512 (&dot)[R], const Rows& x, int64_t r0, int64_t pair, __m512bh w) {
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * x.pairs + pair;
    dot[r] = _mm512_dpbf16_ps(dot[r], (__m512bh)bcast(x.hi + at), w);
    if constexpr (kSplit) dot[r] = _mm512_dpbf16_ps(dot[r], (__m512bh)bcast(x.lo + at), w);
  }
}

template <int R, bool kSplit>
void tile_q4_1(const uint8_t* q, const at::Half* s, const Rows& x, int64_t r0, __m512 (&acc)[R]) {
  const __m512i low = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);  // bf16 128.0
  const __m512 k128 = _mm512_set1_ps(128.0f);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const uint8_t* qb = q + b * kQ4Bytes;
    for (int j = 0; j < 8; ++j) {
      __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * j)));
      __m512bh w0 = (__m512bh)_mm512_or_si512(_mm512_and_si512(v, low), magic);
      __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), magic);
      dot_pair<R, kSplit>(dot, x, r0, b * 16 + j, w0);
      dot_pair<R, kSplit>(dot, x, r0, b * 16 + j + 8, w1);
    }
    const at::Half* sb = s + b * 2 * kCols;
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kCols)));
    __m512 offset = _mm512_fnmadd_ps(k128, d, m);  // m - 128 d
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, dot[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.sums[(r0 + r) * x.nb + b]), acc[r]);
    }
  }
}

inline __m512bh q8_pair(const uint8_t* p) {
  __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(b, a);  // a fills the low half: lanes 0-7 of the pair
}

template <int R, bool kSplit>
void tile_q8_0(const uint8_t* q, const at::Half* s, const Rows& x, int64_t r0, __m512 (&acc)[R]) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const uint8_t* qb = q + b * kQ8Bytes;
    for (int p = 0; p < 16; ++p) dot_pair<R, kSplit>(dot, x, r0, b * 16 + p, q8_pair(qb + 32 * p));
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b * kCols)));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(d, dot[r], acc[r]);
  }
}

template <typename T>
inline void store(T* out, int64_t n_total, int64_t col0, const float* bias, __m512 acc) {
  alignas(64) float v[kCols];
  _mm512_store_ps(v, acc);
  const int64_t count = std::min<int64_t>(kCols, n_total - col0);
  for (int64_t c = 0; c < count; ++c) out[col0 + c] = static_cast<T>(bias ? v[c] + bias[col0 + c] : v[c]);
}

struct Weights {
  const uint8_t* q;
  const at::Half* scales;
  int64_t tile_bytes;     // per tile-block
  int64_t scale_count;    // per tile-block
  Format format;
};

template <typename T, int R, bool kSplit>
void run_rows(const Weights& w, const Rows& x, int64_t r0, int64_t tile, int64_t n, const float* bias, T* out) {
  __m512 acc[R];
  const uint8_t* q = w.q + tile * x.nb * w.tile_bytes;
  const at::Half* s = w.scales + tile * x.nb * w.scale_count;
  if (w.format == Format::kQ4_1) tile_q4_1<R, kSplit>(q, s, x, r0, acc);
  else tile_q8_0<R, kSplit>(q, s, x, r0, acc);
  for (int r = 0; r < R; ++r) store(out + (r0 + r) * n, n, tile * kCols, bias, acc[r]);
}

template <typename T, bool kSplit, int R = kRows>
void run_tail(const Weights& w, const Rows& x, int64_t r0, int rows, int64_t tile, int64_t n, const float* bias, T* out) {
  if constexpr (R > 1) {
    if (rows < R) return run_tail<T, kSplit, R - 1>(w, x, r0, rows, tile, n, bias, out);
  }
  run_rows<T, R, kSplit>(w, x, r0, tile, n, bias, out);
}

template <typename T, bool kSplit>
void matmul(const Weights& w, const Rows& x, int64_t m, int64_t n, int64_t tiles, const float* bias, T* out) {
  // Parallel over output-column tiles only: a tile's columns are computed whole by one thread.
  // Rows go in chunks so that a chunk's activations stay in L2 while the thread's tiles stream by
  // (a 512-token prefill would otherwise re-read all its activations from L3 for every tile).
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t chunk = 0; chunk < m; chunk += kRowChunk)
      for (int64_t tile = first; tile < last; ++tile)
        for (int64_t r0 = chunk; r0 < std::min(m, chunk + kRowChunk); r0 += kRows)
          run_tail<T, kSplit>(w, x, r0, static_cast<int>(std::min<int64_t>(kRows, m - r0)), tile, n, bias, out);
  });
}

// x as bf16 pairs (hi, and lo for float32) plus per-block sums, all in a fixed per-row order.
void prepare_rows(const at::Tensor& x2, at::Tensor& hi, at::Tensor& lo, at::Tensor& sums) {
  const int64_t m = x2.size(0), k = x2.size(1), nb = k / kBlock;
  sums = at::empty({m, nb}, x2.options().dtype(at::kFloat));
  float* sp = sums.data_ptr<float>();
  const bool is_float = x2.scalar_type() == at::kFloat;
  hi = is_float ? at::empty({m, k}, x2.options().dtype(at::kBFloat16)) : x2;
  if (is_float) lo = at::empty({m, k}, x2.options().dtype(at::kBFloat16));
  const float* xf = is_float ? x2.data_ptr<float>() : nullptr;
  const at::BFloat16* xb = is_float ? nullptr : x2.data_ptr<at::BFloat16>();
  at::BFloat16* hp = is_float ? hi.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* lp = is_float ? lo.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        float total = 0.0f;  // in index order: a row's sums do not depend on the other rows
        for (int64_t i = r * k + b * kBlock; i < r * k + (b + 1) * kBlock; ++i) {
          float v = is_float ? xf[i] : static_cast<float>(xb[i]);
          if (is_float) {
            hp[i] = at::BFloat16(v);
            lp[i] = at::BFloat16(v - static_cast<float>(hp[i]));
          }
          total += v;
        }
        sp[r * nb + b] = total;
      }
    }
  });
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "qlinear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "qlinear: bfloat16 or float32 x");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && scales.is_contiguous(), "qlinear: packed [tiles, nb, bytes]");
  const int64_t k = x.size(-1), nb = packed.size(1), tiles = packed.size(0);
  TORCH_CHECK(k == nb * kBlock && out_features <= tiles * kCols, "qlinear: shapes do not match the packed weight");
  const Format format = packed.size(2) == kQ4Bytes ? Format::kQ4_1 : Format::kQ8_0;
  TORCH_CHECK(packed.size(2) == kQ4Bytes || packed.size(2) == kQ8Bytes, "qlinear: unknown packed tile size");
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  auto out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  at::Tensor hi, lo, sums, bias_f;
  prepare_rows(x2, hi, lo, sums);
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  Weights w{packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), packed.size(2), scales.size(2), format};
  Rows rows{reinterpret_cast<const uint32_t*>(hi.data_ptr()), nullptr, sums.data_ptr<float>(), k / 2, nb};
  if (x.scalar_type() == at::kFloat) {
    rows.lo = reinterpret_cast<const uint32_t*>(lo.data_ptr());
    matmul<float, true>(w, rows, m, out_features, tiles, bp, out.data_ptr<float>());
  } else {
    matmul<at::BFloat16, false>(w, rows, m, out_features, tiles, bp, out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("qlinear_bf16_repack_q4_1(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear_bf16_repack_q8_0(Tensor raw, int in_features) -> (Tensor, Tensor)");
  m.def("qlinear_bf16(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("qlinear_bf16_repack_q4_1", &repack_q4_1);
  m.impl("qlinear_bf16_repack_q8_0", &repack_q8_0);
  m.impl("qlinear_bf16", &qlinear);
}
