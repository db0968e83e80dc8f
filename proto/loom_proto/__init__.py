"""Loom's contract between router and shards: shard.proto's stubs (generated at install), the
typed step contract, the protobuf codec, the snapshot format and the one configuration model."""
