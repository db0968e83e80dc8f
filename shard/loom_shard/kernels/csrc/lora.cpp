// LoRA deltas of a mixed batch (Punica/S-LoRA's SGMV on the CPU): each token names its adapter's
// device slot (or -1, the base model), and its delta is x @ A[slot]^T @ B[slot], computed in two
// ops so that a row-parallel projection can sum the shrinks over its ranks in between:
//
//   lora_shrink(x [T, in], A [S, W, in], token_slot [T], slot_ranks [S], parts) -> h [T, W] float32
//   lora_expand_(out [T, N], h [T, W], B_parts: [S, R, out_p] each, token_slot, slot_ranks):
//       out[:, part p] += h_p @ B_p
//
// with W = parts * R (one shrink serves every fused part; part p's rank in h's columns p*R..), R the
// slots' rank (--max-lora-rank) and slot_ranks each slot's adapter's own rank: the padding rows of
// A and B beyond it (zeros) are never read, and h is zero there and for base-model rows.
// The factors are read once per step whatever the number of tokens of each adapter: tokens are
// grouped by slot and each factor row (A) or column block (B) is applied to the whole group
// while it is in L1. Factors may be bfloat16 or float32; accumulation is float32.
//
// A token's delta depends only on its own row and its adapter's factors: every h[t, w] is one
// dot product reduced in simd.h's fixed lane order, every output one FMA chain over its slot's ranks,
// whatever the batch, the grouping, the thread or the ISA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "simd.h"

namespace {

using loom::simd::F16;

constexpr int kGroupRows = 4;   // tokens of one slot sharing each load of A
constexpr int kFactorRows = 4;  // rows of A sharing each load of a token's x
constexpr int64_t kExpandCols = 128;  // output columns of one expand work item

struct Groups {
  std::vector<std::vector<int64_t>> rows;  // batch rows per slot, in batch order; empty: no token
  std::vector<int64_t> ranks;              // each slot's adapter's rank
};

Groups group_by_slot(const at::Tensor& token_slot, const at::Tensor& slot_ranks, int64_t num_slots, int64_t rank) {
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.dim() == 1 && token_slot.is_contiguous(),
              "lora: token_slot must be a contiguous int64 vector");
  TORCH_CHECK(slot_ranks.scalar_type() == at::kLong && slot_ranks.numel() == num_slots && slot_ranks.is_contiguous(),
              "lora: slot_ranks must hold one int64 per slot");
  Groups groups{std::vector<std::vector<int64_t>>(num_slots),
                std::vector<int64_t>(slot_ranks.data_ptr<int64_t>(), slot_ranks.data_ptr<int64_t>() + num_slots)};
  for (int64_t r : groups.ranks) TORCH_CHECK(r >= 0 && r <= rank, "lora: a slot's rank ", r, " is not in 0..", rank);
  const int64_t* slot = token_slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < token_slot.size(0); ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "lora: slot ", slot[t], " out of range");
    if (slot[t] >= 0) groups.rows[slot[t]].push_back(t);
  }
  return groups;
}

