"""The request sequences loom-bench sends: random lengths, a shared prefix, multi-turn chats,
a JSONL file of prompts, or a ShareGPT-format file. Seeded: the same flags, the same requests."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# Plain words: roughly one token each with common tokenizers, so lengths in words are close
# to lengths in tokens (the servers report the exact counts, which the results use).
WORDS = ("the of and to in is was for on that with as by at from his her they an be this are or "
         "had not but what all were when we there can more if one about so out up time said some "
         "would into has them could other than then like may these people first been water long "
         "find day get come made part over new sound take only little work know place year live "
         "back give most very after thing our just name good sentence man think say great where "
         "help through much before line right too mean old any same tell boy follow came want show").split()


@dataclass(slots=True)
class BenchRequest:
    """One request: a prompt, or chat messages, and the tokens to generate."""

    prompt: str
    output_len: int
    messages: list[dict[str, str]] = field(default_factory=list)  # for openai-chat; else [prompt as user]

    def chat_messages(self) -> list[dict[str, str]]:
        return self.messages or [{"role": "user", "content": self.prompt}]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = max(int(mean * (1 - range_ratio)), 1), max(int(mean * (1 + range_ratio)), 1)
    return rng.randint(low, high)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_words(rng, _length(rng, input_len, range_ratio)), _length(rng, output_len, range_ratio))
            for _ in range(n)]


def shared_prefix_requests(n: int, prefix_len: int, input_len: int, output_len: int, num_prefixes: int,
                           seed: int) -> list[BenchRequest]:
    """`num_prefixes` system-prompt-like prefixes, each request one of them plus its own question."""
    rng = random.Random(seed)
    prefixes = [_words(rng, prefix_len) for _ in range(max(num_prefixes, 1))]
    return [BenchRequest(f"{prefixes[i % len(prefixes)]}\n{_words(rng, input_len)}", output_len) for i in range(n)]


def multi_turn_requests(n: int, turns: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Conversations of `turns` user turns; request k of a conversation carries turns 1..k with
    synthetic assistant replies, so each turn's prompt extends the previous one (prefix reuse)."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    while len(out) < n:
        messages: list[dict[str, str]] = []
        for _ in range(turns):
            messages.append({"role": "user", "content": _words(rng, input_len)})
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            out.append(BenchRequest(prompt, output_len, list(messages)))
            messages.append({"role": "assistant", "content": _words(rng, output_len)})
    return out[:n]


def jsonl_requests(path: Path, n: int, output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str} or {"messages": [...]}, optional "output_len"."""
    out: list[BenchRequest] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            messages = row["messages"]
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        elif "prompt" in row:
            messages, prompt = [], row["prompt"]
        else:
            raise ValueError(f"{path}:{number}: needs `prompt` or `messages`")
        out.append(BenchRequest(prompt, int(row.get("output_len", output_len)), messages))
    return _cycle(out, n, path)


def sharegpt_requests(path: Path, n: int, max_output_len: int, seed: int) -> list[BenchRequest]:
    """ShareGPT's [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]:
    the first human turn is the prompt, the reply's length in words (capped) the output length."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for item in json.loads(path.read_text()):
        turns = item.get("conversations", [])
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        reply_words = len(str(turns[1].get("value", "")).split())
        out.append(BenchRequest(str(turns[0]["value"]), max(1, min(reply_words, max_output_len))))
    rng.shuffle(out)
    return _cycle(out, n, path)


def _cycle(requests: list[BenchRequest], n: int, path: Path) -> list[BenchRequest]:
    if not requests:
        raise ValueError(f"{path}: no usable request")
    return [requests[i % len(requests)] for i in range(n)]
