"""`python -m loom_shard.kernels`: build every ISA's kernels now (make setup runs it), so that this
environment (or an image made from it) runs on any x86 CPU; exits 1 when a build fails."""

import logging
import sys

from loom_shard import kernels

logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
failed = []
for isa in kernels.ISAS:
    try:
        print(f"[loom_shard.kernels] {isa.name}: {kernels.build(isa)}", flush=True)
    except Exception as error:  # noqa: BLE001 - reported below, and the exit code fails the build
        print(f"[loom_shard.kernels] {isa.name}: BUILD FAILED: {error}", file=sys.stderr, flush=True)
        failed.append(isa.name)
if failed:
    sys.exit(1)
choice = kernels.select("auto")
print(f"[loom_shard.kernels] this CPU ({kernels.cpu_model()}) runs: {choice.describe()}", flush=True)
sys.exit(0 if choice.isa is not None or not kernels.runnable_isas() else 1)
