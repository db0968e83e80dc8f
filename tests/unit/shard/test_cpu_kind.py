"""Reading the CPU as a lesser kind (LOOM_MAX_CPU_ISA, `loom_shard.cpu`): the flags that kind
lacks are gone, and in the environment `as_cpu_env` gives, the shard makes the choices such a CPU
makes: its kernels build, its dtype, oneDNN's and ATen's instruction sets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom_shard import cpu


@pytest.fixture
def read_as(monkeypatch: pytest.MonkeyPatch):
    def set_level(level: str) -> frozenset[str]:
        monkeypatch.setenv(cpu.MAX_ISA_ENV, level)
        cpu.cpu_flags.cache_clear()
        return cpu.cpu_flags()

    yield set_level
    cpu.cpu_flags.cache_clear()  # monkeypatch then restores the environment; the next call reads it


def test_as_avx2_keeps_avx2_and_drops_everything_newer(read_as) -> None:
    real = cpu.cpu_flags()
    flags = read_as("avx2")
    assert {"avx2", "fma", "f16c"} & real == {"avx2", "fma", "f16c"} & flags
    assert not [f for f in flags if f.startswith(("avx512", "amx", "avx_"))]
    assert flags <= real and all(f.startswith(("avx512", "amx", "avx_")) for f in real - flags)
    assert cpu.cpu_model().endswith(f"read as avx2 ({cpu.MAX_ISA_ENV})")


def test_as_avx512_keeps_vnni_and_drops_bf16_and_amx(read_as) -> None:
    real = cpu.cpu_flags()
    flags = read_as("avx512")
    assert {f for f in real if f.startswith("avx512") and f not in ("avx512_bf16", "avx512_fp16")} <= flags
    assert not {"avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile"} & flags
    assert all(f.startswith(("avx512_bf16", "avx512_fp16", "amx", "avx_")) for f in real - flags)


def test_an_unknown_kind_is_refused_naming_the_known_ones(read_as) -> None:
    with pytest.raises(ValueError, match="avx2, avx512.*'sse2'"):
        read_as("sse2")


_AS_AVX2 = """
import torch
from loom_shard import kernels
from loom_shard.runtime.model_setup import choose_dtype, cpu_summary
from loom_shard.layers import row_invariance
print(cpu_summary())
assert kernels.select("auto").isa.name == "avx2", kernels.selection().describe()
try:
    kernels.select("avx512")
    raise SystemExit("an avx512 build was allowed")
except RuntimeError as e:
    assert "lacks avx512" in str(e), e
dtype, why = choose_dtype(None, torch.device("cpu"))
assert dtype == torch.bfloat16 and "Loom's kernels run it" in why, why
assert not row_invariance.onednn_packs(torch.bfloat16)  # oneDNN held to AVX2: no bfloat16 GEMM
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu.cpu_flags(), reason="the CPU has no AVX2")
def test_a_shard_in_as_cpu_env_avx2_chooses_as_an_avx2_cpu() -> None:
    result = subprocess.run([sys.executable, "-c", _AS_AVX2], env={**os.environ, **cpu.as_cpu_env("avx2")},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "read as avx2" in result.stdout and "avx512" not in result.stdout, result.stdout
