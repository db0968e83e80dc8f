"""The GGUF header reader (loom_proto.gguf_header) gives what gguf's own reader gives, and refuses bad files in one line."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from loom_proto.gguf_header import GGUFFormatError, read_metadata
from loom_router.tokenizer import TokenizerLoadError, _embedded_gguf_path, load_tokenizer


def test_embedded_metadata_equals_ggufs_reader() -> None:
    path = _embedded_gguf_path()
    reader = gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert read_metadata(path) == expected
    assert read_metadata(path, prefix="tokenizer.") == {k: v for k, v in expected.items() if k.startswith("tokenizer.")}


def test_every_value_type_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"a.u8": (7, gguf.GGUFValueType.UINT8), "a.i16": (-3, gguf.GGUFValueType.INT16),
              "a.u32": (70000, gguf.GGUFValueType.UINT32), "a.i64": (-2**40, gguf.GGUFValueType.INT64),
              "a.f32": (0.5, gguf.GGUFValueType.FLOAT32), "a.f64": (0.1, gguf.GGUFValueType.FLOAT64),
              "a.bool": (True, gguf.GGUFValueType.BOOL), "a.str": ("héllo", gguf.GGUFValueType.STRING)}
    for key, (value, kind) in values.items():
        writer.add_key_value(key, value, kind)
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.strs", ["x", "", "ünï"])
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = read_metadata(path, prefix="a.")
    assert got == {key: value for key, (value, _) in values.items()} | {"a.ints": [1, -2, 3], "a.strs": ["x", "", "ünï"]}


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(tmp_path: Path) -> None:
    (tmp_path / "text.gguf").write_text("hello, this is not a GGUF file at all")
    with pytest.raises(GGUFFormatError, match="magic"):
        read_metadata(tmp_path / "text.gguf")
    whole = _embedded_gguf_path().read_bytes()[:4096]  # the vocabulary runs past 4 KiB
    (tmp_path / "cut.gguf").write_bytes(whole)
    with pytest.raises(TokenizerLoadError, match="not a readable GGUF file .*truncated"):
        load_tokenizer(str(tmp_path / "cut.gguf"))
