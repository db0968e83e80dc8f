"""Snapshot name validation and the path it resolves to."""

from __future__ import annotations

import pytest

from loom_router.frontend.snapshots import SnapshotHTTPError, redact_paths, validate_name

GOOD = ["a", "my-prompt_v2", "système", "日本語のプロンプト", "a b", "x.kv", "a.b.c", "emoji 🚀", "é" * 127]
BAD = {
    "empty": b"",
    "too long": b"a" * 256,
    "too long in bytes": ("é" * 128).encode(),  # 128 characters, 256 bytes
    "invalid utf-8": b"caf\xe9",
    "overlong utf-8": b"\xc0\xaf",
    "encoded surrogate": b"\xed\xa0\x80",
    "slash": b"a/b",
    "backslash": b"a\\b",
    "colon": b"a:b",
    "star": b"a*",
    "question": b"a?",
    "quote": b'a"b',
    "lt": b"a<b",
    "gt": b"a>b",
    "pipe": b"a|b",
    "dot": b".",
    "dotdot": b"..",
    "dotdot inside": b"a..b",
    "traversal": b"../etc",
    "leading dot": b".hidden",
    "leading space": b" a",
    "trailing space": b"a ",
    "trailing tab": b"a\t",
    "trailing dot": b"a.",
    "nul": b"a\x00b",
    "control": b"a\x01b",
    "newline": b"a\nb",
    "del": b"a\x7fb",
    "c1 control": "a\u0085b".encode(),
    "bom": "\ufeffa".encode(),
    "zero width joiner": "a\u200db".encode(),
    "rtl override": "a\u202eb".encode(),
    "line separator": "a\u2028b".encode(),
    "not nfc": "e\u0301".encode(),  # e + combining acute: NFC is é
}


@pytest.mark.parametrize("name", GOOD)
def test_good_names_pass(name: str) -> None:
    assert validate_name(name.encode()) == name


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_names_are_400(case: str) -> None:
    with pytest.raises(SnapshotHTTPError) as info:
        validate_name(BAD[case])
    assert info.value.status == 400 and info.value.message.startswith("invalid snapshot name")


@pytest.mark.parametrize("message, redacted", [
    ("[Errno 2] No such file or directory: '/tmp/x/snaps'", "[Errno 2] No such file or directory: 'snaps'"),
    ("[Errno 39] Directory not empty: '/srv/snaps/s' -> '/srv/snaps/.trash-1'",
     "[Errno 39] Directory not empty: 's' -> '.trash-1'"),
    ("part file rank-0.kv is damaged: checksum mismatch", "part file rank-0.kv is damaged: checksum mismatch"),
    ("see http://host/docs and a/b", "see http://host/docs and a/b"),
    ("invalid snapshot name: '/' is not allowed", "invalid snapshot name: '/' is not allowed"),  # no path
])
def test_absolute_paths_are_cut_to_their_last_part(message: str, redacted: str) -> None:
    assert redact_paths(message) == redacted
