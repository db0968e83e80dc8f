"""Loom's launcher: reads the settings, starts the shards and the router, supervises them.
Imports loom_proto's configuration only: it starts processes, it does not run their code."""
