"""TRL's experimental ``AsyncDistillationTrainer`` on hf_fused: its student loss against the teacher's top-k log-probs
(served by ``trl vllm-serve`` and carried by its rollout worker) answered by
:func:`hf_fused.ops.sparse_distillation_loss` for a patched student.

TRL 1.16's ``AsyncDistillationTrainer._compute_loss`` runs the student's backbone, keeps the completion positions with
a teacher signal, reads ``lm_head``'s weight and bias (``full_tensor()`` of an FSDP2 DTensor) and calls the
module-level ``_chunked_jsd_loss(hidden_valid, lm_head_weight, lm_head_bias, logit_scale, final_logit_softcapping,
target_ids, teacher_target_logps, valid_candidate_mask, beta, temperature, add_tail_bucket, teacher_id_idx,
num_teachers, chunk_size)`` by name: 256-row chunks of fp32 ``[chunk, V]`` logits, each recomputed in backward under
activation checkpointing. The entry :data:`TRL_ASYNC_DISTILLATION` of the inventory rebinds that name in
``trl.experimental.async_distillation.async_distillation_trainer`` and wraps ``AsyncDistillationTrainer._compute_loss``
so that a call made for a model patched by :func:`hf_fused.apply_fused_loss` (the trainer's model, or a model whose
lm_head weight is the one passed) is answered by :func:`fused_jsd_loss`, every other call by TRL's function. The
answer is TRL's ``(loss, jsd_sum, entropy_sum, teacher_entropy_sum, per_teacher_stats)`` with the same semantics
(forward/reverse KL or the generalized JSD on the support, the tail bucket or a renormalization, the student's
entropy over the full vocabulary, per-teacher ``(count, divergence sum, teacher-entropy sum)``), so the trainer's
loss, gradients and every logged metric (``jsd``, ``entropy``, ``teacher_entropy``, ``teacher_jsd/<id>``,
``teacher_entropy/<id>``, ``teacher_token_frac/<id>``) are stock TRL's.

What hf_fused does differently, for a patched student: one pass over the vocabulary at the cost of a fused
cross-entropy (the gradients computed in the forward, no logits recomputed, never a ``[chunk, V]`` fp32 tensor in
autograd); the logit scale and soft-cap are those the patch measured on the student's forward (TRL reads the config).
On CUDA the logits come from the operands in their own dtype, as hf_fused's cross-entropy computes them (TRL casts
both operands to fp32 first); on CPU both are fp32 products of the same values.

Every option of TRL 1.16's loss is served (β, the teacher temperature, the tail bucket or not, one or several
teachers). Inputs the op refuses raise its ``ValueError`` saying what is wrong: a candidate id outside ``[0, V)`` at a
valid slot (TRL's gather fails there too), a teacher index outside ``[0, num_teachers)`` at a kept position (TRL's
statistics would drop that position silently). A LoRA adapter on lm_head stays refused by TRL's ``__init__``, which
loads the model itself, before any patch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn as nn

from ...model import find_causal_lm, is_fused
from ...ops import sparse_distillation_loss
from ..patching import ThirdPartyPatch
from .distillation import patched_model_with_head_weight

#: ``_chunked_jsd_loss``'s parameters in TRL 1.16: the call answered here (checked at install).
JSD_LOSS_PARAMETERS = (
    "hidden_valid", "lm_head_weight", "lm_head_bias", "logit_scale", "final_logit_softcapping", "target_ids",
    "teacher_target_logps", "valid_candidate_mask", "beta", "temperature", "add_tail_bucket", "teacher_id_idx",
    "num_teachers", "chunk_size",
)
#: ``AsyncDistillationTrainer._compute_loss``'s parameters in TRL 1.16.
COMPUTE_LOSS_PARAMETERS = ("self", "unwrapped_model", "inputs")

# The model AsyncDistillationTrainer._compute_loss is computing the loss of (set by the wrapped method).
_STUDENT: contextvars.ContextVar = contextvars.ContextVar("hf_fused_async_distillation_student", default=None)


def fused_jsd_loss(
    student: nn.Module,
    hidden_valid: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: Optional[torch.Tensor],
    target_ids: torch.Tensor,
    teacher_target_logps: torch.Tensor,
    valid_candidate_mask: torch.Tensor,
    beta: float,
    temperature: float,
    add_tail_bucket: bool,
    teacher_id_idx: Optional[torch.Tensor],
    num_teachers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``_chunked_jsd_loss`` for the patched causal LM ``student``, by :func:`hf_fused.ops.sparse_distillation_loss`
    (``"sum"`` reduction, the patched student's measured logit scale and soft-cap, tile budget and backend).

    Args:
        student: the patched causal LM whose lm_head ``lm_head_weight`` / ``lm_head_bias`` are (as TRL read them).
        hidden_valid: ``[n, H]`` the student's hidden states at the positions with a teacher signal.
        target_ids, teacher_target_logps, valid_candidate_mask: ``[n, K]`` candidate ids (``-1`` padding), the
            teacher's log-probs at them, and which slots are candidates.
        beta, temperature, add_tail_bucket: as TRL's (``AsyncDistillationConfig``'s ``beta``,
            ``teacher_temperature``, ``add_tail_bucket``).
        teacher_id_idx: ``[n]`` int64 teacher index per position, or None with one teacher.
        num_teachers: the run's number of teachers.

    Returns:
        ``(loss, jsd_sum, entropy_sum, teacher_entropy_sum, per_teacher_stats)`` as TRL's: the fp32 summed divergence
        (differentiable), the detached sums of the per-token divergence, student entropy and teacher entropy, and
        the fp32 ``[3·num_teachers]`` per-teacher ``(count, divergence sum, teacher-entropy sum)`` (zeros without
        ``teacher_id_idx``).

    Raises:
        the errors of :func:`hf_fused.ops.sparse_distillation_loss`.
    """
    state = student._hf_fused
    # TRL multiplies fp32 copies of both operands; a bf16 autocast output against fp32 master weights meets in fp32
    dtype = torch.promote_types(hidden_valid.dtype, lm_head_weight.dtype)
    hidden, weight = hidden_valid.to(dtype), lm_head_weight.to(dtype)
    bias = None if lm_head_bias is None else lm_head_bias.to(dtype)
    transform = state.transform
    out = sparse_distillation_loss(
        hidden, weight, target_ids, teacher_target_logps, bias, support_mask=valid_candidate_mask,
        teacher_index=teacher_id_idx, num_teachers=num_teachers if teacher_id_idx is not None else None, beta=beta,
        temperature=temperature, add_tail_bucket=add_tail_bucket, logit_scale=transform.logit_scale,
        softcap=transform.softcap, reduction="sum", tile_budget_bytes=state.tile_budget_bytes, backend=state.backend,
    )
    if out.per_teacher is None:
        per_teacher = torch.zeros(3 * num_teachers, dtype=torch.float32, device=out.loss.device)
    else:
        per_teacher = out.per_teacher.reshape(-1)
    return out.loss, out.divergence.sum(), out.entropy.sum(), out.teacher_entropy.sum(), per_teacher


