"""TRL's fused-LM-head protocol, served by hf_fused's ops on models patched by :func:`hf_fused.apply_fused_loss`.

TRL ≥ 1.16's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``RLOOTrainer`` and ``GRPOTrainer`` install their own
chunked head with ``trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`` and
then call ``model(..., labels=labels, fused_lm_head=True)``, which returns a ``FusedCausalLMOutput``
(``loss``, ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, ``label_mask``,
``aux_loss``). That head runs the backbone and reads ``lm_head.weight`` itself, so a patched forward is
bypassed. The one switch, :func:`hf_fused.apply_fused_loss`, makes hf_fused answer that call instead, whatever
the order:

* **patched before the trainer is built**: :func:`serve_trl_fused_head` wraps ``add_fused_lm_head`` (in
  ``trl.trainer.utils`` and in every loaded TRL module that imported it). For a patched model the wrapper only
  records the trainer's head options; hf_fused's forward answers ``fused_lm_head=True``. A model that is not
  patched gets TRL's head, except a reference model added while a trainer whose policy is patched is being
  built: it is patched too (same ``tile_budget_bytes`` / ``backend``), so reference log-probs come from
  hf_fused's ops as well.
* **patched after**: TRL's head is already the model's forward (possibly wrapped by accelerate's autocast);
  its options are read from it and the patched forward, which sits outside it, answers ``fused_lm_head=True``.
  Without ``fused_lm_head`` the call passes through TRL's head unchanged, so generation is the original.

The answer (:func:`trl_fused_forward`) runs the model's original forward with ``labels=None`` and the lm_head
call intercepted (:mod:`hf_fused.model.forward`), and computes every field TRL's head would return from the
states lm_head receives: log-probs and entropy with :func:`hf_fused.ops.linear_logprobs`, the gradient-free
statistics with :func:`hf_fused.ops.token_statistics.linear_token_statistics`, ``loss`` and ``label_mask`` as
TRL defines them. A PEFT adapter on lm_head is part of the head (TRL's head would read the bare weight).

TRL's ``DistillationTrainer`` does not use this protocol: its loss is a student–teacher divergence
(``trl/kernels/chunked_divergence.py``) computed from the backbones and lm_head weights directly. hf_fused
has no divergence op, so it warns once and leaves that trainer on TRL's kernel.

If TRL's head changes shape (``add_fused_lm_head``'s signature, ``FusedCausalLMOutput``'s fields, the
closure of the forward it installs), nothing is wrapped and a fused call raises, saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import sys
import types
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.forward import FusedRequest, _as_kwargs, _intercept_lm_head
from ..model.lm_head import head_tensors
from ..model.unwrap import find_causal_lm
from ..ops import linear_logprobs
from ..ops.token_statistics import TOKEN_STATISTICS, linear_token_statistics
from ..ops.token_loss import pad_hint

__all__ = ["TrlHeadOptions", "serve_trl_fused_head", "trl_fused_forward", "trl_head_options"]

#: ``add_fused_lm_head``'s parameters and ``FusedCausalLMOutput``'s fields in TRL 1.16: the protocol served here.
_ADD_HEAD_PARAMETERS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
_OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask", "aux_loss")
#: Names TRL's installed ``_fused_forward`` closes over that hold its options.
_CLOSURE_OPTIONS = ("temperature", "cast_lm_head_to_fp32", "outputs")
#: Where hf_fused keeps a patched model's TRL head options.
_OPTIONS_ATTR = "_hf_fused_trl_head"


@dataclass(frozen=True)
class TrlHeadOptions:
    """The arguments a TRL trainer gave ``add_fused_lm_head`` for one model."""

    temperature: float = 1.0
    cast_lm_head_to_fp32: bool = False
    outputs: tuple = ("log_probs",)


class TrlProtocolError(RuntimeError):
    """TRL's fused-head protocol is not the one hf_fused serves (a TRL version it does not know)."""


# ------------------------------------------------------------------------------------------------------------
# Installation: called by apply_fused_loss on every patched model.


def serve_trl_fused_head(causal_lm: nn.Module) -> None:
    """Make ``causal_lm`` (just patched by :func:`hf_fused.apply_fused_loss`) answer TRL's fused-head calls.

    Reads the options of a TRL head already installed on the model (patched after the trainer was built) and
    wraps TRL's ``add_fused_lm_head`` (once per process) for trainers built afterwards. No-op without TRL.

    Raises:
        TrlProtocolError: a TRL head is installed on the model but its shape is not TRL 1.16's.
    """
    if importlib.util.find_spec("trl") is None:
        return
    _install_add_fused_lm_head_hook()
    options = _trl_head_in(causal_lm._hf_fused.original_forward(causal_lm))
    if options is not None:
        setattr(causal_lm, _OPTIONS_ATTR, options)


