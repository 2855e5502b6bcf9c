"""Rollout: engines that sample completions, rewards that score them, and the
manager that turns prompts into a ``RolloutBatch`` for training."""
