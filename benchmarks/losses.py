"""The objectives the benchmark problems train, in plain torch on small tensors: TRL 1.16's GRPO loss types
(:func:`grpo_loss`) and its distillation divergences (:func:`distillation_divergence`).

The peers that return log-probabilities (or logits) go through these functions, and so does the float64 reference
(:mod:`benchmarks.reference`), so every peer is measured against the same objective. They work in the dtype of their
inputs (the reference runs them in float64).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

IGNORE_INDEX = -100
#: DAPO clipping (TRL's defaults for ``loss_type="dapo"``: epsilon=0.2, epsilon_high=0.28).
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
#: TRL loss types with the clipped-ratio per-token loss (TRL 1.16 ``_compute_loss``: ``loss_type in ["grpo",
#: "bnpo", "dr_grpo", "dapo", "luspo"]``); they differ only in the reduction.
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")
#: Every token-level TRL 1.16 loss type the benchmark runs: the clipped-ratio ones, then CISPO and SAPO, each with
#: its own per-token loss (:func:`trl_per_token_loss`). TRL's ``vespo`` is left out: its weight is a function of
#: the whole sequence's log-ratio, no per-token loss.
TRL_LOSS_TYPES = GRPO_LOSS_TYPES + ("cispo", "sapo")
#: TRL's ``epsilon_high`` in the cispo problems: the upper clamp of cispo's detached ratio (the ScaleRL paper's
#: ε_max; GRPOConfig's docstring recommends 5.0 for cispo, where DAPO's 0.28 would clamp almost every ratio).
CISPO_EPSILON_HIGH = 5.0
#: SAPO's gate temperatures for positive / non-positive advantages (TRL 1.16 ``GRPOConfig.sapo_temperature_pos`` /
#: ``sapo_temperature_neg`` defaults).
SAPO_TEMPERATURE_POS, SAPO_TEMPERATURE_NEG = 1.0, 1.05


def _normalize(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s reduction of a ``[B, T]`` per-token loss (one process, no gradient
    accumulation): ``grpo`` and ``sapo`` mean over sequences of each one's token mean; ``bnpo``, ``dapo`` and
    ``cispo`` sum / unmasked tokens (``num_items_in_batch``, which is that count here); ``dr_grpo`` sum / (B·T)
    (``T`` is ``max_completion_length``); ``luspo`` sum over each sequence's tokens, mean over sequences."""
    m = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo"):
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / per_token.numel()
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {TRL_LOSS_TYPES}")


