"""A rollout engine on plain transformers: batched KV-cache decoding, no extra dependency.

Where it fits: ``--rollout-engine hf`` (and the no-flag CPU default) gives the
``RolloutManager`` this engine; it meets the same ``RolloutEngine`` contract
as the vLLM engine (``vime.rollout.types``), so nothing upstream knows which
one runs. It is the reference for correctness rather than speed: its sampled
log-probs are computed exactly as the trainer computes them
(``vime.data.micro_batch.response_log_probs``), so trainer-vs-rollout
differences measure numerics, not definitions (with top-k / top-p on, both
engines report the truncated distribution the token was drawn from, which the
trainer's full-vocabulary log-prob is then below).

Decoding: completions are laid out as rows (prompt i, sample j) and decoded
together, as many rows at a time as ``rows_per_batch`` allows (a KV-cache token
budget, ``max_batch_tokens``, and an optional row cap, ``max_batch_size``): by
default a small model's whole rollout is one batch. A batch prefills its
distinct prompts once, left-padded, and copies their KV cache to the rows that
sample from them, into buffers reserved for the whole decode (``hf_cache``), so a
step writes its cache column in place and passes a view of one attention mask made
up front (nothing is concatenated per step). It then decodes one token per step
for every row: a finished row rides along, its later tokens ignored, until a
quarter of the batch has finished; those rows are then dropped from the batch
and the cache together (a drop copies the cache, so it is not done per row).
Each step's log-probs come from the logits that step computed (no second
pass). On the CPU, grouped-query attention under the padding mask runs inside
torch's kernel rather than after transformers copies every KV head to its
query heads (``hf_cache.use_gqa_sdpa``; same numbers).

Reproducibility: the uniform that draws token t of sample j of the batch's
prompt i (its index in the whole batch: ``SamplingParams.first_prompt_index``
plus its index in the request) is a counter-based hash of (seed, i, j, t) and
nothing else -- murmur3 blocks and finaliser on int64 tensors, two lanes
making a 64-bit row key, 53 random bits a uniform (``hf_sampling``'s
``row_keys``, ``uniforms``) -- made for all rows at once, and the token is drawn by
inverting the CDF of the filtered distribution at it. So a completion's
tokens do not depend on which other prompts share its batch, on the batch
size or on how a batch was split over engines (its log-probs only up to float
rounding: BLAS sums depend on the batch shape).

New weights while generating (asynchronous rollout): ``update_weights`` may be called
from another thread while ``generate`` runs. Each forward (the prefill, every decode
step, ``score``) and each whole weight load pass one gate, so a load lands between two
decode steps (``vime.rollout.step_gate``) and the rows in flight go on with their
tokens and KV cache kept; each ``Completion`` records the oldest and newest version
that sampled its tokens.

Threads: the matmuls here are tiny, so on a busy CPU torch's intra-op threads
mostly wait for each other; callers that share cores may want
``torch.set_num_threads(1)``. The engine leaves that process-wide setting alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vime import device as vime_device
from vime import profiling
from vime.rollout.engines.hf_cache import expand_cache, use_gqa_sdpa
from vime.rollout.engines.hf_sampling import filter_logits, row_keys, uniforms
from vime.rollout.step_gate import StepGate
from vime.rollout.types import Completion, SamplingParams, wake_tags


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


_BLOCK_STEPS = 64  # uniforms are made this many decode steps at a time
_DROP_FRACTION = 4  # finished rows are dropped once they are 1/_DROP_FRACTION of the batch
_MAX_SAMPLING_ENTRIES = 1 << 26  # rows x vocab of a step's sampling tensors (CDF: 512 MiB)


def _check_params(params: SamplingParams) -> None:
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {params.top_k}")
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")


@dataclass
class _Prefilled:
    """A batch of rows after its prefill, what its decode starts from (``_prefill``)."""

    cache: Any
    logits: torch.Tensor  # [rows, vocab]: the logits token 0 is sampled from
    mask: torch.Tensor  # [rows, width + max_new]: the whole decode's attention mask
    next_pos: torch.Tensor  # [rows, 1]: the position of token 0, less ``width``
    width: int  # the longest prompt's length: the prompts are left-padded to it
    vocab: int  # the model's logits' width
    versions: list[int]  # the weight version each step's forward ran at, in order


def _completions(
    prompts: list[list[int]],
    rows: list[tuple[int, int]],
    tokens: torch.Tensor,
    log_probs: torch.Tensor,
    is_stop: torch.Tensor,
    steps: int,
    versions: list[int],
) -> list[Completion]:
    """The rows' completions: a row's response runs to its first stop token (later tokens
    of a finished row that rode along are ignored), or to the last step."""
    stop_at = is_stop[tokens[:, :steps]]
    stopped = stop_at.any(-1)
    lengths = torch.where(stopped, stop_at.int().argmax(-1) + 1, steps)
    tokens_l, logp_l = tokens.tolist(), log_probs.tolist()
    lengths_l, stopped_l = lengths.tolist(), stopped.tolist()
    return [
        Completion(
            prompt_ids=list(prompts[i]),
            response_ids=tokens_l[r][: lengths_l[r]],
            log_probs=logp_l[r][: lengths_l[r]],
            finish_reason="stop" if stopped_l[r] else "length",
            weight_versions=(versions[0], versions[max(0, lengths_l[r] - 1)]),
        )
        for r, (i, _) in enumerate(rows)
    ]


class HFEngine:
    """``RolloutEngine`` over an HF causal-LM checkpoint (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = 1 << 16,
        max_batch_size: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        if self.device.type == "cpu":
            use_gqa_sdpa(self.model)
        config, gen = self.model.config, self.model.generation_config
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = frozenset(
            _token_ids(gen.eos_token_id) | _token_ids(config.eos_token_id)
        )
        pads = [gen.pad_token_id, config.pad_token_id, *sorted(self.eos_token_ids), 0]
        # Left padding is masked out, so the pad id only has to be a valid token.
        self.pad_token_id = int(next(p for p in pads if p is not None))
        self.weight_version = 0
        self._asleep = False
        # Each forward and each whole weight load: a load lands between two decode steps.
        self.gate = StepGate()

    # ---------------------------------------------------------------- generation

    def rows_per_batch(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """How many rows (completions) ``generate`` decodes together for this request.

        As many as fit ``max_batch_tokens`` KV-cache positions (the longest prompt plus
        ``max_new_tokens`` a row) while a step's ``[rows, vocab]`` sampling tensors keep
        under 2**26 entries, and at most ``max_batch_size`` when set: the defaults decode a
        small model's whole rollout (the embedded default's 64 prompts x 8) as one batch.
        """
        longest = max((len(p) for p in prompts), default=1)
        rows = min(
            self.max_batch_tokens // (longest + params.max_new_tokens),
            _MAX_SAMPLING_ENTRIES // self.vocab_size,
        )
        rows = max(1, rows)
        return rows if self.max_batch_size is None else min(rows, self.max_batch_size)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order (see the module docstring).

        A completion ends at an EOS or ``stop_token_ids`` token (kept, finish
        reason ``"stop"``) or after ``max_new_tokens`` (``"length"``). Its
        ``log_probs`` are log softmax(logits / T) of each sampled token over
        the distribution it was drawn from: the full vocabulary, or with top-k /
        top-p the kept tokens, renormalised (as vLLM reports them, so the two
        engines' log-probs mean the same); T = 1 when greedy.
        """
        self._check_awake()
        _check_params(params)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(
                    f"prompt {i} has a token id outside [0, {self.vocab_size}); "
                    "was it tokenized with this checkpoint's tokenizer?"
                )
        if params.seed is not None:
            seed = params.seed
        else:
            # From torch's global RNG, so a run seeded once is reproducible end to end.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        per_batch = self.rows_per_batch(prompts, params)
        flat: list[Completion] = []
        for start in range(0, len(rows), per_batch):
            flat.extend(self._generate_rows(prompts, rows[start : start + per_batch], params, seed))
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_rows(
        self,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        seed: int,
    ) -> list[Completion]:
        if params.max_new_tokens == 0:
            return [Completion(list(prompts[i]), [], [], "length") for i, _ in rows]
        batch = self._prefill(prompts, rows, params.max_new_tokens)
        keys = None
        if params.temperature != 0:
            prompt_index = torch.tensor([params.prompt_index(i) for i, _ in rows])
            keys = row_keys(seed, prompt_index, torch.tensor([j for _, j in rows]))
            keys = keys.to(self.device)
        # A lookup table rather than ``isin``: one gather a step. Ids the model cannot emit
        # cannot stop it either.
        is_stop = torch.zeros(max(self.vocab_size, batch.vocab), dtype=torch.bool)
        for t in self.eos_token_ids | set(params.stop_token_ids):
            if 0 <= t < len(is_stop):
                is_stop[t] = True
        is_stop = is_stop.to(self.device)
        tokens, log_probs, steps = self._decode(batch, params, keys, is_stop)
        return _completions(prompts, rows, tokens, log_probs, is_stop, steps, batch.versions)

    def _prefill(
        self, prompts: list[list[int]], rows: list[tuple[int, int]], max_new: int
    ) -> _Prefilled:
        """Prefill the rows' distinct prompts once (left-padded), copy each one's cache to
        the rows that sample from it, and make the decode's whole attention mask."""
        dev = self.device
        distinct = list(dict.fromkeys(i for i, _ in rows))
        slot = {p: k for k, p in enumerate(distinct)}
        width = max(len(prompts[p]) for p in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width + max_new), dtype=torch.long)
        for k, p in enumerate(distinct):
            input_ids[k, width - len(prompts[p]) :] = torch.tensor(prompts[p], dtype=torch.long)
            mask[k, width - len(prompts[p]) :] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        # Left padding: real tokens are numbered from 0; pad positions just need a valid index.
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        # The version that made each step's logits, i.e. sampled token ``step``.
        versions: list[int] = []
        with (
            profiling.span("prefill", prompts=len(distinct)),
            self.gate.step(),
        ):  # (a trace's items)
            versions.append(self.weight_version)
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask[:, :width],
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
        # Rows sampling the same prompt share its prefill: copy cache rows instead of recomputing.
        to_row = torch.tensor([slot[i] for i, _ in rows], dtype=torch.long, device=dev)
        cache = out.past_key_values
        # The last token sampled is never fed back: width + max_new - 1 positions at most.
        expand_cache(cache, to_row, width + max_new - 1)
        # One mask for the whole decode, the columns of the steps to come already 1: each
        # step passes a view of its first columns (no per-step concatenation).
        mask = mask.index_select(0, to_row)
        return _Prefilled(
            cache=cache,
            logits=out.logits[:, -1].index_select(0, to_row),
            mask=mask,
            next_pos=mask.sum(-1, keepdim=True) - max_new,
            width=width,
            vocab=out.logits.shape[-1],
            versions=versions,
        )

    def _decode(
        self,
        batch: _Prefilled,
        params: SamplingParams,
        keys: torch.Tensor | None,
        is_stop: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Sample every row's tokens one step at a time: ``(tokens, log_probs, steps)``,
        ``[rows, max_new_tokens]`` each, of which the first ``steps`` columns were made."""
        dev, max_new, num_rows = self.device, params.max_new_tokens, batch.logits.shape[0]
        tokens = torch.zeros((num_rows, max_new), dtype=torch.long, device=dev)
        log_probs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=dev)
        live: torch.Tensor | None = None  # original row of each batch row; None: all, in order
        done = torch.zeros(num_rows, dtype=torch.bool, device=dev)  # per batch row
        logits, mask, next_pos, u_block = batch.logits, batch.mask, batch.next_pos, None
        for step in range(max_new):
            if keys is not None and step % _BLOCK_STEPS == 0:
                block_keys = keys if live is None else keys.index_select(0, live)
                u_block = uniforms(block_keys, step, min(_BLOCK_STEPS, max_new - step))
            u = None if u_block is None else u_block[:, step % _BLOCK_STEPS]
            tok, logp = self._sample(logits, params, u)
            if live is None:
                tokens[:, step], log_probs[:, step] = tok, logp
            else:
                tokens[live, step], log_probs[live, step] = tok, logp
            done |= is_stop[tok]
            if step == max_new - 1:
                break
            finished = int(done.sum())
            if finished == done.numel():
                return tokens, log_probs, step + 1
            # Finished rows ride along (their tokens are ignored) until dropping them pays:
            # a drop copies the whole cache.
            if finished * _DROP_FRACTION >= done.numel():
                keep = (~done).nonzero().squeeze(-1)
                live = keep if live is None else live.index_select(0, keep)
                tok, mask, next_pos = tok[keep], mask[keep], next_pos[keep]
                done = done[keep]
                if u_block is not None:
                    u_block = u_block[keep]
                batch.cache.batch_select_indices(keep)
            with profiling.span("decode", rows=int(tok.shape[0])), self.gate.step():
                batch.versions.append(self.weight_version)
                out = self.model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=mask[:, : batch.width + step + 1],
                    position_ids=next_pos + step,
                    past_key_values=batch.cache,
                    use_cache=True,
                )
            logits = out.logits[:, -1]
        return tokens, log_probs, max_new

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if u is None:
            tok = logits.argmax(-1)
            logp = torch.log_softmax(logits, dim=-1)
            return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        # Same expression as the trainer (divide, not multiply by 1/T): bitwise-equal inputs.
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        kept = filter_logits(scaled, params.top_k, params.top_p)
        logp = torch.log_softmax(kept, dim=-1)  # of what was sampled from (see ``generate``)
        # Inverse CDF in float64 over exp(logp): a filtered token's probability is exactly
        # 0, so it never is the first index whose CDF exceeds the target, and the target
        # is kept strictly below the total mass.
        cdf = logp.double().exp_().cumsum_(-1)
        total = cdf[:, -1:]
        target = torch.minimum(u.unsqueeze(-1) * total, total.nextafter(total.new_zeros(())))
        tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

    # ---------------------------------------------------------------- scoring

    @torch.inference_mode()
    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        """Log-probs of ``token_ids[prompt_len:]``: one teacher-forced forward, no KV cache.

        ``temperature`` 0 (greedy) scores at T = 1, as ``generate`` does.
        """
        self._check_awake()
        if not 1 <= prompt_len <= len(token_ids):
            raise ValueError(f"need 1 <= prompt_len <= {len(token_ids)}, got {prompt_len}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if prompt_len == len(token_ids):
            return []
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with self.gate.step():
            logits = self.model(input_ids=ids, use_cache=False).logits
        logits = logits[0, prompt_len - 1 : -1].float()
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, ids[0, prompt_len:].unsqueeze(-1)).squeeze(-1).tolist()

    # ---------------------------------------------------------------- weights and memory

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
        """Copy HF-named tensors into the model by name, then serve ``version``.

        Tied embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight``
        are one tensor here, so either name (or both) updates it. Every
        parameter must be covered; an unknown name or a shape mismatch raises.
        On an error the model may hold a partial update and ``weight_version``
        is not advanced: send the full set again. A ``generate`` running in another
        thread waits between two decode steps until the load is done.
        """
        self._check_awake()
        with self.gate.load():
            self._load(buckets, version)

    def _load(self, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
        state_names = set(self.model.state_dict().keys())
        named = {
            name: t
            for name, t in [
                *self.model.named_parameters(remove_duplicate=False),
                *self.model.named_buffers(remove_duplicate=False),
            ]
            if name in state_names
        }
        pending = {id(p): name for name, p in self.model.named_parameters()}
        for bucket in buckets:
            for name, value in bucket:
                target = named.get(name)
                if target is None:
                    raise ValueError(
                        f"update_weights: {name!r} is not a tensor of this model; "
                        "send HF parameter names (e.g. 'model.layers.0.mlp.up_proj.weight')"
                    )
                value = torch.as_tensor(value)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(value.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                target.copy_(value)
                pending.pop(id(target), None)
        if pending:
            missing = sorted(pending.values())
            raise ValueError(
                f"update_weights: {len(missing)} parameter(s) not sent, e.g. {missing[0]!r}; "
                "send the full set of weights"
            )
        self.weight_version = version

    def sleep(self) -> None:
        """Free accelerator memory between generations; until ``wake_up`` the engine
        refuses to generate, score or load weights.

        On CUDA the model moves to host memory (weights kept, so ``wake_up``
        needs no reload) and the allocator cache is emptied. On CPU nothing
        moves, but the state is kept all the same: a caller that uses a sleeping
        engine has its sleep/wake order wrong on every device, and should learn
        so on the CPU rather than on its first GPU run.
        """
        if self._asleep:
            return
        if self.device.type == "cuda":
            self.model.to("cpu")
            vime_device.empty_cache()
        self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` (``tags``: ``vime.rollout.types.MEMORY_TAGS``).

        This engine keeps no KV cache between calls, so waking the weights wakes it
        whole, and ``("kv_cache",)`` alone has nothing to bring back.
        """
        if self._asleep and "weights" in wake_tags(tags):
            if self.device.type == "cuda":
                self.model.to(self.device)
            self._asleep = False

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("HFEngine is asleep; call wake_up() before using it")