def student_of_call(lm_head_weight: torch.Tensor) -> Optional[nn.Module]:
    """The patched causal LM a ``_chunked_jsd_loss`` call is for: the model ``AsyncDistillationTrainer._compute_loss``
    is computing (its lm_head weight may be an FSDP2 ``full_tensor()`` copy), else the patched model whose lm_head
    weight is ``lm_head_weight`` itself; ``None`` when neither is patched."""
    model = _STUDENT.get()
    if isinstance(model, nn.Module) and is_fused(model):
        return find_causal_lm(model)
    return patched_model_with_head_weight(lm_head_weight)


@contextlib.contextmanager
def computing_loss_of(model):
    """Within the block, ``_chunked_jsd_loss`` calls are for ``model`` (:func:`student_of_call`)."""
    token = _STUDENT.set(model)
    try:
        yield
    finally:
        _STUDENT.reset(token)


# -- the inventory's entry ---------------------------------------------------------------------------------------


def signature_mismatch(module: types.ModuleType) -> Optional[str]:
    """Why the installed TRL's ``_chunked_jsd_loss`` or ``AsyncDistillationTrainer._compute_loss`` is not the one
    answered here (``None`` when both are)."""
    function = getattr(module, "_chunked_jsd_loss", None)
    trainer = getattr(module, "AsyncDistillationTrainer", None)
    if function is None or trainer is None or not hasattr(trainer, "_compute_loss"):
        return f"{module.__name__} has no _chunked_jsd_loss or AsyncDistillationTrainer._compute_loss"
    for what, found, expected in (
        ("_chunked_jsd_loss", tuple(inspect.signature(function).parameters), JSD_LOSS_PARAMETERS),
        ("AsyncDistillationTrainer._compute_loss", tuple(inspect.signature(trainer._compute_loss).parameters),
         COMPUTE_LOSS_PARAMETERS),
    ):
        if found != expected:
            return f"{module.__name__}.{what} takes {found}, expected {expected}"
    return None


