"""Loom's own CPU kernels (C++, `csrc/`): one build per instruction set, the best one this CPU can
run chosen at run time from its flags, as llama.cpp's GGML_CPU_ALL_VARIANTS does.

Every ISA's build compiles the same sources against `csrc/simd.h` with that ISA's flags (never the
build host's `-march=native`), so `python -m loom_shard.kernels` on one machine (a docker image at
build time) leaves builds that run on any other x86 CPU. Each registers its ops in a namespace of
its own (`torch.ops.loom_avx512`, `torch.ops.loom_avx2`): the shard uses the active one through
`ops()`, and the tests load every build the CPU can run side by side and compare them. The builds
are cached in a folder named by a digest of the sources, flags and torch version under
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`).

Every kernel reduces in an order that depends only on its own row (fixed-size blocks in a fixed
order, no split chosen from the batch size), with the same lane-wise arithmetic on every ISA: a
row's result is bit-identical whatever else is in the batch, and whichever build computes it
(except the bfloat16 dense linear where AVX-512 BF16 runs it: `bf16_dot`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loom_shard.cpu import cpu_flags, cpu_model

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: with torch's OpenMP backend, at::parallel_for is an `omp parallel` in a header, so
# without the flag every kernel ran on one thread. The library then needs libgomp.so.1, which the
# loader resolves to the one torch has already loaded: one thread pool, torch.set_num_threads holds.
# -Bsymbolic and hidden visibility: two builds loaded side by side never call each other's copy
# of an inline function (which could hold another ISA's instructions).
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
LDFLAGS = ("-fopenmp", "-Wl,-Bsymbolic")
DTYPES = (torch.bfloat16, torch.float32)  # what the kernels take


@dataclass(frozen=True, slots=True)
class Isa:
    """One build of the kernels: its name (and ops namespace `loom_<name>`), the compiler flags it
    is built with, and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    summary: str

    @property
    def namespace(self) -> str:
        return f"loom_{self.name}"


ISAS = (  # best first
    Isa("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
        "AVX-512 with VNNI int8 dot products"),
    Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"), "AVX2 + FMA + F16C"),
)
CHOICES = ("auto", *(isa.name for isa in ISAS), "off")  # --cpu-kernels


def runnable(isa: Isa) -> bool:
    return set(isa.cpu_flags) <= cpu_flags()


def runnable_isas() -> list[Isa]:
    """The builds this CPU can execute, best first."""
    return [isa for isa in ISAS if runnable(isa)]


def by_name(name: str) -> Isa:
    for isa in ISAS:
        if isa.name == name:
            return isa
    raise ValueError(f"unknown kernel build {name!r}; known: {', '.join(i.name for i in ISAS)}")


def _flags(isa: Isa) -> list[str]:
    return [*CFLAGS, *isa.cflags, f"-DLOOM_ISA={isa.name}"]


