"""The one generic forward that replaces a patched causal LM's forward.

It runs the model's ORIGINAL forward (so every architecture's backbone call, ``logits_to_keep``
slicing, logit transform and MoE router outputs stay the model's own code) with ``labels=None`` and
with the lm_head call intercepted: inside lm_head's own call (where DeepSpeed ZeRO-3 has gathered its
weight) the intercept computes the fused loss / log-probs from the hidden states it receives and hands
back an empty ``[..., 0]`` tensor in place of the logits. The original forward's logit transform then
runs on that empty tensor for nothing; the fused ops apply the same transform, read from the config.
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import LogitTransform, linear_cross_entropy, linear_logprobs
from .lm_head import head_tensors

#: What a caller may ask the patched forward for (keyword ``fused_output``).
FUSED_OUTPUTS = ("loss", "logprobs", "hidden_states")


@dataclass
class FusedLossState:
    """What :func:`~hf_fused.apply_fused_loss` stores on the patched model (``model._hf_fused``)."""

    original_forward: Any  # the bound forward that was in place before patching
    instance_forward: Any  # the instance-level ``forward`` attribute before patching, if any
    signature: inspect.Signature
    transform: LogitTransform
    tile_budget_bytes: Optional[int] = None
    backend: Optional[str] = None
    enabled: bool = True  # False inside :func:`~hf_fused.model.patch.original_forward_only`


@dataclass
class FusedRequest:
    """One call's instructions for the lm_head intercept, and where it leaves its result."""

    mode: str
    state: FusedLossState
    labels: Optional[torch.Tensor] = None  # aligned with the positions that reach lm_head
    ignore_index: int = -100
    num_items_in_batch: Any = None
    temperature: float = 1.0
    return_entropy: bool = False
    grad_hint: Optional[torch.Tensor] = None  # aligned with labels, see linear_logprobs
    result: Any = None
    called: bool = False


def make_fused_forward(original_forward):
    """A fresh forward function with the original's name, docstring and signature (``__wrapped__``),
    so ``inspect.signature(model.forward)`` and ``generate()`` see the original. Bound to the model with
    ``types.MethodType`` so ``copy.deepcopy`` rebinds it to the copy."""
    func = getattr(original_forward, "__func__", original_forward)

    def forward(self, *args, **kwargs):
        return fused_forward(self, *args, **kwargs)

    forward.__name__ = getattr(func, "__name__", "forward")
    forward.__qualname__ = getattr(func, "__qualname__", "forward")
    forward.__doc__ = getattr(func, "__doc__", None)
    forward.__wrapped__ = func
    forward.__hf_fused__ = True
    return forward


def fused_forward(model: nn.Module, *args, **kwargs):
    """The patched forward (see the module docstring).

    Extra keywords, removed before the original forward sees them:
        fused_output: ``"loss"`` (default when ``labels`` is given), ``"logprobs"`` or ``"hidden_states"``.
        temperature: logits divisor for ``"logprobs"`` (TRL's sampling temperature). Default 1.
        return_entropy: with ``"logprobs"``, also return the per-token entropy.
        grad_hint: with ``"logprobs"``, the gradient the loss will send to ``out.logprobs`` up to a scalar
            (shaped like the aligned labels); see :func:`hf_fused.ops.linear_logprobs`.

    With ``labels`` (``[B, T]``, shifted inside like transformers' causal-LM loss) or ``shift_labels``
    (``[B, L]``, already aligned with the positions that reach lm_head):
        ``"loss"`` → ``out.loss`` (fp32 scalar: mean over non-ignored tokens, or sum / ``num_items_in_batch``),
        plus the MoE router auxiliary loss as the original adds it; ``out.logits`` is None.
        ``"logprobs"`` → ``out.logprobs`` ``[B, L]`` fp32 and ``out.entropy`` ``[B, L]`` fp32 or None;
        0 (no gradient) where the label is ``ignore_index``.
    ``"hidden_states"`` → ``out.last_hidden_state``: the ``[B, L, H]`` states lm_head would have received.
    Without ``labels``/``shift_labels`` and ``fused_output``: the original forward, untouched.

    Raises:
        ValueError: unknown ``fused_output``; ``"loss"``/``"logprobs"`` without labels.
    """
    state: FusedLossState = model._hf_fused
    if not state.enabled:
        return state.original_forward(*args, **kwargs)
    if args:
        if "fused_output" not in kwargs and not _labels_in(state.signature, args, kwargs):
            return state.original_forward(*args, **kwargs)
        kwargs = _as_kwargs(state.signature, args, kwargs)
    mode = kwargs.pop("fused_output", None)
    labels = kwargs.get("labels")
    shift_labels = kwargs.get("shift_labels")
    if mode is None:
        if labels is None and shift_labels is None:
            return state.original_forward(**kwargs)  # generation / inference: exactly the original
        mode = "loss"
    if mode not in FUSED_OUTPUTS:
        raise ValueError(f"fused_output must be one of {FUSED_OUTPUTS}, got {mode!r}")

    request = FusedRequest(mode=mode, state=state, ignore_index=kwargs.get("ignore_index", -100))
    if mode in ("loss", "logprobs"):
        request.labels = _aligned_labels(labels, kwargs.pop("shift_labels", None), request.ignore_index, mode)
    if mode == "logprobs":
        request.temperature = kwargs.pop("temperature", 1.0)
        request.return_entropy = bool(kwargs.pop("return_entropy", False))
        request.grad_hint = kwargs.pop("grad_hint", None)
    request.num_items_in_batch = kwargs.get("num_items_in_batch")
    kwargs["labels"] = None
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)

    with _intercept_lm_head(model.get_output_embeddings(), request):
        out = state.original_forward(**kwargs, return_dict=True)
    if not request.called:
        raise RuntimeError(
            f"{type(model).__name__}.forward did not call its lm_head ({type(model.get_output_embeddings()).__name__}); "
            "hf_fused cannot compute the loss from hidden states for this model."
        )

    fields = {k: v for k, v in out.items() if k not in ("logits", "loss")}
    loss = None
    if mode == "loss":
        loss = request.result
        aux_loss = fields.get("aux_loss")
        if aux_loss is not None:  # MoE: added exactly as the original forward adds it with labels
            loss = loss + _router_aux_loss_coef(model) * aux_loss.to(loss.device)
    new_out = type(out)(loss=loss, **fields)
    if mode == "logprobs":
        new_out["logprobs"] = request.result[0]
        if request.result[1] is not None:
            new_out["entropy"] = request.result[1]
        else:
            new_out.entropy = None
    elif mode == "hidden_states":
        new_out["last_hidden_state"] = request.result
    return new_out if return_dict else new_out.to_tuple()


