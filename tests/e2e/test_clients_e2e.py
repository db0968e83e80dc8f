"""Clients nobody here wrote, against the real launcher and the embedded model: lm-eval's
local-completions loglikelihood (a tiny local task, no downloads), the anthropic client on the
Messages API, the openai client on the Responses API, and forced tool calls that end."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from conftest import Launcher

from loom_router.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

CONTEXTS = ["The capital of France is", "Once upon a time, there was a"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


def hf_tokenizer_folder(folder: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face folder (what lm-eval loads)."""
    tokenizer = load_tokenizer("")
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer.backend_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def loglikelihood_task(folder: Path, docs: list[dict[str, str]]) -> Path:
    """A loglikelihood task over `docs` ({"context", "continuation"}); its acc is lm-eval's
    is_greedy (every continuation token the model's most likely one)."""
    folder.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "loom_greedy.yaml").write_text(f"""task: loom_greedy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def test_lm_eval_scores_a_loglikelihood_task(server: Launcher, client: openai.OpenAI, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    # Each context with the model's own greedy next token (acc 1), and with an unlikely one (acc 0).
    greedy = [client.completions.create(model="loom", prompt=c, max_tokens=1, temperature=0).choices[0].text
              for c in CONTEXTS]
    docs = [{"context": c, "continuation": g} for c, g in zip(CONTEXTS, greedy)]
    docs += [{"context": c, "continuation": " zebra"} for c in CONTEXTS]
    tasks = loglikelihood_task(tmp_path / "tasks", docs)
    tokenizer = hf_tokenizer_folder(tmp_path / "tokenizer")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["loom_greedy"], batch_size=2, log_samples=True,
        model_args={"base_url": f"{server.base_url}/v1/completions", "model": "loom", "tokenizer": str(tokenizer),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1},
        task_manager=TaskManager(include_path=str(tasks)))
    samples = sorted(results["samples"]["loom_greedy"], key=lambda s: s["doc_id"])
    scores = [s["resps"][0][0] for s in samples]  # (loglikelihood, is_greedy) of each doc
    assert [greedy for _, greedy in scores] == [True, True, False, False]
    assert all(ll < 0 for ll, _ in scores) and scores[0][0] > scores[2][0] and scores[1][0] > scores[3][0]
    assert results["results"]["loom_greedy"]["acc,none"] == 0.5
    # the same numbers as the server's own echo of the prompt with the continuation
    scored = client.completions.create(model="loom", prompt=CONTEXTS[0] + " zebra", max_tokens=0, echo=True,
                                       logprobs=1)
    num_context = len(scored.choices[0].logprobs.tokens) - len(tokenizer_ids(" zebra"))
    assert sum(scored.choices[0].logprobs.token_logprobs[num_context:]) == pytest.approx(scores[2][0], abs=1e-3)


def tokenizer_ids(text: str) -> list[int]:
    return load_tokenizer("").encode(text, add_special_tokens=False)


def test_a_forced_tool_call_ends_after_one_call(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        out = client.chat.completions.create(model="loom", messages=ask, tools=[WEATHER], tool_choice=tool_choice,
                                             max_tokens=60, temperature=0)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}


def test_anthropic_messages_whole_and_streamed(server: Launcher) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = {"temperature": 0}  # a field of Anthropic's API that this client version no longer names
    out = client.messages.create(model="loom", max_tokens=12, system="Answer briefly.", messages=ask,
                                 extra_body=greedy)
    assert out.content[0].type == "text" and out.content[0].text
    assert out.stop_reason in ("end_turn", "max_tokens") and out.usage.output_tokens > 0
    with client.messages.stream(model="loom", max_tokens=12, system="Answer briefly.", messages=ask,
                                extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
    assert text == out.content[0].text
    assert client.messages.count_tokens(model="loom", system="Answer briefly.",
                                        messages=ask).input_tokens == out.usage.input_tokens


def test_openai_responses_whole_streamed_and_continued(client: openai.OpenAI) -> None:
    out = client.responses.create(model="loom", input="What is the capital of France?", max_output_tokens=12,
                                  temperature=0, instructions="Answer briefly.")
    assert out.output_text and out.usage.input_tokens > 0
    with client.responses.stream(model="loom", input="What is the capital of France?", max_output_tokens=12,
                                 temperature=0, instructions="Answer briefly.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == out.output_text
    follow = client.responses.create(model="loom", input="And of Italy?", previous_response_id=out.id,
                                     max_output_tokens=12, temperature=0)
    assert follow.usage.input_tokens > out.usage.input_tokens + out.usage.output_tokens
