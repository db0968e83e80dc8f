"""How a router proves itself to its shards: a shared secret in every call's metadata, compared in
constant time. Both sides agree on the key here; the secret itself comes from LOOM_SHARD_SECRET or
--shard-secret-file (loom_proto.config), never from a command line."""

from __future__ import annotations

import hmac

SECRET_METADATA_KEY = "x-loom-shard-secret"


def secret_metadata(secret: str) -> tuple[str, str]:
    return (SECRET_METADATA_KEY, secret)


def presented_secret(metadata: object) -> str | None:
    """The secret a call carries, from gRPC invocation metadata (pairs or objects with key/value)."""
    for item in metadata or ():  # type: ignore[attr-defined]
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == SECRET_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


def secret_matches(expected: str, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())
