// One task of the paged-attention kernel (attention.cpp): up to kMaxRows query rows of one
// (sequence, kv head) against that sequence's keys, read in place through its block table.
// A SIMD path (simd.h: AVX-512 or AVX2) for head_dim 32, 64, 96, 128 and 256, rows held in
// registers; a scalar path for other head sizes.
// Both visit keys in blocks of kKeyBlock on a grid fixed from key 0, starting with the block that
// holds the row's first visible key (a sliding window's start), and update each row from its own
// values only. Keys before the task's first visible key are never read: a sliding-window layer's
// blocks out of every window may already hold another sequence's KV.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "simd.h"

namespace loom::attention {

constexpr int kKeyBlock = 16;  // keys per online-softmax step: one simd::F16 of scores
constexpr int kMaxRows = 6;    // query rows per task: 6 x 4 float32 accumulators fit the registers

struct Geometry {
  int64_t num_heads, kv_heads, head_dim, group, block_size, max_blocks;
  int64_t v_offset;  // elements from a key to its value (kv_layer's first stride)
  int64_t q_stride;  // elements from a token's queries to the next token's (q may be a slice of qkv)
  float scale;
  int64_t window;        // keys a query sees, itself included; 0: every earlier key
  float softcap;         // scores become softcap * tanh(score / softcap); 0: no capping
  const float* sinks;    // [num_heads] logits that join each softmax (gpt-oss), or nullptr
};

struct Task {
  int64_t seq, kv_head, first_row, rows;
  int64_t keys;       // keys its last row sees
  int64_t first_key;  // the first key its first row sees
};

// The first key a query at position `limit - 1` sees.
inline int64_t first_visible(const Geometry& g, int64_t limit) {
  return g.window > 0 ? std::max<int64_t>(0, limit - g.window) : 0;
}

inline float cap_score(float score, float softcap) { return softcap * std::tanh(score / softcap); }

template <typename T>
struct TaskView {
  const T* q;
  const T* kv;
  T* out;
  const int32_t* table;  // this sequence's block table
  int64_t query_start, num_cached;

