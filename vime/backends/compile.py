"""``--compile-decoder``: each decoder block's forward compiled by ``torch.compile``.

Where it fits: both backends call ``compile_decoder`` once on the model they built --
fsdp2 through its load's ``adapt`` hook (``before_sharding``), so every block is compiled
before ``fully_shard`` wraps it, as torch advises for per-block compilation under FSDP2;
megatron on its ``GPTModel`` before any optimizer holds it. The blocks are HF's decoder
layers (the model's ``_no_split_modules``) or megatron-core's ``TransformerLayer``s
(``decoder.layers``).

Only ``forward`` is compiled, not the module call: the hooks around it (FSDP2's
all-gather, activation checkpointing) stay eager, and parameter names do not change
(``torch.compile(module)`` would prefix them). Blocks of one class share one code
object, so their graphs are shared and do not count against dynamo's recompile limit
once each. The packed-row attention is left out of the graphs
(``vime.backends.varlen_attention``, megatron's ``PackedDotProductAttention``: the row's
layout is Python data that changes per row), so each block compiles to the graphs
before and after it, once with gradients and once without (the log-prob passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of an HF causal LM (its ``_no_split_modules`` classes) or of a
    megatron-core ``GPTModel`` (``decoder.layers``), in model order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        # By the class or a base: fully_shard subclasses a block as FSDP<Name>.
        blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    else:
        blocks = list(getattr(getattr(model, "decoder", None), "layers", None) or ())
    if not blocks:
        raise ValueError(
            f"--compile-decoder found no decoder blocks in {type(model).__name__} (neither "
            "_no_split_modules classes nor decoder.layers)"
        )
    return blocks


_announced = False


def compile_decoder(model: torch.nn.Module) -> int:
    """Compile each decoder block's ``forward`` in place; returns how many, and says so
    on stdout once per process (fsdp2's rank 0 also adapts the copy it loads from)."""
    global _announced
    blocks = decoder_blocks(model)
    for block in blocks:
        # dynamic=True: packed rows differ in length from one micro-batch to the next, so
        # the shapes are symbolic from the start (not a static graph first, then a
        # recompile), which halves the compiles of the first steps.
        block.forward = torch.compile(block.forward, dynamic=True)
    if not _announced:
        _announced = True
        kind = type(blocks[0]).__name__
        print(f"vime: --compile-decoder: torch.compile on {len(blocks)} {kind} blocks", flush=True)
    return len(blocks)


def before_sharding(
    adapt: Callable[[torch.nn.Module], None] | None, enabled: bool
) -> Callable[[torch.nn.Module], None] | None:
    """A load's ``adapt`` hook (run on the model before it is sharded) that runs ``adapt``
    and then, when ``enabled``, ``compile_decoder``; ``adapt`` itself when not."""
    if not enabled:
        return adapt

    def adapt_then_compile(model: torch.nn.Module) -> None:
        if adapt is not None:
            adapt(model)
        compile_decoder(model)

    return adapt_then_compile
