"""TRL's ``DistillationTrainer`` on hf_fused: its divergence loss answered by
:func:`hf_fused.ops.linear_distillation_loss` for a patched student.

TRL 1.16's ``DistillationTrainer._compute_loss`` runs both backbones, reads both lm_heads' weights and calls the
module-level ``_chunked_divergence_loss(student_hidden, teacher_hidden, student_W, teacher_W, completion_mask, beta,
...)`` by name, which runs TRL's ``ChunkedDivergenceFunction`` (both models' logits recomputed in backward). The
entry :data:`TRL_DISTILLATION` of the inventory rebinds that name in ``trl.trainer.distillation_trainer``: a call whose
student weight is the lm_head weight of a model patched by :func:`hf_fused.apply_fused_loss` (the weight TRL read from
``get_output_embeddings()``, compared by identity) is answered by :func:`fused_divergence_loss`, every other call by
TRL's function. The answer is TRL's ``(loss, entropy_sum, n_valid)`` with the same reduction; so the trainer's
loss, gradients and logged ``entropy`` are stock TRL's, whichever order the patch and the trainer come in (the
name is looked up at each call).

What hf_fused does differently, for a patched student:

* one pass: the student's gradients are computed in the forward, the teacher's logits never recomputed;
* the student's lm_head is read as hf_fused reads it (:func:`hf_fused.model.head_tensors`): a PEFT LoRA adapter on
  lm_head is part of the head and trains (TRL's ``__init__`` refuses that adapter, because its kernel would read the
  bare weight: while the trainer is built around a patched model, its check sees the layer under the adapter);
* the student's logit transform is the one the patch measured on its forward (the teacher's is TRL's reading of its
  config, or the measured one if the teacher is patched too);
* the divergence is computed inside a call of the student's lm_head module, which engines hook as in a forward
  (DeepSpeed ZeRO-3 gathers the head for it, and hf_fused's gather node again for its backward); a teacher head that
  ZeRO-3 has partitioned again after the teacher's forward is gathered for the call;
* FSDP2: a DTensor weight is gathered once per call with ``full_tensor()`` and cast to its hidden states' dtype, as
  TRL does;
* under FSDP the teacher, which TRL 1.16 leaves unprepared (on the CPU of a GPU rank: huggingface/trl#2580), is
  prepared with TRL's ``prepare_fsdp`` after ``__init__``, as trl#6573 proposes (:mod:`.teacher_fsdp`); its lm_head
  weight is then an FSDP2 DTensor outside its forward, gathered as above, or under FSDP1 a piece of its flat
  parameter, which TRL's kernel cannot read and hf_fused gathers for the call.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn as nn

from ...model import is_fused, patched_models
from ..patching import ThirdPartyPatch
from .divergence import TeacherHead, divergence_in_head_call
from .hooks import lm_head_adapter_hidden_from_trl
from .teacher_fsdp import prepare_teacher_under_fsdp

#: ``_chunked_divergence_loss``'s parameters in TRL 1.16: the call answered here (checked at install).
DIVERGENCE_PARAMETERS = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight",
    "completion_mask", "beta", "num_items_in_batch", "student_lm_head_bias", "teacher_lm_head_bias",
    "student_logit_scale", "teacher_logit_scale", "student_final_logit_softcapping",
    "teacher_final_logit_softcapping", "temperature",
)


def fused_divergence_loss(
    student: nn.Module,
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch=None,
    teacher_lm_head_bias: Optional[torch.Tensor] = None,
    teacher_logit_scale: float = 1.0,
    teacher_final_logit_softcapping: Optional[float] = None,
    temperature: float = 1.0,
    teacher: Optional[nn.Module] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``_chunked_divergence_loss`` for the patched causal LM ``student``, computed inside a call of its lm_head
    (:func:`~hf_fused.integrations.trl.divergence.divergence_in_head_call`).

    Args:
        student: the patched causal LM whose lm_head computes the student's logits.
        student_hidden_states: ``[B, K, H_s]`` what the student's lm_head receives, aligned to the completion tokens.
        teacher_hidden_states: ``[B, K, H_t]`` the teacher's, any width ``H_t``.
        teacher_lm_head_weight, teacher_lm_head_bias: ``[V, H_t]``, ``[V]`` or None, as TRL read them.
        completion_mask: ``[B, K]``, nonzero where the token counts.
        beta, num_items_in_batch, teacher_logit_scale, teacher_final_logit_softcapping, temperature: as TRL's.
        teacher: the teacher's causal LM if it is patched too (its measured transform is then used instead of TRL's
            reading of its config), else None.

    Returns:
        ``(loss, entropy_sum, n_valid)`` as TRL's: the fp32 loss (``Σ divergence / num_items_in_batch``, or over the
        local kept-token count clamped to 1 when it is None), the detached sum of the student's per-token entropies,
        and the kept-token count (int64, on the mask's device).
    """
    state = student._hf_fused
    lm_head = student.get_output_embeddings()
    if teacher is not None:
        transform = teacher._hf_fused.transform
        teacher_logit_scale, teacher_final_logit_softcapping = transform.logit_scale, transform.softcap
    teacher_head = TeacherHead(
        tensors=lambda: (teacher_hidden_states, teacher_lm_head_weight, teacher_lm_head_bias),
        params=(teacher_lm_head_weight, teacher_lm_head_bias), logit_scale=teacher_logit_scale,
        softcap=teacher_final_logit_softcapping,
    )

    out = divergence_in_head_call(lm_head, student_hidden_states, state, teacher_head, beta=beta,
                                  temperature=temperature, mask=completion_mask, num_items_in_batch=num_items_in_batch)
    return out.loss, out.entropy.sum(), (completion_mask.reshape(-1) != 0).sum()