  const T* key(const Geometry& g, int64_t kv_head, int64_t j) const {
    const int64_t slot = static_cast<int64_t>(table[j / g.block_size]) * g.block_size + j % g.block_size;
    return kv + (slot * g.kv_heads + kv_head) * g.head_dim;
  }
  // Calls f(j, key) for keys first..first+count-1 (their values are at + v_offset), walking the
  // block table once.
  template <typename F>
  void each_key(const Geometry& g, int64_t kv_head, int64_t first, int count, F f) const {
    int64_t block = first / g.block_size, offset = first % g.block_size;
    for (int j = 0; j < count; ++j) {
      f(j, kv + ((static_cast<int64_t>(table[block]) * g.block_size + offset) * g.kv_heads + kv_head) * g.head_dim);
      if (++offset == g.block_size) {
        offset = 0;
        ++block;
      }
    }
  }
  void keys(const Geometry& g, int64_t kv_head, int64_t first, int count, const T** out) const {
    each_key(g, kv_head, first, count, [out](int j, const T* key) { out[j] = key; });
  }
  // Starts loading keys first..first+count-1 and their values into L2 (prefetcht1): a block's
  // keys lie on pages scattered by the block table, which the hardware prefetchers do not
  // follow, and in decode K/V stream from memory. (Prefetched into L1, it measured no faster.)
  void prefetch(const Geometry& g, int64_t kv_head, int64_t first, int count) const {
    const int64_t bytes = g.head_dim * static_cast<int64_t>(sizeof(T)), v_offset = g.v_offset;
    each_key(g, kv_head, first, count, [bytes, v_offset](int, const T* key) {
      for (int64_t line = 0; line < bytes; line += 64) {
        simd::prefetch_l2(reinterpret_cast<const char*>(key) + line);
        simd::prefetch_l2(reinterpret_cast<const char*>(key + v_offset) + line);
      }
    });
  }
  // Offsets of a task row (token * group + g) in q and in out (contiguous [tokens, heads, head_dim]).
  int64_t q_offset(const Geometry& g, int64_t kv_head, int64_t row) const {
    return (query_start + row / g.group) * g.q_stride + head(g, kv_head, row) * g.head_dim;
  }
  int64_t out_offset(const Geometry& g, int64_t kv_head, int64_t row) const {
    return ((query_start + row / g.group) * g.num_heads + head(g, kv_head, row)) * g.head_dim;
  }
  int64_t row_limit(const Geometry& g, int64_t row) const { return num_cached + row / g.group + 1; }
  int64_t row_first(const Geometry& g, int64_t row) const { return first_visible(g, row_limit(g, row)); }
  int64_t head(const Geometry& g, int64_t kv_head, int64_t row) const { return kv_head * g.group + row % g.group; }
};

// A sink joins the softmax as one more logit with no value: the weights of the keys shrink.
inline void add_sink(float sink, float& m, float& l, float& rescale) {
  const float m_new = std::max(m, sink);
  rescale = simd::exp1(m - m_new);
  l = std::fma(l, rescale, simd::exp1(sink - m_new));
  m = m_new;
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = loom::from_float<T>(src[i]);
}

// ---- scalar path: any head_dim, any CPU ------------------------------------------------------

template <typename T>
void attend_scalar(const TaskView<T>& v, const Geometry& g, const Task& task) {
  const int64_t hd = g.head_dim;
  for (int64_t i = 0; i < task.rows; ++i) {
    const int64_t row = task.first_row + i, limit = v.row_limit(g, row), first = v.row_first(g, row);
    const T* qrow = v.q + v.q_offset(g, task.kv_head, row);
    std::vector<float> q(hd), acc(hd, 0.0f);
    for (int64_t d = 0; d < hd; ++d) q[d] = loom::to_float(qrow[d]) * g.scale;
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    for (int64_t b = first / kKeyBlock * kKeyBlock; b < limit; b += kKeyBlock) {
      const int64_t lo = std::max(b, first), hi = std::min<int64_t>(b + kKeyBlock, limit);
      float s[kKeyBlock], block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < hi; ++j) {
        const T* k = v.key(g, task.kv_head, j);
        float lanes[loom::kLanes] = {0};
        for (int64_t d = 0; d < hd; ++d) lanes[d % loom::kLanes] = std::fma(q[d], loom::to_float(k[d]), lanes[d % loom::kLanes]);
        float score = loom::sum_lanes(lanes);
        if (g.softcap > 0.0f) score = cap_score(score, g.softcap);
        s[j - b] = score;
        block_max = std::max(block_max, score);
      }
      const float m_new = std::max(m, block_max);
      const float alpha = std::isinf(m) ? 0.0f : std::exp(m - m_new);
      float p_sum = 0.0f;
      for (int64_t j = lo; j < hi; ++j) p_sum += (s[j - b] = std::exp(s[j - b] - m_new));
      l = std::fma(l, alpha, p_sum);
      for (int64_t d = 0; d < hd; ++d) acc[d] *= alpha;
      for (int64_t j = lo; j < hi; ++j) {
        const T* val = v.key(g, task.kv_head, j) + g.v_offset;
        for (int64_t d = 0; d < hd; ++d) acc[d] = std::fma(s[j - b], loom::to_float(val[d]), acc[d]);
      }
      m = m_new;
    }
    if (g.sinks != nullptr) {
      float rescale = 1.0f;
      add_sink(g.sinks[v.head(g, task.kv_head, row)], m, l, rescale);
      for (int64_t d = 0; d < hd; ++d) acc[d] *= rescale;
    }
    for (int64_t d = 0; d < hd; ++d) acc[d] /= l;
    store_row(v.out + v.out_offset(g, task.kv_head, row), acc.data(), hd);
  }
}

// ---- SIMD path: head_dim = 16 * D, R rows in registers -----------------------------------------

// Scores capped lane by lane (Gemma 2); std::tanh is the same code in every ISA's build.
inline simd::F16 cap_scores(simd::F16 scores, float softcap) {
  alignas(64) float lanes[kKeyBlock];
  simd::store(lanes, scores);
  for (int j = 0; j < kKeyBlock; ++j) lanes[j] = cap_score(lanes[j], softcap);
  return simd::load(lanes);
}

// The online-softmax step of a block's rows over their visible keys [lo[r], hi[r]): scores in,
// probabilities out (0 where not visible). A row that sees none of the block's keys adds exact
// zeros. The rescale factors of all rows come from one vector exp, lane r each (simd::exp is
// lane-wise: the same value as exp1 of that lane alone).
template <int R, int D>
inline void softmax_step(const simd::F16 (&scores)[R], const int (&lo)[R], const int (&hi)[R], float (&m)[R],
                         float (&l)[R], float (&p)[R][kKeyBlock], simd::F16 (&acc)[R][D]) {
  alignas(64) float shift[16] = {0.0f};
  float m_new[R];
  for (int r = 0; r < R; ++r) {
    if (lo[r] >= hi[r]) continue;
    m_new[r] = std::max(m[r], simd::max_range(scores[r], lo[r], hi[r]));
    shift[r] = std::isinf(m[r]) ? 0.0f : m[r] - m_new[r];
  }
  alignas(64) float alpha[16];
  simd::store(alpha, simd::exp(simd::load(shift)));
  for (int r = 0; r < R; ++r) {
    if (lo[r] >= hi[r]) {
      simd::store(p[r], simd::zero());
      continue;
    }
    const float a = std::isinf(m[r]) ? 0.0f : alpha[r];
    const simd::F16 probs = simd::keep_range(simd::exp(simd::sub(scores[r], simd::set1(m_new[r]))), lo[r], hi[r]);
    l[r] = std::fma(l[r], a, simd::sum(probs));
    simd::store(p[r], probs);
    const simd::F16 av = simd::set1(a);
    for (int d = 0; d < D; ++d) acc[r][d] = simd::mul(acc[r][d], av);
    m[r] = m_new[r];
  }
}