// h[rows[i], w0 + j] = x[rows[i]] . a_j (length k) for up to kGroupRows rows and kFactorRows factor
// rows a_j = a + j * k: each load of x or of A feeds four FMAs.
template <typename TX, typename TA, int R = kGroupRows, int C = kFactorRows>
void shrink_tile(const TX* x, const TA* a, const int64_t* rows, int rows_left, int cols_left, int64_t k, float* h,
                 int64_t w0, int64_t width) {
  if constexpr (R > 1) {
    if (rows_left < R) return shrink_tile<TX, TA, R - 1, C>(x, a, rows, rows_left, cols_left, k, h, w0, width);
  }
  if constexpr (C > 1) {
    if (cols_left < C) return shrink_tile<TX, TA, R, C - 1>(x, a, rows, rows_left, cols_left, k, h, w0, width);
  }
  F16 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = loom::simd::zero();
  const int64_t full = k / loom::kLanes * loom::kLanes;
  for (int64_t kk = 0; kk < full; kk += loom::kLanes) {
    F16 av[C];
    for (int j = 0; j < C; ++j) av[j] = loom::simd::load(a + j * k + kk);
    for (int i = 0; i < R; ++i) {
      const F16 xv = loom::simd::load(x + rows[i] * k + kk);
      for (int j = 0; j < C; ++j) acc[i][j] = loom::simd::fma(xv, av[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      alignas(64) float lanes[loom::kLanes];
      loom::simd::store(lanes, acc[i][j]);
      for (int64_t kk = full; kk < k; ++kk)  // element kk into lane kk % 16, as the vector part does
        lanes[kk - full] = std::fma(loom::to_float(x[rows[i] * k + kk]), loom::to_float(a[j * k + kk]), lanes[kk - full]);
      h[rows[i] * width + w0 + j] = loom::sum_lanes(lanes);
    }
}

struct ShrinkItem {
  int64_t slot, w0;
  int cols;  // factor rows w0 .. w0 + cols
};

template <typename TX, typename TA>
void shrink(const TX* x, const TA* a, const Groups& groups, int64_t k, int64_t width, int64_t parts, float* h) {
  const int64_t rank = width / parts;
  std::vector<ShrinkItem> items;
  for (int64_t s = 0; s < static_cast<int64_t>(groups.rows.size()); ++s)
    if (!groups.rows[s].empty())
      for (int64_t p = 0; p < parts; ++p)
        for (int64_t r = 0; r < groups.ranks[s]; r += kFactorRows)
          items.push_back({s, p * rank + r, static_cast<int>(std::min<int64_t>(kFactorRows, groups.ranks[s] - r))});
  at::parallel_for(0, static_cast<int64_t>(items.size()), 2, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t s = items[item].slot, w0 = items[item].w0;
      const std::vector<int64_t>& rows = groups.rows[s];
      const int cols = items[item].cols;
      for (size_t i = 0; i < rows.size(); i += kGroupRows)
        shrink_tile(x, a + (s * width + w0) * k, rows.data() + i, static_cast<int>(std::min<size_t>(kGroupRows, rows.size() - i)),
                    cols, k, h, w0, width);
    }
  });
}

template <typename TX>
void shrink_typed(const at::Tensor& x, const at::Tensor& a, const Groups& groups, int64_t parts, at::Tensor& h) {
  const int64_t k = x.size(1), width = a.size(1);
  if (a.scalar_type() == at::kBFloat16)
    shrink(x.data_ptr<TX>(), a.data_ptr<at::BFloat16>(), groups, k, width, parts, h.data_ptr<float>());
  else
    shrink(x.data_ptr<TX>(), a.data_ptr<float>(), groups, k, width, parts, h.data_ptr<float>());
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slot,
                       const at::Tensor& slot_ranks, int64_t parts) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "lora_shrink: x must be a CPU [tokens, in] tensor");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1), "lora_shrink: A must be [slots, W, in]");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kFloat, "lora_shrink: bfloat16 or float32 factors");
  TORCH_CHECK(token_slot.size(0) == x.size(0), "lora_shrink: one slot per token");
  TORCH_CHECK(parts > 0 && a.size(1) % parts == 0, "lora_shrink: A's rows must be parts x rank");
  const at::Tensor xc = x.contiguous();
  at::Tensor h = at::zeros({x.size(0), a.size(1)}, x.options().dtype(at::kFloat));
  const Groups groups = group_by_slot(token_slot, slot_ranks, a.size(0), a.size(1) / parts);
  if (x.scalar_type() == at::kBFloat16) shrink_typed<at::BFloat16>(xc, a, groups, parts, h);
  else if (x.scalar_type() == at::kFloat) shrink_typed<float>(xc, a, groups, parts, h);
  else TORCH_CHECK(false, "lora_shrink: bfloat16 or float32 x");
  return h;
}

struct ExpandItem {
  int64_t slot, part, col0, cols;
};

// acc[i] += h[group[i], hcol + r] * b[r, c .. c + 16] for r in [r0, r0 + R): R rows of b in registers.
template <int R, typename TB>
inline void expand_ranks(F16* acc, int count, const int64_t* group, const float* h, int64_t width, int64_t hcol,
                         const TB* b, int64_t out_p, int64_t r0, int64_t c) {
  F16 bv[R];
  for (int r = 0; r < R; ++r) bv[r] = loom::simd::load(b + (r0 + r) * out_p + c);
  for (int i = 0; i < count; ++i) {
    const float* ht = h + group[i] * width + hcol + r0;
    for (int r = 0; r < R; ++r) acc[i] = loom::simd::fma(loom::simd::set1(ht[r]), bv[r], acc[i]);
  }
}

// out[t, column + c] += sum_r h[t, hcol + r] * b[r, c] for c in [col0, col0 + cols) and r < rank (the
// slot's adapter's), each t of the slot: up to kGroupRows tokens share each load of b, each output
// one FMA chain over r = 0, 1, ...
template <typename TO, typename TB>
void expand_block(TO* out, int64_t n, const float* h, int64_t width, int64_t hcol, const TB* b, int64_t rank,
                  int64_t out_p, int64_t column, int64_t col0, int64_t cols, const std::vector<int64_t>& rows) {
  constexpr int kRanks = 8;  // rows of b held in registers at a time
  const int64_t full = cols / loom::kLanes * loom::kLanes;
  for (size_t first = 0; first < rows.size(); first += kGroupRows) {
    const int count = static_cast<int>(std::min<size_t>(kGroupRows, rows.size() - first));
    const int64_t* group = rows.data() + first;
    for (int64_t c = 0; c < full; c += loom::kLanes) {
      F16 acc[kGroupRows];
      for (int i = 0; i < count; ++i) acc[i] = loom::simd::zero();
      int64_t r0 = 0;
      for (; r0 + kRanks <= rank; r0 += kRanks) expand_ranks<kRanks>(acc, count, group, h, width, hcol, b, out_p, r0, col0 + c);
      for (; r0 < rank; ++r0) expand_ranks<1>(acc, count, group, h, width, hcol, b, out_p, r0, col0 + c);
      for (int i = 0; i < count; ++i) {
        TO* dst = out + group[i] * n + column + col0 + c;
        loom::simd::store(dst, loom::simd::add(loom::simd::load(dst), acc[i]));
      }
    }
    for (int i = 0; i < count; ++i) {
      const float* ht = h + group[i] * width + hcol;
      TO* dst = out + group[i] * n + column + col0;
      for (int64_t c = full; c < cols; ++c) {
        float acc = 0.0f;
        for (int64_t r = 0; r < rank; ++r) acc = std::fma(ht[r], loom::to_float(b[r * out_p + col0 + c]), acc);
        dst[c] = loom::from_float<TO>(loom::to_float(dst[c]) + acc);
      }
    }
  }
}

