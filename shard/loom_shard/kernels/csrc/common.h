// Shared helpers of Loom's CPU kernels: float conversions and fixed-order lane sums.
#pragma once
#include <c10/util/BFloat16.h>

namespace loom {

// Reductions accumulate into kLanes float32 partial sums (element i into lane i % kLanes) and
// combine them pairwise in one fixed tree: the order depends only on the reduction's length.
constexpr int kLanes = 16;

inline float sum_lanes(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

}  // namespace loom
