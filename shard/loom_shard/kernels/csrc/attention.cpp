// Paged attention on CPU for a mixed batch of prefill chunks and decodes, with the contract of
// the Triton kernel (loom_shard/triton_attention.py): K/V blocks are read in place through each
// sequence's block table (no gather, no padding), grouped-query heads fold into query rows
// (row = token * group + g) so K/V are never repeated, and a query at position p sees keys 0..p,
// or p - window + 1..p in a sliding-window layer. Per layer: the scale, a logit softcap (Gemma 2)
// and attention sinks (gpt-oss).
//
// Batch invariance: a row's arithmetic depends only on its sequence and its position.
// Keys are visited in blocks of kKeyBlock from key 0 in ascending order; each block's scores
// (fixed-order dot products), online-softmax update (float32) and P.V accumulation (keys in
// order) use only the row's own values. Rows of a tile that cannot see a key add exact zeros.
// So a row is bit-identical at any batch size and however its prompt was chunked.
//
// Work is split into tasks of up to kMaxRows query rows of one (sequence, kv head); the rows
// of a task share every K/V load (register tiling). Tasks are handed out dynamically, largest
// first, a unit of a (sequence, rows)'s kv heads at a time: which thread runs a task never changes
// its result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_paged.h"
#include "parallel.h"

namespace {

using loom::attention::Geometry;
using loom::attention::Task;

struct Tables {
  const int32_t* block_tables;
  const int32_t* query_starts;
  const int32_t* num_cached;
};

// Units of one step: (sequence, up to kMaxRows rows), each a task for every kv head (kv_head set
// when it runs); longest first (their key count times rows) so dynamic scheduling balances.
std::vector<Task> make_units(const Tables& t, const Geometry& g, int64_t num_seqs, int64_t* work) {
  std::vector<Task> units;
  *work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = static_cast<int64_t>(t.query_starts[s + 1] - t.query_starts[s]) * g.group;
    for (int64_t first = 0; first < rows; first += loom::attention::kMaxRows) {
      const int64_t n = std::min<int64_t>(loom::attention::kMaxRows, rows - first);
      const int64_t keys = t.num_cached[s] + (first + n - 1) / g.group + 1;
      const int64_t first_key = loom::attention::first_visible(g, t.num_cached[s] + first / g.group + 1);
      units.push_back(Task{s, 0, first, n, keys, first_key});
      *work += (keys - first_key) * n * g.kv_heads;
    }
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const Task& a, const Task& b) { return a.keys * a.rows > b.keys * b.rows; });
  return units;
}

template <typename T>
void run_tasks(const T* q, const T* kv, T* out, const Tables& t, const Geometry& g, int64_t num_seqs) {
  int64_t work = 0;
  const std::vector<Task> units = make_units(t, g, num_seqs, &work);
  const int64_t count = static_cast<int64_t>(units.size()), heads = g.kv_heads;
  auto run = [&](Task task, int64_t kv_head) {
    task.kv_head = kv_head;
    loom::attention::TaskView<T> view{q, kv, out, t.block_tables + task.seq * g.max_blocks,
                                     t.query_starts[task.seq], t.num_cached[task.seq]};
    loom::attention::attend(view, g, task);
  };
  auto run_unit = [&](int64_t i) {
    for (int64_t h = 0; h < heads; ++h) run(units[i], h);
  };
  // Below ~1k (one sequence of ~100 keys) waking the thread pool costs more than it saves. A
  // batch-8 decode of 150-300 keys each (~16k) ran on one thread under the old 32k threshold,
  // and its whole step took 1.2-1.35x longer (bench/BENCHMARKS.md).
  constexpr int64_t kInlineWork = 1 << 10;
  constexpr int64_t kUnitsPerThread = 2;  // fewer: each kv head a task of its own, for balance
  if (work < kInlineWork || at::get_num_threads() == 1) {
    for (int64_t i = 0; i < count; ++i) run_unit(i);
    return;
  }
  // The kv heads of a cached token share its row of the cache. With enough units to go round, a
  // thread runs a unit's kv heads in turn, so a row's reads come from one core close together in
  // time rather than from both (attention from memory 1.13-1.19x faster than with a unit's heads
  // split over threads; bench/BENCHMARKS.md).
  if (count < kUnitsPerThread * at::get_num_threads()) {
    loom::parallel_dynamic(count * heads, [&](int64_t i) { run(units[i / heads], i % heads); });
    return;
  }
  loom::parallel_dynamic(count, run_unit);
}

