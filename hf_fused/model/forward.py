"""The one generic forward that replaces a patched causal LM's forward.

It runs the model's ORIGINAL forward (so every architecture's backbone call, ``logits_to_keep``
slicing, logit transform and MoE router outputs stay the model's own code) with ``labels=None`` and
with the lm_head call intercepted: inside lm_head's own call (where DeepSpeed ZeRO-3 has gathered its
weight) the intercept computes the fused loss / log-probs from the hidden states it receives and hands
back an empty ``[..., 0]`` tensor in place of the logits. The original forward's logit transform then
runs on that empty tensor for nothing; the fused ops apply the same transform, read from the config.

A library's own call (TRL's ``fused_lm_head=True``) is answered by the extension registered for its keyword
(:mod:`hf_fused.model.extensions`), with the same intercept (:func:`intercept_lm_head`, :class:`FusedRequest`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import LogitTransform, available_backends, linear_cross_entropy, linear_logprobs
from ..ops.tiling import validate_tile_budget
from .distributed import run_head
from .extensions import call_handler, track_patched
from .lm_head import head_tensors
from .outputs import fused_output_type, to_tuple_with_logits_slot
from .tensor_parallel import check_tensor_parallel_head, local_hidden, vocab_parallel_head

#: What a caller may ask the patched forward for (keyword ``fused_output``).
FUSED_OUTPUTS = ("loss", "logprobs", "hidden_states")


@dataclass
class FusedLossState:
    """What :func:`~hf_fused.apply_fused_loss` stores on the patched model (``model._hf_fused``).

    Picklable (``torch.save(model)`` keeps the patch): it refers to the model's original forward as "the
    class's forward" (``instance_forward is None``, the usual case) rather than holding a bound method."""

    instance_forward: Any  # the instance-level ``forward`` attribute before patching, if any
    transform: LogitTransform
    tile_budget_bytes: Optional[int] = None
    backend: Optional[str] = None
    enabled: bool = True  # False inside :func:`~hf_fused.model.patch.original_forward_only`
    warned_without_labels: bool = False

    def original_forward(self, model: nn.Module):
        """The forward that was in place before patching, bound to ``model``."""
        if self.instance_forward is not None:
            return self.instance_forward
        return types.MethodType(type(model).forward, model)

    def original_forward_callable(self, model: nn.Module):
        """:meth:`original_forward` as the patched forward calls it: the class's forward with ``model`` as a
        ``functools.partial``, which Dynamo traces (building a ``types.MethodType`` inside a compiled forward
        breaks its graph)."""
        if self.instance_forward is not None:
            return self.instance_forward
        return functools.partial(type(model).forward, model)


@dataclass
class FusedRequest:
    """One call's instructions for the lm_head intercept (:func:`intercept_lm_head`), and where it leaves its result.

    ``mode`` is one of :data:`FUSED_OUTPUTS`; ``labels`` are aligned with the positions that reach lm_head. An
    extension (:mod:`hf_fused.model.extensions`) sets ``head`` to compute the head its own way: inside lm_head's
    call (ZeRO-3 parameters gathered), ``head(lm_head, hidden)`` returns tensors (or tuples / dicts of them), which
    become ``result``."""

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
    head: Any = None  # ``head(lm_head, hidden) -> result`` in place of the modes' math (an extension's own head)
    #: Where ``result`` is handed back: the inputs' device for a model dispatched over devices
    #: (:func:`dispatched_output_device`), else ``None`` (lm_head's device).
    output_device: Optional[torch.device] = None


