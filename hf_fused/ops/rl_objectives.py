"""open-instruct's GRPO objective (DAPO / CISPO, truncated importance sampling, four KL estimators) fused:
:func:`linear_grpo_loss` on :func:`~hf_fused.ops.linear_token_loss`, its per-token terms (:func:`grpo_terms`,
:func:`grpo_token_loss`) and its options (:class:`GRPOObjective`)."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .logit_transform import LogitTransform
from .token_loss import linear_token_loss
from .vocab_parallel import VocabParallel

LOSS_FNS = ("dapo", "cispo")
#: open-instruct's clamp of ``logp − ref`` before the KL estimators ("to avoid numerical instability").
KL_CLAMP = 40.0


@dataclass(frozen=True)
class GRPOObjective:
    """The fields of open-instruct's ``GRPOExperimentConfig`` that shape the loss (defaults are its own).

    Raises:
        TypeError: a clip range or ``beta`` that is not a real number (a ``bool`` included).
        ValueError: an unknown ``loss_fn`` or ``kl_estimator``, or a negative clip range.
    """

    loss_fn: str = "dapo"
    clip_lower: float = 0.2
    clip_higher: float = 0.272
    beta: float = 0.05
    kl_estimator: int = 2

    def __post_init__(self) -> None:
        for name in ("clip_lower", "clip_higher", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"GRPOObjective.{name} must be a real number (a Python float), got {value!r}")
        if self.loss_fn not in LOSS_FNS:
            raise ValueError(f"loss_fn must be one of {LOSS_FNS} (open-instruct's GRPOLossType), got {self.loss_fn!r}")
        if self.kl_estimator not in (0, 1, 2, 3):
            raise ValueError(f"kl_estimator must be 0, 1, 2 or 3 (open-instruct's estimate_kl), got {self.kl_estimator!r}")
        if self.clip_lower < 0 or self.clip_higher < 0:
            raise ValueError(f"clip_lower and clip_higher must be ≥ 0, got {self.clip_lower}, {self.clip_higher}")


def grpo_terms(objective: GRPOObjective, logprobs, advantages, old_logprobs, ref_logprobs=None, rho_weights=None):
    """open-instruct's ``compute_grpo_loss`` on tensors of any one shape: ``(pg_loss, clipfrac, kl)``, with
    ``kl`` the chosen estimator (zeros without ``ref_logprobs``) and ``ρ`` 1 when ``rho_weights`` is ``None``.
    Differentiable in ``logprobs`` (the op calls it per tile; metrics call it on the detached log-probs)."""
    ratio = torch.exp(logprobs - old_logprobs)
    if objective.loss_fn == "dapo":
        pg_losses = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - objective.clip_lower, 1.0 + objective.clip_higher)
        clipfrac = (pg_losses2 > pg_losses).float()
        pg_loss = torch.max(pg_losses, pg_losses2)
    else:  # cispo: the ratio clipped from above and detached, times logp (a REINFORCE term)
        clipfrac = (ratio > 1.0 + objective.clip_higher).float()
        pg_loss = -advantages * torch.clamp(ratio.detach(), max=1.0 + objective.clip_higher) * logprobs
    if rho_weights is not None:
        pg_loss = pg_loss * rho_weights
        clipfrac = clipfrac * (rho_weights != 0).float()
    if ref_logprobs is None:
        return pg_loss, clipfrac, torch.zeros_like(pg_loss)
    return pg_loss, clipfrac, kl_estimate(objective.kl_estimator, logprobs - ref_logprobs, ratio)


def kl_estimate(estimator: int, logprobs_diff: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """open-instruct's ``estimate_kl(...)[estimator]`` on ``d = clamp(logp − ref, −40, 40)``:
    ``[0] d``, ``[1] d²/2``, ``[2] expm1(−d) + d``, ``[3] r·d``."""
    d = logprobs_diff.clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == 0:
        return d
    if estimator == 1:
        return d**2 / 2
    if estimator == 2:
        return torch.expm1(-d) + d
    return ratio * d


def grpo_token_loss(logprobs: torch.Tensor, entropy: Optional[torch.Tensor], *, objective: GRPOObjective,
                    inv_denominator: float, advantages: torch.Tensor, mask: torch.Tensor,
                    old_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
                    rho_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token ``(pg + β·kl)·mask · inv_denominator``: a ``token_loss`` for
    :func:`~hf_fused.ops.linear_token_loss` (bind ``objective`` and ``inv_denominator`` with
    ``functools.partial``; the tensors come per token). ``old_logprobs=None`` means open-instruct's first
    epoch without cached log-probs: ``old = logp.detach()`` (ratio 1, the gradient of ``r`` still ``r·dlogp``).
    The terms are open-instruct's ``compute_grpo_loss`` (:func:`grpo_terms`) and ``estimate_kl`` (:func:`kl_estimate`).

    Args:
        logprobs: fp32 ``[n]``, the tile's log-probs in nats (differentiable).
        entropy: fp32 ``[n]`` or ``None``; unused (the objective has no entropy term).
        objective: the loss's :class:`GRPOObjective`.
        inv_denominator: the reduction's ``1 / denominator``.
        advantages: float ``[n]``, per token.
        mask: float ``[n]``, 1 where the token counts, else 0.
        old_logprobs: float ``[n]`` in nats, or ``None`` (ratio 1).
        ref_logprobs: float ``[n]`` in nats, or ``None`` (no KL term).
        rho_weights: float ``[n]`` truncated importance weights, or ``None`` (1).

    Returns:
        fp32 ``[n]``: each token's share of the loss."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    pg_loss, _, kl = grpo_terms(objective, logprobs, advantages, old, ref_logprobs, rho_weights)
    per_token = pg_loss + objective.beta * kl if ref_logprobs is not None else pg_loss
    return per_token * mask * inv_denominator


@dataclass
class GRPOLossOutput:
    """:func:`linear_grpo_loss`'s result. ``loss`` is differentiable; the rest are detached fp32 ``[...]``
    shaped like labels, for open-instruct's metrics (0 where ``response_mask`` is false):
    ``logprobs``, ``ratio`` (``val/ratio``), ``pg_loss`` (``loss/policy_avg``), ``clipfrac``
    (``policy/clipfrac_avg`` is its masked mean, :attr:`clipfrac_avg`), ``kl`` (the chosen estimator, before
    ``β``), ``entropy`` (``None`` unless requested); ``mask`` the bool ``response_mask`` shaped like labels.
    ``loss`` is a 0-dim fp32 tensor."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    ratio: torch.Tensor
    pg_loss: torch.Tensor
    clipfrac: torch.Tensor
    kl: torch.Tensor
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor

    @property
    def clipfrac_avg(self) -> torch.Tensor:
        """open-instruct's ``masked_mean(clipfrac, response_mask)`` (0 for an empty mask)."""
        denom = self.mask.sum()
        return torch.where(denom > 0, (self.clipfrac * self.mask).sum() / denom.clamp_min(1), 0.0)


def linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_denominator: Union[float, torch.Tensor],
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rho_weights: Optional[torch.Tensor] = None,
    objective: GRPOObjective = GRPOObjective(),
    loss_scale: float = 1.0,
    bias: Optional[torch.Tensor] = None,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    need_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    vocab_parallel: Optional[VocabParallel] = None,
) -> GRPOLossOutput:
    """open-instruct's GRPO loss for one micro-batch, from hidden states and lm_head: the loss and its gradients
    for hidden, weight and bias in one pass over the tiles (6·N·H·V FLOPs).

    Source: allenai/open-instruct at e6c3044 (2026-08-20): ``grpo_utils.compute_grpo_loss`` (the policy term and
    the clip fraction), ``model_utils.estimate_kl`` (the KL estimators), ``rl_utils.masked_mean`` and the loss
    assembly in ``grpo_fast.py`` / ``olmo_core_train_modules.py``. Per response token, with ``logp`` the current
    log-prob of the sampled token under logits divided by ``temperature``, ``old`` the log-prob that sampled
    batch had under the policy at the start of the step, ``A`` the advantage and ``ρ`` the truncated
    importance-sampling weight (open-instruct's ``compute_rho_correction``)::

        r   = exp(logp − old)
        pg  = max(−A·r, −A·clip(r, 1 − clip_lower, 1 + clip_higher))          # "dapo"
        pg  = −A · min(r, 1 + clip_higher).detach() · logp                     # "cispo"
        pg  = pg · ρ
        d   = clamp(logp − ref, −40, 40)
        kl  = [d,  d²/2,  expm1(−d) + d,  r·d][kl_estimator]                   # 0 without a reference
        loss = Σ_t (pg_t + β·kl_t)·mask_t / loss_denominator · loss_scale

    and the clip fraction ``clipfrac_t = 1[pg2 > pg1]`` ("dapo": the clipped term is the larger) or
    ``1[r > 1 + clip_higher]`` ("cispo"), zeroed where ``ρ = 0``; open-instruct logs its masked mean.

    Every term is a function of the token's own ``logp`` and per-token constants, so the op is
    :func:`~hf_fused.ops.linear_token_loss` with :func:`grpo_token_loss`.

    Args:
        hidden: ``[B, T, H]`` (or ``[..., H]``) hidden states aligned with ``labels`` (position ``t`` scores
            token ``t + 1``: open-instruct's ``logits[:, :-1]`` and ``query_responses[:, 1:]``).
            fp32/bf16/fp16.
        weight, bias: lm_head ``[V, H]`` on ``hidden``'s device and optional ``[V]``, floating point.
        labels: ``[...]`` sampled token ids. Positions outside ``response_mask`` are never scored (their ids
            may be anything, e.g. padding).
        advantages: per-token advantages, broadcastable to ``labels`` (``[B, T]`` in open-instruct; ``[B, 1]``
            for one per sequence).
        response_mask: bool (or 0/1) ``[...]``: the response tokens the loss counts.
        loss_denominator: open-instruct's ``masked_mean`` denominator: the accumulation group's token count
            (``loss_denominator="token"``) or the configured constant; a number > 0 or a one-element tensor.
        old_logprobs: ``[...]`` log-probs of the tokens at the start of the step (open-instruct's
            ``old_logprobs_BT`` or vLLM's); ``None``: the current ones, detached (ratio 1).
        ref_logprobs: ``[...]`` reference-policy log-probs for the KL term; ``None``: no KL term.
        rho_weights: ``[...]`` truncated-importance-sampling weights ρ (``compute_rho_correction(...).weights``,
            constants); ``None``: 1.
        objective: :class:`GRPOObjective` (loss_fn, clip range, β, KL estimator).
        loss_scale: multiplies the loss (open-instruct's ``world_size // sequence_parallel_size``).
        temperature: the logits are divided by it (open-instruct's ``logits / temperature``).
        transform, softcap, logit_scale, need_entropy, tile_budget_bytes, backend, vocab_parallel: as in
            :func:`~hf_fused.ops.linear_token_loss`.

    Returns:
        :class:`GRPOLossOutput`.

    Raises:
        ValueError: a per-token tensor not broadcastable to ``labels`` or on another device, a bad
            ``loss_denominator``, a bad objective; the errors of :func:`~hf_fused.ops.linear_token_loss`.
        TypeError: ``objective`` not a :class:`GRPOObjective`, non-tensor ``labels`` or per-token inputs,
            ``loss_scale`` not a number.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``).
    """
    if not isinstance(objective, GRPOObjective):
        raise TypeError(f"objective must be a GRPOObjective, got {type(objective).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of sampled token ids, got {type(labels).__name__}")
    if isinstance(loss_scale, bool) or not (isinstance(loss_scale, numbers.Real) or (
            isinstance(loss_scale, torch.Tensor) and loss_scale.numel() == 1)):
        raise TypeError(f"loss_scale must be a number (open-instruct's world_size // sequence_parallel_size), "
                        f"got {loss_scale!r}")
    inv_denominator = float(loss_scale) / _denominator(loss_denominator)
    mask = _per_token(response_mask, labels, "response_mask").bool()
    consts = dict(advantages=_per_token(advantages, labels, "advantages").float(), mask=mask)
    for name, values in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("rho_weights", rho_weights)):
        if values is not None:
            consts[name] = _per_token(values, labels, name).float()
    ignore_index = -100
    scored = torch.where(mask, labels, torch.full_like(labels, ignore_index))
    token_loss = functools.partial(grpo_token_loss, objective=objective, inv_denominator=inv_denominator)
    out = linear_token_loss(
        hidden, weight, scored, token_loss, bias, per_token=consts, ignore_index=ignore_index, transform=transform,
        temperature=temperature, softcap=softcap, logit_scale=logit_scale, need_entropy=need_entropy,
        tile_budget_bytes=tile_budget_bytes, backend=backend, vocab_parallel=vocab_parallel,
    )
    with torch.no_grad():  # metrics from the detached log-probs, as open-instruct computes them
        logp = out.logprobs
        old = consts.get("old_logprobs", logp)
        pg_loss, clipfrac, kl = grpo_terms(objective, logp, consts["advantages"], old, consts.get("ref_logprobs"),
                                           consts.get("rho_weights"))
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        ratio = torch.where(mask, torch.exp(logp - old), zero)
        pg_loss, clipfrac, kl = (torch.where(mask, t, zero) for t in (pg_loss, clipfrac, kl))
    return GRPOLossOutput(out.loss, logp, ratio, pg_loss, clipfrac, kl, out.entropy, mask)


def _per_token(values, labels: torch.Tensor, name: str) -> torch.Tensor:
    shape = labels.shape
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a tensor broadcastable to labels' shape {tuple(shape)}, got {values!r}")
    if values.device != labels.device:
        raise ValueError(f"{name} is on {values.device} and labels on {labels.device}: move it to the labels' device "
                         f"({name}.to(labels.device))")
    try:
        return torch.broadcast_to(values.detach(), shape).contiguous()
    except RuntimeError:
        raise ValueError(
            f"{name} must be broadcastable to labels' shape {tuple(shape)}, got {tuple(values.shape)}"
        ) from None


def _denominator(value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"loss_denominator must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(
            f"loss_denominator must be a finite number > 0 (open-instruct's token count or constant), got {value!r}"
        )
    return float(value)
