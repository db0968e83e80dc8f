"""The PNG of a sweep: output throughput against latency, one line per server (matplotlib,
the `plot` extra: `pip install loom-bench[plot]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("--plot needs matplotlib: pip install 'loom-bench[plot]'") from error
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    servers = list(runs[0]["servers"]) if runs else []
    for server in servers:
        points = [(run["servers"][server]["output_throughput"], run["servers"][server], run["load"]["label"])
                  for run in runs]
        xs = [x for x, _, _ in points]
        for axis, metric in ((left, "e2el_ms"), (right, "ttft_ms")):
            ys = [summary[metric]["p50"] or 0.0 for _, summary, _ in points]
            axis.plot(xs, ys, marker="o", label=server)
            for x, y, (_, _, label) in zip(xs, ys, points):
                axis.annotate(label, (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    for axis, title in ((left, "end-to-end latency p50 (ms)"), (right, "time to first token p50 (ms)")):
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("loom-bench sweep: throughput against latency")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