class PatchedForward:
    """``model.forward`` after :func:`~hf_fused.apply_fused_loss`: calls :func:`fused_forward`.

    Reports the original forward's signature (``inspect.signature(model.forward)``, which ``generate()``
    validates its keywords against) and pickles as "the patched forward of this model", so
    ``torch.save``/``torch.load`` and ``copy.deepcopy`` give a patched model bound to its own copy."""

    __hf_fused__ = True

    def __init__(self, model: nn.Module):
        self.__self__ = model
        track_patched(model)

    def __call__(self, *args, **kwargs):
        return fused_forward(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__._hf_fused.original_forward(self.__self__))

    @property
    def __doc__(self):
        return getattr(self.__self__._hf_fused.original_forward(self.__self__), "__doc__", None)

    __name__ = "forward"

    def __reduce__(self):
        return (PatchedForward, (self.__self__,))

    def __repr__(self) -> str:
        return f"<hf_fused patched forward of {type(self.__self__).__name__}>"


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
    handler = call_handler(kwargs)  # a library's own call (TRL's fused_lm_head=True): its extension answers it
    if handler is not None:
        return handler(model, *args, **kwargs)
    original = state.original_forward_callable(model)
    if not state.enabled:
        return original(*args, **kwargs)
    if args:
        signature = inspect.signature(original)
        if "fused_output" not in kwargs and not _labels_in(signature, args, kwargs):
            return _without_labels(model, state, original, args, kwargs)
        kwargs = as_kwargs(signature, args, kwargs)
    mode = kwargs.pop("fused_output", None)
    labels = kwargs.get("labels")
    shift_labels = kwargs.get("shift_labels")
    if mode is None:
        if labels is None and shift_labels is None:
            return _without_labels(model, state, original, (), kwargs)
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
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)

    out = run_intercepted(model, original, kwargs, request, "compute the loss from hidden states")

    fields = {k: v for k, v in out.items() if k not in ("logits", "loss")}
    loss = None
    if mode == "loss":
        loss = request.result
        aux_loss = fields.get("aux_loss")
        if aux_loss is not None:  # MoE: added exactly as the original forward adds it with labels
            loss = loss + _router_aux_loss_coef(model) * aux_loss.to(loss.device)
    if mode == "logprobs":
        fields["logprobs"], fields["entropy"] = request.result
    elif mode == "hidden_states":
        fields["last_hidden_state"] = request.result
    new_out = fused_output_type(type(out))(loss=loss, **fields)
    if return_dict or mode != "loss":  # fused_output requests always get the output object
        return new_out
    return to_tuple_with_logits_slot(new_out)


def _without_labels(model, state: FusedLossState, original, args, kwargs):
    """Generation and inference: exactly the original forward. In training with gradients this builds the full
    logits (``Trainer`` pops the labels for ``label_smoothing_factor > 0`` or ``compute_loss_func``; a distillation
    trainer such as TRL's GKD computes its loss from the logits): say once per model who called it so, instead of
    quietly losing the memory saving."""
    if model.training and torch.is_grad_enabled() and not state.warned_without_labels:
        state.warned_without_labels = True
        caller, stacklevel = _caller_outside_wrappers()
        if caller.startswith("transformers.trainer.") and caller.split(" ")[0].endswith(".compute_loss"):
            cause = (f"{caller} popped them to compute the loss from the logits itself, which Trainer does when "
                     "label_smoothing_factor > 0 or compute_loss_func is set")
        else:
            cause = (f"{caller} called it so, to compute its loss from the logits itself (a distillation divergence "
                     "such as TRL's GKD, or a custom loss), which apply_fused_loss does not fuse; such a loss can "
                     "instead read model(..., fused_output='hidden_states') and compute with hf_fused.ops (a "
                     "student-teacher divergence: linear_distillation_loss; TRL's DistillationTrainer and "
                     "GKDTrainer's own loss are fused for a patched student)")
        warnings.warn(
            f"hf_fused: {type(model).__name__} was called without labels while training, so its original forward "
            f"built the full [tokens, vocab] logits and the fused loss was not used: {cause}. Pass labels to the "
            "model to use the fused loss.",
            FusedLossBypassedWarning, stacklevel=stacklevel,
        )
    return original(*args, **kwargs)


#: Packages whose frames sit between a model call and its caller (module call machinery, wrappers of the model).
_WRAPPER_PACKAGES = frozenset({"hf_fused", "torch", "accelerate", "peft", "deepspeed", "functools", "contextlib"})


def _caller_outside_wrappers() -> tuple[str, int]:
    """``("module.qualname (line n)", stacklevel)`` of the first frame up the stack outside
    :data:`_WRAPPER_PACKAGES`: the code that called the model. Reads code objects and module names only, never a
    frame's locals (on Python < 3.13 reading ``f_locals`` snapshots them onto the frame, keeping them alive)."""
    frame = sys._getframe(2)  # the caller of _without_labels: warnings' stacklevel 2
    level = 2
    try:
        while frame is not None:
            module = frame.f_globals.get("__name__", "?")
            if module.split(".")[0] not in _WRAPPER_PACKAGES:
                code = frame.f_code
                return f"{module}.{getattr(code, 'co_qualname', code.co_name)} (line {frame.f_lineno})", level
            frame, level = frame.f_back, level + 1
        return "the caller", 2
    finally:
        del frame


