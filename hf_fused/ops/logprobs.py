"""Fused per-token log-probabilities and entropy: the primitive every RL / preference loss builds on."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch

from .backends import Backend, get_backend
from .grads import HeadGrads
from .head_inputs import HeadInputs, NeededGrads, check_per_token, flatten_head_inputs, per_token_outputs
from .logit_transform import LogitTransform
from .precision import autocast_dtype, autocast_off, refuse_double_backward
from .tiling import validate_tile_budget
from .token_statistics import check_statistics, per_token_statistics


#: ``max |g − c·hint| ≤ HINT_RTOL · max |g|`` for the forward's gradients to stand in for the upstream ``g``:
#: a few fp32 roundings of the same products (TRL's normalizers), far below bf16 gradient noise.
HINT_RTOL = 1e-6

#: Whether :func:`hinted_input_grads` reads its host check through an event behind the queued gradient kernels on
#: CUDA (else it syncs first, as on CPU): a switch for the test that the two give the same bits.
_DEFER_HOST_CHECK = True


@dataclass(frozen=True, eq=False)
class _LogprobsCall:
    """Everything :class:`LinearLogprobsFunction` takes besides the differentiable hidden, weight and bias
    (the Function rebuilds ``head`` with those)."""

    head: HeadInputs
    backend: Backend
    return_entropy: bool
    grad_hint: Optional[torch.Tensor]  # [M] fp32 per kept row, or None
    grad_enabled: bool
    statistics: tuple[str, ...]


class LinearLogprobsFunction(torch.autograd.Function):
    """Forward keeps per-token statistics only (log-sum-exp, entropy); backward recomputes each tile's
    logits (8·N·H·V FLOPs in all), so the loss on top can be any autograd code on ``[N]`` tensors.

    With a gradient hint (and a backend budget that holds the one-pass working set) forward also
    computes the gradients of ``Σ hint·logprobs`` from the same logits (6·N·H·V in all); backward hands
    them over, times ``c``, when the upstream gradient is ``c·hint`` and the entropy gets none, and
    otherwise recomputes as above.

    The token statistics named in ``statistics`` come from the forward's own logits tiles (either path) as
    further, non-differentiable outputs in that order."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _LogprobsCall):
        # as given: the backends cast to the operands F.linear would compute from (HeadInputs.compute_dtype),
        # and the gradients go to the given tensors
        given = replace(call.head, hidden=hidden, weight=weight, bias=bias)
        backend, grad_hint, statistics = call.backend, call.grad_hint, call.statistics
        rows, labels = given.rows, given.labels
        # An entropy returned but unused must not cost a backward term: let its gradient arrive as None.
        ctx.set_materialize_grads(False)
        need = NeededGrads.of(ctx, bias)
        ctx.hinted = None
        one_pass = None
        with autocast_off(hidden.device.type):
            if grad_hint is not None and call.grad_enabled and need.any:
                one_pass = backend.logprobs_with_grads(
                    given, grad_hint, need=need, return_entropy=call.return_entropy, statistics=statistics
                )
            if one_pass is not None:
                ctx.hinted = (grad_hint, one_pass.grads)
            else:
                one_pass = backend.logprobs_forward(given, return_entropy=call.return_entropy, statistics=statistics)
        logprobs, entropy = per_token_outputs(hidden, rows, labels.numel(), one_pass.logprobs, one_pass.entropy,
                                              call.return_entropy)
        token_stats = per_token_statistics(one_pass.statistics, rows, labels.numel())
        given.save_for_backward(ctx, one_pass.lse, one_pass.entropy)
        ctx.backend = backend
        stat_outputs = tuple(token_stats[name] for name in statistics)
        ctx.mark_non_differentiable(*stat_outputs)
        return (logprobs, entropy) + stat_outputs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_grad_statistics):
        refuse_double_backward("linear_logprobs")
        given, (lse, ent_rows) = HeadInputs.saved(ctx)
        need = NeededGrads.of(ctx, given.bias)
        hinted, ctx.hinted = ctx.hinted, None  # handed over once; a second backward recomputes
        # Ignored positions carry no gradient whatever the upstream says.
        g_lp = None if grad_logprobs is None else grad_logprobs.float().index_select(0, given.rows)
        g_h = None if grad_entropy is None else grad_entropy.float().index_select(0, given.rows)
        if (g_lp is None and g_h is None) or not need.any:
            return None, None, None, None
        if hinted is not None:
            out = _hinted_grads(hinted[0], hinted[1], g_lp, g_h, given)
            if out is not None:
                return out + (None,)
        grads, rows = recompute_grads(ctx.backend, given, lse, ent_rows, g_lp, g_h, need)
        return grads.input_grads(given.hidden, given.weight, given.bias, rows) + (None,)