template <typename TO, typename TB>
void expand(TO* out, int64_t n, const float* h, int64_t width, const std::vector<const TB*>& parts,
            const std::vector<int64_t>& part_cols, int64_t rank, const Groups& groups) {
  std::vector<ExpandItem> items;
  for (int64_t s = 0; s < static_cast<int64_t>(groups.rows.size()); ++s) {
    if (groups.rows[s].empty() || groups.ranks[s] == 0) continue;
    for (int64_t p = 0; p < static_cast<int64_t>(parts.size()); ++p)
      for (int64_t c = 0; c < part_cols[p]; c += kExpandCols)
        items.push_back({s, p, c, std::min(kExpandCols, part_cols[p] - c)});
  }
  std::vector<int64_t> column(parts.size(), 0);
  for (size_t p = 1; p < parts.size(); ++p) column[p] = column[p - 1] + part_cols[p - 1];
  at::parallel_for(0, static_cast<int64_t>(items.size()), 4, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const ExpandItem& it = items[i];
      const TB* b = parts[it.part] + it.slot * rank * part_cols[it.part];
      expand_block(out, n, h, width, it.part * rank, b, groups.ranks[it.slot], part_cols[it.part], column[it.part],
                   it.col0, it.cols, groups.rows[it.slot]);
    }
  });
}

template <typename TO, typename TB>
void expand_typed(at::Tensor& out, const at::Tensor& h, at::TensorList b_parts, int64_t rank, const Groups& groups) {
  std::vector<const TB*> parts;
  std::vector<int64_t> cols;
  for (const at::Tensor& b : b_parts) {
    parts.push_back(b.data_ptr<TB>());
    cols.push_back(b.size(2));
  }
  expand(out.data_ptr<TO>(), out.size(1), h.data_ptr<float>(), h.size(1), parts, cols, rank, groups);
}

at::Tensor lora_expand_(at::Tensor out, const at::Tensor& h, at::TensorList b_parts, const at::Tensor& token_slot,
                        const at::Tensor& slot_ranks) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(), "lora_expand_: out must be a contiguous CPU [tokens, N] tensor");
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.size(0) == out.size(0), "lora_expand_: h must be float32 [tokens, W]");
  TORCH_CHECK(!b_parts.empty() && token_slot.size(0) == out.size(0), "lora_expand_: factors and one slot per token");
  const int64_t slots = b_parts[0].size(0), rank = b_parts[0].size(1);
  int64_t total = 0;
  for (const at::Tensor& b : b_parts) {
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(0) == slots && b.size(1) == rank &&
                    b.scalar_type() == b_parts[0].scalar_type(),
                "lora_expand_: every B must be [slots, R, out_p] of one dtype");
    total += b.size(2);
  }
  TORCH_CHECK(total == out.size(1) && h.size(1) == rank * static_cast<int64_t>(b_parts.size()),
              "lora_expand_: the parts' columns must make out's, and h must hold R columns per part");
  const Groups groups = group_by_slot(token_slot, slot_ranks, slots, rank);
  const bool b_bf16 = b_parts[0].scalar_type() == at::kBFloat16;
  TORCH_CHECK(b_bf16 || b_parts[0].scalar_type() == at::kFloat, "lora_expand_: bfloat16 or float32 factors");
  if (out.scalar_type() == at::kBFloat16) {
    if (b_bf16) expand_typed<at::BFloat16, at::BFloat16>(out, h, b_parts, rank, groups);
    else expand_typed<at::BFloat16, float>(out, h, b_parts, rank, groups);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kFloat, "lora_expand_: bfloat16 or float32 out");
    if (b_bf16) expand_typed<float, at::BFloat16>(out, h, b_parts, rank, groups);
    else expand_typed<float, float>(out, h, b_parts, rank, groups);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LOOM_OPS, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor token_slot, Tensor slot_ranks, int parts) -> Tensor");
  m.def("lora_expand_(Tensor(a!) out, Tensor h, Tensor[] b_parts, Tensor token_slot, Tensor slot_ranks) -> Tensor(a!)");
}
TORCH_LIBRARY_IMPL(LOOM_OPS, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand_", &lora_expand_);
}
