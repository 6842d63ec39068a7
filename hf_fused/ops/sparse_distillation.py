"""Distillation from a teacher's log-probs at a sparse support of candidate ids (its top-k, served or precomputed),
with TRL 1.16's semantics: the divergence as a per-token function of the student's support log-probs
(:func:`sparse_divergence`), and :func:`sparse_distillation_loss`, which runs it through
:func:`~hf_fused.ops.linear_support_loss` with the metrics TRL logs."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch

from .distillation_math import check_beta, check_temperature
from .logit_transform import LogitTransform
from .support_loss import support_loss_call

_REDUCTIONS = ("mean", "sum", "none")


class SparseDistillationOutput(NamedTuple):
    """What :func:`sparse_distillation_loss` returns.

    loss: fp32; a scalar for ``"mean"``/``"sum"``, per-token ``[...]`` for ``"none"`` (0 at dropped tokens);
        differentiable with respect to the student's hidden states, weight and bias.
    divergence: fp32 ``[...]`` per-token divergence, detached, 0 at dropped tokens (TRL's ``jsd`` metric is its sum
        over the counted tokens divided by their count).
    entropy: fp32 ``[...]`` the student's entropy over the full vocabulary (tempered), detached (TRL's ``entropy``).
    teacher_entropy: fp32 ``[...]`` the entropy of the teacher's distribution on the support (after the tail bucket
        or the renormalization), detached (TRL's ``teacher_entropy``).
    per_teacher: fp32 ``[num_teachers, 3]``, per teacher index: the count of its tokens, their divergence sum and
        their teacher-entropy sum (TRL's ``per_teacher_stats``, which is this flattened); ``None`` without
        ``teacher_index``.
    """

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor
    per_teacher: Optional[torch.Tensor]


# -- the divergence on a support (TRL's _add_tail_bucket, _jsd_divergence) -------------------------------------------


def add_tail_bucket(logprobs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [..., K + 1], valid [..., K + 1])``: the support's log-probs with a last slot for the mass outside
    it, ``log(1 − Σ_k p_k)``, always valid; ``Σ_k p_k`` is clamped below ``1`` (its log to ``≤ −1e-7``, with a zero
    gradient where the clamp binds) so the tail stays finite. Invalid slots must hold ``-inf``. TRL 1.16's
    ``_add_tail_bucket`` (``trl/experimental/async_distillation/async_distillation_trainer.py``), the same ops."""
    log_sum = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))  # log(1 − exp(log_sum))
    return torch.cat([logprobs, tail], dim=-1), torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)


def support_distribution(logprobs: torch.Tensor, valid: torch.Tensor, add_tail: bool):
    """One model's distribution on the support: ``(log-probs, valid)`` of width ``K + 1`` with the tail bucket
    (:func:`add_tail_bucket`), else of width ``K`` renormalized over the valid slots (``s − logsumexp(s)``; NaN in a
    row without a valid slot, which the divergence masks). ``logprobs`` are set to ``-inf`` at invalid slots first."""
    logprobs = torch.where(valid, logprobs, float("-inf"))
    if add_tail:
        return add_tail_bucket(logprobs, valid)
    return logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True), valid