class FusedLossBypassedWarning(UserWarning):
    """A patched model ran its original forward (full logits) in training, because it got no labels."""


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
            "hf_fused cannot add the MoE auxiliary loss as the original forward would. Set router_aux_loss_coef on "
            "the model's config (transformers' MoE models read it there), or call remove_fused_loss(model)."
        )
    return coef


@contextmanager
def intercept_lm_head(lm_head: nn.Module, request: FusedRequest):
    """Within the block, ``lm_head(hidden)`` computes ``request`` from ``hidden`` (its mode's op, or
    ``request.head``), stores it in ``request.result``, sets ``request.called`` and returns an empty ``[..., 0]``
    placeholder for the logits; the head is restored afterwards. Run the model's original forward inside."""
    with lm_head_answering(lm_head, lambda hidden: _head_forward(lm_head, request, hidden)):
        yield


def run_intercepted(model: nn.Module, original, kwargs: dict, request: FusedRequest, purpose: str):
    """``original(**kwargs, labels=None, return_dict=True)`` under :func:`intercept_lm_head` for ``request`` (no
    loss of the forward's own: lm_head returns no logits), its results headed for the device the forward's outputs
    go to (:func:`dispatched_output_device`); returns the forward's output.

    Raises:
        RuntimeError: the forward never called ``model``'s lm_head (``purpose``: what hf_fused then cannot do).
    """
    lm_head = model.get_output_embeddings()
    kwargs = {**kwargs, "labels": None}
    request.output_device = dispatched_output_device(model, kwargs)
    with intercept_lm_head(lm_head, request):
        out = original(**kwargs, return_dict=True)
    if not request.called:
        raise RuntimeError(f"{type(model).__name__}.forward did not call its lm_head ({type(lm_head).__name__}); "
                           f"hf_fused cannot {purpose} for this model. Call remove_fused_loss(model) to use its "
                           "original forward, or compute the loss with hf_fused.ops.linear_cross_entropy on the "
                           "hidden states it passes to its output layer.")
    return out


@contextmanager
def lm_head_answering(lm_head: nn.Module, answer):
    """Within the block, ``lm_head(hidden, ...)`` returns ``answer(hidden)`` (an instance ``forward``, so
    module hooks such as ZeRO-3's gather still run around it); any instance ``forward`` it had is restored.

    On a module dispatched by accelerate (``from_pretrained(device_map=...)``) the answer takes the place of the
    ``_old_forward`` that accelerate's hooked ``forward`` calls, so its hook still moves ``hidden`` to lm_head's
    device first (a tied lm_head sits with the embeddings, often on another GPU than the final norm)."""
    name = "_old_forward" if hasattr(lm_head, "_hf_hook") and "_old_forward" in lm_head.__dict__ else "forward"
    had_instance_attribute = name in lm_head.__dict__
    previous = lm_head.__dict__.get(name)
    # A plain function as the instance attribute (Module.__call__ calls self.forward(hidden)): Dynamo traces
    # it, where building a types.MethodType inside a compiled forward breaks the graph.
    setattr(lm_head, name, lambda hidden, *args, **kwargs: answer(hidden))
    try:
        yield
    finally:
        if had_instance_attribute:
            setattr(lm_head, name, previous)
        else:
            delattr(lm_head, name)


def _head_forward(lm_head: nn.Module, request: FusedRequest, hidden: torch.Tensor) -> torch.Tensor:
    request.called = True
    hidden, as_output = local_hidden(hidden)  # a DTensor from torch's ColwiseParallel pre-hook: its local tensor
    placeholder = as_output(hidden.new_empty(*hidden.shape[:-1], 0))
    if request.mode == "hidden_states":
        result = hidden
    else:
        # ZeRO-3: the head's partitioned parameters gathered for this computation and for its backward.
        result = run_head(lm_head, hidden, lambda h: _head_result(lm_head, request, h))
    request.result = _moved(result, request.output_device)
    return placeholder


def dispatched_output_device(model: nn.Module, kwargs: dict) -> Optional[torch.device]:
    """The device a model dispatched over several devices by accelerate (``from_pretrained(device_map="auto")``,
    which TRL 1.16 uses for a reference model under FSDP) hands its outputs back on: its inputs' (the top-level
    hook's ``io_same_device``; accelerate's ``find_device`` over the call's keywords), else ``None``. The
    original forward's outputs are moved there by that hook; the fused results, made on lm_head's device inside
    its call, must follow them or the caller mixes devices."""
    hook = getattr(model, "_hf_hook", None)
    if not getattr(hook, "io_same_device", False):
        return None
    from accelerate.utils import find_device  # the hook is accelerate's: it is installed

    return find_device(kwargs)


