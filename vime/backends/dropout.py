"""Model dropout in RL: off in every forward unless ``--keep-dropout``.

Where it fits: both backends build their model from the checkpoint's HF config, and
a checkpoint may carry dropout (``attention_dropout`` and the like) for pre-training.
In RL it would make π_old, the reference and the update's own forward random, so the
PPO ratio, the KL and the rollout correction would fire on noise. As TRL does, each
backend builds from :func:`without_dropout`'s copy of the config (fsdp2: the HF model;
megatron: ``convert.transformer_config_from_hf``); the checkpoint's own config, which
engines and HF exports receive, is left as it was. LoRA's adapter dropout
(``--lora-dropout``) is a setting of its own and not touched here.
"""

from __future__ import annotations

import copy
from typing import Any


def _is_dropout(name: str, value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and ("dropout" in name or name.endswith("pdrop"))


def without_dropout(config: Any) -> Any:
    """A copy of an HF ``config`` with every dropout probability 0 (``*dropout*`` and
    ``*_pdrop`` fields, in nested sub-configs too); ``config`` itself is unchanged."""
    out = copy.deepcopy(config)
    _zero(out)
    return out


def _zero(config: Any) -> None:
    for name, value in list(vars(config).items()):
        if _is_dropout(name, value):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            _zero(value)


def model_config(hf_config: Any, keep_dropout: bool) -> Any:
    """The config a backend builds its model from: ``hf_config`` as is with
    ``--keep-dropout``, else :func:`without_dropout` of it."""
    return hf_config if keep_dropout else without_dropout(hf_config)
