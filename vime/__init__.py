"""vime: reinforcement-learning post-training for language models.

The loop is rollout -> reward -> advantage -> train -> weight sync, on a training
backend chosen by name (``vime.backends.registry``). Importing this package is
cheap: nothing here pulls torch, a backend or a rollout engine.
"""

__version__ = "0.1.0"
