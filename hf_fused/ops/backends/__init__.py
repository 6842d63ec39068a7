"""Backends implement the tiled math; the public ops choose one per call.

A backend meets :class:`~hf_fused.ops.backends.protocol.Backend`: ``logprobs_with_grads``,
``logprobs_forward`` and ``logprobs_backward``, each taking one :class:`~hf_fused.ops.head_inputs.HeadInputs` and
its own per-call arguments, the forward ones returning a :class:`~hf_fused.ops.backends.protocol.HeadPass`; and
optionally ``token_loss_with_grads`` (:class:`~hf_fused.ops.backends.protocol.TokenLossBackend`: the one pass of
:func:`~hf_fused.ops.linear_token_loss` and of a ``TokenLossHint``; without it those run statistics +
recompute); and optionally ``describe_plan`` (:func:`describe_plan`). The pure-PyTorch reference
(:mod:`.torch_reference`) runs everywhere and is what CI tests; the GPU backend (:mod:`.triton_cublas`, a package
that owns its planning) registers here and is chosen automatically for CUDA tensors. ``HF_FUSED_BACKEND=<name>``
or the ``backend=`` argument forces one.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, Optional, Union

import torch

from ..grads import HeadGrads
from ..head_inputs import HeadInputs, NeededGrads
from ..tiling import validate_tile_budget
from .protocol import Backend, HeadPass, TokenLossBackend
from .torch_reference import TorchReferenceBackend

_REGISTRY: dict[str, Callable[[], object]] = {"torch": TorchReferenceBackend}
_INSTANCES: dict[str, object] = {}


def _triton_backend():
    from .triton_cublas import TritonCublasBackend

    return TritonCublasBackend()


if importlib.util.find_spec("triton") is not None:
    _REGISTRY["triton"] = _triton_backend


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make a backend available under ``name`` (used by optional GPU backends); ``factory()`` returns an
    object meeting :class:`~hf_fused.ops.backends.protocol.Backend`.

    Raises:
        TypeError: ``name`` not a non-empty string, or ``factory`` not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_backend: factory must be callable (returning a Backend), got {factory!r}")
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """The names :func:`get_backend` accepts (``"torch"``, ``"triton"`` and any registered later), sorted."""
    return sorted(_REGISTRY)


def get_backend(device: Union[torch.device, str], name: Optional[str] = None) -> Backend:
    """The backend for tensors on ``device`` (a ``torch.device`` or its name, e.g. ``"cuda:0"``): ``name``, else
    ``$HF_FUSED_BACKEND``, else the fastest registered one for the device (the torch reference on CPU).

    Raises:
        ValueError: if the requested name is not registered, or is ``"triton"`` for non-CUDA tensors
            without Triton's interpreter.
    """
    device = torch.device(device)
    name = name or os.environ.get("HF_FUSED_BACKEND") or _default_name(device)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown hf_fused backend {name!r}; available: {available_backends()}. "
            "Unset HF_FUSED_BACKEND or pass one of these names."
        )
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"hf_fused backend 'triton' runs on CUDA tensors (got tensors on {device.type}); use backend='torch' "
            "on this device, or set TRITON_INTERPRET=1 before importing triton to run its kernels in the "
            "interpreter (slow, for tests)."
        )
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def describe_plan(
    weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None, need_weight: Optional[bool] = None,
    n_tokens: Optional[int] = None, backend: Optional[str] = None,
) -> str:
    """One line saying what a call with ``weight`` (``[V, H]``, on its device), ``n_rows`` non-ignored tokens out
    of ``n_tokens`` (default: all kept) and hidden states in the weight's dtype that need a gradient would run now
    on the backend such a call gets (``backend``, else as :func:`get_backend` chooses for ``weight.device``): which
    schedule and its working set, e.g. for a log line. ``need_weight`` defaults to ``weight.requires_grad``.

    Raises:
        ValueError: on a ``weight`` that is not ``[V, H]``, a negative ``n_rows``, a ``tile_budget_bytes`` that is
            not ``None`` or a positive integer, or a backend :func:`get_backend` refuses.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"describe_plan: weight must be a [V, H] tensor (lm_head.weight), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 0:
        raise ValueError(f"describe_plan: n_rows must be the number of non-ignored tokens (an int >= 0), got "
                         f"{n_rows!r}")
    validate_tile_budget(tile_budget_bytes)
    chosen = get_backend(weight.device, backend)
    describe = getattr(chosen, "describe_plan", None)
    if describe is None:
        return f"backend {chosen.name!r} (it does not describe its plan)"
    return describe(weight, n_rows=n_rows, tile_budget_bytes=tile_budget_bytes, need_weight=need_weight,
                    n_tokens=n_tokens)


def _default_name(device: torch.device) -> str:
    if device.type == "cuda" and "triton" in _REGISTRY:
        return "triton"
    return "torch"


__all__ = [
    "Backend",
    "HeadGrads",
    "HeadInputs",
    "HeadPass",
    "NeededGrads",
    "TokenLossBackend",
    "TorchReferenceBackend",
    "available_backends",
    "describe_plan",
    "get_backend",
    "register_backend",
]
