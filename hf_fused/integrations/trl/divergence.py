"""A patched student's divergence from a teacher, from both models' hidden states: what TRL's distillation trainers
are answered with (:mod:`.distillation`, :mod:`.gkd`).

* :func:`student_divergence`: :func:`hf_fused.ops.linear_distillation_loss` of the student's lm_head module (read as
  hf_fused reads it: a LoRA adapter on lm_head included) against a :class:`TeacherHead`, with the patched student's
  measured logit transform and options; FSDP2 DTensor weights gathered once per call and ZeRO-3 partitioned teacher
  parameters gathered for it.
* :func:`divergence_in_head_call`: that divergence inside a call of the student's lm_head module on given hidden
  states (``DistillationTrainer``'s, whose backbone TRL runs itself).
* :func:`distillation_forward`: the answer to ``model(..., hf_fused_distillation=DistillationCall(...))`` on a patched
  model (an extension of the model layer, registered in :mod:`hf_fused.integrations`): the divergence computed inside
  the student's lm_head call, where engines have its parameters whole, as its fused loss is.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ...model import FusedRequest, as_kwargs, head_tensors, intercept_lm_head, run_intercepted
from ...ops import DistillationOutput, linear_distillation_loss
from .teacher_fsdp import fsdp1_whole

#: The keyword of the patched student's call that computes a distillation loss (:func:`distillation_forward`).
CALL_KEYWORD = "hf_fused_distillation"


@dataclass(frozen=True)
class TeacherHead:
    """A teacher's head as :func:`student_divergence` reads it: ``tensors()`` gives ``(hidden [..., H_t], weight
    [V, H_t], bias [V] or None)``, called while ``params`` (those ZeRO-3 has partitioned) are gathered; each model's
    logit scale and soft-cap before the shared temperature. Read detached: the teacher gets no gradient."""

    tensors: Callable[[], tuple]
    params: tuple = ()
    logit_scale: float = 1.0
    softcap: Optional[float] = None


def student_divergence(lm_head: nn.Module, hidden: torch.Tensor, state, teacher: TeacherHead, *, beta: float,
                       temperature: float = 1.0, mask=None, labels=None, num_items_in_batch=None):
    """:func:`~hf_fused.ops.linear_distillation_loss` of the student's ``lm_head`` (read as hf_fused reads it: a
    LoRA adapter included, :func:`hf_fused.model.head_tensors`) on ``hidden`` ``[..., H_s]`` against ``teacher``, with
    the patched student's measured transform and options (``state``: its ``FusedLossState``); ``"mean"`` reduction,
    over the tokens ``mask`` keeps (nonzero) or ``labels`` keeps (not -100). FSDP2 DTensor weights are gathered once
    (``full_tensor()``) and cast to their hidden states' dtype, as TRL does. Run it inside the student's lm_head call
    (:func:`divergence_in_head_call`, :func:`distillation_forward`), where engines have the head whole.

    Returns:
        :class:`~hf_fused.ops.DistillationOutput`.

    Raises:
        NotImplementedError: a LoRA adapter on an lm_head whose weight is an FSDP2 DTensor.
        the errors of :func:`~hf_fused.ops.linear_distillation_loss` (e.g. different vocabularies).
    """
    head_hidden, weight, bias = head_tensors(lm_head, hidden)
    if _is_dtensor(weight) and head_hidden is not hidden:
        raise NotImplementedError(
            "hf_fused cannot gather a LoRA adapter on an lm_head whose weight is an FSDP2 DTensor outside lm_head's "
            "call; keep lm_head in the root FSDP unit (accelerate's default) so that it is whole for the loss"
        )
    weight, bias = _whole(weight, head_hidden.dtype), _whole(bias)
    if labels is not None:
        labels = labels.to(head_hidden.device)
    with _gathered(teacher.params):
        teacher_hidden, teacher_weight, teacher_bias = teacher.tensors()
        return linear_distillation_loss(
            head_hidden, weight, teacher_hidden, _whole(teacher_weight, teacher_hidden.dtype), student_bias=bias,
            teacher_bias=_whole(teacher_bias), mask=mask, labels=labels, beta=beta, temperature=temperature,
            student_logit_scale=state.transform.logit_scale, student_softcap=state.transform.softcap,
            teacher_logit_scale=teacher.logit_scale, teacher_softcap=teacher.softcap,
            num_items_in_batch=_on(num_items_in_batch, head_hidden.device), tile_budget_bytes=state.tile_budget_bytes,
            backend=state.backend,
        )


def divergence_in_head_call(lm_head: nn.Module, hidden: torch.Tensor, state, teacher: TeacherHead, **options
                            ) -> DistillationOutput:
    """:func:`student_divergence` computed inside a call of the student's ``lm_head`` on ``hidden`` (the call
    intercepted, :func:`hf_fused.model.intercept_lm_head`): engines hook that call as they hook it in a forward
    (ZeRO-3 gathers the head for it and, through hf_fused's gather node, for its backward; an FSDP unit unshards it),
    so the student's head is read as its own forward reads it. ``options``: :func:`student_divergence`'s keywords."""
    request = FusedRequest(mode="loss", state=state)
    request.head = lambda head, states: tuple(student_divergence(head, states, state, teacher, **options))
    with intercept_lm_head(lm_head, request):
        lm_head(hidden)
    return DistillationOutput(*request.result)


@dataclass(frozen=True)
class DistillationCall:
    """What a patched student's ``model(..., hf_fused_distillation=DistillationCall(...))`` computes: the divergence
    from ``teacher`` at every position that reaches lm_head where ``labels`` (``[B, L]``, aligned with those
    positions) is not -100; ``beta``, ``temperature``, ``num_items_in_batch`` as
    :func:`~hf_fused.ops.linear_distillation_loss`'s, ``"mean"`` reduction."""

    teacher: TeacherHead
    labels: torch.Tensor
    beta: float
    temperature: float = 1.0
    num_items_in_batch: Any = None


def distillation_forward(causal_lm: nn.Module, *args, **kwargs) -> DistillationOutput:
    """Answer ``model(*args, hf_fused_distillation=call, **kwargs)`` on a patched causal LM: its original forward runs
    with ``labels=None`` and its lm_head call answered by :func:`student_divergence` against ``call`` (ZeRO-3 head
    parameters gathered for it and for its backward).

    Returns:
        :class:`~hf_fused.ops.DistillationOutput` ``(loss, divergence [B, L], entropy [B, L])``.

    Raises:
        RuntimeError: the forward did not call its lm_head.
    """
    state = causal_lm._hf_fused
    original = state.original_forward(causal_lm)
    if args:
        kwargs = as_kwargs(inspect.signature(original), args, kwargs)
    call: DistillationCall = kwargs.pop(CALL_KEYWORD)
    for name in ("labels", "shift_labels", "return_dict", "num_items_in_batch"):
        kwargs.pop(name, None)
    kwargs["use_cache"] = False
    request = FusedRequest(mode="loss", state=state)
    request.head = lambda lm_head, hidden: tuple(student_divergence(
        lm_head, hidden, state, call.teacher, beta=call.beta, temperature=call.temperature, labels=call.labels,
        num_items_in_batch=call.num_items_in_batch,
    ))
    run_intercepted(causal_lm, original, kwargs, request, "compute the distillation loss from its hidden states")
    return DistillationOutput(*request.result)


def _is_dtensor(tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _whole(tensor: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """An FSDP2 DTensor gathered once (``full_tensor()``, differentiable: its backward hands the shard its rows of
    this rank's gradient; reducing them over ranks is the engine's job, as for TRL's own gather),
    cast to ``dtype`` when given (a mixed-precision master copy, cast once as TRL casts it); other tensors as given."""
    if not _is_dtensor(tensor):
        return tensor
    whole = tensor.full_tensor()
    return whole if dtype is None else whole.to(dtype)


@contextlib.contextmanager
def _gathered(params):
    """Those of ``params`` that ZeRO-3 has partitioned right now, or that FSDP1 holds for a teacher
    (:func:`~hf_fused.integrations.trl.teacher_fsdp.fsdp1_whole`), whole for the block (a teacher's head, read after
    its forward released it). Collective: every rank computes the loss."""
    partitioned = [p for p in params if p is not None and getattr(getattr(p, "ds_status", None), "name", None)
                   == "NOT_AVAILABLE"]
    with fsdp1_whole(params):
        if not partitioned:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            yield


def _on(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