def recompute_grads(backend: Backend, head: HeadInputs, lse, ent_rows, g_lp, g_h, need: NeededGrads):
    """The recompute backward of the per-token outputs: ``(grads, rows)`` from upstream ``g_lp`` / ``g_h``
    (fp32 ``[M]`` over ``head.rows``, either may be ``None``), with autocast off. Rows whose upstream gradients
    are all 0 (a GRPO completion's padding, a zero advantage) add nothing and are skipped; the returned ``rows``
    are the ones the gradients belong to."""
    live = (g_lp if g_lp is not None else g_h) != 0
    if g_lp is not None and g_h is not None:
        live |= g_h != 0
    if not bool(live.all()):
        keep = live.nonzero().squeeze(1)
        head, lse, ent_rows = head.with_rows(head.rows[keep]), lse[keep], None if ent_rows is None else ent_rows[keep]
        g_lp = None if g_lp is None else g_lp[keep]
        g_h = None if g_h is None else g_h[keep]
    with autocast_off(head.hidden.device.type):
        grads = backend.logprobs_backward(head, lse, ent_rows, g_lp, g_h, need=need)
    return grads, head.rows


def _hinted_grads(hint, grads: HeadGrads, g_lp, g_h, given: HeadInputs):
    """The forward's gradients of ``Σ hint·logp`` times ``c``, as the inputs' gradients, if the upstream gradient
    is ``c·hint`` and none reaches the entropy; else ``None`` after warning (the caller recomputes)."""
    if g_h is not None and bool(g_h.ne(0).any()):
        return _hint_missed("the entropy receives a gradient")
    out = hinted_input_grads(grads, hint, torch.zeros_like(hint) if g_lp is None else g_lp, given)
    return out if out is not None else _hint_missed("the upstream gradient is not a multiple of the hint")


def hinted_input_grads(grads: HeadGrads, hint: torch.Tensor, upstream: torch.Tensor, given: HeadInputs):
    """``grads.input_grads(..., c)`` (the inputs' gradients from a hinted one pass) if ``upstream`` is ``c·hint``
    to ``HINT_RTOL`` of its largest entry (``c`` by least squares), else ``None`` (``grads`` consumed).

    One host sync, for ``c`` and the check. On CUDA the two come back through pinned memory and an event recorded
    before the gradients' scaling and rounding are queued (with ``c`` on the device), so the GPU runs those while
    the host waits instead of idling after it; the result is dropped if the check fails. A compensated pair's
    weight gradient (``weight_residual``) takes the factor from the host as before: a Python 1.0 keeps its ``hi``
    as it is, which a tensor factor would round again. An empty ``hint`` (every token ignored) needs no check: the
    gradients are zeros."""
    inputs = (given.hidden, given.weight, given.bias, given.rows)
    if hint.numel() == 0:
        return grads.input_grads(*inputs, 1.0)
    hh = hint.dot(hint)
    c = torch.where(hh > 0, upstream.dot(hint) / hh.clamp_min(torch.finfo(torch.float32).tiny), 0.0)  # least squares
    matches = (upstream - c * hint).abs().max() <= HINT_RTOL * upstream.abs().max()
    flags = torch.stack([c, matches.float()])
    if flags.is_cuda and grads.weight_residual is None and _DEFER_HOST_CHECK:
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(flags.device))  # the copy's stream, whatever the current device
        out = grads.input_grads(*inputs, c)
        ready.synchronize()
        return out if host[1].item() else None
    factor, ok = flags.tolist()
    return grads.input_grads(*inputs, factor) if ok else None


