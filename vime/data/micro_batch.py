"""One planned micro-batch -> one padding-free packed row, and logits -> per-sample values.

Where it fits: the planner (``vime.data.packing``) decides *which* samples share
a micro-batch; this module builds the tensors a backend forwards and turns the
model's logits back into the ``[B, T]`` per-sample response tensors that the
``vime.algo`` losses consume. Both training backends use it, so packed and
unpacked forwards give the same numbers whichever backend runs.

Layout of a packed row of B samples (sample i = prompt pᵢ tokens + response rᵢ tokens)::

    input_ids     [1, L]   s₀ tokens | s₁ tokens | ... | padding
    position_ids  [1, L]   0..n₀-1   | 0..n₁-1   | ... | 0..pad-1
    cu_seqlens    [B+1]    0, n₀, n₀+n₁, ...            (int32, samples only)

HF transformers derives the per-sample attention boundaries from the restarts
of ``position_ids`` -- but only when no KV cache is built, so every training or
log-prob forward must pass ``use_cache=False`` (with a cache, packed samples
silently attend to each other). Padding sits after every sample and forms its
own position run, so under causal attention it cannot affect any sample.

Shared prompts (``share_prompts=True``): samples of one group repeat the same
prompt, and on short responses the prompt is most of the row (the embedded
default's 6-token prompts against ~7-token responses). A shared row holds each
distinct prompt once, followed by its first sample's response; every further
response of that prompt follows as a run of its own whose positions continue
the prompt's (``p..p+r-1``, not ``0..``)::

    input_ids     [1, L]   prompt | resp₀ | resp₁ | resp₂ | next prompt | ...
    position_ids  [1, L]   0..p-1 | p..   | p..   | p..   | 0..          | ...

The rule that reads it back (``vime.backends.varlen_attention``): a run starting
at position s > 0 continues the latest run that started at 0 and attends to its
first s tokens. Every token is then computed once, the gradient of the prompt is
the sum over its samples (as it is unshared, up to float rounding), and
``cu_seqlens`` no longer describes the attention: only an attention that knows
the rule can forward a shared row (the fsdp2 backend's ``varlen_sdpa``, megatron's
local layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from vime.algo.entropy import entropy_from_logits
from vime.device import to_device
from vime.sync_budget import host_only


@dataclass(frozen=True)
class PackedBatch:
    """Tensors of one packed micro-batch (see the module docstring for the layout).

    ``loss_mask`` is ``[B, T]`` float 0/1 with T the longest response of the
    micro-batch; entries past a sample's response are 0. An empty micro-batch
    (B = 0, the planner's filler for ranks with fewer samples) is a dummy row
    of ``pad_to_multiple_of`` (default 1) padding tokens: the backend still
    runs its forward/backward so collectives line up, and every ``[B, T]``
    output is ``[0, 0]`` so the loss is exactly 0 (with a gradient path).
    """

    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long
    # [B+1] int32: the samples' bounds in the unshared row (with shared prompts they are
    # not this row's; run_cu_seqlens refuses such a row)
    cu_seqlens: torch.Tensor
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long
    loss_mask: torch.Tensor  # [B, T] float32
    max_seqlen: int  # longest sample (for varlen attention kernels)
    pad_length: int  # padding tokens at the end of the row
    # Row index of each sample's first response token, and of its prompt's last token
    # (they are adjacent unless the row shares prompts).
    response_starts: torch.Tensor  # [B] long
    prompt_ends: torch.Tensor  # [B] long
    # The loss positions (sample, response step) where loss_mask is 1, found on the host
    # when packing so no device op has to size its output by the mask.
    loss_samples: torch.Tensor | None = None  # [N] long
    loss_steps: torch.Tensor | None = None  # [N] long
    # run_cu_seqlens() made on the host when packing an unshared row (int32), so an
    # attention that takes cu_seqlens gets them without a device op; on a row with shared
    # prompts only a packer that also hands the attention the row's layout sets them
    # (megatron's packed_rows.device_row: the runs' bounds, the prompts in the layout)
    attention_cu_seqlens: torch.Tensor | None = None
    shares_prompts: bool = False  # some prompt serves several samples (module docstring)

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lengths.shape[0])

    @property
    def row_length(self) -> int:
        return int(self.input_ids.shape[1])

    def run_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` over every position run of the row: the samples, then the
        padding run when there is one -- the boundaries of attention that restarts
        per run (it covers the whole row, so no position is left unattended). On a row
        with shared prompts, only the bounds a packer set with the row's layout."""
        if self.attention_cu_seqlens is not None:
            return self.attention_cu_seqlens
        if self.shares_prompts:
            raise ValueError(
                "a row with shared prompts has no per-sample runs; pack it with "
                "share_prompts=False for an attention that takes cu_seqlens"
            )
        if self.pad_length == 0:
            return self.cu_seqlens
        end = self.cu_seqlens.new_tensor([self.row_length])
        return torch.cat([self.cu_seqlens, end])

    @property
    def max_run_length(self) -> int:
        """The longest position run: a sample, or the padding."""
        return max(self.max_seqlen, self.pad_length)

    def model_inputs(self) -> dict[str, torch.Tensor | bool]:
        """Keyword arguments for an HF causal-LM forward over this row.

        ``use_cache=False`` is not optional: with a cache, transformers does not
        derive sample boundaries from ``position_ids`` and packed samples attend
        to each other (measured on transformers 5.19).
        """
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}

    def loss_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample, step) of every loss position, in row-major order (``loss_mask``'s
        ``nonzero``, read from the fields packing filled in where it did)."""
        if self.loss_samples is None or self.loss_steps is None:
            sample, step = self.loss_mask.nonzero(as_tuple=True)
            return sample, step
        return self.loss_samples, self.loss_steps

    def to(self, device: torch.device | str) -> PackedBatch:
        """Every tensor on ``device``, each copied without the host waiting
        (``vime.device.to_device``)."""
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return PackedBatch(**moved)


def pack_micro_batch(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]] | None = None,
    pad_to_multiple_of: int = 1,
    share_prompts: bool = False,
) -> PackedBatch:
    """Concatenate samples (prompt + response token ids) into one padding-free row.

    ``prompt_lengths[i]`` splits ``token_ids[i]`` into prompt and response;
    ``loss_masks[i]`` (one 0/1 per response token) defaults to all ones. The
    row is right-padded with token 0 to a multiple of ``pad_to_multiple_of``.
    With ``share_prompts`` samples whose prompts are equal share one copy of it
    (module docstring); the ``[B, ...]`` fields keep the order of ``token_ids``.
    """
    with host_only():  # Python lists into host tensors: no device is involved
        return _pack(token_ids, prompt_lengths, loss_masks, pad_to_multiple_of, share_prompts)


def _pack(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]] | None,
    pad_to_multiple_of: int,
    share_prompts: bool,
) -> PackedBatch:
    lengths, responses = _checked_lengths(token_ids, prompt_lengths, loss_masks, pad_to_multiple_of)
    loss_mask = _loss_mask(responses, loss_masks)
    loss_samples, loss_steps = loss_mask.nonzero(as_tuple=True)
    runs, prompt_ends, response_starts = _row_runs(
        token_ids, prompt_lengths, lengths, responses, share_prompts
    )
    used = sum(n for _, _, n in runs)
    # An empty micro-batch still needs a token to forward (see PackedBatch).
    row = max(used, 1)
    row = -(-row // pad_to_multiple_of) * pad_to_multiple_of
    input_ids, position_ids = _row_tensors(token_ids, runs, used, row)
    cu_seqlens = torch.zeros(len(token_ids) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    packed = PackedBatch(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        prompt_lengths=torch.tensor(list(prompt_lengths), dtype=torch.long),
        response_lengths=torch.tensor(responses, dtype=torch.long),
        loss_mask=loss_mask,
        max_seqlen=max(lengths, default=0),
        pad_length=row - used,
        response_starts=torch.tensor(response_starts, dtype=torch.long),
        prompt_ends=torch.tensor(prompt_ends, dtype=torch.long),
        loss_samples=loss_samples,
        loss_steps=loss_steps,
        shares_prompts=any(first > 0 for _, first, _ in runs),
    )
    if packed.shares_prompts:
        return packed
    return replace(packed, attention_cu_seqlens=packed.run_cu_seqlens())


def _checked_lengths(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]] | None,
    pad_to_multiple_of: int,
) -> tuple[list[int], list[int]]:
    """Each sample's token count nᵢ and response length rᵢ = nᵢ − pᵢ, after checking that
    every list has one entry a sample, 1 ≤ pᵢ ≤ nᵢ and each loss mask holds rᵢ entries."""
    if len(prompt_lengths) != len(token_ids):
        raise ValueError(f"{len(token_ids)} samples but {len(prompt_lengths)} prompt_lengths")
    if loss_masks is not None and len(loss_masks) != len(token_ids):
        raise ValueError(f"{len(token_ids)} samples but {len(loss_masks)} loss_masks")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    lengths = [len(ids) for ids in token_ids]
    responses = [n - p for n, p in zip(lengths, prompt_lengths, strict=True)]
    for i, (n, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        # The first response token is predicted from the last prompt token.
        if not 1 <= p <= n:
            raise ValueError(f"sample {i}: need 1 <= prompt_length <= {n} tokens, got {p}")
    if loss_masks is not None:
        for i, r in enumerate(responses):
            if len(loss_masks[i]) != r:
                raise ValueError(
                    f"sample {i}: loss mask has {len(loss_masks[i])} entries, needs {r}"
                )
    return lengths, responses


def _loss_mask(responses: list[int], loss_masks: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """The ``[B, T]`` float 0/1 loss mask, T the longest response: ``loss_masks`` (all
    ones when None) left-aligned, 0 past each response; ValueError on a value not 0/1."""
    width = max(responses, default=0)
    # One tensor op over all samples: a slice assignment per sample costs ~10 us each.
    steps = torch.arange(width)
    filled = steps < torch.tensor(responses, dtype=torch.long)[:, None]
    loss_mask = torch.zeros(len(responses), width, dtype=torch.float32)
    if loss_masks is None:
        loss_mask[filled] = 1.0
    else:
        flat_mask = [float(m) for mask in loss_masks for m in mask]
        loss_mask[filled] = torch.tensor(flat_mask, dtype=torch.float32)
    if not torch.all((loss_mask == 0) | (loss_mask == 1)):
        raise ValueError("loss masks must be 0/1")
    return loss_mask


def _row_runs(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    lengths: list[int],
    responses: list[int],
    share_prompts: bool,
) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """The row as runs of (sample, first token, tokens), with each sample's prompt end
    and response start in the row.

    A run is a whole sample, or under ``share_prompts`` the response of a sample whose
    prompt is already in the row. A prompt's samples sit together (its first one, then
    the others): a run that continues a prompt reads it from the latest run that
    starts at position 0.
    """
    owners: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(token_ids):
        key = tuple(ids[: prompt_lengths[i]]) if share_prompts else (i,)
        owners.setdefault(key, []).append(i)
    runs: list[tuple[int, int, int]] = []
    prompt_ends = [0] * len(token_ids)
    response_starts = [0] * len(token_ids)
    offset = 0
    for owner, *others in owners.values():
        runs.append((owner, 0, lengths[owner]))
        prompt_ends[owner] = offset + prompt_lengths[owner] - 1
        response_starts[owner] = offset + prompt_lengths[owner]
        offset += lengths[owner]
        for i in others:
            runs.append((i, prompt_lengths[i], responses[i]))
            prompt_ends[i] = prompt_ends[owner]
            response_starts[i] = offset
            offset += responses[i]
    return runs, prompt_ends, response_starts


def _row_tensors(
    token_ids: Sequence[Sequence[int]], runs: list[tuple[int, int, int]], used: int, row: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``position_ids`` ``[row]``: the runs' ``used`` tokens laid end to
    end, then padding (token 0, positions 0..row-used-1)."""
    # Position = offset inside its own sample: each run restarts at its first token's.
    positions = [p for _, first, n in runs for p in range(first, first + n)]
    position_ids = torch.tensor(positions + list(range(row - used)), dtype=torch.long)
    input_ids = torch.zeros(row, dtype=torch.long)
    if used:
        flat = [t for i, first, _ in runs for t in token_ids[i][first:]]
        input_ids[:used] = torch.tensor(flat, dtype=torch.long)
    return input_ids, position_ids


