"""A GGUF of another format kept quantized (--quantize auto) against dequantized (none): the embedded
SmolLM2-135M-Instruct requantized by llama.cpp's own quantizer (libllama's llama_model_quantize,
the peer's build in ../shared/peers), then decode steps of the two loadings, each with its layers
in one C++ call and module by module, taking turns.

Run: python bench/bench_gguf_formats.py [--ftype Q4_K_M] [--batches 1 8] [--rounds 4]
     [--random 1024 4096 16]  (a random Llama of K-quant widths instead of SmolLM2's 576)
     [--also-without Q6_K]    (a third loading with that file format dequantized: what keeping it gains)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from bench_engine import bench_decode, load_gguf, make_runner
from common import machine
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from loom_shard.cpu import cpu_flags
from loom_shard.layers.quant_linear import KEPT_AS
from loom_shard.loading.loader import resolve_model_path
from loom_shard.loading.quantize import quantized_summary

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13,
          "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}  # llama_ftype
PEER_LIBS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama.cpp" / "bin"


class QuantizeParams(ctypes.Structure):
    """llama_model_quantize_params: its first two fields (stable across llama.cpp releases), then
    room for the rest, which llama_model_quantize_default_params fills."""

    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int32), ("rest", ctypes.c_uint8 * 504)]


def write_f32(source: Path, target: Path) -> None:
    """The GGUF with every tensor dequantized to float32 (what llama-quantize starts from)."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_f32(target: Path, hidden: int, intermediate: int, layers: int, vocab: int = 32000) -> None:
    """A random Llama of the given widths (heads of 64, a quarter as many kv heads, tied embeddings)
    as a float32 GGUF: a K-quant file's shapes, where every width is a multiple of 256."""
    heads = hidden // 64
    writer = GGUFWriter(target, "llama")
    writer.add_name("random")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 4)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)

    def weight(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), dtype=np.float32) * columns**-0.5).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = heads // 4 * 64
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (intermediate, hidden)),
                            ("ffn_up", (intermediate, hidden)), ("ffn_down", (hidden, intermediate))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_quantize(source: Path, target: Path, ftype: str, libs: Path) -> None:
    for name in ("libggml-base.so.0", "libggml.so.0"):
        ctypes.CDLL(str(libs / name), mode=ctypes.RTLD_GLOBAL)
    llama = ctypes.CDLL(str(libs / "libllama.so.0"))
    llama.llama_model_quantize_default_params.restype = QuantizeParams
    llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    llama.llama_model_quantize.restype = ctypes.c_uint32
    params = llama.llama_model_quantize_default_params()
    params.nthread, params.ftype = os.cpu_count() or 1, FTYPES[ftype]
    if llama.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {ftype}")


def formats(path: Path) -> str:
    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{kind} x{count}" for kind, count in sorted(counts.items()))


@contextmanager
def dequantizing(file_formats: list[str]) -> Iterator[None]:
    """Loads within dequantize these file formats instead of converting them to a kept one."""
    saved = {name: KEPT_AS.pop(name) for name in file_formats if name in KEPT_AS}
    try:
        yield
    finally:
        KEPT_AS.update(saved)


def cpu_line() -> str:
    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    return f"{machine()}, torch {torch.__version__}; SIMD flags {' '.join(simd)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--llama-libs", type=Path, default=PEER_LIBS)
    parser.add_argument("--random", type=int, nargs=3, metavar=("HIDDEN", "INTERMEDIATE", "LAYERS"),
                        help="a random Llama of these widths instead of the embedded model (multiples of 256: "
                             "K-quants throughout)")
    parser.add_argument("--layers", nargs="+", default=["fused", "modules"], choices=["fused", "modules"],
                        help="the layers in one C++ call where they can be, or module by module; interleaved")
    parser.add_argument("--also-without", nargs="+", default=[], metavar="FORMAT",
                        help="also load with these file formats dequantized (e.g. Q6_K), interleaved")
    args = parser.parse_args()
    print(f"machine: {cpu_line()}")
    with tempfile.TemporaryDirectory() as folder:
        f32, target = Path(folder) / "f32.gguf", Path(folder) / f"{args.ftype}.gguf"
        if args.random:
            hidden, intermediate, layers = args.random
            print(f"writing a random Llama ({hidden} wide, {intermediate} MLP, {layers} layers) in float32 ...",
                  flush=True)
            write_random_f32(f32, hidden, intermediate, layers)
        else:
            print("writing the embedded model in float32 ...", flush=True)
            write_f32(resolve_model_path(""), f32)
        print(f"quantizing to {args.ftype} with llama.cpp ...", flush=True)
        llama_quantize(f32, target, args.ftype, args.llama_libs)
        print(f"{args.ftype} file: {formats(target)}")
        runners = {}
        loadings = {"auto": ("auto", []), "none": ("none", [])}
        if args.also_without:
            loadings = {"auto": ("auto", []), f"auto-{'-'.join(args.also_without)}": ("auto", args.also_without),
                        "none": ("none", [])}
        for label, (quantize, dequantized) in loadings.items():
            with dequantizing(dequantized):
                model = load_gguf(str(target), quantize)
            print(f"{label}: {quantized_summary(model)}")
            runners[label] = make_runner(model, args.dtype, num_blocks=2048)
        variants = [(quantize, layers) for quantize in runners for layers in args.layers]
        for batch in args.batches:
            times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            for round_ in range(args.rounds):
                for quantize, layers in variants if round_ % 2 == 0 else reversed(variants):
                    runner = runners[quantize]
                    runner.model.fused_layers.enabled = layers == "fused"
                    times[quantize, layers].append(bench_decode(runner, batch, args.steps).step_ms)
            base = min(times["none", args.layers[-1]])
            for (quantize, layers), steps in times.items():
                fused = runner_fuses(runners[quantize]) if layers == "fused" else False
                print(f"batch {batch:3d} {quantize:12s} {layers:7s} (one call: {fused!s:5}): "
                      f"{min(steps):6.2f} ms/step (rounds {', '.join(f'{t:.2f}' for t in steps)}), "
                      f"{base / min(steps):.2f}x none/{args.layers[-1]}")


def runner_fuses(runner) -> bool:
    model = runner.model
    return bool(model.fused_layers.args(model.layers, plain_model=True)[0])


if __name__ == "__main__":
    main()
