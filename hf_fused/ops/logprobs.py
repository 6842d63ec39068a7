"""Fused per-token log-probabilities and entropy: the primitive every RL / preference loss builds on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .backward import HintMissedWarning, recompute_grads, upstream_rows
from .head_inputs import HeadInputs, NeededGrads
from .hints import HintRows, TokenLossHint, hint_rows
from .logit_transform import LogitTransform
from .precision import autocast_off, refuse_double_backward
from .prepare import PreparedHead, prepare
from .token_statistics import check_statistics, per_token_statistics
from .vocab_parallel import VocabParallel

__all__ = ["HintMissedWarning", "LinearLogprobsFunction", "linear_logprobs", "logprobs_outputs"]


@dataclass(frozen=True, eq=False)
class _LogprobsCall:
    """Everything :class:`LinearLogprobsFunction` takes besides the differentiable hidden, weight and bias."""

    prepared: PreparedHead
    return_entropy: bool
    hint: Optional[HintRows]  # the grad_hint on the kept rows, of either kind, or None
    statistics: tuple[str, ...]


class LinearLogprobsFunction(torch.autograd.Function):
    """Forward keeps per-token statistics only (log-sum-exp, entropy); backward recomputes each tile's
    logits (8·N·H·V FLOPs in all), so the loss on top can be any autograd code on ``[N]`` tensors.

    With a gradient hint (:mod:`hf_fused.ops.hints`: a tensor, or a ``TokenLossHint``) and a backend budget that
    holds the one-pass working set, forward also computes the head's gradients of the hinted loss from the same
    logits (6·N·H·V in all); backward hands them over, times ``c``, when the upstream gradient is ``c`` times the
    hinted one, and otherwise recomputes as above.

    The token statistics named in ``statistics`` come from the forward's own logits tiles (either path) as
    further, non-differentiable outputs in that order."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _LogprobsCall):
        prepared, hint = call.prepared, call.hint
        given, backend = prepared.given(hidden, weight, bias), prepared.backend
        # An entropy returned but unused must not cost a backward term: let its gradient arrive as None.
        ctx.set_materialize_grads(False)
        need = NeededGrads.of(ctx, bias, prepared.grad_enabled)
        ctx.backend, ctx.need, ctx.handover = backend, need, None
        one_pass = None
        with autocast_off(hidden.device.type):
            if hint is not None and need.any:
                one_pass = hint.one_pass(backend, given, need, return_entropy=call.return_entropy,
                                         statistics=call.statistics)
            if one_pass is not None:
                ctx.handover = hint.handover(one_pass)
            else:
                one_pass = backend.logprobs_forward(given, return_entropy=call.return_entropy,
                                                    statistics=call.statistics)
        logprobs = prepared.scatter(one_pass.logprobs, hidden)
        entropy = prepared.scatter(one_pass.entropy, hidden) if call.return_entropy else None
        token_stats = per_token_statistics(one_pass.statistics, given.rows, given.labels.numel())
        given.save_for_backward(ctx, one_pass.lse, one_pass.entropy)
        stat_outputs = tuple(token_stats[name] for name in call.statistics)
        ctx.mark_non_differentiable(*stat_outputs)
        return (logprobs, entropy) + stat_outputs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_grad_statistics):
        refuse_double_backward("linear_logprobs")
        given, (lse, ent_rows) = HeadInputs.saved(ctx)
        need = ctx.need
        handover, ctx.handover = ctx.handover, None  # handed over once; a second backward recomputes
        g_lp, g_h = upstream_rows(grad_logprobs, given.rows), upstream_rows(grad_entropy, given.rows)
        if (g_lp is None and g_h is None) or not need.any:
            return None, None, None, None
        if handover is not None:
            out = handover.input_grads(g_lp, g_h, given)
            if out is not None:
                return out + (None,)
        grads, rows = recompute_grads(ctx.backend, given, lse, ent_rows, g_lp, g_h, need)
        return grads.input_grads(given.hidden, given.weight, given.bias, rows) + (None,)


