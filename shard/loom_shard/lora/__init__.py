"""Multi-LoRA on the shard: PEFT adapters read and checked against the model (`adapter`), laid out
per Loom projection and tensor-parallel rank (`layout`), kept in device slots with LRU eviction to
host memory (`slots`), and applied to a mixed batch as grouped low-rank matmuls (`linear`)."""
