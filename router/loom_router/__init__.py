"""Loom's router: HTTP APIs, validation, tokenizer, scheduler, block manager, engine loop.
Imports loom_proto, never torch or the shard."""