def support_divergence(student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """The elementwise terms ``[..., K']`` of the divergence between two distributions on one support, given as
    log-probs ``student``, ``teacher`` (fp32) and the slots ``valid`` (bool); their sum over the last dim is the
    divergence. TRL 1.16's ``_jsd_divergence`` (masked branch), the same ops in the same order, with its convention
    (Agarwal et al., "On-Policy Distillation of Language Models", arXiv 2306.13649, Eq. (1))::

        β = 0       forward KL   p_t·(t − s)
        β = 1       reverse KL   p_s·(s − t)
        otherwise   generalized JSD, m = (1 − β)·p_s + β·p_t:  β·p_t·(t − log m) + (1 − β)·p_s·(s − log m)

    Invalid slots contribute 0, and so does a term that is NaN (``0·(−inf)`` where a valid slot has probability 0),
    with a zero gradient; ``log m`` uses ``m`` clamped to the smallest normal number."""
    zero = torch.zeros_like(student)
    safe_student = torch.where(valid, student, zero)
    safe_teacher = torch.where(valid, teacher, zero)
    student_probs = torch.where(valid, student.exp(), zero)
    teacher_probs = torch.where(valid, teacher.exp(), zero)
    if beta == 0:
        return torch.nan_to_num(teacher_probs * (safe_teacher - safe_student), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(student_probs * (safe_student - safe_teacher), nan=0.0)
    beta_t = torch.tensor(beta, dtype=student.dtype, device=student.device)
    mixture = (1 - beta_t) * student_probs + beta_t * teacher_probs
    safe_mixture = torch.where(valid, torch.log(mixture.clamp_min(torch.finfo(mixture.dtype).tiny)), zero)
    kl_teacher = torch.nan_to_num(teacher_probs * (safe_teacher - safe_mixture), nan=0.0)
    kl_student = torch.nan_to_num(student_probs * (safe_student - safe_mixture), nan=0.0)
    return beta_t * kl_teacher + (1 - beta_t) * kl_student


def support_entropy(logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``−Σ_k p_k log p_k`` over the valid slots of a distribution on a support (``[...]``; NaN terms count 0), as
    TRL computes the teacher's."""
    zero = torch.zeros_like(logprobs)
    probs = torch.where(valid, logprobs.exp(), zero)
    return torch.nan_to_num(-(probs * torch.where(valid, logprobs, zero)).sum(dim=-1), nan=0.0)


def sparse_divergence(logprobs: torch.Tensor, entropy: Optional[torch.Tensor], *, support_mask: torch.Tensor,
                      teacher: torch.Tensor, teacher_valid: torch.Tensor, beta: float,
                      add_tail: bool) -> torch.Tensor:
    """The per-token divergence ``[r]`` of TRL's ``_jsd_loss_chunk`` as a ``support_loss`` of
    :func:`~hf_fused.ops.linear_support_loss` (``functools.partial`` binds ``beta`` and ``add_tail``): the student's
    support log-probs ``logprobs [r, K]`` (``-inf`` at invalid slots) made a distribution on the support
    (:func:`support_distribution`), against the teacher's already made one (``teacher``, ``teacher_valid``:
    ``[r, K']``, ``K' = K + 1`` with the tail bucket), summed over :func:`support_divergence`'s terms. ``entropy`` is
    not read."""
    student, valid = support_distribution(logprobs, support_mask, add_tail)
    return support_divergence(student, teacher, valid, beta).sum(dim=-1)


# -- checks --------------------------------------------------------------------------------------------------------




def _teacher_logprobs(teacher_logprobs, support_ids) -> torch.Tensor:
    if not isinstance(teacher_logprobs, torch.Tensor) or not teacher_logprobs.is_floating_point():
        raise TypeError(f"teacher_logprobs must be a floating-point tensor shaped like support_ids, got "
                        f"{getattr(teacher_logprobs, 'dtype', type(teacher_logprobs).__name__)}")
    if isinstance(support_ids, torch.Tensor) and (teacher_logprobs.shape != support_ids.shape
                                                  or teacher_logprobs.device != support_ids.device):
        raise ValueError(
            f"teacher_logprobs must have support_ids' shape {tuple(support_ids.shape)} (one log-prob per candidate, "
            f"the same K) on {support_ids.device}, got {tuple(teacher_logprobs.shape)} on {teacher_logprobs.device}"
        )
    return teacher_logprobs.detach().float()


def _check_teacher_index(teacher_index, num_teachers, batch_shape, device) -> None:
    """The multi-teacher arguments checked before the fused pass runs (their values at the counted tokens are
    checked with the statistics, :func:`_per_teacher`)."""
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 1:
        raise ValueError(f"num_teachers must be an int >= 1 with teacher_index (the number of teachers of the run, "
                         f"so every step's statistics have one shape), got {num_teachers!r}")
    if not isinstance(teacher_index, torch.Tensor) or teacher_index.is_floating_point() or teacher_index.is_complex():
        raise TypeError(f"teacher_index must be an integer tensor shaped like hidden's leading dims, got "
                        f"{getattr(teacher_index, 'dtype', type(teacher_index).__name__)}")
    if teacher_index.shape != batch_shape or teacher_index.device != device:
        raise ValueError(f"teacher_index must have hidden's leading shape {tuple(batch_shape)} on {device}, got "
                         f"{tuple(teacher_index.shape)} on {teacher_index.device}")


def _per_teacher(teacher_index, num_teachers, rows, divergence, teacher_entropy) -> torch.Tensor:
    """``[num_teachers, 3]`` (count, divergence sum, teacher-entropy sum) over the kept ``rows`` (one host sync for
    the index check)."""
    index = teacher_index.reshape(-1).index_select(0, rows).long()
    if bool(((index < 0) | (index >= num_teachers)).any()):
        bad = index[(index < 0) | (index >= num_teachers)][0].item()
        raise ValueError(f"teacher_index holds {bad} at a counted token, outside [0, num_teachers={num_teachers}); "
                         "drop padding tokens with mask")
    stats = torch.zeros((num_teachers, 3), dtype=torch.float32, device=rows.device)
    values = torch.stack([torch.ones_like(index, dtype=torch.float32),
                          divergence.reshape(-1).index_select(0, rows),
                          teacher_entropy.reshape(-1).index_select(0, rows)], dim=1)
    return stats.index_add_(0, index, values)


# -- the op --------------------------------------------------------------------------------------------------------


def sparse_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    support_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    support_mask: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    teacher_index: Optional[torch.Tensor] = None,
    num_teachers: Optional[int] = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail_bucket: bool = True,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    transform: Optional[LogitTransform] = None,
    reduction: str = "mean",
    num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> SparseDistillationOutput:
    """The student's divergence from a teacher known only at ``K`` candidate ids per token (its top-k log-probs, from
    a server or a dataset), from the student's hidden states and lm_head, with TRL 1.16's semantics (the experimental
    ``AsyncDistillationTrainer``'s ``_jsd_loss_chunk``; ``ServerDistillationTrainer`` the same), in one fused pass
    (:func:`~hf_fused.ops.linear_support_loss`) at the cost of a fused cross-entropy, never materializing ``[N, V]``.

    Per token: the student's tempered log-probs at the candidates ``s_k = log_softmax(z)[id_k]`` (``z`` after
    ``logit_scale``, ``softcap``, then ``/ temperature``) and the teacher's ``t_k`` (taken as given: a server computes
    them at its temperature) become two distributions on the support, with a tail bucket ``log(1 − Σ_k p_k)``
    (``add_tail_bucket``, TRL's default) or renormalized over the valid slots (:func:`support_distribution`), and
    the divergence is :func:`support_divergence`'s: ``beta = 0`` forward KL(p_t ‖ p_s), ``beta = 1`` reverse
    KL(p_s ‖ p_t), otherwise the generalized JSD. The student's entropy is over the full vocabulary, the teacher's
    over the support. Which candidates to pass is the trainer's choice: TRL's async trainer passes the teacher's
    top-k at ``beta = 0`` and narrows the support to the teacher's top-1 and the sampled token otherwise (top-1 dropped
    at ``beta = 1``); it drops tokens without a valid candidate (pass ``mask & support_mask.any(-1)`` to do the same;
    such a token has divergence 0 but counts in ``"mean"``).

    Reduction: ``"sum"`` is TRL's chunk loss ``Σ_tokens D``; ``"mean"`` divides it by the number of counted tokens,
    ``num_items_in_batch`` (with ``"mean"`` or ``"sum"``) by that instead (TRL's trainer divides by its tokens per
    rank and by the accumulation steps: pass that product); ``"none"`` gives per-token divergences. No ``T²`` factor.

    Args:
        hidden: ``[..., H]`` the student's final hidden states, aligned with the tokens whose next-token
            distributions are compared (no shift here: TRL's and axolotl's candidates at position ``j`` describe
            ``input_ids[j + 1]`` after their shift).
        weight: ``[V, H]`` the student's lm_head weight.  bias: optional ``[V]``.
        support_ids: ``[..., K]`` candidate ids, in ``[0, V)`` at valid slots (TRL pads with -1).
        teacher_logprobs: ``[..., K]`` the teacher's log-probs at them (any floating dtype; used in fp32, detached).
        support_mask: optional ``[..., K]`` bool: valid slots (TRL's ``teacher_topk_ids != -1``, axolotl's
            ``target_mask``); ``None``: all valid.
        mask: optional ``[...]``: tokens where it is nonzero count (TRL's completion mask); ``None``: all.
        teacher_index: optional ``[...]`` integer index of the teacher that scored each token (TRL's multi-teacher
            ``teacher_id_idx``), in ``[0, num_teachers)`` at counted tokens; it only splits the statistics
            (:attr:`SparseDistillationOutput.per_teacher`).
        num_teachers: with ``teacher_index``, the number of teachers (fixed for a run).
        beta: in ``[0, 1]`` (TRL's async default 0.0).  temperature: ``> 0``, the student's.
        add_tail_bucket: the tail bucket (``True``, TRL's default) or renormalization over the support.
        logit_scale, softcap, transform: the student's logit transform (Cohere/Granite scale, Gemma soft-cap), as in
            :func:`~hf_fused.ops.linear_cross_entropy`.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        num_items_in_batch: with ``"mean"``/``"sum"``, divide the sum by it (one finite number > 0).
        tile_budget_bytes, backend: as :func:`~hf_fused.ops.linear_support_loss`.

    Returns:
        :class:`SparseDistillationOutput` ``(loss, divergence, entropy, teacher_entropy, per_teacher)``.

    Gradients reach the student's hidden states, weight and bias only, as :func:`~hf_fused.ops.linear_support_loss`
    computes them (one pass for ``"mean"``/``"sum"``, scaled in backward by the upstream gradient; a recompute for
    ``"none"``).

    Host syncs: :func:`~hf_fused.ops.linear_support_loss`'s two, and one more for a ``teacher_index``'s range.

    Raises:
        ValueError: ``beta`` outside ``[0, 1]``, ``temperature`` not > 0, an unknown ``reduction``,
            ``num_items_in_batch`` with ``"none"``, ``teacher_logprobs`` not shaped like ``support_ids`` (a different
            ``K``), ``teacher_index`` without ``num_teachers`` or with values outside ``[0, num_teachers)`` at counted
            tokens; and :func:`~hf_fused.ops.linear_support_loss`'s (ids out of range, shapes, devices, ...).
        TypeError: non-floating ``teacher_logprobs``, a non-integer ``teacher_index``, and
            :func:`~hf_fused.ops.linear_support_loss`'s.
        RuntimeError: as :func:`~hf_fused.ops.linear_support_loss`.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if reduction == "none" and num_items_in_batch is not None:
        raise ValueError("num_items_in_batch applies to reduction='mean' or 'sum', not 'none'")
    if teacher_index is None and num_teachers is not None:
        raise ValueError("num_teachers is given without teacher_index; pass both (multi-teacher) or neither")
    if teacher_index is not None and num_teachers is None:
        raise ValueError("teacher_index needs num_teachers, the number of teachers of the run")
    if teacher_index is not None and isinstance(hidden, torch.Tensor):
        _check_teacher_index(teacher_index, num_teachers, hidden.shape[:-1], hidden.device)
    beta = check_beta(beta)
    if transform is None:
        check_temperature(temperature)
    teacher = _teacher_logprobs(teacher_logprobs, support_ids)
    # The teacher's distribution on the support, once for all rows (a per-token constant of the loss). A support_mask
    # that linear_support_loss will refuse leaves it None: the op raises before the loss runs.
    valid = support_mask
    if valid is None:
        valid = torch.ones(teacher.shape, dtype=torch.bool, device=teacher.device)
    teacher_dist, teacher_valid = None, None
    usable = (isinstance(valid, torch.Tensor) and valid.shape == teacher.shape and valid.device == teacher.device
              and not (valid.is_floating_point() or valid.is_complex()))
    if usable:
        teacher_dist, teacher_valid = support_distribution(teacher, valid != 0, bool(add_tail_bucket))
    divergence_fn = functools.partial(sparse_divergence, beta=beta, add_tail=bool(add_tail_bucket))
    per_token = None if teacher_dist is None else {"teacher": teacher_dist, "teacher_valid": teacher_valid}
    out, prepared = support_loss_call(
        hidden, weight, support_ids, divergence_fn, bias, support_mask=support_mask, mask=mask, per_token=per_token,
        reduction="none" if reduction == "none" else "sum", transform=transform, temperature=temperature,
        softcap=softcap, logit_scale=logit_scale, return_entropy=True, tile_budget_bytes=tile_budget_bytes,
        backend=backend, num_items_in_batch=num_items_in_batch,
    )
    rows = prepared.rows
    kept = prepared.scatter(torch.ones(rows.numel(), dtype=torch.float32, device=rows.device), teacher)
    teacher_entropy = (support_entropy(teacher_dist, teacher_valid) * kept.view(prepared.batch_shape)).detach()
    loss = out.loss
    items = prepared.num_items_in_batch
    if items is not None:
        loss = loss / (items.to(loss.device, torch.float32) if isinstance(items, torch.Tensor) else float(items))
    elif reduction == "mean":
        loss = loss / max(rows.numel(), 1)
    per_teacher = None
    if teacher_index is not None:
        per_teacher = _per_teacher(teacher_index, num_teachers, rows, out.token_losses, teacher_entropy)
    return SparseDistillationOutput(loss, out.token_losses, out.entropy, teacher_entropy, per_teacher)
