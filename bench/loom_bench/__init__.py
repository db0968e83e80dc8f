"""loom-bench: load generation against Loom, TGI or any OpenAI-compatible server."""
