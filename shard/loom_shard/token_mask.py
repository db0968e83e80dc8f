"""Applies the router's allowed-token bitmasks (constrained decoding) to a step's logits.

The router compiles grammars and computes, per constrained sequence, which tokens it may
sample next; the shard only sets the others to -inf, for all masked rows at once. A mask
is packed little-endian int32 words: token t is allowed when bit t % 32 of word t // 32
is set; ids past the mask's end are disallowed.
"""

from __future__ import annotations

import sys

import torch

_BITS = 32


def check_mask(request_id: int, mask: bytes) -> None:
    """Raises ValueError for a mask that cannot be a packed int32 bitmask."""
    if not mask or len(mask) % 4:
        raise ValueError(f"request {request_id}: allowed-token mask of {len(mask)} bytes is not whole int32 words")


def unpack_masks(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed bitmasks -> bool [len(masks), vocab_size], True = allowed (no per-token Python)."""
    num_words = max(len(m) for m in masks) // 4
    packed = b"".join(m.ljust(num_words * 4, b"\x00") for m in masks)
    assert sys.byteorder == "little", "masks are little-endian int32 words"
    words = torch.frombuffer(bytearray(packed), dtype=torch.int32).to(device)  # [rows * num_words]
    words = words.view(len(masks), num_words, 1)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)  # [32]
    bits = ((words >> shifts) & 1).view(len(masks), num_words * _BITS).bool()  # [rows, num_words * 32]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(len(masks), vocab_size - bits.shape[1], dtype=torch.bool, device=device)
    return torch.cat([bits, pad], dim=1)


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
    allowed = unpack_masks([masks[i] for i in rows], logits.shape[1], logits.device)  # [rows, vocab]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    masked = logits.clone()
    masked[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return masked
