"""`python -m loom_shard.kernels`: build the CPU kernels now (make setup runs it) and say how it went."""

import logging
import sys

from loom_shard.kernels import load

logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
sys.exit(0 if load() else 1)
