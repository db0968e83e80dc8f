"""Generate the Python stubs for proto/shard.proto into proto/loom_proto/ (git-ignored).

Run by the install (proto/setup.py's build step) and by hand: `python proto/generate.py`.
Idempotent: every run rewrites the same files from the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
OUT_DIR = PROTO_DIR / "loom_proto"
PROTO_FILE = "shard.proto"

# protoc writes a top-level import that only works with proto/loom_proto on sys.path.
GENERATED_IMPORT = "import shard_pb2 as shard__pb2"
PACKAGE_IMPORT = "from loom_proto import shard_pb2 as shard__pb2"


def run_protoc() -> None:
    """Run grpc_tools' bundled protoc; raises SystemExit with its status on failure."""
    from grpc_tools import protoc  # dev dependency: only needed here

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        str(PROTO_DIR / PROTO_FILE),
    ]
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")


def fix_grpc_import() -> None:
    grpc_file = OUT_DIR / "shard_pb2_grpc.py"
    text = grpc_file.read_text()
    if GENERATED_IMPORT in text:
        grpc_file.write_text(text.replace(GENERATED_IMPORT, PACKAGE_IMPORT))
    elif PACKAGE_IMPORT not in text:
        raise SystemExit(f"unexpected import layout in {grpc_file}; expected {GENERATED_IMPORT!r}")


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    run_protoc()
    fix_grpc_import()
    print(f"generated stubs in {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
