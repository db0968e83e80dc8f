"""What CPU this is, torch-free: its flags and model name as Linux reports them, and the lesser
kind that LOOM_MAX_CPU_ISA asks to read it as.

LOOM_MAX_CPU_ISA=avx2|avx512: Loom reads the CPU as one of a lesser kind, without the flags that
kind lacks (by prefix), so that one machine runs what an AVX2-only CPU (AMD Zen 3) or an AVX-512
VNNI CPU without BF16 or AMX (Intel Cascade Lake) runs: the kernel build, the dtype, the GEMM
probe. oneDNN and ATen read their own variables (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY):
`as_cpu_env` sets all three, as `make test-as-avx2` does.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

MAX_ISA_ENV = "LOOM_MAX_CPU_ISA"
LACKS = {"avx2": ("avx512", "avx_", "amx"), "avx512": ("avx512_bf16", "avx512_fp16", "avx_", "amx")}
_ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI"}


def as_cpu_env(level: str) -> dict[str, str]:
    """The environment in which Loom, oneDNN and ATen all run as on a CPU of kind `level`."""
    return {MAX_ISA_ENV: level, "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[level], "ATEN_CPU_CAPABILITY": level}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (what the OS enables, not only what cpuid
    has), less those of a CPU kind beyond LOOM_MAX_CPU_ISA when it is set."""
    flags = frozenset(_cpuinfo("flags").split())
    level = os.environ.get(MAX_ISA_ENV)
    if not level:
        return flags
    if level not in LACKS:
        raise ValueError(f"{MAX_ISA_ENV} must be one of {', '.join(LACKS)}, not {level!r}")
    return frozenset(f for f in flags if not f.startswith(LACKS[level]))


def cpu_model() -> str:
    """The CPU's model name, and the kind it is read as under LOOM_MAX_CPU_ISA."""
    level = os.environ.get(MAX_ISA_ENV)
    return (_cpuinfo("model name") or "unknown CPU") + (f" read as {level} ({MAX_ISA_ENV})" if level else "")


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" when there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