def _aligned_labels(labels, shift_labels, ignore_index: int, mode: str) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError(f"fused_output={mode!r} needs `labels` or `shift_labels`")
    # transformers' ForCausalLMLoss: tokens < n predict n; the last position predicts nothing.
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _router_aux_loss_coef(model: nn.Module) -> float:
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(model.config, "router_aux_loss_coef", None)
    if coef is None:
        raise RuntimeError(
            f"{type(model).__name__} returned aux_loss but has no router_aux_loss_coef; "
            "hf_fused cannot add the MoE auxiliary loss as the original forward would."
        )
    return coef


@contextmanager
def _intercept_lm_head(lm_head: nn.Module, request: FusedRequest):
    """Route this call's ``lm_head(hidden)`` to :func:`_head_forward`; restore the head afterwards."""
    had_instance_forward = "forward" in lm_head.__dict__
    previous = lm_head.__dict__.get("forward")

    def intercept(self, hidden, *args, **kwargs):
        return _head_forward(self, request, hidden)

    lm_head.forward = types.MethodType(intercept, lm_head)
    try:
        yield
    finally:
        if had_instance_forward:
            lm_head.forward = previous
        else:
            del lm_head.forward


def _head_forward(lm_head: nn.Module, request: FusedRequest, hidden: torch.Tensor) -> torch.Tensor:
    request.called = True
    placeholder = hidden.new_empty(*hidden.shape[:-1], 0)
    if request.mode == "hidden_states":
        request.result = hidden
        return placeholder
    head_hidden, weight, bias = head_tensors(lm_head, hidden)
    head_hidden = head_hidden.to(weight.device)
    labels = request.labels.to(weight.device)
    if labels.shape != head_hidden.shape[:-1]:
        raise ValueError(
            f"labels are aligned to shape {tuple(labels.shape)} but lm_head receives hidden states of shape "
            f"{tuple(hidden.shape[:-1])}; with logits_to_keep pass shift_labels for the kept positions"
        )
    state, transform = request.state, request.state.transform
    common = dict(
        ignore_index=request.ignore_index, softcap=transform.softcap, logit_scale=transform.logit_scale,
        tile_budget_bytes=state.tile_budget_bytes, backend=state.backend,
    )
    if request.mode == "loss":
        num_items = request.num_items_in_batch
        request.result = linear_cross_entropy(
            head_hidden, weight, labels, bias, reduction="sum" if num_items is not None else "mean",
            num_items_in_batch=num_items, **common,
        )
    else:
        request.result = linear_logprobs(
            head_hidden, weight, labels, bias, temperature=request.temperature,
            return_entropy=request.return_entropy, grad_hint=_on(request.grad_hint, weight.device), **common,
        )
    return placeholder


def _labels_in(signature: inspect.Signature, args, kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in ("labels", "shift_labels")) or (
        _as_kwargs(signature, args, kwargs).get("labels") is not None
    )


def _as_kwargs(signature: inspect.Signature, args, kwargs) -> dict:
    bound = signature.bind_partial(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError("hf_fused's patched forward cannot pass extra positional arguments; use keywords")
        else:
            out[name] = value
    return out


def _on(tensor: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.to(device)
