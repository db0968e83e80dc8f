// Work handed out as threads ask for it, for the kernels whose pieces differ in size or whose
// threads the OS may preempt (the router's processes share the shard's cores).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
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

// Calls compute(first, last) over ranges of [0, groups) column groups. Few rows (a decode): one
// contiguous range per thread, which streams (and prefetches) its weights end to end. Many rows (a
// prefill): runs of at most an eighth of a thread's share (at least one group) handed out as threads
// ask, so that a thread the OS preempts does not hold the other at the barrier. The run rounds
// down: a layer of few groups (18 for a 576-wide output) goes out one group at a time, where runs
// of two made 9 runs, one thread computing 5 while the other waited (8% of those layers' time).
// Each column group is computed whole by one thread either way: which thread never changes a result.
template <typename F>
void parallel_column_groups(int64_t groups, bool many_rows, const F& compute) {
  const int64_t threads = at::get_num_threads();
  if (!many_rows || threads == 1) {
    at::parallel_for(0, groups, 1, compute);
    return;
  }
  const int64_t run = std::max<int64_t>(1, groups / (8 * threads));
  const int64_t runs = (groups + run - 1) / run;
  parallel_dynamic(runs, [&](int64_t i) { compute(i * run, std::min(groups, (i + 1) * run)); });
}

}  // namespace loom
