"""Two versions of Loom's CPU kernels in one process: the working tree's against a commit's (or
another source folder's), each built as an op namespace of its own, taking turns; min and median
of the rounds. What a kernel change buys, on the CPU that runs it.

    python bench/bench_kernel_ab.py --base d29a32c                      # every case, 2 threads
    python bench/bench_kernel_ab.py --base d29a32c --cases qlinear --rows 8 200 --load 0.3
    python bench/bench_kernel_ab.py --base /tmp/other/csrc --threads 1 --clock cpu
    python bench/bench_kernel_ab.py --base d29a32c --isa avx2        # the avx2 build, on any CPU with AVX2
    python bench/bench_kernel_ab.py --base d29a32c --cases attention-decode --decode-batch 8 --evict 16

Cases, on the embedded SmolLM2-135M's shapes: `attention-decode` (one step's paged attention at
batch 32 or --decode-batch, 200-330 cached tokens each, over 30 layers' K/V so that they come from
memory; --evict MB streams that much between layers, untimed, as a step's weights do),
`attention-prefill` (8 prompts of 150-200 tokens, 30 layers), `qlinear` (every linear of a step on
the embedded GGUF's weights, at each of --rows), `activations` (the same with each weight cut to 32
columns: mostly the quantization of the activations), `linear` (the same shapes as dense
bfloat16 linears, random weights, at each of --rows). Each case prints the largest difference between
the two versions' outputs (0: bit-identical). --load F runs a process that keeps F of one core
busy in 2 ms slices, as the router's processes do beside a shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from io import BytesIO
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loom_shard import kernels

REPO = Path(__file__).resolve().parents[1]
CSRC_IN_REPO = Path("shard/loom_shard/kernels/csrc")
# label, run(ops) (returns the seconds to count, or None: all of its time), diff(a, b)
Case = tuple[str, Callable[[object], float | None], Callable[[object, object], float]]


def sources(spec: str, into: Path) -> Path:
    """A folder of kernel sources: `spec` itself, or the kernels of git revision `spec`."""
    if Path(spec).is_dir():
        return Path(spec)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, str(CSRC_IN_REPO)],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / CSRC_IN_REPO


def load(csrc: Path, name: str, isa: kernels.Isa) -> object:
    """Build (once) and load `isa`'s build of the sources in `csrc` as torch.ops.loom_<name>."""
    renamed = dataclasses.replace(isa, name=name)
    torch.ops.load_library(str(kernels.build(renamed, csrc)))
    return getattr(torch.ops, renamed.namespace)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _paged_case(label: str, lengths: list[int], computes: list[int], layers: int, evict_mb: int) -> Case:
    """Paged attention over `layers` caches: sequence i computes computes[i] tokens after
    lengths[i] - computes[i] cached ones; blocks scattered over the cache. evict_mb: that many
    MB copied before each layer's call (untimed), as a step's weights stream between its
    attention calls, so that K/V come from memory as in serving."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    need = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(need), generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[start : start + n]
        start += n
    caches = [torch.randn(2, sum(need), block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
              for _ in range(layers)]
    q = torch.randn(sum(computes), heads, head_dim, generator=gen).to(torch.bfloat16)
    query_starts = torch.tensor([0, *torch.tensor(computes).cumsum(0).tolist()], dtype=torch.int32)
    cached = torch.tensor([n - c for n, c in zip(lengths, computes)], dtype=torch.int32)

    def attend(ops: object, kv: torch.Tensor) -> torch.Tensor:
        return ops.paged_attention(q, kv, tables, query_starts, cached, head_dim**-0.5, 0, 0.0, None)

    src = torch.ones(evict_mb << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def run(ops: object) -> float | None:
        if not evict_mb:
            for kv in caches:
                attend(ops, kv)
            return None
        spent = 0.0  # wall time of the calls alone
        for kv in caches:
            dst.copy_(src)
            start = time.perf_counter()
            attend(ops, kv)
            spent += time.perf_counter() - start
        return spent

    return label, run, lambda a, b: _max_diff(attend(a, caches[0]), attend(b, caches[0]))


def attention_case(name: str, batch: int, evict_mb: int) -> Case:
    gen = torch.Generator().manual_seed(1)
    if name == "attention-decode":
        return _paged_case(f"attention, decode at batch {batch} x 30 layers",
                           torch.randint(200, 331, (batch,), generator=gen).tolist(), [1] * batch, 30, evict_mb)
    prompts = torch.randint(150, 201, (8,), generator=gen).tolist()
    return _paged_case("attention, prefill of 8 prompts x 30 layers", prompts, prompts, 30, evict_mb)


def qlinear_cases(rows: list[int], columns: int | None = None) -> Iterator[Case]:
    """Every linear of a step at each row count; with `columns`, each weight cut to its first
    `columns` outputs, so that what is timed is mostly the activations' quantization."""
    from bench_qlinear import layer_sources

    from loom_shard.layers.quant_linear import QuantKind
    from loom_shard.loading.gguf_file import open_gguf
    from loom_shard.loading.loader import resolve_model_path

    layers = layer_sources(open_gguf(resolve_model_path("")), 30)
    if columns is not None:
        layers = [dataclasses.replace(s, raw=s.raw[:columns].contiguous()) for s in layers]
    packed: dict[int, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}

    def weights(ops: object) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
        if id(ops) not in packed:  # each version packs its own layout
            repack = {QuantKind.Q4_1: ops.qlinear_repack_q4_1, QuantKind.Q8_0: ops.qlinear_repack_q8_0}
            packed[id(ops)] = [(*repack[s.kind](s.raw.contiguous(), s.in_features), s.in_features, s.out_features)
                               for s in layers]
        return packed[id(ops)]

    for count in rows:
        xs = {k: torch.randn(count, k, dtype=torch.bfloat16) for k in {s.in_features for s in layers}}

        def run(ops: object, xs: dict[int, torch.Tensor] = xs) -> None:
            for w, scales, k, n in weights(ops):
                ops.qlinear(xs[k], w, scales.view(torch.float16), n, None)

        def diff(a: object, b: object, xs: dict[int, torch.Tensor] = xs) -> float:
            return max(_max_diff(a.qlinear(xs[k], wa, sa.view(torch.float16), n, None),
                                 b.qlinear(xs[k], wb, sb.view(torch.float16), n, None))
                       for (wa, sa, k, n), (wb, sb, _, _) in zip(weights(a), weights(b)))

        what = "one step's linears" if columns is None else f"one step's linears cut to {columns} columns"
        yield f"qlinear, {what} at {count} rows", run, diff


