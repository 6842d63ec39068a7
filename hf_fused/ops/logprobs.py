"""Fused per-token log-probabilities and entropy: the primitive every RL / preference loss builds on."""

from __future__ import annotations

from typing import Optional

import torch

from .backends import get_backend
from .head_inputs import flatten_head_inputs
from .logit_transform import LogitTransform
from .tiling import check_tile_budget, valid_rows


class LinearLogprobsFunction(torch.autograd.Function):
    """Forward keeps per-token statistics only (log-sum-exp, entropy); backward recomputes each tile's
    logits (8·N·H·V FLOPs in all), so the loss on top can be any autograd code on ``[N]`` tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows, transform, tile_budget_bytes, backend, return_entropy):
        # An entropy returned but unused must not cost a backward term: let its gradient arrive as None.
        ctx.set_materialize_grads(False)
        logp_rows, ent_rows, lse = backend.logprobs_forward(
            hidden, weight, bias, labels, rows, transform, tile_budget_bytes, return_entropy
        )
        n = labels.numel()
        logprobs = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, logp_rows)
        entropy = None
        if return_entropy:
            entropy = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, ent_rows)
        ctx.save_for_backward(hidden, weight, bias, labels, rows, lse, ent_rows)
        ctx.config = (transform, tile_budget_bytes, backend)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, rows, lse, ent_rows = ctx.saved_tensors
        transform, tile_budget_bytes, backend = ctx.config
        need = ctx.needs_input_grad
        # Ignored positions carry no gradient whatever the upstream says.
        g_lp = None if grad_logprobs is None else grad_logprobs.float().index_select(0, rows)
        g_h = None if grad_entropy is None else grad_entropy.float().index_select(0, rows)
        if (g_lp is None and g_h is None) or not any(need[:3]):
            return (None,) * 9
        # Rows whose upstream gradients are all 0 (a GRPO completion's padding, say) add nothing: skip them.
        live = (g_lp if g_lp is not None else g_h) != 0
        if g_lp is not None and g_h is not None:
            live |= g_h != 0
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)
            rows, lse, ent_rows = rows[keep], lse[keep], None if ent_rows is None else ent_rows[keep]
            g_lp = None if g_lp is None else g_lp[keep]
            g_h = None if g_h is None else g_h[keep]
        grads = backend.logprobs_backward(
            hidden, weight, bias, labels, rows, lse, ent_rows, g_lp, g_h, transform, tile_budget_bytes,
            need[0], need[1], bias is not None and need[2],
        )
        d_weight = None if grads.weight is None else grads.weight.to(weight.dtype)
        d_bias = None if grads.bias is None else grads.bias.to(bias.dtype)
        return grads.hidden, d_weight, d_bias, None, None, None, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probabilities of ``labels`` (and optionally the entropy of the whole distribution)
    under the logits of ``hidden @ weight.T + bias``, never materializing the ``[N, V]`` logits.

    With logits ``z`` (``(h·Wᵀ + b) · logit_scale``, then ``softcap · tanh(z / softcap)``, then
    ``/ temperature``): ``logprobs = z[label] − logsumexp(z)`` and
    ``entropy = −Σ_j p_j log p_j`` with ``p = softmax(z)``; TRL's ``selective_log_softmax`` and
    ``entropy_from_logits`` on the same logits.

    Args:
        hidden: ``[..., H]`` hidden states, aligned with ``labels`` (no shift here).
        weight: ``[V, H]`` lm_head weight.  bias: optional ``[V]``.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``.
        return_entropy: also return the (differentiable) entropy.
        temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy`.

    Returns:
        ``(logprobs, entropy)``: fp32 ``[...]`` each (``entropy`` is ``None`` unless requested); 0 with
        no gradient at ignored positions.

    Backward recomputes each tile from ``hidden``/``weight`` and accepts any upstream gradient on both
    outputs; gradients for hidden, weight and bias are accumulated in fp32.

    Raises:
        ValueError / TypeError: as :func:`~hf_fused.ops.linear_cross_entropy`.
    """
    transform = LogitTransform(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    flat = flatten_head_inputs(hidden, weight, labels, bias, ignore_index)
    rows = valid_rows(flat.labels, ignore_index)
    logprobs, entropy = LinearLogprobsFunction.apply(
        flat.hidden, flat.weight, flat.bias, flat.labels, rows, transform,
        check_tile_budget(tile_budget_bytes), get_backend(hidden.device, backend),
        bool(return_entropy),
    )
    logprobs = logprobs.view(flat.batch_shape)
    if entropy is not None:
        entropy = entropy.view(flat.batch_shape)
    return logprobs, entropy