def trl_head_options(model: nn.Module) -> Optional[TrlHeadOptions]:
    """The TRL head options hf_fused serves on ``model`` (``None`` if no TRL trainer asked for a head)."""
    return find_causal_lm(model).__dict__.get(_OPTIONS_ATTR)


_HOOK: dict = {}  # "original": TRL's add_fused_lm_head; "refused": why the protocol is not served


def _install_add_fused_lm_head_hook() -> None:
    """Once per process: wrap ``add_fused_lm_head`` (see the module docstring), let TRL's trainers accept a PEFT
    adapter on a patched model's lm_head, and make ``DistillationTrainer`` say it does not use hf_fused."""
    if _HOOK:
        return
    try:
        import trl.trainer.utils as trl_utils
    except Exception as error:  # a broken TRL must not break apply_fused_loss for models TRL never sees
        _HOOK["refused"] = f"TRL is installed but could not be imported ({type(error).__name__}: {error})"
        warnings.warn(f"hf_fused: {_HOOK['refused']}; its trainers cannot be served.", stacklevel=3)
        return

    original = trl_utils.add_fused_lm_head
    _HOOK["original"] = original
    why = _protocol_mismatch(trl_utils)
    if why is not None:
        _HOOK["refused"] = why
        warnings.warn(
            f"hf_fused: {why}. TRL's trainers will use TRL's own fused head on this model, not hf_fused's; a "
            "fused call on a patched model raises. hf_fused serves TRL 1.16's protocol.",
            stacklevel=3,
        )
        return

    @functools.wraps(original)
    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        options = TrlHeadOptions(float(temperature), bool(cast_lm_head_to_fp32), tuple(outputs))
        if not _is_patched(model):
            policy = _patched_policy_of_trainer_being_built(model)
            if policy is None:
                return original(model, temperature, cast_lm_head_to_fp32, outputs)
            from ..model.patch import apply_fused_loss

            # A reference model: computed by hf_fused like the policy it is compared with.
            state = policy._hf_fused
            apply_fused_loss(model, tile_budget_bytes=state.tile_budget_bytes, backend=state.backend)
        setattr(find_causal_lm(model), _OPTIONS_ATTR, options)

    add_fused_lm_head.__hf_fused__ = True
    for module in list(sys.modules.values()):  # trainer modules bound the name at import
        # vars(), not getattr: a lazy TRL module would import its optional submodules on attribute access.
        name = getattr(module, "__name__", None)
        if isinstance(name, str) and name.startswith("trl") and vars(module).get("add_fused_lm_head") is original:
            module.add_fused_lm_head = add_fused_lm_head
    _let_trainers_accept_lm_head_adapters()
    _warn_on_distillation_trainer()


#: TRL 1.16 trainers that refuse a PEFT adapter on lm_head (their head would read the bare weight).
_TRAINERS_REFUSING_HEAD_ADAPTERS = {
    "trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
    "trl.trainer.kto_trainer": "KTOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer",
    "trl.trainer.grpo_trainer": "GRPOTrainer",
}


def _let_trainers_accept_lm_head_adapters() -> None:
    """TRL's trainers raise when a PEFT adapter sits on lm_head, because TRL's head would ignore it. On a patched
    model hf_fused computes the head with the adapter (:func:`hf_fused.model.lm_head.head_tensors`), so while such a
    trainer is built around a patched model its lm_head check sees the layer under the adapter."""
    import importlib

    for module_name, class_name in _TRAINERS_REFUSING_HEAD_ADAPTERS.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        init = cls.__init__
        if getattr(init, "__hf_fused__", False):
            continue

        def make(init):
            @functools.wraps(init)
            def __init__(self, *args, **kwargs):
                model = kwargs.get("model", args[0] if args else None)
                with lm_head_adapter_hidden_from_trl(model):
                    init(self, *args, **kwargs)

            __init__.__hf_fused__ = True
            return __init__

        cls.__init__ = make(init)


@contextlib.contextmanager
def lm_head_adapter_hidden_from_trl(model):
    """While a TRL trainer is built around a patched ``model``, ``get_output_embeddings()`` returns the layer *under*
    a PEFT adapter on lm_head, so TRL's "adapter on lm_head is not supported" check passes. Only the causal LM's
    instance attribute is touched, and it is removed on exit. No-op for an unpatched model (TRL's check stands)."""
    if not isinstance(model, nn.Module) or not _is_patched(model):
        yield
        return
    inner = find_causal_lm(model)
    if "get_output_embeddings" in inner.__dict__:  # someone else's instance patch (or ours, nested): leave it
        yield
        return
    cls_get = type(inner).get_output_embeddings

    def get_output_embeddings(self):
        head = cls_get(self)
        while hasattr(head, "get_base_layer") and hasattr(head, "active_adapters"):  # peft BaseTunerLayer
            head = head.get_base_layer()
        return head

    inner.get_output_embeddings = types.MethodType(get_output_embeddings, inner)
    try:
        yield
    finally:
        del inner.get_output_embeddings


