// AVX-512 building blocks of the paged-attention kernel (attention.cpp): bf16/f32 loads,
// a 16-key transpose-reduce, and a polynomial exp. Each is a fixed sequence of instructions,
// so a value's rounding never depends on what else the kernel computes with it.
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>

#include <array>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace loom::simd {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is the high half of a float32: widen and shift, exact.
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Sums of 256-bit halves: [a.lo + a.hi | b.lo + b.hi] (8 partials of each).
inline __m512 fold256(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

// Per 128-bit lane pairs: [a0+a1 | b0+b1 | c0+c1 | d0+d1] of two fold256 results.
inline __m512 fold128(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// Within each 128-bit lane: [x0+x2, x1+x3, y0+y2, y1+y3].
inline __m512 fold64(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
}

// Within each 128-bit lane: [x0+x1, x2+x3, y0+y1, y2+y3].
inline __m512 fold32(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

// The 16 horizontal sums of v[0..15], in the tree's own lane order (see key_order()).
inline __m512 reduce16_raw(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold256(v[i], v[i + 8]);
  for (int i = 0; i < 4; ++i) b[i] = fold128(a[i], a[i + 4]);
  for (int i = 0; i < 2; ++i) c[i] = fold64(b[i], b[i + 2]);
  return fold32(c[0], c[1]);
}

// Where the tree leaves each vector's sum: found once by reducing vectors filled with their index
// (exact in float32), so the shuffles above need no hand-derived table.
inline __m512i key_order() {
  static const __m512i order = [] {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i));
    alignas(64) float lane[16];
    _mm512_store_ps(lane, reduce16_raw(v));
    alignas(64) int32_t index[16];
    for (int i = 0; i < 16; ++i) index[static_cast<int>(lane[i]) / 16] = i;
    return _mm512_load_si512(index);
  }();
  return order;
}

// Lane k = sum of the 16 lanes of v[k].
inline __m512 reduce16(const __m512* v) { return _mm512_permutexvar_ps(key_order(), reduce16_raw(v)); }

// exp(x) in float32 (Cephes' polynomial, about 1 ulp); exp(0) is exactly 1.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

}  // namespace loom::simd
#endif  // __AVX512F__
