"""The playground page driven in headless Chromium (Debian's, through Playwright's Python package):
the chat flow against the REAL launcher and model, and HTML escaping against a router whose
fake shard writes a chosen text. Screenshots at desktop and phone width land in ARTIFACTS.

Never `playwright install` (it downloads a browser of its own): the test uses the system's
Chromium and installs Debian's `chromium` with apt-get when it runs as root and finds none.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom_proto.config import RouterConfig
from loom_router.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
from api_fakes import FakeShardClient  # noqa: E402
from router_harness import served_router  # noqa: E402

from tests.net import free_port

pytestmark = pytest.mark.slow

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
APT_PACKAGES = ("chromium", "chromium-driver")
ARTIFACTS = Path(os.environ.get("LOOM_TEST_ARTIFACTS", "/tmp/loom-test-artifacts")) / "playground"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
WAIT_MS = 120_000  # the real model on 2 shared CPU cores
# What the fake shard generates: markup that would run or render if the page wrote it as HTML.
HOSTILE_TEXT = ' <script>window.__injected = 1</script><img src="x" onerror="window.__injected = 2"> <b>bold</b>'
CANCELLED = re.compile(r'^loom_requests_finished_total\{reason="cancelled"\} (\S+)$', re.M)



def find_chromium() -> str | None:
    return next((p for p in CHROMIUM_PATHS if os.access(p, os.X_OK)), None)


def chromium_or_skip() -> str:
    """The system Chromium; installed from Debian when missing and we are root, else a skip."""
    path = find_chromium()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", *APT_PACKAGES]):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                pytest.skip(f"no Chromium: `{' '.join(argv)}` failed: {done.stderr[-500:]}")
        path = find_chromium()
    if path is None:
        pytest.skip(f"no Chromium at {', '.join(CHROMIUM_PATHS)} and not root to apt-get install "
                    f"{' '.join(APT_PACKAGES)}")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the root's test extra")
    executable = chromium_or_skip()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"the page's script failed: {errors}"


def cancelled_count(base_url: str) -> float:
    match = CANCELLED.search(httpx.get(f"{base_url}/metrics", timeout=10).text)
    return float(match.group(1)) if match else 0.0


def answer_texts(page: Any) -> list[str]:
    return page.locator("#answers .answer .text").all_text_contents()


def wait_until_idle(page: Any) -> None:
    """The request in flight ended (the stop button is disabled only then)."""
    page.wait_for_function("document.getElementById('stop').disabled")


def save_screenshots(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(viewport)
        page.screenshot(path=str(ARTIFACTS / f"{name}-{label}.png"), full_page=True)
    print(f"playground screenshots: {ARTIFACTS}")


def check_phone_layout(page: Any) -> None:
    """At phone width nothing scrolls sideways and the answers stack instead of squeezing."""
    page.set_viewport_size(PHONE)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    boxes = [card.bounding_box() for card in page.locator("#answers .answer").all()]
    assert len(boxes) >= 2
    assert boxes[1]["y"] >= boxes[0]["y"] + boxes[0]["height"]
    assert boxes[0]["width"] > PHONE["width"] * 0.8
    page.set_viewport_size(DESKTOP)


def test_chat_two_answers_pick_follow_up_and_stop(page: Any, launcher: Any) -> None:
    page.goto(launcher.base_url + "/")
    info = httpx.get(f"{launcher.base_url}/info", timeout=10).json()
    expected_info = f"Model: {info['served_model_name']} · context {info['max_total_tokens']} tokens"
    page.wait_for_function("text => document.getElementById('model-info').textContent === text", arg=expected_info)
    # every control has a label: the page can be used by keyboard and screen reader alone
    assert page.evaluate("[...document.querySelectorAll('input, select, textarea')].every(e => e.labels.length)")
    assert page.evaluate("document.activeElement.id") == "prompt"

    page.select_option("#num-answers", "2")
    assert page.is_visible("#temp-1") and not page.is_visible("#temp-2")  # one temperature per answer
    page.fill("#temp-0", "0")
    page.fill("#temp-1", "1.2")
    page.fill("#max-tokens", "40")
    page.focus("#prompt")
    page.keyboard.type("Name three colors.")
    with page.expect_request("**/v1/chat/completions") as first:
        page.keyboard.press("Enter")
    body = first.value.post_data_json
    assert body["n"] == 2 and body["stream"] is True and "response_format" not in body
    assert body["choice_params"] == [{"temperature": 0}, {"temperature": 1.2}]
    assert body["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    # both answers show text while the request is still in flight: they stream in
    page.wait_for_function("""() => !document.getElementById('stop').disabled &&
        [...document.querySelectorAll('#answers .answer .text')].filter(e => e.textContent).length === 2""")
    wait_until_idle(page)
    first_answers = answer_texts(page)
    assert len(first_answers) == 2 and all(first_answers)
    for stats in page.locator("#answers .stats").all_text_contents():
        assert re.search(r"TTFT \d+ ms · [\d.]+ tokens/s · \d+ tokens? · (stop|length)", stats), stats
    save_screenshots(page, "two-answers")
    check_phone_layout(page)

    page.keyboard.press("Alt+2")  # keyboard pick of answer 2
    conversation = page.locator("#conversation .message .text").all_text_contents()
    assert conversation == ["Name three colors.", first_answers[1]]
    assert page.locator("#answers .answer").count() == 0
    assert page.evaluate("document.activeElement.id") == "prompt"

    page.keyboard.type("And one more?")
    with page.expect_request("**/v1/chat/completions") as follow_up:
        page.keyboard.press("Enter")
    messages = follow_up.value.post_data_json["messages"]
    assert messages[1:] == [{"role": "user", "content": "Name three colors."},
                            {"role": "assistant", "content": first_answers[1]},
                            {"role": "user", "content": "And one more?"}]
    wait_until_idle(page)
    assert all(answer_texts(page))
    page.locator("#answers .pick").first.click()
    assert page.locator("#conversation .message").count() == 4

    cancelled_before = cancelled_count(launcher.base_url)
    page.fill("#max-tokens", "300")
    page.fill("#prompt", "Write a long story about a lighthouse keeper.")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('#answers .answer .text').textContent.length > 0")
    page.keyboard.press("Escape")
    wait_until_idle(page)
    assert page.locator("#status").text_content() == "Stopped."
    assert all("stopped" in s for s in page.locator("#answers .stats").all_text_contents())
    deadline = time.monotonic() + 30
    while cancelled_count(launcher.base_url) < cancelled_before + 1:
        assert time.monotonic() < deadline, "the stopped request was not cancelled on the server"
        time.sleep(0.2)
    save_screenshots(page, "stopped")


class ScriptedShardClient(FakeShardClient):
    """A fake shard whose every sequence generates `words` in order (then EOS), so the test
    knows the text the page receives."""

    def _remap(self, request_id: int, index: int, token_id: int) -> int:
        # Only unconstrained sequences: one in JSON mode keeps what its grammar allowed.
        return self.eos_id if index == self.eos_at else self.words[index % len(self.words)]


def start_scripted_router(**overrides: Any) -> Iterator[tuple[str, str, ScriptedShardClient]]:
    """A real router (engine, HTTP app, uvicorn) in a thread, over the scripted fake shard:
    its URL, the text every answer will be, and the shard (to pace it)."""
    tokenizer = load_tokenizer("")
    words = tokenizer.encode(HOSTILE_TEXT, add_special_tokens=False)
    backend = ScriptedShardClient(words, tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
    backend.eos_at = len(words)
    backend.step_delay_s = 0.01
    port = free_port()
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), hostname="127.0.0.1", port=port,
                          max_total_tokens=256, served_model_name="scripted", **overrides)
    urls: queue.Queue[str] = queue.Queue()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:  # the engine core and a frontend in this thread's loop, uvicorn serving it
        async with served_router(config, backend, tokenizer) as (url, _, _):
            urls.put(url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    url = urls.get(timeout=60)
    yield url, tokenizer.decode(words), backend
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@pytest.fixture(scope="module")
def scripted_router() -> Iterator[tuple[str, str, ScriptedShardClient]]:
    yield from start_scripted_router()


@pytest.fixture(scope="module")
def keyed_router() -> Iterator[tuple[str, str, ScriptedShardClient]]:
    """The same router started with --api-key right-key."""
    yield from start_scripted_router(api_key=["right-key"])


def test_model_output_is_shown_as_text(page: Any, scripted_router: tuple[str, str, ScriptedShardClient]) -> None:
    url, expected, _ = scripted_router
    assert "<script>" in expected
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model-info').textContent.startsWith('Model: scripted')")
    page.fill("#prompt", "Say something.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    assert "response_format" not in sent.value.post_data_json
    wait_until_idle(page)
    assert answer_texts(page) == [expected, expected]
    save_screenshots(page, "escaped-output")
    check_phone_layout(page)
    page.locator("#answers .pick").nth(1).click()
    assert page.locator("#conversation .message .text").last.text_content() == expected
    # nothing of the output became markup, and none of it ran
    assert page.locator("main script, main img, main b").count() == 0
    assert page.evaluate("window.__injected") is None


def test_json_mode_sends_response_format(page: Any, scripted_router: tuple[str, str, ScriptedShardClient]) -> None:
    """The toggle asks for JSON; the server enforces it (tests/e2e/test_structured_e2e.py checks the JSON itself)."""
    url, expected, _ = scripted_router
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model-info').textContent.startsWith('Model: scripted')")
    page.check("#json-mode")
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "Answer in JSON.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    assert sent.value.post_data_json["response_format"] == {"type": "json_object"}
    wait_until_idle(page)
    texts = answer_texts(page)
    assert texts and all(text.lstrip().startswith(("{", "[")) for text in texts), texts  # not the script
    assert expected not in texts


def test_api_key_is_sent_and_401_is_shown(page: Any, keyed_router: tuple[str, str, ScriptedShardClient]) -> None:
    """Against a router started with --api-key: the page loads without a key, a wrong key's 401 is
    shown clearly, and the right key, sent as a Bearer token, gets answers."""
    url, expected, _ = keyed_router
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model-info').textContent.includes('API key')")
    page.fill("#api-key", "wrong-key")
    page.fill("#prompt", "Hello?")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    assert sent.value.headers["authorization"] == "Bearer wrong-key"
    wait_until_idle(page)
    alert = page.locator("#auth-error")
    assert alert.is_visible() and alert.get_attribute("role") == "alert"
    assert "401 Unauthorized" in alert.text_content()
    assert page.get_attribute("#api-key", "aria-invalid") == "true"
    assert page.input_value("#prompt") == "Hello?"  # nothing was answered: the message is kept to resend
    page.fill("#api-key", "right-key")
    with page.expect_request("**/v1/chat/completions") as resent:
        page.press("#prompt", "Enter")
    assert resent.value.headers["authorization"] == "Bearer right-key"
    wait_until_idle(page)
    assert page.is_hidden("#auth-error")
    assert answer_texts(page) == [expected, expected]


def test_a_turn_is_settled_before_the_next(page: Any, scripted_router: tuple[str, str, ScriptedShardClient]) -> None:
    """Several answers wait for a pick before the conversation goes on; a single one is taken."""
    url, expected, _ = scripted_router
    sent: list[Any] = []
    page.on("request", lambda request: sent.append(request) if request.url.endswith("/chat/completions") else None)
    page.goto(url + "/")
    page.fill("#max-tokens", "60")  # the scripted answer and the history fit the 256-token context
    page.fill("#prompt", "First?")
    page.press("#prompt", "Enter")
    wait_until_idle(page)
    page.fill("#prompt", "Second?")
    page.press("#prompt", "Enter")
    assert page.locator("#status").text_content().startswith("Pick the answer")
    assert page.evaluate("document.activeElement.textContent") == "Continue with answer 1"
    assert len(sent) == 1 and page.input_value("#prompt") == "Second?"
    page.keyboard.press("Enter")  # the focused pick button
    page.select_option("#num-answers", "1")
    page.press("#prompt", "Enter")
    wait_until_idle(page)
    page.wait_for_function("document.querySelectorAll('#conversation .message').length === 4")
    assert page.locator("#conversation .message .text").all_text_contents() == [
        "First?", expected, "Second?", expected]
    assert sent[1].post_data_json["n"] == 1 and page.locator("#answers .answer").count() == 0


FOCUS_NAME = """() => { const e = document.activeElement;
    return e.id || (e.tagName === 'SUMMARY' ? 'settings' : e.textContent.trim()); }"""


def test_tab_reaches_every_control_in_reading_order(page: Any, scripted_router: tuple[str, str, ScriptedShardClient]) -> None:
    url, _, _ = scripted_router
    page.goto(url + "/")
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Enter")
    wait_until_idle(page)
    page.focus("#api-key")
    order = [page.evaluate(FOCUS_NAME)]
    for _ in range(12):
        page.keyboard.press("Tab")
        order.append(page.evaluate(FOCUS_NAME))
    # Stop is disabled while idle, so Tab skips it; the hidden temperatures (3, 4) are skipped too
    assert order == ["api-key", "settings", "system-prompt", "num-answers", "max-tokens", "json-mode",
                     "temp-0", "temp-1", "Continue with answer 1", "Continue with answer 2", "prompt", "send",
                     "new-chat"]


def test_the_stop_button_cancels_on_the_server(page: Any, scripted_router: tuple[str, str, ScriptedShardClient]) -> None:
    url, expected, backend = scripted_router
    backend.step_delay_s = 0.3  # slow enough to stop after the first token
    try:
        page.goto(url + "/")
        cancelled_before = cancelled_count(url)
        page.fill("#prompt", "Hello")
        page.click("#send")
        page.wait_for_function("document.querySelector('#answers .answer .text').textContent.length > 0")
        page.click("#stop")
        wait_until_idle(page)
    finally:
        backend.step_delay_s = 0.01
    assert page.locator("#status").text_content() == "Stopped."
    assert all(len(text) < len(expected) for text in answer_texts(page))
    deadline = time.monotonic() + 30
    while cancelled_count(url) < cancelled_before + 1:
        assert time.monotonic() < deadline, "the stopped request was not cancelled on the server"
        time.sleep(0.1)