// A head's 16 * D elements as D vectors, 32 at a time by simd::load_pairs: for bfloat16 the even
// then the odd elements of each 32, for float32 their order. Dot products and P.V run in this
// order; store_slots puts a row back in element order.
template <typename T, int D>
inline void load_slots(const T* src, simd::F16 (&v)[D]) {
  static_assert(D % 2 == 0, "head_dim is a multiple of 32");
#pragma GCC unroll 8
  for (int d = 0; d < D; d += 2) simd::load_pairs(src + 16 * d, v[d], v[d + 1]);
}

template <typename T, int D>
inline void store_slots(T* dst, const simd::F16 (&v)[D]) {
  alignas(64) float row[16 * D];
  for (int d = 0; d < D; ++d) simd::store(row + 16 * d, v[d]);
  if constexpr (std::is_same_v<T, float>) {
    store_row(dst, row, 16 * D);
  } else {
    alignas(64) float ordered[16 * D];
    for (int d = 0; d < D; d += 2)
      for (int i = 0; i < 16; ++i) {
        ordered[16 * d + 2 * i] = row[16 * d + i];
        ordered[16 * d + 2 * i + 1] = row[16 * (d + 1) + i];
      }
    store_row(dst, ordered, 16 * D);
  }
}

// One key's score partials for every row (16 lanes each, summed by simd::reduce16_halves): a
// fixed chain of D FMAs per row; zeros for a key that is not read (nullptr).
template <typename T, int D, int R>
inline void key_scores(const T* key, const float (&q)[R][16 * D], simd::F16 (&s)[R]) {
  if (key == nullptr) {
    for (int r = 0; r < R; ++r) s[r] = simd::zero();
    return;
  }
  simd::F16 k[D];
  load_slots<T, D>(key, k);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    simd::F16 score = simd::mul(simd::load(q[r]), k[0]);
#pragma GCC unroll 8
    for (int d = 1; d < D; ++d) score = simd::fma(simd::load(q[r] + 16 * d), k[d], score);
    s[r] = score;
  }
}

