// Work handed out as threads ask for it, for the kernels whose pieces differ in size or whose
// threads the OS may preempt (the router's processes share the shard's cores).
#pragma once
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace loom {

// Calls f(i) for every i in [0, count) on torch's threads, each thread taking the next index
// when it is free: no thread waits at the barrier for a slow one's fixed share. Which thread runs
// an index must never change a result (each index writes outputs of its own).
template <typename F>
void parallel_dynamic(int64_t count, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t first, int64_t last) {
    for (int64_t worker = first; worker < last; ++worker)
      for (int64_t i = next++; i < count; i = next++) f(i);
  });
}

}  // namespace loom
