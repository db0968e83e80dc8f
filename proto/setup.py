"""Generates the gRPC stubs from shard.proto as part of every build (wheel or editable),
so they are never committed and always match the .proto."""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self) -> None:
        runpy.run_path(str(Path(__file__).resolve().parent / "generate.py"), run_name="loom_proto_build")["main"]()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
