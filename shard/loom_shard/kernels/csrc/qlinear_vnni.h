// Register tiles of loom::qlinear: R rows x C column tiles of 16 outputs, AVX-512 VNNI int8 dots.
//
// Activations arrive quantized per row and block of 32 (Q8_0-like: int8 q, float32 d, and for Q4_1
// s = d * sum(q)). Per block, each (row, column) gets an exact int32 dot from `dpbusd` (u8 x s8, 4
// products per lane), folded into a float32 accumulator in the same instruction order for every
// row: the row and column tiling never changes a row's arithmetic (issue 14's batch invariance).
//   Q4_1: weights are the unsigned operand (nibbles 0..15), x the signed one;
//         y += (d_w d_x) * dot + m_w * s_x.
//   Q8_0: weights are signed, so x goes in as the unsigned operand q + 128 (q XOR 0x80) and the dot
//         starts from -128 * sum(q_w), precomputed per column and block at load: exact in int32.
//         y += (d_w d_x) * dot.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace loom::qlinear {

constexpr int64_t kBlock = 32;      // inputs per quantization block (GGUF)
constexpr int64_t kCols = 16;       // output columns per tile: one zmm of int32 / float32 lanes
constexpr int64_t kQ4Bytes = 256;   // Q4_1 tile-block: 4 chunks of 64 bytes of nibble pairs
constexpr int64_t kQ8Bytes = 544;   // Q8_0 tile-block: 8 groups of 64 int8, then 16 int16 -sum(q)

// One row chunk's quantized activations: q [rows, K] (int8 for Q4_1, q + 128 as u8 for Q8_0),
// d and s [rows, K/32].
struct QRows {
  const uint8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t nb;
};

// Column group `group` of C tiles: tile-blocks [groups, nb, C, bytes], scales [groups, nb, C, 16 or 32]
// (a group's blocks are interleaved so that its weights stream from memory in one sequential pass).
struct QTiles {
  const uint8_t* q;
  const at::Half* scales;
  int64_t nb;
  int64_t group;
};

inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q4_1: chunk j (0..3) byte 4c+i holds column c's input 4j+i in its low nibble and 4(j+4)+i in its
// high nibble. Scales per tile-block: d[16] then m[16], fp16.
template <int R, int C>
inline void q4_1_tile(const QTiles& w, const QRows& x, int64_t r0, __m512 (&acc)[R][C]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        __m512i v = _mm512_loadu_si512(w.q + ((w.group * w.nb + b) * C + c) * kQ4Bytes + 64 * j);
        lo[c] = _mm512_and_si512(v, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = x.q + (r0 + r) * x.k + b * kBlock;
        const __m512i xl = bcast4(xr + 4 * j), xh = bcast4(xr + 4 * (j + 4));
        for (int c = 0; c < C; ++c) {
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], xl);
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], xh);
        }
      }
    }
    __m512 d[C], m[C];
    for (int c = 0; c < C; ++c) {
      const at::Half* s = w.scales + ((w.group * w.nb + b) * C + c) * 2 * kCols;
      d[c] = load_half16(s);
      m[c] = load_half16(s + kCols);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * x.nb + b]), sx = _mm512_set1_ps(x.s[(r0 + r) * x.nb + b]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(d[c], dx), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(m[c], sx, acc[r][c]);
      }
    }
  }
}

// Q8_0: group g (0..7) byte 4c+i holds column c's input 4g+i; then int16[16] = -sum of the column's
// 32 weights (the dot starts from 128 times that). Scales per tile-block: d[16], fp16.
template <int R, int C>
inline void q8_0_tile(const QTiles& w, const QRows& x, int64_t r0, __m512 (&acc)[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i dot[R][C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* sums = w.q + ((w.group * w.nb + b) * C + c) * kQ8Bytes + 512;
      const __m512i start = _mm512_slli_epi32(
          _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums))), 7);
      for (int r = 0; r < R; ++r) dot[r][c] = start;
    }
    for (int g = 0; g < 8; ++g) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w.q + ((w.group * w.nb + b) * C + c) * kQ8Bytes + 64 * g);
      for (int r = 0; r < R; ++r) {
        const __m512i xg = bcast4(x.q + (r0 + r) * x.k + b * kBlock + 4 * g);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], xg, wv[c]);
      }
    }
    __m512 d[C];
    for (int c = 0; c < C; ++c) d[c] = load_half16(w.scales + ((w.group * w.nb + b) * C + c) * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * x.nb + b]);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(d[c], dx), acc[r][c]);
    }
  }
}

}  // namespace loom::qlinear
