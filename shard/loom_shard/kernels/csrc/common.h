// Shared helpers of Loom's CPU kernels: the ops' namespace, float conversions, fixed-order lane sums.
#pragma once
#include <c10/util/BFloat16.h>

// Each ISA's build (-DLOOM_ISA=avx512, avx2) registers its ops in a namespace of its own
// (torch.ops.loom_avx512, ...), so every build the CPU can run loads into one process side by side.
#ifndef LOOM_ISA
#error "build with -DLOOM_ISA=<the build's name>"
#endif
#define LOOM_CAT_(a, b) a##b
#define LOOM_CAT(a, b) LOOM_CAT_(a, b)
#define LOOM_STR_(x) #x
#define LOOM_STR(x) LOOM_STR_(x)
#define LOOM_OPS LOOM_CAT(loom_, LOOM_ISA)  // TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m)
#define LOOM_OP(name) LOOM_STR(LOOM_OPS) "::" name  // "loom_avx512::qlinear"

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
