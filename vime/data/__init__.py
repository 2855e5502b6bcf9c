"""Data side of the loop: samples, prompt datasets, the packing planner and micro-batch tensors."""