def build_dir(isa: Isa, csrc: Path = CSRC) -> Path:
    digest = hashlib.sha256(" ".join([torch.__version__, *_flags(isa), *LDFLAGS]).encode())
    for source in sorted(csrc.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"loom_kernels_{isa.name}_{digest.hexdigest()[:16]}"


def library_path(isa: Isa, csrc: Path = CSRC) -> Path:
    return build_dir(isa, csrc) / f"loom_kernels_{isa.name}.so"


def build(isa: Isa, csrc: Path = CSRC) -> Path:
    """Compile one ISA's build of the sources in `csrc` (any host can build any of them; nothing is
    loaded). Raises on failure."""
    path = library_path(isa, csrc)
    if path.exists():
        return path
    # torch's JIT builder without its loader: a build this CPU cannot run must not be loaded.
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    start = time.perf_counter()
    sources = sorted(csrc.glob("*.cpp"))
    log.info("building Loom's CPU kernels for %s (%d sources, about 30 s)", isa.name, len(sources))
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_ninja_file_and_build_library(
        name=path.stem, sources=[str(s) for s in sources], extra_cflags=_flags(isa), extra_cuda_cflags=[],
        extra_sycl_cflags=[], extra_ldflags=list(LDFLAGS), extra_include_paths=[], build_directory=str(path.parent),
        verbose=False, with_cuda=False, with_sycl=False)
    log.info("built Loom's CPU kernels for %s in %.1f s", isa.name, time.perf_counter() - start)
    return path


@functools.cache
def load(isa: Isa) -> None:
    """Build (first time only) and load one ISA's build; it must be runnable here. Raises on failure."""
    if not runnable(isa):
        missing = sorted(set(isa.cpu_flags) - cpu_flags())
        raise RuntimeError(f"this CPU cannot run the {isa.name} kernels (it lacks {', '.join(missing)})")
    torch.ops.load_library(str(build(isa)))


def ops_for(isa: Isa) -> torch._ops._OpNamespace:
    """One build's ops (loaded on first use)."""
    load(isa)
    return getattr(torch.ops, isa.namespace)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which build the shard runs, and why (logged once at start and reported in /info)."""

    isa: Isa | None
    reason: str

    def describe(self) -> str:
        if self.isa is None:
            return f"none ({self.reason})"
        dot = "; bfloat16 dense linears on AVX-512 BF16 dot products" if runs_bf16_dot(self.isa) else ""
        return f"{self.isa.name} ({self.isa.summary}{dot}; {self.reason})"


_selection: Selection | None = None


def select(choice: str = "auto") -> Selection:
    """Choose the build the shard runs: "auto" (the best this CPU runs), an ISA name, or "off".

    An explicit build the CPU cannot run raises; "auto" falls back to the torch paths, with one
    warning, only when no build can run here or building fails (no compiler).
    """
    global _selection
    if choice not in CHOICES:
        raise ValueError(f"--cpu-kernels must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "off":
        _selection = Selection(None, "--cpu-kernels off: the shard uses its torch paths")
    elif choice != "auto":
        load(by_name(choice))
        _selection = Selection(by_name(choice), "chosen with --cpu-kernels")
    else:
        _selection = _auto()
    if _selection.isa is None and choice == "auto":
        log.warning("Loom's CPU kernels: %s", _selection.describe())
    return _selection


def _auto() -> Selection:
    isas = runnable_isas()
    if not isas:
        return Selection(None, f"this CPU ({cpu_model()}) has neither AVX-512 VNNI nor AVX2+FMA+F16C: torch paths")
    try:
        load(isas[0])
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a build error
        return Selection(None, f"the {isas[0].name} build failed ({error}): torch paths")
    return Selection(isas[0], "the best this CPU runs")


def selection() -> Selection:
    """The build in use (chosen automatically on first use when the shard did not choose)."""
    return _selection if _selection is not None else select("auto")


def available() -> bool:
    """True when a build is loaded for the shard's use."""
    return selection().isa is not None


def ops() -> torch._ops._OpNamespace:
    """The active build's ops (`torch.ops.loom_<isa>`)."""
    isa = selection().isa
    if isa is None:
        raise RuntimeError("Loom's CPU kernels are not in use")
    return getattr(torch.ops, isa.namespace)


def bf16_dot() -> bool:
    """True when the build in use multiplies bfloat16 pairs in one instruction here (AVX-512 BF16's
    `vdpbf16ps`): then a bfloat16 dense linear packs its weight in pairs (`linear_repack`)."""
    return runs_bf16_dot(selection().isa)


def runs_bf16_dot(isa: Isa | None) -> bool:
    """True when `isa`'s build multiplies bfloat16 pairs in one instruction on this CPU."""
    return isa is not None and isa.name == "avx512" and "avx512_bf16" in cpu_flags()


def linear_repack(weight: torch.Tensor) -> torch.Tensor:
    """Weight [out, in] packed for `ops().linear`: in pairs of k for the bfloat16 dot products where
    they run, else in the FMA chain's tiles."""
    if weight.dtype == torch.bfloat16 and bf16_dot():
        return ops().linear_repack_pairs(weight)
    return ops().linear_repack(weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation of each row of x [rows, hidden] (float32 accumulation, one pass per row)."""
    return ops().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) in one pass; the sum rounds as torch's add does."""
    return ops().add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[..., 2 * intermediate] (gate, then up) -> silu(gate) * up [..., intermediate], rounded once."""
    out = ops().silu_mul(gate_up.reshape(-1, gate_up.shape[-1]), intermediate)
    return out.view(*gate_up.shape[:-1], intermediate)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated at each token's position (half-split layout); cos and
    sin are float32 [table_len, rotary_dim // 2]."""
    return ops().rotary(x, positions, cos, sin)


def greedy_logprob_terms(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 logits [rows, vocab], one pass: (argmax, max, log(sum(exp(row - max))))."""
    return ops().greedy_logprob_terms(logits)


def runs(x: torch.Tensor) -> bool:
    """True when the kernels are in use and take x (a CPU tensor of a dtype they compute in)."""
    return x.is_cpu and x.dtype in DTYPES and available()
