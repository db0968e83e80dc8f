"""`bench_vs_llamacpp.py --as-avx2` runs llama-server from a copy of its folder that holds one
CPU variant library, so that the server cannot load a better variant than the one asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_vs_llamacpp import only_variant  # noqa: E402


def fake_peer(root: Path) -> Path:
    """A wrapper script beside a folder laid out as the peers' llama.cpp build."""
    bin_dir = root / "llama.cpp" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"  # prints the CPU variants beside it and its library path
    server.write_text('#!/bin/sh\ncd "$(dirname "$0")" && ls libggml-cpu-*.so && echo "path=$LD_LIBRARY_PATH"\n')
    server.chmod(0o755)
    for name in ("libggml-base.so.0", "libllama.so.0", "libggml-cpu-haswell.so", "libggml-cpu-zen4.so",
                 "libggml-cpu-sapphirerapids.so"):
        (bin_dir / name).write_bytes(b"\x7fELF")
    wrapper = root / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{server}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_the_copy_holds_only_the_variant_asked_for(tmp_path: Path) -> None:
    with only_variant(fake_peer(tmp_path), "haswell") as script:
        copied = {path.name for path in script.parent.iterdir()}
        assert copied == {"llama-server", "llama-server.sh", "libggml-base.so.0", "libllama.so.0",
                          "libggml-cpu-haswell.so"}
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        out = subprocess.run([str(script)], capture_output=True, text=True, check=True, env=env).stdout.split()
        assert out == ["libggml-cpu-haswell.so", f"path={script.parent}"]
    assert not script.parent.exists()  # the copy goes with the run


def test_a_variant_that_is_not_there_stops_the_bench(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="libggml-cpu-x86-64-v5.so"):
        with only_variant(fake_peer(tmp_path), "x86-64-v5"):
            pass