DENSE_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2's qkv, o, gate_up, down


def linear_cases(rows: list[int], isa: kernels.Isa) -> Iterator[Case]:
    """The dense bfloat16 linears of a step of SmolLM2's shape (30 layers, random weights), packed
    as each version packs them for `isa` on this CPU (pairs of k where AVX-512 BF16 runs)."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(30) for k, n in DENSE_SHAPES]
    packed: dict[int, list[tuple[torch.Tensor, int]]] = {}

    def weights(ops: object) -> list[tuple[torch.Tensor, int]]:
        if id(ops) not in packed:
            repack = ops.linear_repack_pairs if kernels.runs_bf16_dot(isa) else ops.linear_repack
            packed[id(ops)] = [(repack(w), w.shape[0]) for w in layers]
        return packed[id(ops)]

    for count in rows:
        xs = {k: torch.randn(count, k, generator=gen).to(torch.bfloat16) for k, _ in DENSE_SHAPES}

        def run(ops: object, xs: dict[int, torch.Tensor] = xs) -> None:
            for w, n in weights(ops):
                ops.linear(xs[in_features_of(w)], w, n, None)

        def diff(a: object, b: object, xs: dict[int, torch.Tensor] = xs) -> float:
            return max(_max_diff(a.linear(xs[in_features_of(wa)], wa, n, None), b.linear(xs[in_features_of(wb)], wb, n, None))
                       for (wa, n), (wb, _) in zip(weights(a), weights(b)))

        yield f"linear (bfloat16, dense), one step's linears at {count} rows", run, diff


def in_features_of(packed: torch.Tensor) -> int:
    """in_features of a packed dense weight ([tiles, K, 16] or [tiles, K/2, 16, 2]; K even here)."""
    return packed.shape[1] * (2 if packed.dim() == 4 else 1)


def busy(fraction: float) -> subprocess.Popen:
    """A process that keeps `fraction` of one core busy, in 2 ms slices."""
    code = ("import time\nwhile True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {0.002 * fraction}: pass\n    time.sleep({0.002 * (1 - fraction)})")
    return subprocess.Popen([sys.executable, "-c", code])


def measure(case: Case, base: object, exp: object, rounds: int, clock: Callable[[], float]) -> None:
    label, run, diff = case
    times: dict[str, list[float]] = {"base": [], "exp": []}
    for _ in range(rounds):
        for name, ops in (("base", base), ("exp", exp)):  # taking turns
            start = clock()
            counted = run(ops)
            times[name].append(clock() - start if counted is None else counted)
    b, e = times["base"], times["exp"]
    print(f"{label}: base {min(b) * 1e3:.2f} ms (median {statistics.median(b) * 1e3:.2f}), "
          f"this tree {min(e) * 1e3:.2f} ms (median {statistics.median(e) * 1e3:.2f}); "
          f"base / this tree {min(b) / min(e):.2f}x min, {statistics.median(b) / statistics.median(e):.2f}x median; "
          f"max output difference {diff(base, exp):.3g}", flush=True)


def _cases(name: str, args: argparse.Namespace, isa: kernels.Isa) -> Iterable[Case]:
    if name.startswith("attention"):
        return [attention_case(name, args.decode_batch, args.evict)]
    if name == "qlinear":
        return qlinear_cases(args.rows)
    if name == "activations":
        return qlinear_cases(args.rows, columns=32)
    return linear_cases(args.rows, isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a git revision, or a folder of kernel sources")
    parser.add_argument("--exp", default=str(REPO / CSRC_IN_REPO), help="the other version (default: this working tree's)")
    parser.add_argument("--cases", nargs="+", default=["attention-decode", "attention-prefill", "qlinear"],
                        choices=["attention-decode", "attention-prefill", "qlinear", "activations", "linear"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 200], help="qlinear's and linear's row counts")
    parser.add_argument("--decode-batch", type=int, default=32, help="attention-decode's sequences")
    parser.add_argument("--evict", type=int, default=0, metavar="MB",
                        help="attention: copy this many MB before each layer (untimed), so K/V come from memory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (steadier on a shared machine, with --threads 1)")
    parser.add_argument("--load", type=float, default=0.0, help="keep this fraction of one core busy meanwhile")
    parser.add_argument("--isa", choices=[isa.name for isa in kernels.runnable_isas()],
                        help="the kernels build to compare (default: the best this CPU runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    isa = kernels.by_name(args.isa) if args.isa else kernels.runnable_isas()[0]
    print(f"{kernels.cpu_model()}; {isa.name} build, {args.threads} threads, {args.clock} clock, load {args.load}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = load(sources(args.base, Path(tmp) / "base"), "ab_base", isa)
        exp = load(sources(args.exp, Path(tmp) / "exp"), "ab_exp", isa)
    hog = busy(args.load) if args.load > 0 else None
    try:
        with torch.inference_mode():
            for name in args.cases:
                cases = _cases(name, args, isa)
                for case in cases:
                    measure(case, base, exp, args.rounds, clock)
    finally:
        if hog is not None:
            hog.kill()


if __name__ == "__main__":
    main()