def logprobs_outputs(prepared: PreparedHead, *, return_entropy: bool = False, grad_hint=None,
                     statistics: tuple[str, ...] = ()) -> tuple:
    """``(logprobs, entropy or None, *statistics)`` shaped like the labels, from :class:`LinearLogprobsFunction` on a
    prepared call (:func:`linear_logprobs` after its checks; ``linear_cross_entropy(reduction="none")``)."""
    call = _LogprobsCall(prepared, bool(return_entropy), hint_rows(grad_hint, prepared), statistics)
    return tuple(prepared.shaped(t) for t in prepared.apply(LinearLogprobsFunction, call))


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    grad_hint: Union[None, torch.Tensor, TokenLossHint] = None,
    statistics: Optional[Sequence[str]] = None,
    vocab_parallel: Optional[VocabParallel] = None,
) -> Union[
    tuple[torch.Tensor, Optional[torch.Tensor]],
    tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]],
]:
    """Per-token log-probabilities of ``labels`` (and optionally the entropy of the whole distribution)
    under the logits of ``hidden @ weight.T + bias``, never materializing the ``[N, V]`` logits.

    With logits ``z`` (``(h·Wᵀ + b) · logit_scale``, then ``softcap · tanh(z / softcap)``, then
    ``/ temperature``): ``logprobs = z[label] − logsumexp(z)`` and
    ``entropy = −Σ_j p_j log p_j`` with ``p = softmax(z)``; TRL's ``selective_log_softmax`` and
    ``entropy_from_logits`` on the same logits.

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16), aligned with ``labels`` (no shift here).
        weight: ``[V, H]`` lm_head weight on ``hidden``'s device (the GPU backend computes in weight's dtype).
        bias: optional ``[V]``, floating point.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``.
        return_entropy: also return the (differentiable) entropy.
        transform, temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy`.
        grad_hint: optional float tensor shaped like ``labels``: the gradient the loss will send to
            ``logprobs``, up to one scalar factor ``c`` (not differentiated). On-policy GRPO without KL or
            entropy terms sends ``−A·mask/normalizer`` (TRL's loss at ratio 1), so ``A·mask`` is a hint.
            With it, when the planner allows the one pass (the cross-entropy one-pass condition, see
            ``tile_budget_bytes`` of :func:`~hf_fused.ops.linear_cross_entropy`; always on the torch
            backend), the forward also computes the gradients of ``Σ hint·logprobs`` from the same
            logits, 6·N·H·V FLOPs in all instead of 8, and holds them until backward. Backward uses
            them, times ``c``, when the upstream gradient is ``c·hint`` to ``1e-6`` of its largest entry
            and the entropy receives no gradient; otherwise it recomputes as without a hint (exact
            either way; a warning says so once). Or a :class:`~hf_fused.ops.hints.TokenLossHint`: the loss as
            a per-token function of the log-probs (and entropies) and per-token constants, for losses whose
            gradient is not known before the forward (off-policy ratios, KL, entropy terms); the forward then
            differentiates it tile by tile in the one pass and backward checks it the same way.
        statistics: optional names among :data:`~hf_fused.ops.token_statistics.TOKEN_STATISTICS`
            (``"mean_logits"``, ``"is_top1"``, ``"log_sum_sq_probs"``; TRL's fused-head metrics, formulas in
            :func:`~hf_fused.ops.linear_token_statistics`): computed from the forward's own logits tiles, on either
            schedule, at a few operations per logit and no extra matmul. Not with a ``TokenLossHint``.
        vocab_parallel: as in :func:`~hf_fused.ops.linear_cross_entropy` (a vocabulary-sharded head): the rank's
            weight rows, global labels, every tile's statistics merged over the group; the entropy and the
            statistics are those of the whole vocabulary, the same on every rank.

    Returns:
        ``(logprobs, entropy)``: fp32 ``[...]`` each (``entropy`` is ``None`` unless requested); 0 with
        no gradient at ignored positions. With ``statistics`` (even empty) a third element
        ``{name: [...] tensor}`` for each requested name: ``mean_logits`` and ``log_sum_sq_probs`` fp32,
        ``is_top1`` bool; 0 / ``False`` at ignored positions; never differentiable.

    Backward recomputes each tile from ``hidden``/``weight`` (unless a matching ``grad_hint`` made it
    unnecessary) and accepts any upstream gradient on both outputs; gradients for hidden, weight and
    bias are accumulated in fp32.

    Mixed precision: as :func:`~hf_fused.ops.linear_cross_entropy` (operands cast as ``F.linear`` would be
    under autocast; forward and backward compute from the same operands).

    Raises:
        ValueError / TypeError: as :func:`~hf_fused.ops.linear_cross_entropy`; ``grad_hint`` not a
            floating-point tensor shaped like ``labels`` on its device; a ``TokenLossHint`` whose ``per_token``
            tensors are not shaped like ``labels``, require grad or use the names ``logprobs`` / ``entropy``; an
            unknown name in ``statistics``, or statistics named with a ``TokenLossHint``.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``).
    """
    names = None if statistics is None else check_statistics(statistics)
    if names and isinstance(grad_hint, TokenLossHint):
        raise ValueError(
            "linear_logprobs: statistics= with a TokenLossHint grad_hint is not supported; pass the hint's loss "
            "to linear_token_loss, or drop the hint (statistics + recompute costs the same 8·N·H·V FLOPs as the "
            "hint's one pass plus a statistics pass)"
        )
    prepared = prepare(hidden, weight, labels, bias, ignore_index=ignore_index, transform=transform,
                       temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       tile_budget_bytes=tile_budget_bytes, backend=backend, vocab_parallel=vocab_parallel,
                       defer_count=True)
    logprobs, entropy, *stat_outputs = logprobs_outputs(prepared, return_entropy=return_entropy,
                                                        grad_hint=grad_hint, statistics=names or ())
    if names is None:
        return logprobs, entropy
    return logprobs, entropy, dict(zip(names, stat_outputs))
