"""vLLM's own LoRA on a CUDA device: a bf16 base with each sync's adapters on top.

Proves: after the first sync (base and adapters) and an adapter-only one, a bf16 Qwen3
served by vLLM with LoRA scores tokens as a transformers bf16 forward of the merged
weights does, within bf16 rounding, and the adapter before is far off. Skipped without
CUDA (``conftest.py``) or vLLM (the lent GPU's image has none: scripts/gpu-kit.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_vllm_gpu import LOGP_ATOL, _checkpoint

pytestmark = pytest.mark.gpu


def _log_probs(model: torch.nn.Module, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(ids[start:], device="cuda")[:, None])[:, 0].tolist()


def test_vllm_serves_each_syncs_adapters_on_a_bf16_base(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from tests.cpu.test_vllm_lora import SETTINGS, _adapters, _merged
    from vime.rollout.engines.vllm import VLLMEngine
    from vime.weights.lora import AdapterLoader, EngineLora

    folder = _checkpoint(tmp_path / "model", logit_scale=4.0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    engine = VLLMEngine(
        folder,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        max_lora_rank=SETTINGS.rank,
    )
    loader = AdapterLoader(EngineLora(SETTINGS, bucket_bytes=1 << 24))
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    first, second = _adapters(base, seed=1), _adapters(base, seed=2)
    on_gpu = [(n, t.cuda()) for n, t in base.state_dict().items()]
    loader.update(engine, [on_gpu, [(n, t.cuda()) for n, t in first.items()]], 1)
    loader.update(engine, [[(n, t.cuda()) for n, t in second.items()]], 2)
    served = engine.score(ids, 4, 1.0)

    def diff(adapters: dict[str, torch.Tensor]) -> float:
        model = _merged(base.float(), adapters).to(torch.bfloat16).cuda()
        reference = _log_probs(model, ids, 4)
        return max(abs(a - b) for a, b in zip(served, reference, strict=True))

    assert diff(second) < LOGP_ATOL
    assert diff(first) > 10 * LOGP_ATOL