def patched_model_with_head_weight(weight) -> Optional[nn.Module]:
    """The patched causal LM whose lm_head's ``weight`` (what TRL reads from ``get_output_embeddings()``) is
    ``weight`` itself, or ``None``."""
    for causal_lm in patched_models():
        if getattr(causal_lm.get_output_embeddings(), "weight", None) is weight:
            return causal_lm
    return None


# -- the inventory's entry ---------------------------------------------------------------------------------------


def divergence_signature_mismatch(module: types.ModuleType) -> Optional[str]:
    """Why the installed TRL's ``_chunked_divergence_loss`` is not the one answered here (``None`` when it is)."""
    function = getattr(module, "_chunked_divergence_loss", None)
    if function is None:
        return "trl.trainer.distillation_trainer has no _chunked_divergence_loss"
    params = tuple(inspect.signature(function).parameters)
    if params != DIVERGENCE_PARAMETERS:
        return (f"trl.trainer.distillation_trainer._chunked_divergence_loss takes {params}, expected "
                f"{DIVERGENCE_PARAMETERS}")
    return None


def _install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Rebind ``_chunked_divergence_loss`` (answered by hf_fused for a patched student) and wrap
    ``DistillationTrainer.__init__`` (for a patched student: a LoRA adapter on its lm_head passes TRL's check, and a
    teacher TRL left unprepared under FSDP is prepared, :mod:`.teacher_fsdp`); or, for a TRL whose function has
    another shape, record why not and warn."""
    why = divergence_signature_mismatch(module)
    if why is not None:
        patch.refuse(why, "DistillationTrainer will compute its loss with TRL's own kernel, on patched models too. "
                          "hf_fused serves TRL 1.16's DistillationTrainer.")
        return
    live = patch.liveness()
    original = module._chunked_divergence_loss

    @functools.wraps(original)
    def _chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                 teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                 student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                 teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                 teacher_final_logit_softcapping=None, temperature=1.0):
        student = patched_model_with_head_weight(student_lm_head_weight) if live() else None
        if student is None:
            return original(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch, student_lm_head_bias,
                            teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                            student_final_logit_softcapping, teacher_final_logit_softcapping, temperature)
        return fused_divergence_loss(
            student, student_hidden_states, teacher_hidden_states, teacher_lm_head_weight, completion_mask, beta,
            num_items_in_batch, teacher_lm_head_bias, teacher_logit_scale, teacher_final_logit_softcapping,
            temperature, teacher=patched_model_with_head_weight(teacher_lm_head_weight),
        )

    _chunked_divergence_loss.__hf_fused__ = True
    patch.rebind(module, "_chunked_divergence_loss", _chunked_divergence_loss)

    trainer_cls = module.DistillationTrainer
    init = trainer_cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not live():
            return init(self, *args, **kwargs)
        with lm_head_adapter_hidden_from_trl(kwargs.get("model", args[0] if args else None)):
            init(self, *args, **kwargs)
        if is_fused(self.model):
            prepare_teacher_under_fsdp(self)

    __init__.__hf_fused__ = True
    patch.rebind(trainer_cls, "__init__", __init__)


TRL_DISTILLATION = ThirdPartyPatch(
    name="_chunked_divergence_loss",
    module="trl.trainer.distillation_trainer",
    target="trl.trainer.distillation_trainer._chunked_divergence_loss and DistillationTrainer.__init__",
    trigger="first apply_fused_loss; applied when trl.trainer.distillation_trainer is imported (at once if it is)",
    versions="trl 1.16 (_chunked_divergence_loss's parameters checked at install: DIVERGENCE_PARAMETERS; another "
             "shape: nothing rebound, a warning)",
    why="DistillationTrainer computes its divergence with TRL's chunked kernel from lm_head.weight, bypassing the "
        "patched forward (and refuses a LoRA adapter on lm_head); hf_fused answers it in one pass, the adapter "
        "included. Under FSDP TRL 1.16 leaves the teacher unprepared (huggingface/trl#2580: on the CPU of a GPU "
        "rank); for a patched student __init__ then prepares it with trl.models.prepare_fsdp, the fix of the open "
        "trl#6573, only where TRL left it unwrapped (that part can go once the supported TRL includes #6573)",
    passes_through="a student that is not patched: TRL's function and its kernel; an unpatched model: TRL's "
                   "__init__, its lm_head check and its teacher, unchanged; a teacher TRL wrapped itself: left as is",
    apply=_install,
)
