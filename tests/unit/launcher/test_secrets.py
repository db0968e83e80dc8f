"""API keys travel from the launcher to the router on stdin, never on a command line (which
`ps` shows to every user), and read from flags, a comma-separated env var, or the JSON."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import pytest

from loom_launcher.cli import child_env, load_settings, router_spec
from loom_launcher.supervisor import ProcessSpec, Supervisor
from loom_proto.config import RouterConfig, parse_config, secrets_json

KEYS = ("sk-alpha-0001", "sk-beta-0002")


def test_api_keys_from_repeated_flags_and_from_one_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = load_settings(["--api-key", KEYS[0], "--api-key", KEYS[1]])
    assert tuple(key.get_secret_value() for key in flags.api_key) == KEYS
    monkeypatch.setenv("LOOM_API_KEY", f"{KEYS[0]}, {KEYS[1]}")
    monkeypatch.setenv("LOOM_CORS_ALLOW_ORIGIN", "https://a.example,https://b.example")
    env = load_settings([])
    assert tuple(key.get_secret_value() for key in env.api_key) == KEYS
    assert env.cors_allow_origin == ("https://a.example", "https://b.example")


def test_the_routers_argv_holds_no_key_and_its_stdin_brings_them(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_settings(["--api-key", KEYS[0], "--api-key", KEYS[1], "--port", "3100"]).router_config()
    spec = router_spec(config, {})
    assert not any(key in arg for key in KEYS for arg in spec.argv)
    assert spec.argv[-1] == "--secrets-on-stdin" and spec.stdin_text is not None
    monkeypatch.setattr(sys, "stdin", io.StringIO(spec.stdin_text))
    parsed = parse_config(RouterConfig, list(spec.argv[3:]), "loom-router", "")
    assert parsed == config and parsed.port == 3100
    assert tuple(key.get_secret_value() for key in parsed.api_key) == KEYS


def test_without_keys_nothing_goes_to_stdin() -> None:
    config = load_settings([]).router_config()
    assert secrets_json(config) is None
    spec = router_spec(config, {})
    assert spec.stdin_text is None and "--secrets-on-stdin" not in spec.argv


def test_the_supervisor_writes_stdin_text_to_the_child(tmp_path: Path) -> None:
    out = tmp_path / "got"
    script = f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"
    supervisor = Supervisor(threading.Event(), log=lambda line: None)
    child = supervisor.spawn(ProcessSpec("child", (sys.executable, "-c", script), {}, stdin_text='{"k": 1}\n'))
    assert child.process.wait(timeout=30) == 0
    assert out.read_text() == '{"k": 1}\n'


def test_the_key_variable_is_not_handed_down_to_the_children() -> None:
    env = child_env({"LOOM_API_KEY": KEYS[0], "LOOM_PORT": "1", "PATH": "/bin"}, num_threads=1)
    assert "LOOM_API_KEY" not in env and env["PATH"] == "/bin"


@pytest.mark.parametrize("argv, env", [(["--api-key", ""], None), (["--api-key", "   "], None),
                                       (["--api-key", KEYS[0], "--api-key", ""], None),
                                       ([], ""), ([], f"{KEYS[0]},"), ([], " , ")])
def test_a_blank_key_is_refused_at_start(argv: list[str], env: str | None, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An unset variable expanded into `--api-key ''` or `LOOM_API_KEY=` must not turn auth off."""
    if env is not None:
        monkeypatch.setenv("LOOM_API_KEY", env)
    with pytest.raises(SystemExit):
        load_settings(argv)
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "", "# keys go here\n\n   \n"])
def test_a_key_file_without_a_key_stops_the_launcher_before_anything_loads(
        content: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"  # None: no such file
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        load_settings(["--api-key-file", str(path)])
    assert "--api-key-file" in capsys.readouterr().err