def _hint_missed(why: str):
    # Python's default filter shows this once per call site, not once per training step.
    warnings.warn(
        f"linear_logprobs(grad_hint=...): {why}, so the gradients computed in the forward were dropped and "
        "recomputed (8·N·H·V FLOPs instead of 6). The gradients are exact; pass no grad_hint for this loss.",
        HintMissedWarning, stacklevel=4,
    )
    return None


class HintMissedWarning(UserWarning):
    """``linear_logprobs(grad_hint=...)`` recomputed its gradients: the hint did not match the loss."""


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
    grad_hint: Optional[torch.Tensor] = None,
    statistics: Optional[Sequence[str]] = None,
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
        hidden: ``[..., H]`` hidden states, aligned with ``labels`` (no shift here).
        weight: ``[V, H]`` lm_head weight.  bias: optional ``[V]``.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``.
        return_entropy: also return the (differentiable) entropy.
        temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
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
            either way; a warning says so once). Or a :class:`~hf_fused.ops.token_loss.TokenLossHint`: the loss as
            a per-token function of the log-probs (and entropies) and per-token constants, for losses whose
            gradient is not known before the forward (off-policy ratios, KL, entropy terms); the forward then
            differentiates it tile by tile in the one pass and backward checks it the same way.
        statistics: optional names among :data:`~hf_fused.ops.token_statistics.TOKEN_STATISTICS`
            (``"mean_logits"``, ``"is_top1"``, ``"log_sum_sq_probs"``; TRL's fused-head metrics, formulas in
            :mod:`hf_fused.ops.token_statistics`): computed from the forward's own logits tiles, on either
            schedule, at a few operations per logit and no extra matmul. Not with a ``TokenLossHint``.

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
            floating-point tensor shaped like ``labels`` on its device; an unknown name in ``statistics``, or
            statistics named with a ``TokenLossHint``.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``).
    """
    transform = LogitTransform(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    from .token_loss import TokenLossHint, hinted_logprobs  # deferred: token_loss imports this module

    names = None if statistics is None else check_statistics(statistics)
    if isinstance(grad_hint, TokenLossHint):
        if names:
            raise ValueError(
                "linear_logprobs: statistics= with a TokenLossHint grad_hint is not supported; pass the hint's loss "
                "to linear_token_loss, or drop the hint (statistics + recompute costs the same 8·N·H·V FLOPs as the "
                "hint's one pass plus a statistics pass)"
            )
        out = hinted_logprobs(hidden, weight, labels, bias, grad_hint, ignore_index=ignore_index, transform=transform,
                              return_entropy=return_entropy, tile_budget_bytes=tile_budget_bytes, backend=backend)
        return out if names is None else out + ({},)
    flat = flatten_head_inputs(hidden, weight, labels, bias, ignore_index)
    rows = flat.rows
    hint_rows = None
    if grad_hint is not None:
        hint_rows = check_per_token(grad_hint, labels, "grad_hint").reshape(-1).index_select(0, rows)
    head = HeadInputs(flat.hidden, flat.weight, flat.bias, flat.labels, rows, transform,
                      validate_tile_budget(tile_budget_bytes), autocast_dtype(flat.hidden.device.type))
    call = _LogprobsCall(head, get_backend(hidden.device, backend), bool(return_entropy), hint_rows,
                         torch.is_grad_enabled(), names or ())
    logprobs, entropy, *stat_outputs = LinearLogprobsFunction.apply(flat.hidden, flat.weight, flat.bias, call)
    logprobs = logprobs.view(flat.batch_shape)
    if entropy is not None:
        entropy = entropy.view(flat.batch_shape)
    if names is None:
        return logprobs, entropy
    return logprobs, entropy, {name: value.view(flat.batch_shape) for name, value in zip(names, stat_outputs)}
