"""API keys (--api-key, --api-key-file): which a request presents, and whether it is one of
them. The frontends' guard checks every route with them; the engine core's --prometheus-port
checks /metrics with them when --metrics-require-api-key says so."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from loom_proto.config import RouterConfig, read_api_key_file


def load_api_keys(config: RouterConfig) -> tuple[bytes, ...]:
    """The keys of --api-key and of --api-key-file (one per line; blank lines and # comments
    skipped). A file without a key is refused (ValueError): it would leave every route open."""
    keys = [key.get_secret_value() for key in config.api_key]
    if config.api_key_file is not None:
        keys += read_api_key_file(config.api_key_file)
    return tuple(key.encode() for key in keys)


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key of `Authorization: Bearer <key>`, or of Anthropic's `x-api-key: <key>`."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:  # the first of a repeated header counts
        found.setdefault(name.lower(), bytes(value))
    if b"authorization" in found:
        scheme, _, token = found[b"authorization"].partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" else None
    header = found.get(b"x-api-key")
    return header.strip() if header is not None else None


def is_a_key(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Whether token is one of keys. Every key is compared, each in constant time: how long it
    takes says nothing about which key, or how much of one, matched."""
    if not token:  # never a key, whatever the keys
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched
