// Register tiles of loom::qlinear: R rows x C column tiles of 16 outputs, exact int8 dot products
// per block of 32, for the ISA this library is built for: AVX-512 VNNI (`dpbusd`) or AVX2
// (`maddubs` + `madd`, exact here: see each tile). Both produce the same int32 dot for every
// (row, column, block), and fold it into a float32 accumulator with the same lane-wise
// instructions (simd.h), so a row's result is bit-identical on either ISA, at any row count and
// in any register tiling.
//
// Activations arrive quantized per row and block of 32 (Q8_0-like: int8 q, float32 d, and for Q4_1
// s = d * sum(q)).
//   Q4_1: weights are the unsigned operand (nibbles 0..15), x the signed one;
//         y += (d_w d_x) * dot + m_w * s_x.
//   Q8_0: weights are signed; x arrives as q + 128 (q XOR 0x80), the unsigned operand, and the dot
//         starts from -128 * sum(q_w), precomputed per column and block at load (AVX2 multiplies
//         the two nibbles of q + 128 apart: see its tile). y += (d_w d_x) * dot.
//   Q8_16: Q8_0 with a weight scale per half block (16 inputs: Q3_K's and Q6_K's): each half's
//         dot as Q8_0's, y += (d_w0 d_x) * dot_0, then y += (d_w1 d_x) * dot_1.
//   Q8_M: Q8_0 with a min per block (Q5_1's and Q5_K's unsigned q): y += (d_w d_x) * dot + m_w * s_x.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace loom::qlinear {

constexpr int64_t kBlock = 32;      // inputs per quantization block (GGUF)
constexpr int64_t kCols = 16;       // output columns per tile: one simd::F16 of float32 lanes
constexpr int64_t kQ4Bytes = 256;   // Q4_1 tile-block: 4 chunks of 64 bytes of nibble pairs
constexpr int64_t kQ8Bytes = 544;   // Q8_0 tile-block: 8 groups of 64 int8, then 16 int16 -sum(q)
constexpr int64_t kQ816Bytes = 576; // Q8_16 tile-block: 8 groups of 64 int8, then 2 x 16 int16 -sum(q)
constexpr int kTiles = 2;           // column tiles per group in the packed layout

// The int8 tile-blocks, Q8_0 and Q8_M (1 part) and Q8_16 (2): kParts weight scales a block of 32 inputs.
template <int kParts>
constexpr int64_t q8_bytes() { return kParts == 1 ? kQ8Bytes : kQ816Bytes; }

// One row chunk's quantized activations: q [rows, K] (int8 for Q4_1, q + 128 as u8 for the int8 formats),
// d and s [rows, K/32].
struct QRows {
  const uint8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t nb;
  const uint8_t* high = nullptr;  // AVX2, the int8 formats: q's high and low nibbles as bytes (split_q8_0_rows)
  const uint8_t* low = nullptr;
};

// Column group `group` of kTiles tiles: tile-blocks [groups, nb, kTiles, bytes], scales [groups, nb,
// kTiles, 16 or 32] (a group's blocks are interleaved so that its weights stream from memory in one
// sequential pass). A register tile covers C of them from `first_tile`.
struct QTiles {
  const uint8_t* q;
  const at::Half* scales;
  int64_t nb;
  int64_t group;
  int first_tile;
  bool prefetch;  // start loading group + 1's weights while this tile computes
  const uint8_t* unpacked = nullptr;  // AVX2, Q4_1: this tile's nibbles as bytes (share_q4_1_nibbles)

  const uint8_t* block(int64_t b, int c, int64_t bytes) const {
    return q + ((group * nb + b) * kTiles + first_tile + c) * bytes;
  }
  const at::Half* scale(int64_t b, int c, int64_t count) const {
    return scales + ((group * nb + b) * kTiles + first_tile + c) * count;
  }
};

// Starts loading block b of the next group's tiles (the thread's next weights) into L2, so that
// streaming the weights from memory overlaps this group's arithmetic.
inline void prefetch_next(const QTiles& w, int64_t b, int64_t bytes, int64_t count) {
  if (!w.prefetch) return;
  const auto* q = reinterpret_cast<const char*>(w.q + ((w.group + 1) * w.nb + b) * kTiles * bytes);
  for (int64_t i = 0; i < kTiles * bytes; i += 64) simd::prefetch_l2(q + i);
  const auto* s = reinterpret_cast<const char*>(w.scales + ((w.group + 1) * w.nb + b) * kTiles * count);
  for (int64_t i = 0; i < kTiles * count * static_cast<int64_t>(sizeof(at::Half)); i += 64) simd::prefetch_l2(s + i);
}

