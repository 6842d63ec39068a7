"""TRL 1.16's GRPO loss as a per-token function of the policy log-prob and entropy, for the one-pass head.

``GRPOTrainer._compute_loss`` turns the policy's per-token log-probs ``logp`` and entropies ``H`` into one scalar.
For the options below every token's contribution depends only on that token's ``logp`` / ``H`` and on constants
known before the policy forward (advantages, old / reference / sampling log-probs, masks, normalizers, the
entropy coefficient), so ``∂loss/∂logp_t`` and ``∂loss/∂H_t`` can be formed tile by tile in the forward's single
pass over the head (:class:`hf_fused.ops.TokenLossHint`): 6·N·H·V FLOPs instead of 8, on- and
off-policy, with and without KL and entropy bonus.

The loss TRL returns is still computed by TRL's own code from the returned tensors: :func:`trl_token_loss` only
predicts its gradient, and the op checks that prediction against the gradient TRL's loss really sends before
using the forward's head gradients (and recomputes, exactly, if they differ). So this module can cost speed,
never exactness.

Per token, with ``r = exp(logp − old)`` (``old = logp.detach()`` on-policy), ``A`` the advantage (TRL 1.16,
``grpo_trainer.py``, ``_compute_loss``)::

    cispo:                       ℓ = −clamp(r, max=ε_high).detach()·A·logp
    grpo/bnpo/dr_grpo/dapo/luspo ℓ = −min(min(r, δ)·A, clamp(r, 1 − ε_low, 1 + ε_high)·A)     (min(r, δ) if delta)
    sapo:                        ℓ = −σ(τ_A·(r − 1))·4/τ_A · A,  τ_A = τ_pos if A > 0 else τ_neg
    ℓ ← ℓ · is_ratio            (vLLM importance-sampling correction)
    ℓ ← ℓ + β·kl,  kl = exp(ref − logp) − (ref − logp) − 1  (· r with use_bias_correction_kl)
    loss = Σ_t ℓ_t · w_t − Σ_t c_H·H_t·m_t / Σ m / accumulation                      (entropy bonus)

with ``w_t = mask_t ×`` the loss type's normalizer (``1/|o_i|/B/accumulation`` for grpo and sapo,
``1/Σmask/accumulation`` for bnpo, ``1/(B·max_completion_length)/accumulation`` for dr_grpo,
``1/(num_items_in_batch/num_processes·accumulation/steps_per_generation)`` for dapo and cispo, ``1/B/accumulation``
for luspo).

Not token-separable, so left to the two-pass path: ``importance_sampling_level="sequence"`` (GSPO: a ratio per
sequence), ``top_entropy_quantile < 1`` (a quantile of the batch's entropies), ``off_policy_mask_threshold``
(a per-sequence mean of the current log-probs), ``loss_type="vespo"`` (sequence-level gamma weights).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..ops import TokenLossHint

_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
SEPARABLE_LOSS_TYPES = _CLIPPED + ("cispo", "sapo")


def not_separable_reason(trainer) -> Optional[str]:
    """Why TRL's loss for ``trainer``'s configuration is not token-separable, or ``None`` if it is."""
    if trainer.loss_type not in SEPARABLE_LOSS_TYPES:
        return f"loss_type={trainer.loss_type!r} (sequence-level weights)"
    if trainer.importance_sampling_level != "token":
        return "importance_sampling_level='sequence' (a ratio per sequence)"
    if trainer.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 (a quantile of the batch's entropies)"
    if trainer.off_policy_mask_threshold is not None:
        return "off_policy_mask_threshold (a per-sequence mean of the current log-probs)"
    return None


def trl_token_loss_hint(trainer, inputs: dict) -> Optional[TokenLossHint]:
    """The :class:`TokenLossHint` of TRL 1.16's ``_compute_loss`` for this micro-batch (``[B, k]`` tensors over the
    completion positions), or ``None`` when the loss is not token-separable (:func:`not_separable_reason`)."""
    if not_separable_reason(trainer) is not None:
        return None
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    mask = mask.float()
    shape = mask.shape
    batch = shape[0]
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    train = trainer.model.training
    accumulation = trainer.current_gradient_accumulation_steps if train else 1.0
    per_token = dict(advantages=advantages.float().expand(shape), weight=mask * _loss_scale(trainer, inputs, mask,
                                                                                             batch, accumulation, train))
    old = inputs.get("old_per_token_logps")
    if old is not None:
        per_token["old"] = old.float()
    if trainer.beta != 0.0:
        per_token["ref"] = inputs["ref_per_token_logps"].float()
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        per_token["is_ratio"] = inputs["importance_sampling_ratio"].float().expand(shape)
    need_entropy = bool(trainer._entropy_bonus_enabled)
    if need_entropy:
        if trainer.use_adaptive_entropy:
            coef = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
        else:
            coef = trainer.entropy_coef
        per_token["entropy_weight"] = mask * (coef / float(mask.sum().clamp(min=1.0)) / accumulation)
    args = trainer.args
    token_loss = functools.partial(
        trl_token_loss, loss_type=trainer.loss_type, epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high, delta=args.delta, beta=trainer.beta,
        bias_correction_kl=bool(args.use_bias_correction_kl), sapo_pos=args.sapo_temperature_pos,
        sapo_neg=args.sapo_temperature_neg,
    )
    return TokenLossHint(token_loss, {k: v.contiguous() for k, v in per_token.items()}, need_entropy=need_entropy)


def _loss_scale(trainer, inputs, mask, batch, accumulation, train) -> torch.Tensor:
    """``∂loss/∂(per_token_loss · mask)`` per token for TRL's reductions (``[B, 1]`` or a scalar tensor)."""
    lt = trainer.loss_type
    if lt in ("grpo", "sapo"):
        return 1.0 / mask.sum(-1, keepdim=True).clamp(min=1.0) / batch / accumulation
    if lt == "bnpo":
        return torch.as_tensor(1.0 / float(mask.sum().clamp(min=1.0)) / accumulation, device=mask.device)
    if lt == "dr_grpo":
        return torch.as_tensor(1.0 / (batch * trainer.max_completion_length) / accumulation, device=mask.device)
    if lt in ("dapo", "cispo"):
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if train:
            normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return (1.0 / normalizer).float().to(mask.device)
    if lt == "luspo":
        return torch.as_tensor(1.0 / batch / accumulation, device=mask.device)
    raise ValueError(f"not a token-separable loss type: {lt!r}")


def trl_token_loss(logprobs, entropy, *, advantages, weight, old=None, ref=None, is_ratio=None, entropy_weight=None,
                   loss_type, epsilon_low, epsilon_high, delta, beta, bias_correction_kl, sapo_pos, sapo_neg):
    """TRL 1.16's per-token loss times its reduction weight (module docstring), elementwise on ``[r]`` tensors; the
    expressions are TRL's, in TRL's order, so that the gradients round alike."""
    old = logprobs.detach() if old is None else old
    coef_1 = torch.exp(logprobs - old)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
        if bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * logprobs
    elif loss_type in _CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    else:  # sapo
        temperatures = torch.where(advantages > 0, sapo_pos, sapo_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    loss = per_token_loss * weight
    if entropy_weight is not None:
        loss = loss - entropy_weight * entropy
    return loss
