"""The engine core: scheduler, block manager, requests and the shard client, in a process of its own
that serves no HTTP; frontends reach it through loom_router.contract."""
