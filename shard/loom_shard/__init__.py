"""Loom's shard: one tensor-parallel rank's model, paged KV cache and gRPC server.
Imports loom_proto, never the router."""
