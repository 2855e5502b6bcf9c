"""The vLLM rollout engine: token-id prompts in, sampled completions with log-probs out.

Where it fits: one implementation of the ``RolloutEngine`` contract
(``vime.rollout.types``) next to ``engines.hf``. ``RolloutManager`` calls
``generate`` every rollout step; the weight transport calls ``update_weights``
with the HF-named buckets the training backend streams; colocated GPU runs call
``sleep`` / ``wake_up`` around training; a LoRA run's adapter-only syncs reach
``load_adapter`` (vLLM's own LoRA: one adapter, replaced in place at each sync;
``vime.weights.lora.AdapterLoader``). vLLM is imported only when an engine is built,
so importing this module is cheap.

Log-prob semantics (what training compares against ``vime.data.micro_batch``):
the engine runs with ``logprobs_mode="processed_logprobs"``, so a sampled
token's log-prob is ``log_softmax(logits / T)`` over the full vocabulary, the
same number the trainer computes, as long as top-p / top-k are off. With top-p
or top-k on, vLLM returns the log-prob under the *truncated, renormalised*
distribution it actually sampled from (filtered tokens get -inf first); the
trainer's full-vocab log-probs are then lower and the gap is real, not noise.
Greedy requests (T = 0) report ``log_softmax(logits)``, i.e. T = 1.

New weights while generating (asynchronous rollout): ``generate`` adds its requests to
vLLM's engine and steps it itself, each step inside ``self.gate.step()``
(``vime.rollout.step_gate``); ``update_weights``, ``score``'s scale changes and sleep /
wake run inside the gate too, from whichever thread calls them. A load therefore lands
between two engine steps, and the requests in flight go on with their tokens and KV
cache kept; each ``Completion`` records the oldest and newest version that sampled it.
Prefixes cached before a load are never reused after it: every request's
``cache_salt`` names the weight load it was added after. ``score`` may share a step
with a generation: its temperature scales only the prompt log-probs it asks for.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from vime.rollout.engines.flags import VLLM_GPU_MEMORY_SHARE
from vime.rollout.engines.vllm_start import (
    eos_token_ids,
    lora_options,
    on_cuda_here,
    prepare_env,
    start_llm,
)
from vime.rollout.step_gate import StepGate
from vime.rollout.types import MEMORY_TAGS, Completion, SamplingParams, wake_tags

_SHM = "/dev/shm"


def _request_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A per-completion seed: the same draw whatever else shares the batch."""
    digest = hashlib.blake2b(f"{base}/{prompt_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 2  # < 2**62: fits int64 everywhere


def _runs_in_process(llm: Any) -> bool:
    """Whether ``llm``'s one worker runs in this process (an in-process, uniprocess
    engine): Python objects (the lazy weights iterator) then reach it unserialised."""
    core = type(llm.llm_engine.engine_core).__name__
    executor = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    return core == "InprocClient" and executor == "uni"


def _completion(prompt: list[int], request_output: Any, oldest: int, newest: int) -> Completion:
    """The ``Completion`` of a finished one-sample request, its versions ``(oldest,
    newest)``."""
    out = request_output.outputs[0]
    response = list(out.token_ids)
    steps = zip(out.logprobs, response, strict=True)
    log_probs = [step[token].logprob for step, token in steps]
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with {out.finish_reason!r}")
    return Completion(
        prompt_ids=list(prompt),
        response_ids=response,
        log_probs=log_probs,
        finish_reason=out.finish_reason,
        extra={"weight_version": newest},
        weight_versions=(oldest, newest),
    )


class VLLMEngine:
    """A ``RolloutEngine`` backed by ``vllm.LLM`` (prompts are token ids: no tokenizer)."""

    weight_version: int

    def __init__(
        self,
        checkpoint: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        gpu_memory_utilization: float = VLLM_GPU_MEMORY_SHARE,
        enable_sleep_mode: bool | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        max_lora_rank: int | None = None,
    ) -> None:
        """Start an engine serving the HF checkpoint folder ``checkpoint``.

        ``dtype="auto"`` is vLLM's rule: the checkpoint's dtype, except that
        float32 checkpoints are downcast (to bf16 on CPU); pass ``"float32"``
        to match an fp32 trainer exactly. Sleep mode defaults to on with CUDA
        only: the CPU worker does not implement it. ``enforce_eager`` defaults
        to on without CUDA: vLLM 0.32's CPU torch.compile cache fails to reload
        (it recompiles at every start, ~10 s) and eager decoding of small
        models was no slower here; with CUDA, vLLM's default (compiled, CUDA
        graphs). ``max_lora_rank``: serve one LoRA adapter of up to that rank on top of
        the weights (``load_adapter``); None: no LoRA.
        """
        on_cuda = on_cuda_here()
        prepare_env(on_cuda, tensor_parallel_size)
        self.sleep_mode = on_cuda if enable_sleep_mode is None else enable_sleep_mode
        self.checkpoint = str(checkpoint)
        self.weight_version = 0
        self._eos = eos_token_ids(self.checkpoint)
        # Seeds requests that come without one, so a run is reproducible from `seed`.
        self._rng = random.Random(seed)
        # The MEMORY_TAGS parts asleep. Kept without sleep mode too (CPU), where nothing is
        # freed, so that using a sleeping engine fails on every device, not just on a GPU.
        self._sleeping: set[str] = set()
        self._lora_enabled = max_lora_rank is not None
        self._adapter: Any = None  # the LoRARequest new requests are served with, or None
        self._start_bookkeeping()
        self._llm = start_llm(
            self.checkpoint,
            on_cuda,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_mode,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=not on_cuda if enforce_eager is None else enforce_eager,
            **lora_options(max_lora_rank),
        )
        # vLLM's CPU attention plans for the intra-op thread count the engine was built
        # with and refuses to run on another; torch's count is per thread, and calls come
        # from other threads (an actor's thread pools, a probe's scoring thread).
        self._threads = torch.get_num_threads()
        self._in_process = _runs_in_process(self._llm)

    def _start_bookkeeping(self) -> None:
        """What lets calls from several threads share the engine (see the module
        docstring): the gates, and the requests and loads counted."""
        # Each engine step and each whole weight load: a load lands between two steps.
        self.gate = StepGate()
        # Finished outputs of requests some other caller's step finished (generate and
        # score step one engine from two threads), each with the version of that step.
        self._finished: dict[str, tuple[Any, int]] = {}
        self._request_ids = itertools.count()
        # Weight loads begun: the prefix-cache salt of the requests added after them.
        self._loads = 0
        self._score_lock = threading.Lock()  # one temperature at a time for prompt logits
        # Whole calls: generations may overlap each other, a score runs alone and goes
        # before the next generation (a score sharing a generation's engine steps could
        # leave that generation stepping for ever: seen once in CI).
        self._calls = StepGate()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order.

        Each completion is its own vLLM request seeded from ``(params.seed,
        params.prompt_index(i), sample index)``
        (``params.seed=None`` draws a base from the engine's seed), so a
        completion depends neither on batch composition nor on how a batch was
        split over engines, and greedy decoding works with ``n > 1``.

        ``update_weights`` may run from another thread meanwhile: it lands between two
        engine steps (see the module docstring). A completion's ``weight_versions`` is
        ``(oldest, newest)``: ``oldest`` the version when its request was added, with
        the first step, a lower bound for a request vLLM queued past that step;
        ``newest`` the version at the step that returned it finished: exact where vLLM
        runs one batch a step (the CPU build), an upper bound where it runs ahead of
        the steps taken here (async scheduling, its default with CUDA; an engine core
        in processes of its own, tensor parallel).
        """
        self._same_threads()
        self._check_awake(MEMORY_TAGS)
        if params.n < 1:
            raise ValueError(f"n must be >= 1, got {params.n}")
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        requests = self._requests(prompts, params, base)
        results: list[list[Completion]] = [[] for _ in prompts]
        with self._calls.step():
            ran = self._run(requests)
        for k, (request_output, oldest, newest) in enumerate(ran):
            i = k // params.n
            results[i].append(_completion(prompts[i], request_output, oldest, newest))
        return results

    def _requests(
        self, prompts: list[list[int]], params: SamplingParams, base: int
    ) -> list[tuple[list[int], Any]]:
        """One vLLM request a completion, seeded by ``base`` and its prompt and sample."""
        from vllm import SamplingParams as VllmSamplingParams

        stop = list(dict.fromkeys([*params.stop_token_ids, *self._eos]))
        requests: list[tuple[list[int], Any]] = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                sampling = VllmSamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=max(params.top_k, 0),  # vLLM: 0 (or -1) disables top-k
                    max_tokens=params.max_new_tokens,
                    stop_token_ids=stop,
                    logprobs=0,  # the sampled token's log-prob only
                    seed=_request_seed(base, params.prompt_index(i), j),
                    detokenize=False,
                )
                requests.append((list(prompt), sampling))
        return requests

    def _run(self, requests: list[tuple[list[int], Any]]) -> list[tuple[Any, int, int]]:
        """Add ``(prompt ids, vLLM SamplingParams)`` requests and step the engine until all
        have finished: ``(RequestOutput, oldest, newest version)`` each, in order.

        Every engine call runs inside ``self.gate.step()``, one step at a time, so weight
        loads from other threads go between two steps. Another caller's requests (a
        ``score`` while a generation runs) may share the steps: whichever caller steps
        keeps the outputs it finished for their owner in ``self._finished``. On an error
        the requests still in the engine are aborted.
        """
        if not requests:
            return []
        engine = self._llm.llm_engine
        ids = [f"vime-{next(self._request_ids)}" for _ in requests]
        pending: set[str] = set()
        done: dict[str, tuple[Any, int]] = {}
        oldest = -1
        try:
            while oldest < 0 or pending:
                with self.gate.step():
                    self._check_awake(MEMORY_TAGS)
                    if oldest < 0:  # added with the first step, at the version it runs
                        oldest = self.weight_version
                        self._add_requests(engine, ids, requests, pending)
                    self._step(engine, pending, done)
        except BaseException:
            if pending:
                with self.gate.step():
                    engine.abort_request(sorted(pending), internal=False)
                    for request_id in pending:
                        self._finished.pop(request_id, None)
            raise
        return [(done[r][0], oldest, done[r][1]) for r in ids]

    def _add_requests(
        self,
        engine: Any,
        ids: list[str],
        requests: list[tuple[list[int], Any]],
        pending: set[str],
    ) -> None:
        """Add ``requests`` to the engine under ``ids``, each into ``pending`` once added."""
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        salt = f"vime-load-{self._loads}"  # no prefix cached by older weights
        for request_id, (prompt, sampling) in zip(ids, requests, strict=True):
            sampling.output_kind = RequestOutputKind.FINAL_ONLY
            prompt_input = tokens_input(prompt, cache_salt=salt)
            engine.add_request(request_id, prompt_input, sampling, lora_request=self._adapter)
            pending.add(request_id)

    def _step(self, engine: Any, pending: set[str], done: dict[str, tuple[Any, int]]) -> None:
        """Move the ``pending`` requests that finished to ``done``, with the version of the
        step that finished them: those another caller's steps finished, then, while any is
        left, those of one engine step (another caller's it keeps in ``self._finished``)."""
        if self._finished:  # finished in another caller's steps
            for request_id in pending & self._finished.keys():
                done[request_id] = self._finished.pop(request_id)
            pending.difference_update(done.keys())
        if not pending:
            return
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM lost {len(pending)} request(s) unfinished")
        outputs = engine.step()
        version = self.weight_version
        for output in outputs:
            if not output.finished:
                continue
            if output.request_id in pending:
                pending.discard(output.request_id)
                done[output.request_id] = (output, version)
            else:
                self._finished[output.request_id] = (output, version)

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        """Log-probs at ``temperature`` of ``token_ids[prompt_len:]`` given what precedes each.

        vLLM's prompt log-probs skip the sampler, so they are always at T = 1
        whatever the logprobs mode. For T != 1 the logits they are computed from are
        scaled by 1/T while this request runs (``vime_set_prompt_logit_scale``, set on
        every worker by RPC and restored afterwards): exact, and O(length) instead of
        the full-vocab prompt log-probs a host-side correction would need. A score that
        arrives while ``generate`` runs in another thread waits for it to end and goes
        before the next one.
        """
        from vllm import SamplingParams as VllmSamplingParams

        self._same_threads()
        self._check_awake(MEMORY_TAGS)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 1 <= prompt_len <= len(token_ids):
            raise ValueError(f"need 1 <= prompt_len <= {len(token_ids)}, got {prompt_len}")
        if prompt_len == len(token_ids):
            return []
        # One throwaway greedy token: vLLM needs max_tokens >= 1.
        sampling = VllmSamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
        )
        scale = 1.0 / temperature
        with self._calls.load(), self._score_lock:
            if scale != 1.0:
                self._set_prompt_logit_scale(scale)
            try:
                [(output, _, _)] = self._run([(list(token_ids), sampling)])
            finally:
                if scale != 1.0:
                    self._set_prompt_logit_scale(1.0)
        # prompt_logprobs[p] scores token p given tokens < p (entry 0 is None).
        steps = zip(output.prompt_logprobs[prompt_len:], token_ids[prompt_len:], strict=True)
        return [step[token].logprob for step, token in steps]

    def _set_prompt_logit_scale(self, scale: float) -> None:
        with self.gate.step():
            self._llm.collective_rpc("vime_set_prompt_logit_scale", args=(scale,))

    def _same_threads(self) -> None:
        """This thread's intra-op thread count set to the engine's (see ``__init__``)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def update_weights(self, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
        """Load a full set of HF-named tensors, bucket by bucket, and serve ``version``.

        All buckets go through *one* ``reload_weights`` call: vLLM's in-place
        reload rebuilds every layer a call touched, and the parts of a fused layer
        (qkv, gate_up) the call did not carry come out of uninitialised memory, so a
        layer split across two calls would be half garbage (a set that arrives over
        several calls streams into one, ``vime.weights.update_stream``). In-process
        the worker consumes the buckets lazily, one at a time. Workers in other
        processes cannot take tensors by RPC (the engine core re-pickles them
        as memoryviews and fails), so there each bucket goes to a safetensors
        file in a RAM-backed temp folder and the workers read the files.

        Needs the weights awake (``wake_up(("weights",))``), not the KV cache. A
        ``generate`` running in another thread meanwhile waits between two engine steps
        until the load is done (files for other processes are written before that wait).
        Prefixes cached before the load are not reused after it: requests added from now
        on carry a prefix-cache salt of their own (see ``_run``).
        """
        self._same_threads()
        if self._in_process:
            self._reload("vime_reload_weights", _flatten(buckets), version)
            return
        from safetensors.torch import save_file

        self._check_awake(("weights",))
        with tempfile.TemporaryDirectory(dir=reload_dir(self.checkpoint)) as folder:
            paths = []
            for k, bucket in enumerate(buckets):
                paths.append(os.path.join(folder, f"bucket-{k:05d}.safetensors"))
                # Copies: safetensors refuses tensors that share storage (tied weights).
                tensors = {name: t.detach().to("cpu", copy=True) for name, t in bucket}
                save_file(tensors, paths[-1])
            self._reload("vime_reload_from_files", paths, version)

    def one_load(self) -> contextlib.AbstractContextManager[None]:
        """The loads inside the block (``update_weights``, ``load_adapter``) land as one,
        between two engine steps: no request is added or stepped until it ends."""
        return self.gate.load()

    def load_adapter(self, folder: str | None, version: int) -> None:
        """Serve the PEFT adapter folder ``folder`` on top of the weights from now on, in
        place of the last (None: the weights alone), as ``version``.

        One adapter id, reloaded in place (vLLM's ``load_inplace``) between two engine
        steps, like new weights (``update_weights``): requests in flight go on with the
        new adapter, and their prefixes cached before it are not reused. vLLM reads the
        folder during this call and not after (the one adapter id stays loaded), so the
        caller may delete it once this returns.
        """
        from vllm.lora.request import LoRARequest

        if folder is not None and not self._lora_enabled:
            raise RuntimeError("VLLMEngine: load_adapter needs an engine built with max_lora_rank")
        self._same_threads()
        with self.gate.load():
            self._check_awake(("weights",))
            self._loads += 1
            if folder is None:
                self._adapter = None
            else:
                self._llm.llm_engine.add_lora(
                    LoRARequest(_ADAPTER_NAME, _ADAPTER_ID, folder, load_inplace=True)
                )
                # Requests name the adapter without reloading it at every step.
                self._adapter = LoRARequest(_ADAPTER_NAME, _ADAPTER_ID, folder)
            self.weight_version = version

    def _reload(self, method: str, weights: Any, version: int) -> None:
        """Worker RPC ``method`` with ``weights``, between two engine steps."""
        with self.gate.load():
            self._check_awake(("weights",))
            self._loads += 1  # from now on requests get a new prefix-cache salt
            self._llm.collective_rpc(method, args=(weights,))
            self.weight_version = version

    def sleep(self) -> None:
        """Free accelerator memory (weights offloaded, KV cache dropped); until ``wake_up``
        the engine refuses work (a generation in flight fails at its next step).

        Memory is freed only in sleep mode (by default with CUDA only: the CPU
        worker does not implement it, and there is no device memory to hand
        back); the asleep state is kept either way. Level 1 keeps a host copy of
        the weights and puts it back on wake: load new weights only after waking.
        """
        with self.gate.load():
            if self._sleeping == set(MEMORY_TAGS):
                return
            if self._sleeping:  # half awake: vLLM sleeps only from fully awake
                self._wake(set(self._sleeping))
            if self.sleep_mode:
                self._llm.sleep(level=1)
            self._sleeping = set(MEMORY_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` freed: the parts named in ``tags`` (``MEMORY_TAGS``), or
        all. ``("weights",)`` first lets new weights load before the KV cache takes its
        memory back (vLLM resumes scheduling once every part is back)."""
        with self.gate.load():
            self._wake(self._sleeping & wake_tags(tags))

    def _wake(self, parts: set[str]) -> None:
        if not parts:
            return
        if self.sleep_mode:
            self._llm.wake_up(tags=sorted(parts))
        self._sleeping -= parts
        if "kv_cache" in parts:  # a fresh cache: no prefix computed with older weights
            self._llm.reset_prefix_cache()

    def _check_awake(self, needed: Sequence[str]) -> None:
        if not self._sleeping:  # every engine step asks
            return
        asleep = sorted(self._sleeping & set(needed))
        if asleep:
            raise RuntimeError(
                f"VLLMEngine: {' and '.join(asleep)} asleep; call wake_up() before using it"
            )


# The one adapter an engine serves (``load_adapter``): vLLM's ids start at 1.
_ADAPTER_NAME, _ADAPTER_ID = "vime-lora", 1


def reload_dir(checkpoint: str, shm: str = _SHM) -> str | None:
    """Where a weight set goes for workers in other processes to read: RAM-backed
    ``shm`` when it holds the checkpoint's weights with room to spare (containers often
    give ``/dev/shm`` 64 MB), else None, the system's temporary folder."""
    if not os.path.isdir(shm):
        return None
    weights = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    return shm if shutil.disk_usage(shm).free > 1.25 * weights else None


def _flatten(buckets: Iterable[list[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
    for bucket in buckets:
        yield from bucket
