"""Rollout engines: the registry naming each (``registry.py``), their flags (``flags.py``,
kept free of torch for the parser), the builders mapping ``EngineOptions`` onto each
constructor (``builders.py``), and the engines: ``hf.py`` (plain transformers; its draws
in ``hf_sampling.py``, its KV cache and attention in ``hf_cache.py``) and ``vllm.py``
(vLLM; its start in ``vllm_start.py``, what runs in its workers in ``vllm_worker.py``).
Nothing outside ``registry.py`` names an engine."""