// Folds block b's exact dots into the accumulators: acc = fma(dot, d_w d_x, acc) [+ m_w s_x]. A
// tile-block's scales: kCount fp16 per column tile; d_w is the `part`-th 16 of them (Q8_16's halves).
template <int R, int C, bool kHasMin, int64_t kCount = kHasMin ? 2 * kCols : kCols>
inline void fold_block(const QTiles& w, const QRows& x, int64_t r0, int64_t b, const simd::F16 (&dot)[R][C],
                       simd::F16 (&acc)[R][C], int part = 0) {
  simd::F16 d[C], m[C];
  for (int c = 0; c < C; ++c) {
    const at::Half* s = w.scale(b, c, kCount);
    d[c] = simd::load(s + part * kCols);
    if constexpr (kHasMin) m[c] = simd::load(s + kCols);
  }
  for (int r = 0; r < R; ++r) {
    const simd::F16 dx = simd::set1(x.d[(r0 + r) * x.nb + b]);
    const simd::F16 sx = simd::set1(kHasMin ? x.s[(r0 + r) * x.nb + b] : 0.0f);
    for (int c = 0; c < C; ++c) {
      acc[r][c] = simd::fma(dot[r][c], simd::mul(d[c], dx), acc[r][c]);
      if constexpr (kHasMin) acc[r][c] = simd::fma(m[c], sx, acc[r][c]);
    }
  }
}

#if defined(__AVX512F__)

constexpr int kRows = 4;              // rows per register tile
constexpr int kTileCols = 2;          // column tiles per register tile

// A row chunk's register tiles split Q4_1 nibbles in registers, straight into vpdpbusd: split once
// per chunk and loaded by every tile, as the AVX2 build does (share_q4_1_nibbles), they measured
// no faster here (bench/BENCHMARKS.md).
inline void share_q4_1_nibbles(QTiles&, std::vector<uint8_t>&) {}

// vpdpbusd takes Q8_0's activations whole (the AVX2 build splits them: see its split_q8_0_rows).
inline void split_q8_0_rows(QRows&, int64_t, std::vector<uint8_t>&) {}

inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Q4_1: chunk j (0..3) byte 4c+i holds column c's input 4j+i in its low nibble and 4(j+4)+i in its
// high nibble. Scales per tile-block: d[16] then m[16], fp16.
template <int R, int C>
inline void q4_1_tile(const QTiles& w, const QRows& x, int64_t r0, simd::F16 (&acc)[R][C]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < x.nb; ++b) {
    prefetch_next(w, b, kQ4Bytes, 2 * kCols);
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(w.block(b, c, kQ4Bytes) + 64 * j);
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
    simd::F16 dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dots[r][c] = {_mm512_cvtepi32_ps(dot[r][c])};
    fold_block<R, C, true>(w, x, r0, b, dots, acc);
  }
}

// Q8_0 (kParts 1), Q8_16 (2) and Q8_M (1, kHasMin): group g (0..7) byte 4c+i holds column c's
// input 4g+i; then per part int16[16] = -sum of the column's weights in that part (the part's dot
// starts from 128 times that). Scales per tile-block: d[16] per part, then Q8_M's m[16], fp16. A
// part's dot is folded as soon as it is done.
template <int R, int C, int kParts, bool kHasMin>
inline void q8_tile(const QTiles& w, const QRows& x, int64_t r0, simd::F16 (&acc)[R][C]) {
  static_assert(kParts == 1 || !kHasMin, "a min per block of 32");
  constexpr int64_t bytes = q8_bytes<kParts>(), count = (kParts + kHasMin) * kCols;
  constexpr int groups = 8 / kParts;
  for (int64_t b = 0; b < x.nb; ++b) {
    prefetch_next(w, b, bytes, count);
    for (int p = 0; p < kParts; ++p) {
      __m512i dot[R][C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* sums = w.block(b, c, bytes) + 512 + 32 * p;
        const __m512i start = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums))), 7);
        for (int r = 0; r < R; ++r) dot[r][c] = start;
      }
      for (int g = p * groups; g < (p + 1) * groups; ++g) {
        __m512i wv[C];
        for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w.block(b, c, bytes) + 64 * g);
        for (int r = 0; r < R; ++r) {
          const __m512i xg = bcast4(x.q + (r0 + r) * x.k + b * kBlock + 4 * g);
          for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], xg, wv[c]);
        }
      }
      simd::F16 dots[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dots[r][c] = {_mm512_cvtepi32_ps(dot[r][c])};
      fold_block<R, C, kHasMin, count>(w, x, r0, b, dots, acc, p);
    }
  }
}

