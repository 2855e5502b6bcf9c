"""CPU shims for megatron-core 0.16: the few hard ``torch.cuda`` calls it makes on the way.

Where it fits: the megatron backend (``model.py`` and everything that builds or
runs a ``GPTModel``) calls ``apply_cpu_shims()`` before touching megatron-core.
On a machine with CUDA it does nothing. Without CUDA it patches, once per
process, only the calls that the CPU code path actually reaches, so that the
CPU test suite (and the CPU alignment with the fsdp2 backend) runs megatron-core's
own layers rather than a reimplementation of them.

Every shim names the megatron-core call it covers, and
``tests/cpu/test_megatron_shims.py`` calls that megatron-core function, so a
shim that stops working (or a megatron-core release that moves the call) fails
a test instead of silently falling back to something else.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_applied = False


def apply_cpu_shims() -> bool:
    """Patch megatron-core's CUDA-only calls when CUDA is absent; idempotent.

    Returns whether the shims are in effect (False on a CUDA machine, where
    nothing is touched).
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _shim_current_device()
    _shim_synchronize()
    _shim_rng_tracker()
    _shim_default_causal_mask()
    _shim_grad_clip()
    _shim_pipeline_schedule()
    _shim_tied_embedding_setup()
    _shim_optimizer_literals()
    _shim_optimizer_type_checks()
    _applied = True
    return True


def shims_applied() -> bool:
    """Whether ``apply_cpu_shims`` has patched this process."""
    return _applied


# ----- torch.cuda.current_device ------------------------------------------------------------


def _cpu_current_device() -> str:
    return "cpu"


def _shim_current_device() -> None:
    """``torch.cuda.current_device()`` -> ``"cpu"``.

    Covers megatron-core's ``device=torch.cuda.current_device()`` allocations, first
    hit in ``RotaryEmbedding.get_emb`` (it moves ``inv_freq`` to the current device on
    every forward), in ``dist_checkpointing.save`` (``state_dict_saver.
    save_state_dict_async_finalize`` all-reduces a failure flag allocated there) and,
    with tensor parallelism, in the gather/scatter buffers of
    ``tensor_parallel.mappings`` (``_gather_along_last_dim`` and friends). Patched on
    ``torch.cuda`` itself because megatron-core reads it through the ``torch`` module
    at call time, so the patch is process-wide: without CUDA the original only raises
    "Torch not compiled with CUDA enabled", and only code that probes for CUDA by
    catching that error would now see ``"cpu"`` instead (nothing in vime does).
    """
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


def _cpu_synchronize(device: Any = None) -> None:
    """Nothing to wait for: CPU ops complete before they return."""


def _shim_synchronize() -> None:
    """``torch.cuda.synchronize()`` -> no-op.

    Covers ``dist_checkpointing.save``: its default ``torch_dist`` strategy runs
    ``FileSystemWriterAsync.preload_tensors`` (``strategies/filesystem_async.py``), which
    synchronizes before copying tensors to the host, also when saving synchronously;
    ``fully_parallel`` and ``async_utils`` do the same. Process-wide, like the
    ``current_device`` shim: without CUDA the original only raises, and there is no
    device work to wait for.
    """
    torch.cuda.synchronize = _cpu_synchronize  # type: ignore[assignment]


# ----- RNG tracker ---------------------------------------------------------------------------


