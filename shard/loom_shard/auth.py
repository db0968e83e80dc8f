"""The shard's door: every call must carry the router's shared secret (loom_proto.shard_auth).

A call without it is refused with UNAUTHENTICATED before any handler runs, and the first refusal
from each host is logged as one line naming it, so an operator sees a stranger knocking without a
flood of lines from one that keeps trying (each try is a new connection, a new port).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from loom_proto.shard_auth import presented_secret, secret_matches

log = logging.getLogger("loom_shard.auth")
MAX_HOSTS_REMEMBERED = 1024  # bounded: a scan from many addresses cannot grow memory


class SecretInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str, rank: int) -> None:
        self._secret = secret
        self._rank = rank
        self._refused_hosts: set[str] = set()

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
        host = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer  # "ipv4:10.0.0.9:51234" -> "ipv4:10.0.0.9"
        if host in self._refused_hosts:
            return
        if len(self._refused_hosts) < MAX_HOSTS_REMEMBERED:
            self._refused_hosts.add(host)
        log.warning("rank %d refused a connection from %s (%s): wrong or missing shard secret",
                    self._rank, peer, method)