// One block of 32 activations as int8 q (32 bytes, XOR flip), from 32 int32 lanes holding them.
inline void store_q8(uint8_t* q, __m512i q0, __m512i q1, uint8_t flip) {
  const __m128i mask = _mm_set1_epi8(static_cast<char>(flip));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_xor_si128(_mm512_cvtepi32_epi8(q0), mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(q1), mask));
}

inline __m512i to_int(simd::F16 a) { return _mm512_cvt_roundps_epi32(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a + b as int32 bits in float32 lanes (reduced with simd::AddIntLanes), and such lanes as floats.
inline simd::F16 int_lanes(__m512i a, __m512i b) { return {_mm512_castsi512_ps(_mm512_add_epi32(a, b))}; }
inline simd::F16 int_to_float(simd::F16 a) { return {_mm512_cvtepi32_ps(_mm512_castps_si512(a.v))}; }

#else  // AVX2

constexpr int kRows = 2;
constexpr int kTileCols = 1;
constexpr int64_t kQ4Unpacked = 512;  // bytes per unpacked tile-block: per chunk j, low then high nibbles

inline __m256i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The low and high nibbles of 32 bytes, as bytes 0..15 (Q4_1 weights, Q8_0 activations).
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }

// One tile's Q4_1 nibbles as bytes (values 0..15) in `buffer`, for every block: chunk j's 64 low
// nibbles, then its 64 high ones; w.unpacked points there. A row chunk's register tiles read them
// instead of each splitting the packed bytes again (the split is about a fifth of a tile's
// integer work).
inline void share_q4_1_nibbles(QTiles& w, std::vector<uint8_t>& buffer) {
  buffer.resize(w.nb * kQ4Unpacked);
  uint8_t* out = buffer.data();
  w.unpacked = out;
  for (int64_t b = 0; b < w.nb; ++b)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(b, 0, kQ4Bytes) + 64 * j + 32 * h));
        uint8_t* o = out + b * kQ4Unpacked + 128 * j + 32 * h;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), low_nibbles(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64), high_nibbles(v));
      }
}

// Q4_1 as on AVX-512. A maddubs lane is at most 2 * 15 * 127 = 3810, so a block's 8 of them add
// up exactly in int16 (30,480 < 32,767) before one widening madd per half. kUnpacked: the nibbles
// come from w.unpacked (one column tile: C == 1) instead of the packed bytes.
template <int R, int C, bool kUnpacked>
inline void q4_1_tile_from(const QTiles& w, const QRows& x, int64_t r0, simd::F16 (&acc)[R][C]) {
  static_assert(!kUnpacked || C == 1, "unpacked nibbles cover one column tile");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < x.nb; ++b) {
    prefetch_next(w, b, kQ4Bytes, 2 * kCols);
    __m256i sum16[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum16[r][c][0] = sum16[r][c][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i lo[C][2], hi[C][2];
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) {
          if constexpr (kUnpacked) {
            const uint8_t* u = w.unpacked + b * kQ4Unpacked + 128 * j + 32 * h;
            lo[c][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
            hi[c][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64));
          } else {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(b, c, kQ4Bytes) + 64 * j + 32 * h));
            lo[c][h] = low_nibbles(v);
            hi[c][h] = high_nibbles(v);
          }
        }
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = x.q + (r0 + r) * x.k + b * kBlock;
        const __m256i xl = bcast4(xr + 4 * j), xh = bcast4(xr + 4 * (j + 4));
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h) {
            sum16[r][c][h] = _mm256_add_epi16(sum16[r][c][h], _mm256_maddubs_epi16(lo[c][h], xl));
            sum16[r][c][h] = _mm256_add_epi16(sum16[r][c][h], _mm256_maddubs_epi16(hi[c][h], xh));
          }
      }
    }
    simd::F16 dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        dots[r][c] = {_mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r][c][0], ones)),
                      _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r][c][1], ones))};
    fold_block<R, C, true>(w, x, r0, b, dots, acc);
  }
}

template <int R, int C>
inline void q4_1_tile(const QTiles& w, const QRows& x, int64_t r0, simd::F16 (&acc)[R][C]) {
  if constexpr (C == 1) {
    if (w.unpacked != nullptr) return q4_1_tile_from<R, C, true>(w, x, r0, acc);
  }
  q4_1_tile_from<R, C, false>(w, x, r0, acc);
}

