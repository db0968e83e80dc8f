"""Imports and dependencies follow the processes: router -> proto, shard -> proto,
launcher -> proto's configuration only; the router's distribution never needs torch."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"proto": "loom_proto", "router": "loom_router", "shard": "loom_shard", "launcher": "loom_launcher"}
FORBIDDEN = {
    "loom_proto": {"torch", "loom_router", "loom_shard", "loom_launcher", "fastapi", "uvicorn"},
    "loom_router": {"torch", "loom_shard", "loom_launcher", "safetensors"},
    "loom_shard": {"loom_router", "loom_launcher", "fastapi", "uvicorn"},
    "loom_launcher": {"torch", "loom_router", "loom_shard", "grpc"},
}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every import in a file, deferred ones inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def forbidden_imports(package: str, files: list[Path]) -> list[str]:
    return sorted(f"{file} imports {name}" for file in files
                  for name in imported_modules(file) & FORBIDDEN[package])


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_import_crosses_a_process_line(folder: str) -> None:
    package = PACKAGES[folder]
    files = sorted((ROOT / folder / package).rglob("*.py"))
    assert files, f"{folder}/{package} has no code"
    assert forbidden_imports(package, files) == []


def test_the_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.nn\n    from loom_shard.runtime.runner import ModelRunner\n")
    assert len(forbidden_imports("loom_router", [bad])) == 2


def test_no_loom_package_is_left() -> None:
    assert not (ROOT / "loom").exists()


def dependencies(folder: str) -> set[str]:
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    return {dep.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower()
            for dep in project["dependencies"]}


def test_distributions_depend_only_on_what_their_process_runs() -> None:
    assert "torch" not in dependencies("router") and "loom-shard" not in dependencies("router")
    assert "loom-router" not in dependencies("shard")
    assert dependencies("launcher") == {"loom-proto"}
    assert dependencies("proto").isdisjoint({"torch", "loom-router", "loom-shard", "loom-launcher"})
    assert {"loom-proto", "loom-router", "loom-shard", "loom-launcher"} <= dependencies(".")