def _shim_rng_tracker() -> None:
    """Keep megatron-core's named RNG states on the CPU generator.

    Covers ``tensor_parallel.random.CudaRNGStatesTracker.add`` (called by
    ``model_parallel_cuda_manual_seed``: it reads ``torch.cuda.get_rng_state()``)
    and ``CudaRNGStatesTracker.fork`` (entered by ``DotProductAttention.forward`` on
    every forward, around attention dropout), and the module functions
    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` that activation recomputation
    (``tensor_parallel.checkpoint``) uses to replay dropout. On the CPU all random
    ops draw from the default CPU generator, so that is the generator whose state
    the tracker swaps.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        # A private generator: seeding it leaves the global CPU stream untouched,
        # as megatron-core's CUDA version restores the CUDA stream after seeding.
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            # The named stream advances by what was drawn inside; the outer one resumes.
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom.CudaRNGStatesTracker.add = add  # type: ignore[method-assign]
    mrandom.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


# ----- device="cuda" literals ----------------------------------------------------------------


def _shim_default_causal_mask() -> None:
    """``transformer.utils.get_default_causal_mask`` on the CPU.

    Covers ``FusedScaleMaskSoftmax.forward_torch_softmax`` (the local spec's attention
    softmax), which builds its causal mask with ``torch.ones(..., device="cuda")``
    whenever a forward passes ``attention_mask=None`` without ``PackedSeqParams``.
    vime's own forwards pass packed rows in THD format (``model.stage_forward``), which
    never reach it, but a plain megatron-core forward must work too. Patched where it
    is defined and where ``fused_softmax`` imported it by name.
    """
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    original: Callable[[int], torch.Tensor] = utils.get_default_causal_mask

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    get_default_causal_mask.__wrapped__ = original  # type: ignore[attr-defined]
    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


# ----- gradient norm and clipping ------------------------------------------------------------


def _shim_grad_clip() -> None:
    """CPU versions of ``optimizer.clip_grads.get_grad_norm_fp32`` and
    ``clip_grad_by_total_norm_fp32``.

    The originals allocate ``device="cuda"`` buffers (the multi-tensor applier's
    overflow flag, and ``utils.local_multi_tensor_l2_norm``'s result) and assert
    ``param.grad.type() == "torch.cuda.FloatTensor"``. These replacements keep the
    semantics: the p-norm over the given gradients, summed (or maxed) over the
    DTensor data-parallel group and then ``grad_stats_parallel_group``, returned as
    a float; clipping scales fp32 gradients in place when ``max_norm / (norm + 1e-6)``
    is below 1. Patched in ``clip_grads`` and in ``optimizer.optimizer``, which imported
    them by name (its ``MegatronOptimizer.get_grad_norm`` / ``clip_grad_norm`` are what
    the distributed optimizer calls).
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    replacements = {
        "get_grad_norm_fp32": _get_grad_norm_fp32,
        "clip_grad_by_total_norm_fp32": _clip_grad_by_total_norm_fp32,
    }
    for module in (clip_grads, moptimizer):  # vime builds no other megatron optimizer
        for name, fn in replacements.items():
            setattr(module, name, fn)


def _get_grad_norm_fp32(
    grads_for_norm: list[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group: Any = None,
) -> float:
    """megatron-core's ``get_grad_norm_fp32`` on host tensors."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None
    for grad in grads_for_norm:
        dp_group = get_data_parallel_group_if_dtensor(grad, dp_group)
    grads = [to_local_if_dtensor(g).float() for g in grads_for_norm]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.zeros(1)
        for g in grads:
            total = torch.maximum(total, g.abs().max())
        op = dist.ReduceOp.MAX
    else:
        total = torch.zeros(1)
        for g in grads:
            total += torch.linalg.vector_norm(g, norm_type) ** norm_type
        op = dist.ReduceOp.SUM
    if dp_group:
        dist.all_reduce(total, op=op, group=dp_group)
    dist.all_reduce(total, op=op, group=grad_stats_parallel_group)
    if norm_type == math.inf:
        return float(total.item())
    return float(total.item()) ** (1.0 / norm_type)


def _clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` on host tensors."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            # As the original: fp32 grads (decoupled grads may also be bf16).
            allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
            if grad.dtype not in allowed:
                raise TypeError(f"expected {allowed} gradients, got {grad.dtype}")
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


# ----- pipeline parallelism ------------------------------------------------------------------


def _on_cpu(device: Any) -> Any:
    """``device`` with any CUDA device replaced by the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _TorchWithCpuFactories(types.ModuleType):
    """The ``torch`` module as one megatron-core module sees it: every attribute is
    torch's own, except that ``zeros`` and ``tensor`` put a ``device="cuda"`` tensor on
    the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(data: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, device=_on_cpu(device), **kwargs)


def _shim_pipeline_schedule() -> None:
    """``pipeline_parallel.schedules``' ``device="cuda"`` token counter on the CPU.

    Covers ``forward_backward_pipelining_without_interleaving`` (and the other
    schedules), which count the step's tokens in ``torch.zeros([], dtype=torch.int,
    device="cuda")``. The module reads ``torch`` as a global at call time, so giving
    that one module a ``torch`` whose ``zeros`` maps CUDA to the CPU covers the literal
    and touches nothing else (its p2p buffers go through ``torch.cuda.current_device``,
    already shimmed above).
    """
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _TorchWithCpuFactories):
        schedules.torch = _TorchWithCpuFactories()


@contextlib.contextmanager
def _tensor_method(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``torch.Tensor.<name>`` is ``replacement(original, self, ...)`` inside the block."""
    original = getattr(torch.Tensor, name)

    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return replacement(original, self, *args, **kwargs)

    setattr(torch.Tensor, name, method)
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def _tensor_cuda_is_identity() -> contextlib.AbstractContextManager[None]:
    return _tensor_method("cuda", lambda _original, self, *args, **kwargs: self)


def _shim_tied_embedding_setup() -> None:
    """``LanguageModule.setup_embeddings_and_output_layer`` under pipeline parallelism.

    With tied embeddings and more than one stage, the last stage keeps its own copy
    of the word embeddings, and this method makes the first and last stages agree by
    all-reducing that copy over the embedding group -- after ``weight.data =
    weight.data.cuda()``. The wrapper runs megatron-core's method unchanged with
    ``Tensor.cuda`` returning the tensor itself for the length of the call, so the
    weight stays on the host and the all-reduce runs over gloo.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "__wrapped__", None) is not None:
        return

    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensor_cuda_is_identity():
            original(self)

    setup_embeddings_and_output_layer.__wrapped__ = original  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer  # type: ignore[method-assign]


# ----- megatron-core's optimizers ------------------------------------------------------------


def _shim_optimizer_literals() -> None:
    """``optimizer.optimizer``'s ``device='cuda'`` scalars on the CPU.

    Covers ``MixedPrecisionOptimizer.__init__`` (the base of ``DistributedOptimizer``),
    which makes its ``found_inf``, ``_dummy_overflow_buf`` and ``_scale_one`` with
    ``torch.tensor([...], device='cuda')``, and ``FP32Optimizer``'s ``_scale``. The
    module reads ``torch`` as a global at call time, so it gets the same CPU-factory
    ``torch`` as the pipeline schedule.
    """
    from megatron.core.optimizer import optimizer as moptimizer

    if not isinstance(moptimizer.torch, _TorchWithCpuFactories):
        moptimizer.torch = _TorchWithCpuFactories()


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _cuda_type_name(original: Callable[..., Any], self: torch.Tensor, *args: Any, **kw: Any) -> Any:
    name = original(self, *args, **kw)
    return name if args or kw else _CUDA_TYPE_NAMES.get(name, name)


def _cpu_tensors_named_as_cuda() -> contextlib.AbstractContextManager[None]:
    """``Tensor.type()`` (no arguments) answers the CUDA type name for a CPU float tensor."""
    return _tensor_method("type", _cuda_type_name)


def _shim_optimizer_type_checks() -> None:
    """Construct ``DistributedOptimizer`` with CPU parameters.

    Covers its ``__init__``: ``DistributedOptimizer._build_model_and_main_param_groups``
    sorts parameters by ``param.type()`` against ``'torch.cuda.HalfTensor'``,
    ``'torch.cuda.BFloat16Tensor'`` and ``'torch.cuda.FloatTensor'`` and raises
    ``TypeError`` for anything else, and ``DistributedOptimizer.__init__`` marks 16-bit
    parameters by the same names. Only during that constructor does a CPU float tensor
    report its CUDA type name; the dtype is what the checks mean, and it is unchanged.
    (megatron-core's non-distributed ``Float16OptimizerWithFloat16Params`` has the same
    checks; vime never builds it: without the flag it runs torch AdamW.)
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    init = cls.__init__
    if getattr(init, "_vime_cpu_shim", False):
        return

    def constructor(self: Any, *args: Any, **kwargs: Any) -> None:
        with _cpu_tensors_named_as_cuda():
            init(self, *args, **kwargs)

    constructor._vime_cpu_shim = True  # type: ignore[attr-defined]
    cls.__init__ = constructor  # type: ignore[method-assign]
