"""vime.algo: the shared RL math, pure tensor functions with no I/O and no distributed state.

Both training backends and the rollout manager call these; custom hooks
(``--custom-advantage-function-path``, ``--custom-loss-function-path``) import
the public five from here::

    from vime.algo import (
        aggregate_loss, compute_advantages, entropy_from_logits, kl_penalty, policy_loss,
    )
"""

from vime.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from vime.algo.aggregation import AGGREGATION_MODES, aggregate_loss
from vime.algo.custom import load_function
from vime.algo.entropy import entropy_from_logits
from vime.algo.losses import KL_TYPES, kl_penalty, policy_loss
from vime.algo.metrics import MetricAccumulator

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_TYPES",
    "MetricAccumulator",
    "aggregate_loss",
    "compute_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "load_function",
    "policy_loss",
]