// Every key a task reads must lie in the cache: a wrong table is an error, never a stray read.
// With a window, blocks before the first query's window are never read (nor checked).
void check_tables(const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& num_cached,
                  int64_t num_tokens, int64_t num_blocks, int64_t block_size, int64_t window) {
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* cached = num_cached.data_ptr<int32_t>();
  const int64_t num_seqs = num_cached.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens, "paged_attention: query_starts must run from 0 to num_tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    TORCH_CHECK(len >= 0 && cached[s] >= 0, "paged_attention: sequence ", s, " has a negative length");
    if (len == 0) continue;
    const int64_t last_block = (cached[s] + len - 1) / block_size;
    TORCH_CHECK(last_block < max_blocks, "paged_attention: sequence ", s, " reaches past its block table");
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, cached[s] + 1 - window) : 0;
    for (int64_t b = first_key / block_size; b <= last_block; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block ", block, " out of range");
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& query_starts, const at::Tensor& num_cached, double scale, int64_t window,
                           double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [tokens, heads, head_dim] on CPU");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
              "paged_attention: kv_layer must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv_layer.scalar_type() == q.scalar_type(), "paged_attention: q and kv_layer dtypes differ");
  TORCH_CHECK(q.size(2) == kv_layer.size(4) && q.size(1) % kv_layer.size(3) == 0, "paged_attention: head shapes disagree");
  for (const at::Tensor* x : {&block_tables, &query_starts, &num_cached})
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous(), "paged_attention: tables must be contiguous int32");
  const int64_t num_seqs = num_cached.size(0);
  TORCH_CHECK(query_starts.size(0) == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "paged_attention: table shapes disagree");
  TORCH_CHECK(kv_layer.size(4) > 0 && kv_layer.size(3) > 0, "paged_attention: empty heads");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must not be negative");
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_values.dim() == 1 && sink_values.size(0) == q.size(1), "paged_attention: sinks must be [num_heads]");
  }
  check_tables(block_tables, query_starts, num_cached, q.size(0), kv_layer.size(1), kv_layer.size(2), window);
  // Each token's heads contiguous, its queries anywhere: q as a slice of the qkv projection is read in place.
  const at::Tensor qc = q.stride(1) == q.size(2) ? q : q.contiguous();
  Geometry g{};
  g.num_heads = q.size(1);
  g.kv_heads = kv_layer.size(3);
  g.head_dim = q.size(2);
  g.group = g.num_heads / g.kv_heads;
  g.block_size = kv_layer.size(2);
  g.max_blocks = block_tables.size(1);
  g.v_offset = kv_layer.stride(0);
  g.q_stride = qc.stride(0);
  g.scale = static_cast<float>(scale);
  g.window = window;
  g.softcap = static_cast<float>(softcap);
  g.sinks = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const Tables t{block_tables.data_ptr<int32_t>(), query_starts.data_ptr<int32_t>(), num_cached.data_ptr<int32_t>()};
  if (q.scalar_type() == at::kBFloat16) {
    run_tasks(qc.data_ptr<at::BFloat16>(), kv_layer.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), t, g, num_seqs);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: bfloat16 or float32 only");
    run_tasks(qc.data_ptr<float>(), kv_layer.data_ptr<float>(), out.data_ptr<float>(), t, g, num_seqs);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("paged_attention(Tensor q, Tensor kv_layer, Tensor block_tables, Tensor query_starts, Tensor num_cached, "
        "float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) { m.impl("paged_attention", &paged_attention); }
