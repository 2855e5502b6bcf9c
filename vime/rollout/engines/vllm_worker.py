"""What runs inside vLLM's workers: vime's methods, mixed into every worker.

Where it fits: ``vime.rollout.engines.vllm_start.start_llm`` names
``VimeWorkerExtension`` as vLLM's ``worker_extension_cls`` (by its dotted name,
``WORKER_EXTENSION``), and ``vime.rollout.engines.vllm.VLLMEngine`` reaches its methods
through ``llm.collective_rpc``: reloading weights in place, and scaling the logits
prompt log-probs are computed from (``VLLMEngine.score``'s temperature).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vime.rollout.engines.vllm_start import only_errors


class VimeWorkerExtension:
    """Methods mixed into every vLLM worker (vLLM's ``worker_extension_cls`` hook).

    Reached through ``llm.collective_rpc(name, ...)`` by method *name*, so a
    multiprocess engine needs no pickled callables (which vLLM refuses unless
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
    """

    def vime_set_prompt_logit_scale(self, scale: float) -> float:
        """Multiply by ``scale`` the logits that prompt log-probs are computed from (requests
        with ``prompt_logprobs``: ``VLLMEngine.score``) from now on; return the old factor.

        The tokens sampled in the same step keep their logits: a generation sharing the
        batch with a scoring request is not touched. Both of vLLM's model runners compute
        prompt log-probs apart from sampling, each in a method of its own, wrapped here
        once: the V1 runner (the CPU's) in ``_get_prompt_logprobs_dict``, with the model's
        logit scale set for the call; the V2 runner (CUDA's default) in its
        ``prompt_logprobs_worker``, which takes the logits function as an argument.
        """
        runner = self.model_runner  # type: ignore[attr-defined]
        previous = getattr(runner, "_vime_prompt_scale", None)
        if previous is None:
            _scale_prompt_logits(runner)
            previous = 1.0
        runner._vime_prompt_scale = scale
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
        only_errors(
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


def _scale_prompt_logits(runner: Any) -> None:
    """Make ``runner`` scale prompt log-probs' logits by ``runner._vime_prompt_scale``."""
    worker = getattr(runner, "prompt_logprobs_worker", None)
    if worker is not None:  # V2 runner
        compute = worker.compute_prompt_logprobs

        def scaled_v2(logits_fn: Any, *args: Any, **kwargs: Any) -> Any:
            scale = runner._vime_prompt_scale
            if scale != 1.0:
                unscaled = logits_fn

                def logits_fn(hidden: Any) -> Any:
                    return unscaled(hidden) * scale

            return compute(logits_fn, *args, **kwargs)

        worker.compute_prompt_logprobs = scaled_v2
    elif hasattr(runner, "_get_prompt_logprobs_dict"):  # V1 runner
        compute = runner._get_prompt_logprobs_dict

        def scaled_v1(*args: Any, **kwargs: Any) -> Any:
            scale = runner._vime_prompt_scale
            if scale == 1.0:
                return compute(*args, **kwargs)
            processor = runner.get_model().logits_processor
            base = processor.scale
            processor.scale = base * scale
            try:
                return compute(*args, **kwargs)
            finally:
                processor.scale = base

        runner._get_prompt_logprobs_dict = scaled_v1
    else:
        raise RuntimeError(
            f"vLLM's {type(runner).__name__} computes prompt log-probs in no method vime "
            "knows (_get_prompt_logprobs_dict, prompt_logprobs_worker): score() cannot "
            "scale them to a temperature; a vLLM version vime was not written for?"
        )
