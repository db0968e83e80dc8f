"""A StepPlan's protobuf bytes, written directly: the router sends one every step, and building a
message object per running request (`to_pb`) cost ~1.7 us each, as much as the rest of the
router's work on a decoding sequence. The bytes are the protobuf encoding of `to_pb(plan)` (same
fields, in field-number order); tests/unit/test_codec.py parses them back against it. Nested
messages that only new requests and forks carry are still built by `to_pb`; the plain decodes
(most of a decode step) are one packed column of ids, `decode_ids`.

Wire format reminder: a field is a varint key (field number << 3 | wire type) then its value;
wire type 0 is a varint, 2 a length-delimited run (a nested message, bytes, or a packed repeated
scalar). Fields at their default (0, empty) are left out, as protobuf does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loom_proto.codec import pb, to_pb
from loom_proto.step import RunningRequest, StepPlan

_SMALL = [bytes([i]) for i in range(128)]


def varint(value: int) -> bytes:
    """An unsigned varint; ValueError for a negative value."""
    if 0 <= value < 128:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(key: bytes, body: bytes) -> bytes:
    return key + varint(len(body)) + body


def _packed(key: bytes, values: Iterable[int]) -> bytes:
    return _delimited(key, b"".join([varint(v) for v in values]))


# Keys: StepPlan (1 new_requests, 2 running_requests, 3 released_ids, 4 swap_out, 5 swap_in,
# 7 allowed_token_masks; 8 decode_ids, serialized by protobuf); RunningRequest (1 request_id,
# 2 num_compute, 3 new_block_ids, 4 forks, 5 draft_token_ids); BlockPair (1 src, 2 dst); a map
# entry (1 key, 2 value).
_NEW, _RUNNING, _RELEASED, _SWAP_OUT, _SWAP_IN, _MASKS = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x3a"
_ID, _COMPUTE, _BLOCKS, _FORKS, _DRAFTS = b"\x08", b"\x10", b"\x1a", b"\x22", b"\x2a"
_FIRST, _SECOND, _SECOND_BYTES = b"\x08", b"\x10", b"\x12"


def _running(request: RunningRequest) -> bytes:
    parts = [_ID, varint(request.request_id)]
    if request.num_compute:
        parts += [_COMPUTE, varint(request.num_compute)]
    if request.new_block_ids:
        parts.append(_packed(_BLOCKS, request.new_block_ids))
    for fork in request.forks:
        parts.append(_delimited(_FORKS, to_pb(fork).SerializeToString()))
    if request.draft_token_ids:
        parts.append(_packed(_DRAFTS, request.draft_token_ids))
    return _delimited(_RUNNING, b"".join(parts))


def _pair(key: bytes, src: int, dst: int) -> bytes:
    body = (_FIRST + varint(src) if src else b"") + (_SECOND + varint(dst) if dst else b"")
    return _delimited(key, body)


def _pairs(key: bytes, pairs: Sequence[tuple[int, int]]) -> list[bytes]:
    return [_pair(key, src, dst) for src, dst in pairs]


def _mask(request_id: int, mask: bytes) -> bytes:
    body = (_FIRST + varint(request_id) if request_id else b"") + (_delimited(_SECOND_BYTES, mask) if mask else b"")
    return _delimited(_MASKS, body)


def encode_plan(plan: StepPlan) -> bytes:
    """The wire bytes of `to_pb(plan)`. What a request brought (a new request in full, a fork's
    sampling) goes through `to_pb`, which checks every value's range; what is written here by
    hand is the router's own counting (ids, block ids, token counts)."""
    parts = [_delimited(_NEW, to_pb(request).SerializeToString()) for request in plan.new_requests]
    decode_ids: list[int] = []
    for request in plan.running_requests:
        if request.plain_decode:
            decode_ids.append(request.request_id)
        else:
            parts.append(_running(request))
    if plan.released_ids:
        parts.append(_packed(_RELEASED, plan.released_ids))
    parts += _pairs(_SWAP_OUT, plan.swap_out)
    parts += _pairs(_SWAP_IN, plan.swap_in)
    parts += [_mask(request_id, mask) for request_id, mask in plan.allowed_token_masks.items()]
    if decode_ids:  # a message holding only this field serializes to exactly its bytes, in C
        parts.append(pb.StepPlan(decode_ids=decode_ids).SerializeToString())
    return b"".join(parts)