def _moved(result, device: Optional[torch.device]):
    """``result`` (a tensor, or tuples / lists / dicts of tensors and ``None``) with its tensors on ``device``
    (differentiably); unchanged for ``None``."""
    if device is None:
        return result
    if isinstance(result, torch.Tensor):
        return result.to(device)
    if isinstance(result, dict):
        return {k: _moved(v, device) for k, v in result.items()}
    if isinstance(result, (tuple, list)):
        return type(result)(_moved(v, device) for v in result)
    return result


def _head_result(lm_head: nn.Module, request: FusedRequest, hidden: torch.Tensor):
    if request.head is not None:
        return request.head(lm_head, hidden)
    check_tensor_parallel_head(lm_head)
    head_hidden, weight, bias, labels, _ = head_operands(lm_head, hidden, request.labels)
    # Tensor parallelism: this rank's vocabulary rows, the statistics merged over the group (no logits gathered).
    weight, bias, shard = vocab_parallel_head(weight, bias)
    if labels.shape != head_hidden.shape[:-1]:
        raise ValueError(
            f"labels are aligned to shape {tuple(labels.shape)} but lm_head receives hidden states of shape "
            f"{tuple(hidden.shape[:-1])}; with logits_to_keep pass shift_labels for the kept positions"
        )
    common = op_options(request.state, ignore_index=request.ignore_index)
    if request.mode == "loss":
        num_items = request.num_items_in_batch
        return linear_cross_entropy(
            head_hidden, weight, labels, bias, reduction="sum" if num_items is not None else "mean",
            num_items_in_batch=num_items, backend=request.state.backend, vocab_parallel=shard, **common,
        )
    return linear_logprobs(
        head_hidden, weight, labels, bias, temperature=request.temperature, return_entropy=request.return_entropy,
        grad_hint=_on(request.grad_hint, weight.device), backend=request.state.backend, vocab_parallel=shard,
        **common,
    )


def head_operands(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, fp32: bool = False):
    """``(hidden', weight, bias, labels, precision)`` for the ops from what lm_head received: lm_head read as one
    linear map (:func:`~hf_fused.model.lm_head.head_tensors`, LoRA included), everything on the weight's device.
    With ``fp32`` (TRL's ``cast_lm_head_to_fp32``) the operands are fp32 and ``precision`` turns autocast off
    around the op; otherwise ``precision`` is a null context."""
    head_hidden, weight, bias = head_tensors(lm_head, hidden)
    head_hidden, labels = head_hidden.to(weight.device), labels.to(weight.device)
    if not fp32:
        return head_hidden, weight, bias, labels, nullcontext()
    bias = None if bias is None else bias.float()
    precision = torch.autocast(head_hidden.device.type, enabled=False)
    return head_hidden.float(), weight.float(), bias, labels, precision


def check_op_options(tile_budget_bytes: Optional[int], backend: Optional[str], caller: str) -> None:
    """The ops' options checked where they are given (``caller``: the public name), not at the first forward.

    Raises:
        ValueError: ``tile_budget_bytes`` not ``None`` or a positive int; ``backend`` not ``None`` or a
            registered name.
    """
    validate_tile_budget(tile_budget_bytes)
    if backend is not None and backend not in available_backends():
        raise ValueError(
            f"{caller}(backend={backend!r}): not an hf_fused backend; available: {available_backends()}. "
            "Pass one of these names, or None for the fastest one on the model's device."
        )


def op_options(state: FusedLossState, *, ignore_index: int = -100) -> dict:
    """The ops' keywords a patched model fixes: its logit transform and memory budget."""
    transform = state.transform
    return dict(ignore_index=ignore_index, softcap=transform.softcap, logit_scale=transform.logit_scale,
                tile_budget_bytes=state.tile_budget_bytes)


def _labels_in(signature: inspect.Signature, args, kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in ("labels", "shift_labels")) or (
        as_kwargs(signature, args, kwargs).get("labels") is not None
    )


def as_kwargs(signature: inspect.Signature, args, kwargs) -> dict:
    """A call's ``args`` and ``kwargs`` as keywords of ``signature`` (a ``**kwargs`` parameter's contents spread).

    Raises:
        TypeError: extra positional arguments (a ``*args`` parameter): the patched forward passes keywords only.
    """
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
