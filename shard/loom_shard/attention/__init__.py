"""Attention over the paged KV cache: the step's metadata, and the backends that read the blocks
(Loom's C++ kernel on CPU, Triton on CUDA, torch's paths otherwise), chosen per device by `backend`."""