def _install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Rebind ``_chunked_jsd_loss`` (answered by hf_fused for a patched student) and wrap
    ``AsyncDistillationTrainer._compute_loss`` (it names the student of the calls); or, for a TRL whose functions
    have another shape, record why not and warn."""
    why = signature_mismatch(module)
    if why is not None:
        patch.refuse(why, "AsyncDistillationTrainer will compute its loss with TRL's own chunked function, on patched "
                          "models too. hf_fused serves TRL 1.16's AsyncDistillationTrainer.")
        return
    live = patch.liveness()
    original = module._chunked_jsd_loss

    @functools.wraps(original)
    def _chunked_jsd_loss(hidden_valid, lm_head_weight, lm_head_bias, logit_scale, final_logit_softcapping,
                          target_ids, teacher_target_logps, valid_candidate_mask, beta, temperature, add_tail_bucket,
                          teacher_id_idx, num_teachers, chunk_size):
        student = student_of_call(lm_head_weight) if live() else None
        if student is None:
            return original(hidden_valid, lm_head_weight, lm_head_bias, logit_scale, final_logit_softcapping,
                            target_ids, teacher_target_logps, valid_candidate_mask, beta, temperature,
                            add_tail_bucket, teacher_id_idx, num_teachers, chunk_size)
        return fused_jsd_loss(student, hidden_valid, lm_head_weight, lm_head_bias, target_ids, teacher_target_logps,
                              valid_candidate_mask, beta, temperature, add_tail_bucket, teacher_id_idx, num_teachers)

    _chunked_jsd_loss.__hf_fused__ = True
    patch.rebind(module, "_chunked_jsd_loss", _chunked_jsd_loss)

    trainer_cls = module.AsyncDistillationTrainer
    compute_loss = trainer_cls._compute_loss

    @functools.wraps(compute_loss)
    def _compute_loss(self, unwrapped_model, inputs):
        with computing_loss_of(unwrapped_model):
            return compute_loss(self, unwrapped_model, inputs)

    _compute_loss.__hf_fused__ = True
    patch.rebind(trainer_cls, "_compute_loss", _compute_loss)


TRL_ASYNC_DISTILLATION = ThirdPartyPatch(
    name="_chunked_jsd_loss",
    module="trl.experimental.async_distillation.async_distillation_trainer",
    target="trl.experimental.async_distillation.async_distillation_trainer._chunked_jsd_loss and "
           "AsyncDistillationTrainer._compute_loss",
    trigger="first apply_fused_loss; applied when trl.experimental.async_distillation.async_distillation_trainer is "
            "imported (at once if it is)",
    versions="trl 1.16 (_chunked_jsd_loss's and _compute_loss's parameters checked at install: JSD_LOSS_PARAMETERS, "
             "COMPUTE_LOSS_PARAMETERS; another shape: nothing rebound, a warning)",
    why="AsyncDistillationTrainer computes its student loss against the teacher's top-k log-probs with fp32 [chunk, V] "
        "logits from lm_head.weight, recomputed in backward; hf_fused answers it in one pass, at the cost of a fused "
        "cross-entropy",
    passes_through="a student that is not patched: TRL's function, unchanged",
    apply=_install,
)