def _protocol_mismatch(trl_utils) -> Optional[str]:
    params = tuple(inspect.signature(trl_utils.add_fused_lm_head).parameters)
    if params != _ADD_HEAD_PARAMETERS:
        return f"trl.trainer.utils.add_fused_lm_head takes {params}, expected {_ADD_HEAD_PARAMETERS}"
    output_cls = getattr(trl_utils, "FusedCausalLMOutput", None)
    fields = tuple(f.name for f in dataclasses.fields(output_cls)) if output_cls is not None else None
    if fields != _OUTPUT_FIELDS:
        return f"trl.trainer.utils.FusedCausalLMOutput has fields {fields}, expected {_OUTPUT_FIELDS}"
    return None


def _is_patched(model: nn.Module) -> bool:
    try:
        return "_hf_fused" in find_causal_lm(model).__dict__
    except TypeError:
        return False


def _patched_policy_of_trainer_being_built(model: nn.Module) -> Optional[nn.Module]:
    """The patched causal LM of the trainer whose ``__init__`` is adding a head to ``model`` (its reference
    model), found on the call stack; ``None`` when there is none or its policy is not patched."""
    from transformers import Trainer

    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            policy = getattr(owner, "model", None)
            if isinstance(policy, nn.Module) and policy is not model and _is_patched(policy):
                return find_causal_lm(policy)
            return None
        frame = frame.f_back
    return None


