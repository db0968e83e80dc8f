"""Loom's shard: one tensor-parallel rank's model, paged KV cache and gRPC server.
Imports loom_proto, never the router.

    server.py     the gRPC server: protobuf in, a runner call, protobuf out
    runtime/      the runner and each request's state, sampler, KV cache and groups, CUDA graphs
    loading/      Hugging Face folders, GGUF files, quantized weights, tensor-parallel slices
    models/       one file per model family on the shared decoder, and the registry
    layers/       the building blocks every family shares (attention, MLPs, experts, norms, rope)
    attention/    the step's attention metadata and the backends that read the paged KV cache
    kernels/      Loom's C++ CPU kernels, one build per instruction set
    cpu.py        what CPU this is (flags, model name), or the lesser kind LOOM_MAX_CPU_ISA reads it as
"""
