"""The shard's door: every call must carry the router's shared secret (loom_proto.shard_auth).

A call without it is refused with UNAUTHENTICATED before any handler runs, and the first refusal
from each peer is logged as one line naming it, so an operator sees a stranger knocking without a
flood of lines from one that keeps trying.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from loom_proto.shard_auth import presented_secret, secret_matches

log = logging.getLogger("loom_shard.auth")
MAX_PEERS_REMEMBERED = 1024  # bounded: a scan from many addresses cannot grow memory


class SecretInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str, rank: int) -> None:
        self._secret = secret
        self._rank = rank
        self._refused_peers: set[str] = set()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if secret_matches(self._secret, presented_secret(handler_call_details.invocation_metadata)):
            return await continuation(handler_call_details)
        return self._refusal(handler_call_details.method)

    def _refusal(self, method: str) -> grpc.RpcMethodHandler:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            self.note_stranger(context.peer(), method)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this shard serves only its router: "
                                "wrong or missing shard secret")

        # Raw bytes in and out: the refusal never parses what a stranger sent.
        return grpc.unary_unary_rpc_method_handler(refuse)

    def note_stranger(self, peer: str, method: str) -> None:
        if peer in self._refused_peers:
            return
        if len(self._refused_peers) < MAX_PEERS_REMEMBERED:
            self._refused_peers.add(peer)
        log.warning("rank %d refused a connection from %s (%s): wrong or missing shard secret",
                    self._rank, peer, method)