TokenStats = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def full_vocab_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log softmax(logits)[target], entropy or None)`` per row of ``[N, V]`` logits
    holding the whole vocabulary. gather − logsumexp avoids a full ``[N, V]`` log-softmax."""
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
        logits, dim=-1
    )
    return token_logp, entropy_from_logits(logits) if with_entropy else None


def response_log_probs(
    logits: torch.Tensor,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    token_stats: TokenStats = full_vocab_token_stats,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample response log-probs ``[B, T]`` (and entropies) from a packed row's logits.

    ``logits`` is ``[1, L, V]`` or ``[L, V]``. Entry ``[i, t]`` is
    log softmax(z / temperature)[token] of response token t of sample i, with z
    the logits at the position before it -- divided by the sampling
    temperature so they match the rollout engine's log-probs. With
    ``with_entropy``, also the entropy of that same tempered distribution.
    Entries where ``batch.loss_mask`` is 0 (padding past a response, or tokens
    excluded from the loss) are 0 and cost nothing: only the loss positions'
    logits are gathered (``[N, V]``, upcast to float32 if lower precision)
    before any softmax. Differentiable w.r.t. ``logits``; for an empty batch the
    ``[0, 0]`` outputs still hang off ``logits`` so a backward is valid.

    ``token_stats(picked, targets, with_entropy)`` turns the gathered, tempered
    ``[N, V]`` logits into per-token log-probs and entropies; a backend whose
    logits are split over the vocabulary (megatron's tensor parallelism) passes
    one that reduces across its shards, V then being this rank's shard.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"a packed row has batch dim 1; got logits {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[0] != batch.row_length:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match a packed row of {batch.row_length} tokens"
        )
    sample, step, before, targets = loss_targets(batch)
    picked = logits.index_select(0, before)
    picked = picked.to(torch.promote_types(picked.dtype, torch.float32))
    if temperature != 1.0:
        picked = picked / temperature
    token_logp, entropy = token_stats(picked, targets, with_entropy)
    return per_sample_values(batch, sample, step, token_logp, entropy)


def loss_targets(
    batch: PackedBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sample, step, before, target)`` ``[N]`` each, one entry per loss position:
    response token ``step`` of ``sample``, the row position whose output predicts it,
    and its token id."""
    sample, step = batch.loss_positions()  # [N] each
    token_pos = batch.response_starts[sample] + step
    # Causal LM: the token at position p is predicted by the logits at p - 1; the first
    # response token by the prompt's last token (elsewhere in the row when shared).
    before = torch.where(step == 0, batch.prompt_ends[sample], token_pos - 1)
    return sample, step, before, batch.input_ids[0, token_pos]


def per_sample_values(
    batch: PackedBatch,
    sample: torch.Tensor,
    step: torch.Tensor,
    token_logp: torch.Tensor,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N]`` per-position values scattered to ``[B, T]`` (0 off ``loss_mask``)."""
    shape = tuple(batch.loss_mask.shape)
    log_probs = token_logp.new_zeros(shape).index_put((sample, step), token_logp)
    if entropy is None:
        return log_probs, None
    return log_probs, entropy.new_zeros(shape).index_put((sample, step), entropy)
