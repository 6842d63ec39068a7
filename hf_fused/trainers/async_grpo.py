"""``FusedAsyncGRPOTrainer``: TRL's ``AsyncGRPOTrainer`` with the head's gradients computed in the forward's one pass.

TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) trains on rollouts streamed from a vLLM server, packed
into one row per micro-batch as a tree: samples that share a prefix share its positions, and a position serves
every sample through it (``token_index`` lists one loss term per trained token, so one position can carry several
terms, each with its own sampler log-prob and advantage). Its loss (TRL 1.16, ``AsyncGRPOTrainer.compute_loss``) is
the clipped ratio of PPO (Schulman et al., 2017, "Proximal Policy Optimization Algorithms", eq. 7) summed over the
terms::

    r_j = exp(logp[token_index_j] − old_j),   ℓ_j = −min(r_j·A_j, clamp(r_j, 1 − ε_low, 1 + ε_high)·A_j)
    loss = Σ_j ℓ_j / tokens_per_rank / accumulation,   tokens_per_rank = max(global_n_tokens / world_size, 1)

Every term depends on one position's log-prob and on constants the batch carries before the forward, so the loss is
token-separable: :func:`packed_token_loss_hint` states it per position as a :class:`~hf_fused.ops.TokenLossHint` with
a trailing dimension of terms, and the head computes its gradients tile by tile in the forward's single pass
(6·N·H·V FLOPs instead of 8). TRL's own ``compute_loss`` still computes the loss and every metric from the returned
log-probs; backward checks that the gradient it sends matches the hint's and recomputes if not (exact either way).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer

from ..ops import TokenLossHint

__all__ = ["FusedAsyncGRPOTrainer", "async_grpo_token_loss", "packed_token_loss_hint"]


class FusedAsyncGRPOTrainer(AsyncGRPOTrainer):
    """Drop-in replacement for TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer``; same arguments, same
    objective, gradients and metrics. The trainer loads its model itself (with TRL's tree attention) and is then
    patched by :func:`hf_fused.apply_fused_loss`, so its log-probs and entropies come from hf_fused's tiles; each
    micro-batch's loss goes to the head as a hint (module docstring), so the head's gradients come out of the
    forward's one pass where the call's plan is the one pass (on a GPU by default where its working set fits in a
    quarter of the free memory; :func:`hf_fused.ops.describe_plan` says what a call takes).

    Args:
        model (str): the model id or path, as for ``AsyncGRPOTrainer``. Every other argument is its own.
        fused_options: keyword arguments for :func:`hf_fused.apply_fused_loss` (``tile_budget_bytes``, ``backend``,
            ``verify``).

    Raises:
        TypeError, NotImplementedError, ValueError, FusedLossVerificationError: from
            :func:`hf_fused.apply_fused_loss` for a model it cannot patch or bad options (an unknown key in
            ``fused_options`` is a ``TypeError``); ``AsyncGRPOTrainer``'s own errors otherwise.
    """

    def __init__(self, model: str, *args, fused_options: Optional[dict] = None, **kwargs):
        from ..model import apply_fused_loss

        super().__init__(model, *args, **kwargs)
        # the trainer loads the model and adds TRL's head to it in __init__; patched afterwards, hf_fused's forward
        # sits outside TRL's head and answers its fused calls
        apply_fused_loss(self.model, **dict(fused_options or {}))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hinted = _HintedCall(model, packed_token_loss_hint(self, inputs))
        return super().compute_loss(hinted, inputs, return_outputs, num_items_in_batch)


class _HintedCall:
    """Stands in for ``model`` inside ``AsyncGRPOTrainer.compute_loss``, whose only use of it is one call
    ``model(input_ids=..., shift_labels=..., fused_lm_head=True, ...)`` on the packed row; adds the hint."""

    def __init__(self, model, grad_hint: TokenLossHint):
        self.model, self.grad_hint = model, grad_hint

    def __call__(self, *args: Any, **kwargs: Any):
        return self.model(*args, grad_hint=self.grad_hint, **kwargs)


def packed_token_loss_hint(trainer: AsyncGRPOTrainer, inputs: dict) -> TokenLossHint:
    """TRL 1.16's ``AsyncGRPOTrainer.compute_loss`` for one micro-batch as a :class:`~hf_fused.ops.TokenLossHint`
    on the packed row its model call scores (``[1, L, K]`` constants: ``L`` the row's positions, ``K`` the most loss
    terms any position carries, padded with zero weights), selected from ``inputs`` as ``compute_loss`` selects them.
    One host sync (the row's length and ``K``)."""
    selected = inputs["token_index"] >= 0
    token_index = inputs["token_index"][selected]
    constants = {"old": inputs["old_log_probs"][selected], "advantages": inputs["advantages"][selected]}
    tokens_per_rank = (inputs["global_n_tokens"][0] / trainer.accelerator.num_processes).clamp(min=1.0)
    weight = 1.0 / tokens_per_rank.to(torch.float32) / trainer.current_gradient_accumulation_steps
    constants["weight"] = weight.expand(token_index.shape)
    # term j goes to (its position, its rank among the terms of that position); the row's length and K in one read
    counts = torch.bincount(token_index)
    length = inputs["attention_mask"].bool().sum()
    length, terms = torch.stack([length, counts.max()]).tolist() if token_index.numel() else (int(length), 1)
    order = torch.argsort(token_index, stable=True)
    position = token_index[order]
    slot = torch.arange(position.numel(), device=position.device) - (counts.cumsum(0) - counts)[position]
    per_token = {}
    for name, values in constants.items():
        table = torch.zeros((length, terms), dtype=torch.float32, device=values.device)
        table[position, slot] = values[order].float()
        per_token[name] = table.unsqueeze(0)
    token_loss = functools.partial(async_grpo_token_loss, epsilon_low=trainer.epsilon_low,
                                   epsilon_high=trainer.epsilon_high)
    return TokenLossHint(token_loss, per_token, terms=True)


def async_grpo_token_loss(logprobs: torch.Tensor, entropy: Optional[torch.Tensor], *, old: torch.Tensor,
                          advantages: torch.Tensor, weight: torch.Tensor, epsilon_low: float,
                          epsilon_high: float) -> torch.Tensor:
    """Each position's share of ``AsyncGRPOTrainer.compute_loss``: ``Σ_k weight_k·ℓ_k`` over its ``K`` terms
    (module docstring), from fp32 ``logprobs [r]`` and ``old``/``advantages``/``weight [r, K]``; ``[r]``. TRL's
    expressions in TRL's order, so that the gradients round alike; the entropy is not read."""
    log_ratio = logprobs.unsqueeze(-1) - old
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token_loss * weight).sum(-1)
