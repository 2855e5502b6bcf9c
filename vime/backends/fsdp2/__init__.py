"""The ``fsdp2`` backend: HF transformers causal LMs sharded with torch ``fully_shard``."""
