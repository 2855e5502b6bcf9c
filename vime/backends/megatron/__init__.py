"""The ``megatron`` backend: megatron-core ``GPTModel`` with HF <-> Megatron weight conversion."""
