"""Rollout engines: the registry naming each (``registry.py``), their flags (``flags.py``,
kept free of torch for the parser), the builders mapping ``EngineOptions`` onto each
constructor (``builders.py``), and the engines: ``hf.py`` (plain transformers) and
``vllm.py`` (vLLM). Nothing outside ``registry.py`` names an engine."""
