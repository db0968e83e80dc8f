"""A frontend process: HTTP APIs (TGI, OpenAI), validation, tokenization, detokenization, stop
strings and streaming; it holds no scheduling state and reaches the engine core through
loom_router.contract."""
