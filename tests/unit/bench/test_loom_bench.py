"""loom-bench's parts that need no server: datasets, arrivals, statistics, goodput, CLI checks."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from loom_bench import datasets
from loom_bench.backends import RequestResult
from loom_bench.cli import build_parser, loads, main
from loom_bench.runner import Load
from loom_bench.stats import parse_goodput, percentile, ratios, summarize


def test_random_requests_are_seeded_and_within_the_range() -> None:
    a = datasets.random_requests(20, 100, 10, 0.5, seed=1)
    assert a == datasets.random_requests(20, 100, 10, 0.5, seed=1)
    assert a != datasets.random_requests(20, 100, 10, 0.5, seed=2)
    assert all(50 <= len(r.prompt.split()) <= 150 and 5 <= r.output_len <= 15 for r in a)


def test_shared_prefix_and_multi_turn_reuse_their_beginnings() -> None:
    shared = datasets.shared_prefix_requests(6, 30, 5, 4, num_prefixes=2, seed=0)
    assert shared[0].prompt.split("\n")[0] == shared[2].prompt.split("\n")[0] != shared[1].prompt.split("\n")[0]
    turns = datasets.multi_turn_requests(5, turns=3, input_len=4, output_len=4, seed=0)
    assert [len(r.messages) for r in turns] == [1, 3, 5, 1, 3]
    assert turns[1].messages[:1] == turns[0].messages and turns[2].prompt.startswith(turns[1].prompt)


def test_jsonl_and_sharegpt_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b", "output_len": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    rows = datasets.jsonl_requests(jsonl, 3, output_len=7)
    assert [(r.prompt, r.output_len) for r in rows] == [("a b", 3), ("user: hi", 7), ("a b", 3)]
    assert rows[1].chat_messages() == [{"role": "user", "content": "hi"}]
    share = tmp_path / "s.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "one two three"}]},
        {"conversations": [{"from": "gpt", "value": "skipped: starts with the model"}]},
    ]))
    (row,) = datasets.sharegpt_requests(share, 1, max_output_len=2, seed=0)
    assert row.prompt == "q1" and row.output_len == 2
    with pytest.raises(ValueError, match="no usable"):
        datasets.jsonl_requests(tmp_path / "p.jsonl", 1, 1) and datasets.sharegpt_requests(
            _write(tmp_path / "empty.json", "[]"), 1, 2, 0)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_poisson_and_gamma_arrivals_have_the_asked_rate() -> None:
    for burstiness in (1.0, 0.25, 4.0):
        gaps = Load(None, 10.0, burstiness).intervals(4000, seed=3)
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
        # gamma's coefficient of variation is 1/sqrt(shape): burstier means more spread
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness ** -0.5, rel=0.15)
    assert Load(2, math.inf).intervals(3, seed=0) == [0.0, 0.0, 0.0]


def test_sweep_loads_are_every_combination() -> None:
    args = build_parser().parse_args(["--concurrency", "1,4", "--request-rate", "2,inf"])
    assert [(x.concurrency, x.request_rate) for x in loads(args)] == [(1, 2.0), (1, math.inf), (4, 2.0), (4, math.inf)]
    assert [x.concurrency for x in loads(build_parser().parse_args([]))] == [None]


def result(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if ok and tokens > 1 else []
    return RequestResult(ok, "s", 5, tokens if ok else 0, ttft, latency, gaps, "" if ok else "HTTP 500: boom")


def test_summary_percentiles_goodput_and_errors() -> None:
    results = [result(0.1, 1.0, 10), result(0.2, 2.0, 10), result(0.3, 3.1, 11), result(0, 0.5, 0, ok=False)]
    s = summarize("s", results, duration_s=4.0, slo_ms=parse_goodput(["ttft:250", "tpot:200"]))
    assert (s.completed, s.failed, s.total_output_tokens, s.total_input_tokens) == (3, 1, 31, 15)
    assert s.request_throughput == 0.75 and s.output_throughput == 31 / 4
    assert s.ttft_ms["mean"] == pytest.approx(200.0) and s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.ttft_ms["p90"] == pytest.approx(280.0)
    assert s.tpot_ms["p50"] == pytest.approx(200.0)  # (2.0 - 0.2) / 9
    assert s.goodput == 2 / 4  # the third misses tpot (280 ms), the failure counts for nothing
    assert s.errors == {"HTTP 500: boom": 1}
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    other = summarize("t", [result(0.2, 2.0, 10)], 1.0, None)
    assert ratios(s, other)["ttft_ms.mean"] == pytest.approx(1.0) and other.goodput is None


def test_bad_flags_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--goodput", "latency:5", "--num-prompts", "1"]) == 2
    assert "--goodput takes KEY:MS" in capsys.readouterr().err
    assert main(["--dataset-name", "jsonl"]) == 2
    assert main(["--num-prompts", "0"]) == 2  # nothing measured is no result
    assert "--num-prompts must be at least 1" in capsys.readouterr().err
    assert main(["--base-url", "http://a:1/", "--compare", "http://a:1", "--num-prompts", "1"]) == 2
    assert "compare two servers" in capsys.readouterr().err


def test_a_missing_dataset_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--dataset-name", "jsonl", "--dataset-path", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


async def test_the_api_key_goes_as_a_bearer_header_and_never_into_the_results(tmp_path: Path) -> None:
    from aiohttp import web

    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"error": "no"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        args = build_parser().parse_args(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
                                          "--api-key", "sk-test", "--no-progress"])
        from loom_bench.cli import bench

        result = await bench(args)
    finally:
        await runner.cleanup()
    assert seen == ["Bearer sk-test"] * 2
    assert "sk-test" not in json.dumps(result)
