"""The step socket's framing (loom_proto.step_channel): frames cut anywhere, or several in one
read, come out whole and in order."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from loom_proto import step_channel
from loom_proto.step_channel import _Frames


def test_requests_cut_anywhere_or_sent_together_come_out_whole_and_in_order() -> None:
    first = step_channel.encode_request(b"plan-1", (("traceparent", "00-abc-def-01"),))
    second = step_channel.encode_request(b"", None)
    data = first + second
    for cut in range(len(data) + 1):
        frames = _Frames()
        frames.feed(data[:cut])
        got = []
        while (request := frames.request()) is not None:
            got.append(request)
        frames.feed(data[cut:])
        while (request := frames.request()) is not None:
            got.append(request)
        assert got == [(b"plan-1", (("traceparent", "00-abc-def-01"),)), (b"", ())], cut


def test_replies_carry_their_status_and_payload() -> None:
    frames = _Frames()
    frames.feed(step_channel.encode_reply(step_channel.OK, b"result") + step_channel.encode_reply(3, b"refused")[:4])
    assert frames.reply() == (step_channel.OK, b"result")
    assert frames.reply() is None  # the second one is not whole yet
    frames.feed(step_channel.encode_reply(3, b"refused")[4:])
    assert frames.reply() == (3, b"refused")


async def test_a_closed_step_socket_leaves_no_file(tmp_path: Path) -> None:
    path = str(tmp_path / "shard.sock.step")

    async def handle(plan: bytes, metadata: step_channel.Metadata) -> tuple[int, bytes]:
        return step_channel.OK, plan

    server = await step_channel.serve(path, handle)
    assert os.path.exists(path)
    step_channel.close(server)
    assert not os.path.exists(path)


async def test_a_live_socket_is_never_taken_over(tmp_path: Path) -> None:
    from loom_shard.server import start_server

    path = str(tmp_path / "shard.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:  # another server's, still listening
        other.bind(path)
        other.listen()
        with pytest.raises(OSError, match="another process serves"):
            await start_server(None, uds_path=path)  # type: ignore[arg-type]
        with pytest.raises(OSError, match="another process serves"):
            await step_channel.serve(path, lambda plan, metadata: None)  # type: ignore[arg-type,return-value]
    step_channel.refuse_live_socket(path)  # closed: a stale file, replaced as before
