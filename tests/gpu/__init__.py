"""GPU tests (CUDA, NCCL, bf16); a package so its module names cannot clash with tests/cpu."""