def _policy_loss(logps: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL 1.16 ``_compute_loss``'s per-token policy term of ``loss_type`` (before the KL term)::

        clipped-ratio (GRPO_LOSS_TYPES):  −min(r·A, clamp(r, 1 − 0.2, 1 + 0.28)·A)
        cispo:                            −clamp(r, max=CISPO_EPSILON_HIGH).detach() · A · logp
        sapo:                             −sigmoid(τ·(r − 1)) · 4/τ · A,   τ = 1.0 where A > 0 else 1.05
    """
    if loss_type == "cispo":  # REINFORCE with the ratio as a clamped, detached weight: no gradient through r
        return -torch.clamp(ratio, max=CISPO_EPSILON_HIGH).detach() * adv * logps
    if loss_type == "sapo":  # τ in adv's dtype (TRL's torch.where of two floats is fp32): 1.05 exact in float64
        tau = torch.full_like(adv, SAPO_TEMPERATURE_NEG).masked_fill_(adv > 0, SAPO_TEMPERATURE_POS)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    if loss_type in GRPO_LOSS_TYPES:
        return -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPSILON_LOW, 1 + EPSILON_HIGH) * adv)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {TRL_LOSS_TYPES}")


def trl_per_token_loss(logps: torch.Tensor, advantages: torch.Tensor, old_logps: Optional[torch.Tensor] = None,
                       ref_logps: Optional[torch.Tensor] = None, beta: float = 0.0,
                       loss_type: str = "dapo") -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s per-token loss before masking and reduction (token-level importance
    sampling, no vLLM correction), elementwise on any one shape::

        r  = exp(logp − old)                                   (old = logp.detach() when None: r = 1)
        pg = the loss type's policy term (DAPO's −min(r·A, clamp(r, 0.8, 1.28)·A))
        kl = (exp(ref − logp) − (ref − logp) − 1) · r          (k3, bias-corrected; only when ref is given)
        loss = pg + β·kl

    The ``· r`` is TRL 1.16's default ``GRPOConfig.use_bias_correction_kl=True`` (``per_token_kl * coef_1``),
    applied to the KL term whatever the loss type. ``advantages`` broadcasts against ``logps`` (``[B, 1]`` for
    per-sequence advantages of ``[B, T]``); constants are cast to ``logps``' dtype.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    ratio = torch.exp(logps - old)
    per_token = _policy_loss(logps, ratio, advantages.to(logps.dtype), loss_type)
    if ref_logps is not None and beta != 0.0:
        d = ref_logps.to(logps.dtype) - logps
        per_token = per_token + beta * (torch.exp(d) - d - 1) * ratio
    return per_token


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo",
              old_logps: Optional[torch.Tensor] = None, ref_logps: Optional[torch.Tensor] = None,
              beta: float = 0.0) -> torch.Tensor:
    """TRL 1.16's GRPO loss of ``loss_type`` on ``[B, T]`` log-probs: :func:`trl_per_token_loss` with ``[B]``
    advantages, reduced as ``loss_type`` says. On-policy without a KL term when ``old_logps`` / ``ref_logps`` are
    ``None``.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    per_token = trl_per_token_loss(logps, advantages.unsqueeze(-1), old_logps, ref_logps, beta, loss_type)
    return _normalize(per_token, mask, loss_type)


def normalizer_weights(mask: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """``[B, T]`` fp32 ``s`` with ``reduction(x) = Σ s·x`` for every per-token loss ``x`` (each TRL reduction is
    linear in it): ``mask / normalizer`` per token, a per-sequence normalizer for ``grpo`` and ``sapo``."""
    ones = torch.ones(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(_normalize(ones, mask, loss_type), ones)
    return weights


def token_weights_at_ratio_one(mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """``[B, T]`` fp32 weights ``w`` with ``∇ grpo_loss = −∇ Σ w·logp`` on-policy and KL-free, for every loss type:
    at ratio 1 each per-token loss has ``∂/∂logp = −A`` (clipped-ratio: no clip active, ``−r·A``; cispo:
    ``−clamp(1, max=5)·A``; sapo: ``−σ'(0)·τ·4/τ·r·A = −A``), so ``w = A·mask / normalizer`` (the gradient hint
    ``FusedGRPOTrainer`` passes on-policy)."""
    return normalizer_weights(mask, loss_type) * advantages.float().unsqueeze(-1)


def distillation_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                            temperature: float = 1.0) -> torch.Tensor:
    """Per-row divergence ``[...]`` between ``p_s = softmax(z_s / T)`` and ``p_t = softmax(z_t / T)`` of logits
    ``[..., V]``, with TRL 1.16's conventions (``trl/kernels/chunked_divergence.py``, the same as Liger's
    ``LigerFusedLinearJSD`` and TRL's ``GKDTrainer.generalized_jsd_loss``; Agarwal et al., arXiv 2306.13649, Eq. 1)::

        β = 0        forward KL(p_t ‖ p_s) = Σ p_t (log p_t − log p_s)
        β = 1        reverse KL(p_s ‖ p_t) = Σ p_s (log p_s − log p_t)
        0 < β < 1    β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m),   m = (1 − β)·p_s + β·p_t

    Computed in the logits' dtype; differentiable in both (the trainers detach the teacher).

    Raises:
        ValueError: ``beta`` outside [0, 1], or a ``temperature`` that is not positive.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] (0: forward KL, 1: reverse KL, between: JSD), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    s = torch.log_softmax(student_logits / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    log_m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return beta * (t.exp() * (t - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)


def sparse_divergence(student_logits: torch.Tensor, support_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                      support_mask: torch.Tensor, beta: float = 0.0, add_tail_bucket: bool = True) -> torch.Tensor:
    """Per-row divergence ``[...]`` between a student known by its logits ``[..., V]`` and a teacher known by its
    log-probs ``[..., K]`` at the candidate ids ``support_ids`` (valid where ``support_mask``), with TRL 1.16's
    semantics (``trl/experimental/async_distillation``'s ``_jsd_loss_chunk``, its ``_add_tail_bucket`` and
    ``_jsd_divergence``, the same ops): both made distributions on the support with a tail bucket ``log(1 − Σ p)``
    (``add_tail_bucket``) or renormalized over the valid slots; β as :func:`distillation_divergence`'s. Computed in
    the logits' dtype; differentiable in the student's logits."""
    student = torch.log_softmax(student_logits, dim=-1).gather(-1, support_ids.clamp_min(0))
    neg_inf = torch.full((), float("-inf"), dtype=student.dtype, device=student.device)
    student = torch.where(support_mask, student, neg_inf)
    teacher = torch.where(support_mask, teacher_logprobs.to(student.dtype), neg_inf)
    valid = support_mask
    if add_tail_bucket:
        def tail(logp):
            log_sum = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
            return torch.cat([logp, torch.log(-torch.expm1(log_sum))], dim=-1)

        student, teacher = tail(student), tail(teacher)
        valid = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    zero = torch.zeros_like(student)
    s, t = torch.where(valid, student, zero), torch.where(valid, teacher, zero)
    ps, pt = torch.where(valid, student.exp(), zero), torch.where(valid, teacher.exp(), zero)
    if beta == 0:
        terms = torch.nan_to_num(pt * (t - s), nan=0.0)
    elif beta == 1:
        terms = torch.nan_to_num(ps * (s - t), nan=0.0)
    else:
        log_m = torch.where(valid, torch.log(((1 - beta) * ps + beta * pt).clamp_min(torch.finfo(ps.dtype).tiny)),
                            zero)
        terms = beta * torch.nan_to_num(pt * (t - log_m), nan=0.0) + (1 - beta) * torch.nan_to_num(ps * (s - log_m),
                                                                                                     nan=0.0)
    return terms.sum(-1)
