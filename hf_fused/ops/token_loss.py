"""Fused token-separable losses (:func:`linear_token_loss`): ``Σ_t token_loss(logp_t, H_t; c_t)`` and its head
gradients in one pass over the tiles, for GRPO-family objectives written as a per-token function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

import torch

from .backward import recompute_grads, stored_grads
from .head_inputs import HeadInputs, NeededGrads
from .hints import TokenLossHint, pad_hint  # noqa: F401  (their import path before hints.py existed)
from .logit_transform import LogitTransform
from .precision import autocast_off, refuse_double_backward
from .prepare import PreparedHead, prepare
from .tile_loss import TileLoss, TokenLossFn, token_loss_one_pass
from .vocab_parallel import VocabParallel


class TokenLossOutput(NamedTuple):
    """What :func:`linear_token_loss` returns.

    loss: fp32 scalar, ``Σ_t token_loss(...)_t`` over non-ignored tokens; differentiable w.r.t. hidden,
        weight and bias.
    logprobs: fp32 ``[...]`` shaped like labels, detached; 0 at ignored positions.
    entropy: fp32 ``[...]`` detached (0 at ignored positions), or ``None`` unless ``need_entropy``.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


@dataclass(frozen=True, eq=False)
class _TokenLossCall:
    """Everything :class:`LinearTokenLossFunction` takes besides the differentiable hidden, weight and bias."""

    prepared: PreparedHead
    tile_loss: TileLoss
    need_entropy: bool  # the token loss reads the entropy; the op then returns it too


