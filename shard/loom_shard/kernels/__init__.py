"""Loom's own CPU kernels (C++, `csrc/`), compiled once on the machine that runs them.

They are built with `torch.utils.cpp_extension.load` (ninja) the first time a shard needs them
(`make setup` builds them ahead: `python -m loom_shard.kernels`), cached in a folder named by a
digest of their sources, flags and torch version under `TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions`), so checkouts with different sources never rebuild over each other,
and registered as `torch.ops.loom.*`.
They are compiled for the host CPU (`-march=native`): the build happens where they run.
Without a compiler the shard keeps its torch paths and says so in one log line.

Every kernel here reduces in an order that depends only on its own row (fixed-size blocks in a
fixed order, no split chosen from the batch size): a row's result is bit-identical whatever else
is in the batch (issue 14).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
# -fopenmp: with torch's OpenMP backend, at::parallel_for is an `omp parallel` in a header, so
# without the flag every kernel ran on one thread. The library then needs libgomp.so.1, which the
# loader resolves to the one torch has already loaded: one thread pool, torch.set_num_threads holds.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
DTYPES = (torch.bfloat16, torch.float32)  # what the kernels take


@functools.cache
def load() -> bool:
    """Build (first time only) and load the kernels; False, with one warning, when that fails."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    log.info("loading Loom's CPU kernels (%d sources; the first build takes about a minute)", len(SOURCES))
    build_dir = _build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name="loom_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
            build_directory=str(build_dir), is_python_module=False, verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a build error
        log.warning("Loom's CPU kernels are unavailable (%s); the shard uses its torch paths", error)
        return False
    log.info("Loom's CPU kernels ready in %.1f s", time.perf_counter() - start)
    return True


def _build_dir() -> Path:
    digest = hashlib.sha256(" ".join([torch.__version__, *CFLAGS]).encode())
    for source in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"loom_kernels_{digest.hexdigest()[:16]}"


def available() -> bool:
    """True when the kernels are built and loaded (builds them on first call)."""
    return load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation of each row of x [rows, hidden] (float32 accumulation, one pass per row)."""
    return torch.ops.loom.rms_norm(x, weight, eps)
