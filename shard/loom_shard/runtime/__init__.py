"""What runs a step: the model runner and each request's state, the sampler and its token masks,
the paged KV cache and its KV groups, CUDA graphs, speculative drafts, the plan's checks, KV
snapshot files, and the device, dtype and kernels a shard chooses at start."""