// P.V of a block: keys in ascending order, one FMA per (row, key, 16 dims). The accumulators run
// in a local copy: acc itself is memory that the loads of p might alias (vector types may alias
// any), and GCC would store every accumulator back after each key.
#if defined(__AVX512F__)
template <typename T, int D, int R>
inline void accumulate_values(const T* const* key_at, int j0, int nk, int64_t v_offset, const float (&p)[R][kKeyBlock],
                              simd::F16 (&acc)[R][D]) {
  simd::F16 a[R][D];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) a[r][d] = acc[r][d];
  for (int j = j0; j < nk; ++j) {
    simd::F16 val[D];
    load_slots<T, D>(key_at[j] + v_offset, val);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const simd::F16 pj = simd::set1(p[r][j]);
#pragma GCC unroll 8
      for (int d = 0; d < D; ++d) a[r][d] = simd::fma(pj, val[d], a[r][d]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) acc[r][d] = a[r][d];
}
#else
// AVX2 has 16 registers, too few for R x D accumulators of two ymm each: the keys are walked once
// per half of each pair of vectors (2R accumulators, in registers). Each lane still gets one FMA
// per key in ascending order: the same values as the AVX-512 build.
template <typename T, int D, int R>
inline void accumulate_values(const T* const* key_at, int j0, int nk, int64_t v_offset, const float (&p)[R][kKeyBlock],
                              simd::F16 (&acc)[R][D]) {
  for (int d = 0; d < D; d += 2)
    for (int h = 0; h < 2; ++h) {
      __m256 a[R][2];
      for (int r = 0; r < R; ++r) {
        a[r][0] = simd::half(acc[r][d], h);
        a[r][1] = simd::half(acc[r][d + 1], h);
      }
      for (int j = j0; j < nk; ++j) {
        __m256 first, second;
        simd::load_pairs_half(key_at[j] + v_offset + 16 * d, h, first, second);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m256 pj = _mm256_set1_ps(p[r][j]);
          a[r][0] = _mm256_fmadd_ps(pj, first, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(pj, second, a[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        simd::half(acc[r][d], h) = a[r][0];
        simd::half(acc[r][d + 1], h) = a[r][1];
      }
    }
}
#endif

template <typename T, int D, int R>
void attend_simd(const TaskView<T>& v, const Geometry& g, const Task& task) {
  using simd::F16;
  alignas(64) float q[R][16 * D];
  alignas(64) float p[R][kKeyBlock];
  F16 acc[R][D];
  int64_t limit[R], first[R];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = task.first_row + r;
    F16 qv[D];
    load_slots<T, D>(v.q + v.q_offset(g, task.kv_head, row), qv);
    for (int d = 0; d < D; ++d) simd::store(q[r] + 16 * d, simd::mul(qv[d], simd::set1(g.scale)));
    limit[r] = v.row_limit(g, row);
    first[r] = v.row_first(g, row);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    for (int d = 0; d < D; ++d) acc[r][d] = simd::zero();
  }
  const T* key_at[kKeyBlock];
  for (int64_t b = task.first_key / kKeyBlock * kKeyBlock; b < task.keys; b += kKeyBlock) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyBlock, task.keys - b));
    const int j0 = static_cast<int>(std::max<int64_t>(0, task.first_key - b));  // keys before: never read
    v.keys(g, task.kv_head, b, nk, key_at);
    if (b + kKeyBlock < task.keys)  // the next block loads while this one computes
      v.prefetch(g, task.kv_head, b + kKeyBlock, static_cast<int>(std::min<int64_t>(kKeyBlock, task.keys - b - kKeyBlock)));
    // Scores: each (row, key) is a fixed chain of D FMAs, reduced by one fixed tree below whose
    // first level (keys j and j + 8) runs as soon as both are computed. Keys not read score 0.
    F16 half[R][kKeyBlock / 2];
    for (int j = 0; j < kKeyBlock / 2; ++j) {
      F16 low[R], high[R];
      key_scores<T, D, R>(j >= j0 && j < nk ? key_at[j] : nullptr, q, low);
      key_scores<T, D, R>(j + 8 >= j0 && j + 8 < nk ? key_at[j + 8] : nullptr, q, high);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) half[r][j] = simd::fold_pair(low[r], high[r]);
    }
    F16 scores[R];
    int lo[R], hi[R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      lo[r] = static_cast<int>(std::max<int64_t>(first[r] - b, 0));
      hi[r] = static_cast<int>(std::min<int64_t>(limit[r] - b, kKeyBlock));
      if (lo[r] >= hi[r]) continue;
      scores[r] = simd::reduce16_halves(half[r]);
      if (g.softcap > 0.0f) scores[r] = cap_scores(scores[r], g.softcap);
    }
    softmax_step<R, D>(scores, lo, hi, m, l, p, acc);
    accumulate_values<T, D, R>(key_at, j0, nk, g.v_offset, p, acc);
  }
  for (int r = 0; r < R; ++r) {
    if (g.sinks != nullptr) {
      float rescale = 1.0f;
      add_sink(g.sinks[v.head(g, task.kv_head, task.first_row + r)], m[r], l[r], rescale);
      const F16 a = simd::set1(rescale);
      for (int d = 0; d < D; ++d) acc[r][d] = simd::mul(acc[r][d], a);
    }
    const F16 inv = simd::set1(l[r]);
    F16 result[D];
    for (int d = 0; d < D; ++d) result[d] = simd::div(acc[r][d], inv);
    store_slots<T, D>(v.out + v.out_offset(g, task.kv_head, task.first_row + r), result);
  }
}

template <typename T, int D>
void attend_rows(const TaskView<T>& v, const Geometry& g, const Task& task) {
  static_assert(kMaxRows == 6, "one case per row count");
  switch (task.rows) {
    case 1: return attend_simd<T, D, 1>(v, g, task);
    case 2: return attend_simd<T, D, 2>(v, g, task);
    case 3: return attend_simd<T, D, 3>(v, g, task);
    case 4: return attend_simd<T, D, 4>(v, g, task);
    case 5: return attend_simd<T, D, 5>(v, g, task);
    default: return attend_simd<T, D, kMaxRows>(v, g, task);
  }
}

template <typename T>
void attend(const TaskView<T>& v, const Geometry& g, const Task& task) {
  switch (g.head_dim) {  // the head sizes of the model families Loom serves
    case 32: return attend_rows<T, 2>(v, g, task);
    case 64: return attend_rows<T, 4>(v, g, task);
    case 96: return attend_rows<T, 6>(v, g, task);
    case 128: return attend_rows<T, 8>(v, g, task);
    case 256: return attend_rows<T, 16>(v, g, task);
    default: return attend_scalar(v, g, task);
  }
}

}  // namespace loom::attention
