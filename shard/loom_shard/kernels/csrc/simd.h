// Sixteen float32 lanes, the unit every Loom kernel computes in, for the ISA this library is
// built for: one zmm register (AVX-512) or two ymm registers (AVX2 + FMA + F16C). Each build of
// the kernels (one per ISA, chosen at run time from cpuid) compiles the same kernel code against
// one of the two. Every operation is lane-wise IEEE arithmetic, and every horizontal reduction
// follows one tree (lane i + lane i+8, then +4, +2, +1: `sum_lanes`), so the two builds compute
// bit-identical results: the ISA changes the speed, never a value.
#pragma once
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"

namespace loom::simd {

// The operations a reduction tree (fold_pair, reduce16_*) combines lanes with: float32 add (the
// default: sums), max, and int32 add. Defined below, on each ISA's Lanes.
struct AddLanes;
struct MaxLanes;
struct AddIntLanes;

#if defined(__AVX512F__)

struct F16 {
  __m512 v;
};

inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load(const c10::BFloat16* p) {  // bfloat16 is the high half of a float32: widen, exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline F16 load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// 32 bfloat16 from p, exact: elements 0, 2, .., 30 in `even` and 1, 3, .., 31 in `odd` (one load,
// then one shift or one mask each: half the work of widening 16 at a time).
inline void load_pairs(const c10::BFloat16* p, F16& even, F16& odd) {
  const __m512i bits = _mm512_loadu_si512(p);
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))};
  odd = {_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
// Rounded to the nearest bfloat16, ties to even, NaN as 0x7FC0: c10::BFloat16's own conversion.
inline void store(c10::BFloat16* p, F16 a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 sub(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a * b + c
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
inline F16 round_even(F16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n in [-126, 127]: 2^n is exact, so this rounds once, like a multiply.
inline F16 scale_pow2(F16 a, F16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// b's lanes where a's lane is not zero (C's `a != 0`: NaN is not zero), 0 elsewhere.
inline F16 where_nonzero(F16 a, F16 b) {
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_NEQ_UQ), b.v)};
}
// Lanes outside [first, last) set to zero (0 <= first <= last <= 16).
inline F16 keep_range(F16 a, int first, int last) {
  const unsigned upto_last = last >= 16 ? 0xFFFFu : (1u << last) - 1;
  return {_mm512_maskz_mov_ps(__mmask16(upto_last & ~((1u << first) - 1)), a.v)};
}

// One register of lanes, and the lane-wise operations a reduction tree combines them with (the
// shuffles only move bits: an int32 add works on lanes that hold int32 bits).
using Lanes = __m512;
inline Lanes add_lanes(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline Lanes max_lanes(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
inline Lanes add_int_lanes(Lanes a, Lanes b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

// The reduction tree's first level for two vectors: [a's lanes i op i+8 | b's lanes i op i+8].
template <typename Op = AddLanes>
inline F16 fold_pair(F16 a, F16 b, Op op = {}) {
  return {op(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE))};
}

// The 16 horizontal reductions of v[0..15] from half[i] = fold_pair(v[i], v[i + 8]), in the
// tree's own lane order (see reduce16_halves below).
template <typename Op = AddLanes>
inline F16 reduce16_folded(const F16* half, Op op = {}) {
  auto fold128 = [op](__m512 x, __m512 y) {  // 128-bit lane pairs of two fold_pair results
    return op(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  auto fold64 = [op](__m512 x, __m512 y) { return op(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE)); };
  auto fold32 = [op](__m512 x, __m512 y) { return op(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD)); };
  __m512 b[4], c[2];
  for (int i = 0; i < 4; ++i) b[i] = fold128(half[i].v, half[i + 4].v);
  for (int i = 0; i < 2; ++i) c[i] = fold64(b[i], b[i + 2]);
  return {fold32(c[0], c[1])};
}

// Lane k of the result = lane order[k] of a.
inline F16 permute(F16 a, const int* order) {
  return {_mm512_permutexvar_ps(_mm512_loadu_si512(order), a.v)};
}

inline __m256 fold_halves(F16 a) { return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)); }

// The first lane of a that equals x or is NaN (torch.argmax's winner); 16 if none.
inline int first_max_lane(F16 a, float x) {
  const __mmask16 hit = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_EQ_OQ) | _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return hit ? __builtin_ctz(hit) : 16;
}
inline float max_range(F16 a, int first, int last) {  // max of lanes first..last-1 (first < last): exact
  const unsigned upto_last = last >= 16 ? 0xFFFFu : (1u << last) - 1;
  return _mm512_mask_reduce_max_ps(__mmask16(upto_last & ~((1u << first) - 1)), a.v);
}

#else  // AVX2 + FMA + F16C

struct F16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};

inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline F16 load(const c10::BFloat16* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F16 load(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void load_pairs(const c10::BFloat16* p, F16& even, F16& odd) {  // as on AVX-512
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, high_half)), _mm256_castsi256_ps(_mm256_and_si256(hi, high_half))};
}
// Half `h` (0: lanes 0..7, 1: lanes 8..15) of what load_pairs gives for the same 32 elements:
// one ymm of each of the two vectors.
inline void load_pairs_half(const c10::BFloat16* p, int h, __m256& even, __m256& odd) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void load_pairs_half(const float* p, int h, __m256& first, __m256& second) {
  first = _mm256_loadu_ps(p + 8 * h);
  second = _mm256_loadu_ps(p + 16 + 8 * h);
}
inline __m256& half(F16& a, int h) { return h == 0 ? a.lo : a.hi; }
inline void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline __m128i narrow_bf16(__m256 a) {  // 8 floats to bfloat16 as c10::BFloat16 rounds them
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));  // each < 2^16
}
inline void store(c10::BFloat16* p, F16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(a.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), narrow_bf16(a.hi));
}
#define LOOM_F16_BINARY(name, op) \
  inline F16 name(F16 a, F16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
LOOM_F16_BINARY(add, _mm256_add_ps)
LOOM_F16_BINARY(sub, _mm256_sub_ps)
LOOM_F16_BINARY(mul, _mm256_mul_ps)
LOOM_F16_BINARY(div, _mm256_div_ps)
LOOM_F16_BINARY(max, _mm256_max_ps)
LOOM_F16_BINARY(min, _mm256_min_ps)
#undef LOOM_F16_BINARY
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 abs(F16 a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline F16 round_even(F16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127], built from its exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F16 scale_pow2(F16 a, F16 n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
inline F16 where_nonzero(F16 a, F16 b) {
  const __m256 zero = _mm256_setzero_ps();
  return {_mm256_and_ps(_mm256_cmp_ps(a.lo, zero, _CMP_NEQ_UQ), b.lo), _mm256_and_ps(_mm256_cmp_ps(a.hi, zero, _CMP_NEQ_UQ), b.hi)};
}
inline F16 keep_range(F16 a, int first, int last) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i index_hi = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  const __m256i lo = _mm256_set1_epi32(first - 1), hi = _mm256_set1_epi32(last);
  const __m256 keep_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, index), _mm256_cmpgt_epi32(index, lo)));
  const __m256 keep_hi =
      _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, index_hi), _mm256_cmpgt_epi32(index_hi, lo)));
  return {_mm256_and_ps(a.lo, keep_lo), _mm256_and_ps(a.hi, keep_hi)};
}

using Lanes = __m256;  // as on AVX-512
inline Lanes add_lanes(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline Lanes max_lanes(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes add_int_lanes(Lanes a, Lanes b) {
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}

template <typename Op = AddLanes>
inline F16 fold_pair(F16 a, F16 b, Op op = {}) { return {op(a.lo, a.hi), op(b.lo, b.hi)}; }  // as on AVX-512

template <typename Op = AddLanes>
inline F16 reduce16_folded(const F16* half, Op op = {}) {
  auto fold128 = [op](__m256 x, __m256 y) {  // [x.lo128 op x.hi128 | y.lo128 op y.hi128]
    return op(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  };
  auto fold64 = [op](__m256 x, __m256 y) { return op(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE)); };
  auto fold32 = [op](__m256 x, __m256 y) { return op(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD)); };
  __m256 b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = fold128(half[i].lo, half[i].hi);
  for (int i = 0; i < 4; ++i) c[i] = fold64(b[i], b[i + 4]);
  return {fold32(c[0], c[2]), fold32(c[1], c[3])};
}

inline __m256 fold_halves(F16 a) { return _mm256_add_ps(a.lo, a.hi); }

// The first lane of a that equals x or is NaN (torch.argmax's winner); 16 if none.
inline int first_max_lane(F16 a, float x) {
  const __m256 m = _mm256_set1_ps(x);
  const auto hits = [m](__m256 h) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(h, m, _CMP_EQ_OQ), _mm256_cmp_ps(h, h, _CMP_UNORD_Q)));
  };
  const int hit = hits(a.lo) | (hits(a.hi) << 8);
  return hit ? __builtin_ctz(hit) : 16;
}
inline float max_range(F16 a, int first, int last) {  // max of lanes first..last-1 (first < last): exact
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto inside = [&](int offset) {  // lanes offset + i within [first, last)
    const __m256i lane = _mm256_add_epi32(index, _mm256_set1_epi32(offset));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(first - 1)),
                                                _mm256_cmpgt_epi32(_mm256_set1_epi32(last), lane)));
  };
  const __m256 neg = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = _mm256_max_ps(_mm256_blendv_ps(neg, a.lo, inside(0)), _mm256_blendv_ps(neg, a.hi, inside(8)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline F16 permute(F16 a, const int* order) {
  auto half = [&](const int* at) {  // 8 lanes, each taken from a.lo or a.hi
    const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256 from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(7)));
    const __m256i lane = _mm256_and_si256(index, _mm256_set1_epi32(7));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, lane), _mm256_permutevar8x32_ps(a.hi, lane), from_hi);
  };
  return {half(order), half(order + 8)};
}

