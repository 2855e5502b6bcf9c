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

Decoding: completions are laid out as rows (prompt i, sample j) and processed
``max_batch_size`` rows at a time. Each chunk prefills its distinct prompts
once, left-padded, copies their KV cache to the rows that sample from them,
then decodes one token per step for all live rows; finished rows are dropped
from the batch (and the cache) as they stop.

Reproducibility: every completion draws its uniforms from its own
``torch.Generator`` seeded by (seed, whole-batch prompt index, sample index)
(``SamplingParams.first_prompt_index``), and samples by inverting the CDF of
the filtered distribution, so a completion's tokens do not depend on which
other prompts share its batch, on ``max_batch_size`` or on how a batch was split
over engines (its log-probs only up to float rounding: BLAS sums depend on the
batch shape).

Threads: the matmuls here are tiny, so on a busy CPU torch's intra-op threads
mostly wait for each other; callers that share cores may want
``torch.set_num_threads(1)``. The engine leaves that process-wide setting alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vime import device as vime_device
from vime import profiling
from vime.rollout.types import Completion, SamplingParams, wake_tags


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    # A hash rather than arithmetic so neighbouring rows get unrelated streams.
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


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


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k, then outside the top-p nucleus, to -inf (``[B, V]`` float).

    Top-p keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` after top-k (the order vLLM applies them); the best token always stays.
    """
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= top_p
        drop[:, 0] = False
        scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scaled


class HFEngine:
    """``RolloutEngine`` over an HF causal-LM checkpoint (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        self.model.to(self.device).eval().requires_grad_(False)
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

    # ---------------------------------------------------------------- generation

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
        flat: list[Completion] = []
        for start in range(0, len(rows), self.max_batch_size):
            flat.extend(
                self._generate_rows(
                    prompts, rows[start : start + self.max_batch_size], params, seed
                )
            )
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_rows(
        self,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        seed: int,
    ) -> list[Completion]:
        dev = self.device
        num_rows, max_new = len(rows), params.max_new_tokens
        if max_new == 0:
            return [Completion(list(prompts[i]), [], [], "length") for i, _ in rows]
        distinct = list(dict.fromkeys(i for i, _ in rows))
        slot = {p: k for k, p in enumerate(distinct)}
        width = max(len(prompts[p]) for p in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for k, p in enumerate(distinct):
            input_ids[k, width - len(prompts[p]) :] = torch.tensor(prompts[p], dtype=torch.long)
            mask[k, width - len(prompts[p]) :] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        # Left padding: real tokens are numbered from 0; pad positions just need a valid index.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with profiling.span("prefill", prompts=len(distinct)):  # a trace's items (vime.profiling)
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
        # Rows sampling the same prompt share its prefill: copy cache rows instead of recomputing.
        to_row = torch.tensor([slot[i] for i, _ in rows], dtype=torch.long, device=dev)
        cache = out.past_key_values
        cache.batch_select_indices(to_row)
        logits = out.logits[:, -1].index_select(0, to_row)
        mask = mask.index_select(0, to_row)
        next_pos = mask.sum(-1, keepdim=True)

        greedy = params.temperature == 0
        uniforms = None
        if not greedy:
            draws = []
            for i, j in rows:
                gen = torch.Generator().manual_seed(
                    _row_seed(seed, params.first_prompt_index + i, j)
                )
                draws.append(torch.rand(max_new, generator=gen))
            uniforms = torch.stack(draws).to(dev)
        stop_ids = torch.tensor(
            sorted(self.eos_token_ids | set(params.stop_token_ids)), dtype=torch.long, device=dev
        )
        tokens = torch.zeros((num_rows, max_new), dtype=torch.long, device=dev)
        log_probs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=dev)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        live = torch.arange(num_rows, device=dev)  # original row of each batch row
        for step in range(max_new):
            u = None if uniforms is None else uniforms[live, step]
            tok, logp = self._sample(logits, params, u)
            tokens[live, step] = tok
            log_probs[live, step] = logp
            lengths[live] += 1
            done = torch.isin(tok, stop_ids)
            stopped[live] |= done
            if step == max_new - 1:
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                live, tok, mask, next_pos = live[keep], tok[keep], mask[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            with profiling.span("decode", rows=int(tok.shape[0])):
                out = self.model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=next_pos,
                    past_key_values=cache,
                    use_cache=True,
                )
            next_pos = next_pos + 1
            logits = out.logits[:, -1]

        tokens_l, logp_l = tokens.tolist(), log_probs.tolist()
        lengths_l, stopped_l = lengths.tolist(), stopped.tolist()
        return [
            Completion(
                prompt_ids=list(prompts[i]),
                response_ids=tokens_l[r][: lengths_l[r]],
                log_probs=logp_l[r][: lengths_l[r]],
                finish_reason="stop" if stopped_l[r] else "length",
            )
            for r, (i, _) in enumerate(rows)
        ]

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if uniforms is None:
            tok = logits.argmax(-1)
            logp = torch.log_softmax(logits, dim=-1)
            return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        # Same expression as the trainer (divide, not multiply by 1/T): bitwise-equal inputs.
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        kept = filter_logits(scaled, params.top_k, params.top_p)
        logp = torch.log_softmax(kept, dim=-1)  # of what was sampled from (see ``generate``)
        probs = torch.softmax(kept, dim=-1)
        # Inverse CDF in float64: the target stays strictly below the total mass, and a
        # zero-probability token can never be the first index whose CDF exceeds it.
        cdf = probs.double().cumsum(-1)
        target = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        tok = tok.clamp(max=logits.shape[-1] - 1)
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
        logits = self.model(input_ids=ids, use_cache=False).logits[0, prompt_len - 1 : -1].float()
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
        is not advanced: send the full set again.
        """
        self._check_awake()
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
