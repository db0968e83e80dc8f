"""The HTTP socket: bound once by the router (its frontends accept on it), and tried by the
launcher before any model loads, so that a port in use is one line at start, not after minutes."""

from __future__ import annotations

import socket


def bind_http(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, as servers bind). Raises OSError naming both."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot serve HTTP on {host}:{port}: {error.strerror}") from None
    return sock


def check_http_port(host: str, port: int) -> None:
    """Raises OSError when host:port cannot be bound now (in use, or not an address of this host)."""
    bind_http(host, port).close()