class LinearTokenLossFunction(torch.autograd.Function):
    """One pass when the backend can hold its working set (``token_loss_with_grads``; always on the torch
    reference): statistics, per-row loss gradients and head gradients tile by tile in the forward; backward
    scales them by the upstream factor. Otherwise forward computes statistics and the per-row loss gradients
    on all rows, and backward recomputes the tiles (``logprobs_backward``) with the factor folded in:
    8·N·H·V, the same result."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _TokenLossCall):
        prepared, tile_loss = call.prepared, call.tile_loss
        given, backend = prepared.given(hidden, weight, bias), prepared.backend
        need = NeededGrads.of(ctx, bias, prepared.grad_enabled)
        ctx.backend, ctx.need = backend, need
        ctx.grads, ctx.row_grads = None, None
        lse = None
        with autocast_off(hidden.device.type):
            one_pass = token_loss_one_pass(backend, given, tile_loss, need, return_entropy=call.need_entropy,
                                           need_entropy=call.need_entropy)
            if one_pass is not None:
                ctx.grads = one_pass.grads
            else:
                # Statistics, then the loss and its per-row gradients on all rows at once (elementwise, so
                # the same values as tile by tile); backward recomputes the tiles.
                one_pass = backend.logprobs_forward(given, return_entropy=call.need_entropy)
                lse = one_pass.lse
                tile_loss.differentiate = need.any
                ctx.row_grads = tile_loss(0, given.rows.numel(), one_pass.logprobs, one_pass.entropy)
        logp, ent = one_pass.logprobs, one_pass.entropy
        given.save_for_backward(ctx, lse, ent)
        logprobs = prepared.scatter(logp, hidden)
        entropy = None if ent is None else prepared.scatter(ent, hidden)
        if entropy is None:
            ctx.mark_non_differentiable(logprobs)
        else:
            ctx.mark_non_differentiable(logprobs, entropy)
        return tile_loss.loss_sum, logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs, _grad_entropy):
        refuse_double_backward("linear_token_loss")
        given, (lse, ent) = HeadInputs.saved(ctx)
        need = ctx.need
        if grad_loss is None or not need.any:
            return None, None, None, None
        # An fp32 tensor on the device: no host sync (see linear_cross_entropy's backward).
        factor = grad_loss.detach().to(torch.float32)
        rows = given.rows
        if lse is None:  # one pass: the gradients were computed in the forward
            grads = stored_grads(ctx, "linear_token_loss", recomputes=False)
        else:
            if ctx.row_grads is None:
                raise RuntimeError("linear_token_loss: backward ran twice; call linear_token_loss again.")
            (g_lp, g_ent), ctx.row_grads = ctx.row_grads, None
            g_lp = g_lp * factor
            g_ent = None if g_ent is None else g_ent * factor
            grads, rows = recompute_grads(ctx.backend, given, lse, ent, g_lp, g_ent, need)
            factor = 1.0
        return grads.input_grads(given.hidden, given.weight, given.bias, rows, factor) + (None,)


def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLossFn,
    bias: Optional[torch.Tensor] = None,
    *,
    per_token: Optional[Mapping[str, torch.Tensor]] = None,
    ignore_index: int = -100,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    need_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    vocab_parallel: Optional[VocabParallel] = None,
) -> TokenLossOutput:
    """The summed loss ``Σ_t token_loss(logp_t, H_t; per_token_t)`` of a token-separable objective under the
    logits of ``hidden @ weight.T + bias``, with its gradients for hidden, weight and bias computed in the same
    pass over the tiles (6·N·H·V FLOPs), never materializing the ``[N, V]`` logits.

    Logits and log-probs as in :func:`~hf_fused.ops.linear_logprobs`: ``z = (h·Wᵀ + b)·logit_scale``, then
    ``softcap·tanh(z/softcap)``, then ``/temperature``; ``logp_t = z[y_t] − logsumexp(z)``,
    ``H_t = −Σ_j p_j log p_j``.

    For GRPO-family objectives the gradient reaching a token's log-prob (and entropy) is an elementwise function
    of that token's log-prob and entropy and of per-token constants known before the forward (advantages, old
    and reference log-probs, masks, importance weights, normalizers). So once a tile's full-vocabulary logits
    are resident and its log-sum-exp (and entropy) are known, the op evaluates ``token_loss`` on the tile's rows,
    differentiates it there with ordinary autograd on ``[rows]`` tensors (``g_lp = ∂L/∂logp_t``,
    ``g_H = ∂L/∂H_t``), and forms the logits gradient in the same pass (DESIGN.md, "The math")::

        dz_j = g_lp·(1[j = y_t] − p_j) − g_H·p_j·(log p_j + H_t)

    then ``dh = dz·W``, ``dW += dzᵀ·h``: 6·N·H·V FLOPs in all instead of the 8 of log-probs + a recompute
    backward.

    **Token-separable** means: the loss is a sum over tokens of terms each depending on that token's ``logp``
    and ``H`` only (plus constants). Not separable, so not for this op (use :func:`~hf_fused.ops.linear_logprobs`
    and autograd on ``[B, T]`` tensors instead): a sequence-level ratio ``exp(mean_t(logp_t − old_t))`` (GSPO,
    TRL's ``importance_sampling_level="sequence"``: every token's gradient depends on the whole sequence's
    log-probs); a quantile of the batch's entropies (TRL's ``top_entropy_quantile < 1``: the mask depends on all
    rows); anything normalized by a statistic of the current log-probs themselves. Per-batch constants computed
    beforehand (token counts, ``num_items_in_batch``, sequence lengths, advantages) are fine: pass them per token
    in ``per_token`` or close over them in ``token_loss``.

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16) aligned with ``labels`` (no shift here).
        weight: ``[V, H]`` lm_head weight on ``hidden``'s device (the GPU backend computes in weight's dtype).
        bias: optional ``[V]``, floating point.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``. Ignored tokens are not passed to
            ``token_loss`` and contribute neither loss nor gradient.
        token_loss: ``token_loss(logprobs, entropy, **rows) -> losses``: the per-token loss, elementwise,
            written in plain PyTorch. ``logprobs`` is fp32 ``[r]`` for a tile's ``r`` kept tokens,
            ``entropy`` fp32 ``[r]`` (``None`` unless ``need_entropy``), ``rows`` the ``per_token`` tensors
            sliced to the same tokens (dtypes kept). It must return ``[r]`` floating losses in which token
            ``t``'s entry depends on token ``t``'s inputs only (above: what is not separable); the
            op differentiates it per tile with autograd. It may be called several times (once per tile).
        per_token: optional dict of tensors shaped like ``labels`` (advantages, old/reference log-probs, masks,
            importance weights, per-token normalizers …), constants (not differentiated).
        ignore_index, transform, temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy`.
        need_entropy: compute the entropy, pass it to ``token_loss`` (differentiable) and return it.
        vocab_parallel: as in :func:`~hf_fused.ops.linear_cross_entropy` (a vocabulary-sharded head). The one pass
            stays one pass: each tile's statistics are merged over the group before ``token_loss`` sees them, so
            every rank differentiates it on the same log-probs and forms its own slice's logits gradient.

    Returns:
        :class:`TokenLossOutput` ``(loss, logprobs, entropy)``: fp32 scalar loss (0 when every token is
        ignored), and the detached fp32 per-token log-probs and entropies shaped like ``labels`` for metrics.

    Gradients: when the backend's budget holds the one-pass working set (always on the torch backend; on the
    GPU, room for the ``[V, H]`` weight-gradient accumulator, fp32 or for a bf16 weight the compensated pair,
    :mod:`hf_fused.ops.backends.triton_cublas.plan`) they are computed in the forward's pass and kept in fp32 (or as the
    pair) until backward scales them by the upstream gradient and rounds them once; otherwise forward computes
    the statistics and the per-token loss gradients and backward recomputes each tile with the upstream factor
    folded in (8·N·H·V). Exact under any upstream gradient on the loss either way (gradient accumulation, loss
    scaling).

    Mixed precision: as :func:`~hf_fused.ops.linear_cross_entropy` (operands cast as ``F.linear`` would be
    under autocast; ``token_loss`` runs in fp32 with autocast off).

    Raises:
        ValueError / TypeError: as :func:`~hf_fused.ops.linear_cross_entropy`; ``token_loss`` not callable or
            returning something other than one floating loss per token; ``per_token`` not a dict of tensors
            shaped like ``labels`` on its device, a value requiring grad, or a key named ``logprobs`` or
            ``entropy``.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``) or a second backward.
    """
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable (logprobs, entropy, **per_token) -> losses, got {token_loss!r}")
    prepared = prepare(hidden, weight, labels, bias, ignore_index=ignore_index, transform=transform,
                       temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       tile_budget_bytes=tile_budget_bytes, backend=backend, vocab_parallel=vocab_parallel)
    tile_loss = TileLoss(token_loss, prepared.per_token_constants(per_token), prepared.rows,
                         differentiate=prepared.grad_enabled)
    call = _TokenLossCall(prepared, tile_loss, bool(need_entropy))
    loss, logprobs, entropy = prepared.apply(LinearTokenLossFunction, call)
    return TokenLossOutput(loss, prepared.shaped(logprobs), prepared.shaped(entropy))
