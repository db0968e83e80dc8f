"""Applies the router's allowed-token bitmasks (constrained decoding) to a step's logits.

The router compiles grammars and computes, per constrained sequence, which tokens it may
sample next; the shard only sets the others to -inf, for all masked rows at once. A mask
is packed little-endian int32 words: token t is allowed when bit t % 32 of word t // 32
is set; ids past the mask's end are disallowed.
"""

from __future__ import annotations

import torch

from loom_shard.transfers import to_device


def check_mask(request_id: int, mask: bytes) -> None:
    """Raises ValueError for a mask that cannot be a packed int32 bitmask."""
    if not mask or len(mask) % 4:
        raise ValueError(f"request {request_id}: allowed-token mask of {len(mask)} bytes is not whole int32 words")


def mask_bias(masks: list[bytes], vocab_size: int, device: torch.device,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed bitmasks -> [len(masks), vocab_size] additive bias: 0 allowed, -inf not.

    Little-endian int32 words make token t bit t % 8 of byte t // 8, so a table from a byte
    to its 8 biases unpacks every mask with one index_select (no per-token Python). Adding
    a bias is several times faster on the CPU than masked_fill with a bool mask.
    """
    num_bytes = max(len(m) for m in masks)
    packed = b"".join(m.ljust(num_bytes, b"\x00") for m in masks)
    data = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(device)  # [rows * num_bytes]
    bias = _byte_bias(device, dtype).index_select(0, data.long()).view(len(masks), num_bytes * 8)
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    pad = torch.full((len(masks), vocab_size - bias.shape[1]), float("-inf"), dtype=dtype, device=device)
    return torch.cat([bias, pad], dim=1)


def unpack_masks(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed bitmasks -> bool [len(masks), vocab_size], True = allowed."""
    return mask_bias(masks, vocab_size, device) == 0


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: 0 where bit j of byte value b is set, else -inf (built once per device and dtype)."""
    table = _BYTE_BIAS.get((device, dtype))
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)  # [256, 1]
        bits = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool()  # [256, 8], least significant first
        table = torch.zeros(256, 8, dtype=dtype).masked_fill(~bits, float("-inf")).to(device)
        _BYTE_BIAS[(device, dtype)] = table
    return table


def apply_allowed_masks(logits: torch.Tensor, masks: list[bytes | None]) -> torch.Tensor:
    """Sets every disallowed token's logit to -inf in the rows that carry a mask.

    Args:
        logits: [num_seqs, vocab] processed logits; not modified.
        masks: one per row; None leaves the row as it is.
    Returns:
        `logits` itself when no row is masked, else a masked copy.
    """
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return logits
    bias = mask_bias([masks[i] for i in rows], logits.shape[1], logits.device, logits.dtype)  # [rows, vocab]
    if len(rows) == len(masks):  # every row constrained: one add, no gather/scatter
        return logits + bias
    index = to_device(rows, logits.device)
    masked = logits.clone()
    masked[index] = logits.index_select(0, index) + bias
    return masked