// Q8_0 activations (q + 128, 0..255) as two byte planes, their high and low nibbles (0..15), for
// the m rows of x: maddubs multiplies an unsigned nibble by a signed weight exactly, while q + 128
// whole would overflow its int16 pairs. Split once per call; every column tile reads them.
inline void split_q8_0_rows(QRows& x, int64_t m, std::vector<uint8_t>& planes) {
  const int64_t bytes = m * x.k;  // a multiple of 32
  planes.resize(2 * bytes);
  for (int64_t i = 0; i < bytes; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(planes.data() + i), high_nibbles(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(planes.data() + bytes + i), low_nibbles(v));
  }
  x.high = planes.data();
  x.low = planes.data() + bytes;
}

// The int8 formats, per part: dot = -128 sum(w) + 16 dot(high, w) + dot(low, w), with q + 128 =
// 16 high + low. A maddubs lane is at most 2 * 15 * 128 = 3840, so a block's 8 of them add up
// exactly in int16 (30,720) for each nibble before one widening madd: the same int32 dot as
// vpdpbusd's. Layout and folding as on AVX-512.
template <int R, int C, int kParts, bool kHasMin>
inline void q8_tile(const QTiles& w, const QRows& x, int64_t r0, simd::F16 (&acc)[R][C]) {
  static_assert(kParts == 1 || !kHasMin, "a min per block of 32");
  constexpr int64_t bytes = q8_bytes<kParts>(), count = (kParts + kHasMin) * kCols;
  constexpr int groups = 8 / kParts;
  const __m256i sixteen = _mm256_set1_epi16(16), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < x.nb; ++b) {
    prefetch_next(w, b, bytes, count);
    for (int p = 0; p < kParts; ++p) {
      __m256i high[R][C][2], low[R][C][2];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h) high[r][c][h] = low[r][c][h] = _mm256_setzero_si256();
#pragma GCC unroll 8  // the accumulators stay in registers only when the loop unrolls
      for (int g = p * groups; g < (p + 1) * groups; ++g) {
        __m256i wv[C][2];
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < 2; ++h)
            wv[c][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(b, c, bytes) + 64 * g + 32 * h));
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * x.k + b * kBlock + 4 * g;
          const __m256i xh = bcast4(x.high + at), xl = bcast4(x.low + at);
          for (int c = 0; c < C; ++c)
            for (int h = 0; h < 2; ++h) {
              high[r][c][h] = _mm256_add_epi16(high[r][c][h], _mm256_maddubs_epi16(xh, wv[c][h]));
              low[r][c][h] = _mm256_add_epi16(low[r][c][h], _mm256_maddubs_epi16(xl, wv[c][h]));
            }
        }
      }
      __m256i start[C][2];  // -128 sum(w) per column: the part's int16[16] after the tile-block's weights
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h)
          start[c][h] = _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w.block(b, c, bytes) + 512 + 32 * p + 16 * h))), 7);
      simd::F16 dots[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          __m256i dot[2];
          for (int h = 0; h < 2; ++h)
            dot[h] = _mm256_add_epi32(start[c][h], _mm256_add_epi32(_mm256_madd_epi16(high[r][c][h], sixteen),
                                                                    _mm256_madd_epi16(low[r][c][h], ones)));
          dots[r][c] = {_mm256_cvtepi32_ps(dot[0]), _mm256_cvtepi32_ps(dot[1])};
        }
      fold_block<R, C, kHasMin, count>(w, x, r0, b, dots, acc, p);
    }
  }
}

struct Int16 {
  __m256i lo, hi;
};

inline void store_q8(uint8_t* q, Int16 q0, Int16 q1, uint8_t flip) {
  // packs interleave 128-bit lanes; permute4x64(0xD8) puts each result back in element order.
  const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0.lo, q0.hi), 0xD8);  // 16 int16
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q1.lo, q1.hi), 0xD8);
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xD8);       // 32 int8
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(flip))));
}

inline Int16 to_int(simd::F16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }  // MXCSR: nearest even
inline simd::F16 int_lanes(Int16 a, Int16 b) {
  return {_mm256_castsi256_ps(_mm256_add_epi32(a.lo, b.lo)), _mm256_castsi256_ps(_mm256_add_epi32(a.hi, b.hi))};
}
inline simd::F16 int_to_float(simd::F16 a) {
  return {_mm256_cvtepi32_ps(_mm256_castps_si256(a.lo)), _mm256_cvtepi32_ps(_mm256_castps_si256(a.hi))};
}

#endif

}  // namespace loom::qlinear