#endif

// ---- written once on the operations above -------------------------------------------------

struct AddLanes {
  Lanes operator()(Lanes a, Lanes b) const { return add_lanes(a, b); }
};
struct MaxLanes {
  Lanes operator()(Lanes a, Lanes b) const { return max_lanes(a, b); }
};
struct AddIntLanes {
  Lanes operator()(Lanes a, Lanes b) const { return add_int_lanes(a, b); }
};

inline float sum(F16 a) {  // the halving tree of sum_lanes: lane i + i+8, then + i+4, + i+2, + i+1
  const __m256 eight = fold_halves(a);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// 32 float32 from p in their order (the float32 twin of the bfloat16 load_pairs).
inline void load_pairs(const float* p, F16& first, F16& second) {
  first = load(p);
  second = load(p + 16);
}

inline float max_first(F16 a, int n) { return max_range(a, 0, n); }  // max of lanes 0..n-1 (n >= 1)

// The 16 horizontal sums of v[0..15], in the tree's own lane order (see reduce16_halves below).
inline F16 reduce16_raw(const F16* v) {
  F16 half[8];
  for (int i = 0; i < 8; ++i) half[i] = fold_pair(v[i], v[i + 8]);
  return reduce16_folded(half);
}

// Where reduce16_raw leaves each vector's sum: found once by reducing vectors filled with their
// index (exact in float32), so the shuffles need no hand-derived table.
inline const int* key_order() {
  static const auto order = [] {
    F16 v[16];
    for (int i = 0; i < 16; ++i) v[i] = set1(static_cast<float>(i));
    alignas(64) float lane[16];
    store(lane, reduce16_raw(v));
    struct Order {
      int at[16];
    } o{};
    for (int i = 0; i < 16; ++i) o.at[static_cast<int>(lane[i]) / 16] = i;
    return o;
  }();
  return order.at;
}

// Lane k = the sum (or the op's reduction) of the 16 lanes of v[k], each by the halving tree,
// from its first level half[i] = fold_pair(v[i], v[i + 8], op). The tree's lane order is the
// same for every op: only its shuffles place the lanes.
template <typename Op = AddLanes>
inline F16 reduce16_halves(const F16* half, Op op = {}) { return permute(reduce16_folded(half, op), key_order()); }

// exp(x) in float32 (Cephes' polynomial, about 1 ulp); exp(0) is exactly 1.
inline F16 exp(F16 x) {
  x = min(max(x, set1(-87.3f)), set1(88.3f));
  const F16 n = round_even(mul(x, set1(1.44269504088896341f)));
  F16 r = fnma(n, set1(0.693359375f), x);
  r = fnma(n, set1(-2.12194440e-4f), r);
  F16 y = set1(1.9875691500e-4f);
  y = fma(y, r, set1(1.3981999507e-3f));
  y = fma(y, r, set1(8.3334519073e-3f));
  y = fma(y, r, set1(4.1665795894e-2f));
  y = fma(y, r, set1(1.6666665459e-1f));
  y = fma(y, r, set1(5.0000001201e-1f));
  y = fma(y, mul(r, r), add(r, set1(1.0f)));
  return scale_pow2(y, n);
}

// Starts loading the cache line at p into L2 (prefetcht1). Volatile asm: GCC deletes a loop of
// __builtin_prefetch calls and nothing else as a loop without side effects.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

inline float exp1(float x) {
  alignas(64) float lanes[16];
  store(lanes, exp(set1(x)));
  return lanes[0];
}

}  // namespace loom::simd
