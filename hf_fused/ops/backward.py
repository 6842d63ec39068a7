"""What the ops' backward passes share: the upstream gradient at the kept rows, the recompute of the head's
gradients from saved statistics, and handing over the gradients a one pass computed in the forward when the
upstream gradient turns out to be a multiple of what the forward assumed (a grad hint)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .backends import Backend, HeadGrads
from .head_inputs import HeadInputs, NeededGrads
from .precision import autocast_off

#: ``max |g − c·hint| ≤ HINT_RTOL · max |g|`` for the forward's gradients to stand in for the upstream ``g``:
#: a few fp32 roundings of the same products (TRL's normalizers), far below bf16 gradient noise.
HINT_RTOL = 1e-6

#: Whether :func:`hinted_input_grads` reads its host check through an event behind the queued gradient kernels on
#: CUDA (else it syncs first, as on CPU): a switch for the test that the two give the same bits.
_DEFER_HOST_CHECK = True


class HintMissedWarning(UserWarning):
    """``linear_logprobs(grad_hint=...)`` recomputed its gradients: the hint did not match the loss."""


def upstream_rows(grad: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """A per-token output's upstream gradient ``[N]`` at the kept ``rows``, fp32 ``[M]`` (``None`` stays ``None``):
    ignored positions carry no gradient whatever the upstream says."""
    return None if grad is None else grad.float().index_select(0, rows)


def stored_grads(ctx, op: str, recomputes: bool = True) -> HeadGrads:
    """The gradients a one-pass forward stored in ``ctx.grads``, handed over once: ``ctx.grads`` is cleared, so
    that they are freed as soon as the caller is done with them.

    Args:
        ctx: the autograd Function's context.  op: the public op's name, for the error.
        recomputes: whether the op has a ``reduction='none'`` that recomputes (named in the error as the way out).

    Raises:
        RuntimeError: a second backward through the same forward (``retain_graph=True``)."""
    if ctx.grads is None:
        way_out = " (or use reduction='none', which recomputes)" if recomputes else ""
        raise RuntimeError(f"{op} computed its gradients in the forward and handed them to backward once; to "
                           f"backpropagate twice, call {op} again{way_out}.")
    grads, ctx.grads = ctx.grads, None
    return grads


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


def hinted_input_grads(grads: HeadGrads, hint: torch.Tensor, upstream: torch.Tensor, given: HeadInputs):
    """``grads.input_grads(..., c)`` (the inputs' gradients from a hinted one pass) if ``upstream`` is ``c·hint``
    to ``HINT_RTOL`` of its largest entry (``c`` by least squares), else ``None`` (``grads`` consumed).

    One host sync, for ``c`` and the check. On CUDA the two come back through pinned memory and an event recorded
    before the gradients' scaling and rounding are queued (with ``c`` on the device), so the GPU runs those while
    the host waits instead of idling after it; the result is dropped if the check fails (a compensated pair's
    scaling, which a factor of 1 leaves as it is on the device as from the host, gives the same bits either way).
    An empty ``hint`` (every token ignored) needs no check: the gradients are zeros."""
    inputs = (given.hidden, given.weight, given.bias, given.rows)
    if hint.numel() == 0:
        return grads.input_grads(*inputs, 1.0)
    hh = hint.dot(hint)
    c = torch.where(hh > 0, upstream.dot(hint) / hh.clamp_min(torch.finfo(torch.float32).tiny), 0.0)  # least squares
    matches = (upstream - c * hint).abs().max() <= HINT_RTOL * upstream.abs().max()
    flags = torch.stack([c, matches.float()])
    if flags.is_cuda and _DEFER_HOST_CHECK:
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(flags.device))  # the copy's stream, whatever the current device
        out = grads.input_grads(*inputs, c)
        ready.synchronize()
        return out if host[1].item() else None
    factor, ok = flags.tolist()
    return grads.input_grads(*inputs, factor) if ok else None


def warn_hint_missed(message: str) -> None:
    """Warn (:class:`HintMissedWarning`) that a hinted one pass's gradients were dropped and recomputed. For a
    caller one frame below an autograd Function's ``backward``: the warning is attributed to autograd's call of
    ``backward``, so Python's default filter shows it once per message, not once per training step."""
    warnings.warn(message, HintMissedWarning, stacklevel=4)
