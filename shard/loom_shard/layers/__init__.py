"""Building blocks shared by every model family: the decoder layer, attention, MLPs and mixtures
of experts, norms, rotary embeddings and their scalings, and the CPU linears (packed for a
batch-invariant GEMM, or quantized on Loom's kernels)."""
