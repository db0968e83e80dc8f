"""The Responses API's stored responses, kept by the engine core for every frontend (a
`previous_response_id` may come to any of them): opaque records by id, least recently used
dropped first past a count or a size in bytes, so the store's memory stays bounded."""

from __future__ import annotations

from collections import OrderedDict

MAX_RESPONSES = 4096
MAX_BYTES = 64 << 20


class ResponseStore:
    """Records (bytes) by response id, in least recently used order."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response_id: str, record: bytes) -> bool:
        """Store a record (False when it alone is larger than the store)."""
        self.delete(response_id)
        if len(record) > self.max_bytes:
            return False
        self._records[response_id] = record
        self.num_bytes += len(record)
        while len(self._records) > self.max_responses or self.num_bytes > self.max_bytes:
            _, dropped = self._records.popitem(last=False)
            self.num_bytes -= len(dropped)
        return True

    def get(self, response_id: str) -> bytes | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self.num_bytes -= len(record)
        return True

    def run(self, method: str, response_id: str, payload: bytes) -> bytes | bool | None:
        """A frontend's call: response_put, response_get (None: unknown) or response_delete."""
        if method == "response_put":
            return self.put(response_id, payload)
        if method == "response_get":
            return self.get(response_id)
        if method == "response_delete":
            return self.delete(response_id)
        raise ValueError(f"unknown call {method!r}")