def _warn_on_distillation_trainer() -> None:
    """``DistillationTrainer`` computes a student–teacher divergence from the lm_head weights itself, which
    hf_fused has no op for: say so once when it is given a patched model, and leave it on TRL's kernel."""
    try:
        from trl.trainer.distillation_trainer import DistillationTrainer
    except ImportError:
        return
    init = DistillationTrainer.__init__
    if getattr(init, "__hf_fused__", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models = [getattr(self, "model", None), getattr(self, "teacher_model", None)]
        if any(isinstance(m, nn.Module) and _is_patched(m) for m in models) and not _DISTILLATION_WARNED:
            _DISTILLATION_WARNED.append(True)
            warnings.warn(
                "hf_fused does not compute DistillationTrainer's loss: its student–teacher divergence reads both "
                "lm_head weights directly (trl/kernels/chunked_divergence.py) and hf_fused has no divergence op. "
                "Training uses TRL's chunked kernel, which also never builds the full logits; apply_fused_loss "
                "has no effect on this trainer's loss (generation is unchanged).",
                UserWarning,
                stacklevel=2,
            )

    __init__.__hf_fused__ = True
    DistillationTrainer.__init__ = __init__


_DISTILLATION_WARNED: list = []


def _trl_head_in(forward: Any) -> Optional[TrlHeadOptions]:
    """The options of TRL's ``_fused_forward`` found in ``forward`` or the wrappers around it (a bound method's
    ``__func__``, ``functools.wraps``' ``__wrapped__``, accelerate's ``ConvertOutputsToFp32.model_forward``).

    Raises:
        TrlProtocolError: a function named ``_fused_forward`` from TRL that does not close over TRL 1.16's options.
    """
    seen = set()
    current = forward
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        func = getattr(current, "__func__", current)
        code = getattr(func, "__code__", None)
        # functools.wraps gave it the model's __module__ and __qualname__: its code object says where it is from.
        if code is not None and code.co_name == "_fused_forward" and _is_trl_file(code.co_filename):
            cells = dict(zip(code.co_freevars, func.__closure__ or ()))
            if not all(name in cells for name in _CLOSURE_OPTIONS + ("original_forward",)):
                raise TrlProtocolError(
                    f"TRL's fused head (_fused_forward in {code.co_filename}) closes over {code.co_freevars}, not over "
                    f"{_CLOSURE_OPTIONS}: hf_fused cannot read its options. hf_fused serves TRL 1.16's fused head."
                )
            values = {name: cells[name].cell_contents for name in _CLOSURE_OPTIONS}
            return TrlHeadOptions(float(values["temperature"]), bool(values["cast_lm_head_to_fp32"]),
                                  tuple(values["outputs"]))
        nxt = getattr(func, "__wrapped__", None)
        if nxt is None:
            nxt = getattr(current, "model_forward", None)  # accelerate's ConvertOutputsToFp32
        current = nxt
    return None


def _is_trl_file(filename: str) -> bool:
    return f"{os.sep}trl{os.sep}" in filename


# ------------------------------------------------------------------------------------------------------------
# The call.


def trl_fused_forward(model: nn.Module, *args, **kwargs):
    """Answer ``model(*args, labels=..., fused_lm_head=True, **kwargs)`` as TRL's fused head would, with hf_fused.

    Args (besides the model's own): ``labels`` ``[B, T]`` (shifted here: the output is ``[B, T − 1]``) or
    ``shift_labels`` ``[B, T]`` (already aligned: output ``[B, T]``); ``num_items_in_batch``; and hf_fused's
    ``grad_hint`` (shaped like the output, see :func:`hf_fused.ops.linear_logprobs`).

    Returns:
        ``trl.trainer.utils.FusedCausalLMOutput`` with TRL's fields: per-token fields 0 (``False``) where the label
        is -100 and ``None`` unless listed in the trainer's ``outputs``; ``loss = −Σ log_probs / (num_items_in_batch
        or the number of labelled tokens)`` plus ``router_aux_loss_coef · aux_loss`` when router logits are
        requested; ``label_mask``; ``aux_loss``.

    Raises:
        TrlProtocolError: no TRL trainer asked this model for a fused head, or TRL's protocol has changed.
        ValueError: neither ``labels`` nor ``shift_labels``.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    state = model._hf_fused
    options = model.__dict__.get(_OPTIONS_ATTR)
    if options is None:
        raise TrlProtocolError(
            "model(..., fused_lm_head=True) on a model patched by hf_fused, but no TRL trainer added a fused head to "
            "it through trl.trainer.utils.add_fused_lm_head"
            + (f" ({_HOOK['refused']})" if "refused" in _HOOK else "")
            + ". Build the TRL trainer with this model, or call apply_fused_loss after building it."
        )
    original = state.original_forward(model)
    if args:
        kwargs = _as_kwargs(inspect.signature(original), args, kwargs)
    kwargs.pop("fused_lm_head")
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    grad_hint = kwargs.pop("grad_hint", None)
    kwargs.pop("return_dict", None)
    kwargs["use_cache"] = False
    text_config = model.config.get_text_config()
    if getattr(text_config, "output_router_logits", False):  # as TRL's head: the model's own MoE default
        kwargs.setdefault("output_router_logits", True)

    if shift_labels is not None:
        aligned, trim = shift_labels, False
    elif labels is not None:
        aligned, trim = F.pad(labels[:, 1:], (0, 1), value=-100), True  # the last position predicts nothing
    else:
        raise ValueError("model(..., fused_lm_head=True) needs `labels` or `shift_labels` (TRL's fused-head protocol)")
    if grad_hint is not None and trim:
        grad_hint = pad_hint(grad_hint, 0, 1)  # a tensor or a TokenLossHint

    request = FusedRequest(mode="logprobs", state=state, labels=aligned)
    request.head = functools.partial(_head, labels=aligned, options=options, state=state, grad_hint=grad_hint)
    with _intercept_lm_head(model.get_output_embeddings(), request):
        out = original(**kwargs, labels=None, return_dict=True)
    if not request.called:
        raise RuntimeError(f"{type(model).__name__}.forward did not call its lm_head; hf_fused cannot serve TRL's head")

    fields = {k: (None if v is None else (v[:, :-1] if trim else v)) for k, v in request.result.items()}
    mask = (aligned != -100)[:, :-1] if trim else aligned != -100
    mask = mask.to(fields["log_probs"].device)
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / denominator
    aux_loss = out.get("aux_loss") if kwargs.get("output_router_logits") else None
    if aux_loss is not None:
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)


def _head(lm_head: nn.Module, hidden: torch.Tensor, *, labels, options: TrlHeadOptions, state, grad_hint):
    """Every per-token field TRL's head returns, from the states lm_head received (``[B, T, H]``)."""
    head_hidden, weight, bias = head_tensors(lm_head, hidden)
    head_hidden = head_hidden.to(weight.device)
    labels = labels.to(weight.device)
    precision = nullcontext()
    if options.cast_lm_head_to_fp32:  # TRL: the projection in fp32, outside autocast
        precision = torch.autocast(head_hidden.device.type, enabled=False)
        head_hidden, weight = head_hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    transform = state.transform
    common = dict(
        ignore_index=-100, temperature=options.temperature, softcap=transform.softcap,
        logit_scale=transform.logit_scale, tile_budget_bytes=state.tile_budget_bytes,
    )
    statistics = [name for name in TOKEN_STATISTICS if name in options.outputs]
    with precision:
        log_probs, entropy = linear_logprobs(
            head_hidden, weight, labels, bias, return_entropy="entropy" in options.outputs, backend=state.backend,
            grad_hint=None if grad_hint is None else grad_hint.to(weight.device), **common,
        )
        stats = linear_token_statistics(head_hidden, weight, labels, bias, statistics=statistics, **common) if statistics else {}
    return {"log_probs": log_probs, "entropy": entropy, **{name: stats.get(name) for name in TOKEN_STATISTICS}}
