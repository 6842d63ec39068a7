"""Fused token-separable losses: ``Σ_t token_loss(logp_t, H_t; c_t)`` and its head gradients in one pass.

For GRPO-family objectives the gradient reaching a token's log-prob (and entropy) is an elementwise function
of that token's log-prob and entropy and of per-token constants known before the forward (advantages, old
and reference log-probs, masks, importance weights, normalizers). So once a tile's full-vocabulary logits
are resident and its log-sum-exp (and entropy) are known, the op evaluates the user's ``token_loss`` on the
tile's rows, differentiates it there with ordinary autograd on ``[rows]`` tensors (``g_lp = ∂L/∂logp_t``,
``g_H = ∂L/∂H_t``), and forms the logits gradient in the same pass (DESIGN.md, "The math")::

    dz_j = g_lp·(1[j = y_t] − p_j) − g_H·p_j·(log p_j + H_t)

then ``dh = dz·W``, ``dW += dzᵀ·h``: 6·N·H·V FLOPs in all instead of the 8 of log-probs + a recompute
backward. Backward only scales the stored fp32 gradients by the upstream factor before their one rounding,
so gradient accumulation and loss scaling stay exact.

**Token-separable** means: the loss is a sum over tokens of terms each depending on that token's ``logp``
and ``H`` only (plus constants). Not separable, so not for this op (use :func:`~hf_fused.ops.linear_logprobs`
and autograd on ``[B, T]`` tensors instead):

- a sequence-level ratio ``exp(mean_t(logp_t − old_t))`` (GSPO, TRL's ``importance_sampling_level=
  "sequence"``): every token's gradient depends on the whole sequence's log-probs;
- a quantile of the batch's entropies (TRL's ``top_entropy_quantile < 1``): the mask depends on all rows;
- anything normalized by a statistic of the current log-probs themselves.

Per-batch constants computed beforehand (token counts, ``num_items_in_batch``, sequence lengths,
advantages) are fine: pass them per token in ``per_token`` or close over them in ``token_loss``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .backends import Backend, HeadPass, get_backend
from .head_inputs import HeadInputs, NeededGrads, flatten_head_inputs, per_token_outputs
from .logit_transform import LogitTransform
from .logprobs import HintMissedWarning, hinted_input_grads, recompute_grads
from .precision import autocast_dtype, autocast_off, refuse_double_backward
from .tiling import validate_tile_budget

#: ``token_loss(logprobs [r], entropy [r] or None, **per_token_rows) -> losses [r]``
TokenLossFn = Callable[..., torch.Tensor]


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


class _TileLoss:
    """Evaluates ``token_loss`` on a run of the kept rows and returns its per-row gradients; accumulates the
    summed loss. Called by the backend between a tile's statistics and its gradient (one pass), or once on
    all rows (statistics + recompute)."""

    def __init__(self, token_loss: TokenLossFn, per_token: dict[str, torch.Tensor], rows: torch.Tensor,
                 differentiate: bool, keep_row_grads: bool = False):
        self.token_loss = token_loss
        self.per_token = per_token  # name -> flat [N]
        self.rows = rows
        self.differentiate = differentiate
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=rows.device)
        # With keep_row_grads, every call's (g_lp, g_ent) in row order (a TokenLossHint checks them in backward).
        self.row_grads: Optional[list] = [] if keep_row_grads else None

    def __call__(self, start: int, stop: int, logp: torch.Tensor, entropy: Optional[torch.Tensor]):
        """``(g_lp [r], g_H [r] or None)`` fp32 for kept rows ``start:stop`` with fp32 ``logp``/``entropy [r]``;
        ``(None, None)`` when not differentiating. ``g_H`` is ``None`` when the loss ignores the entropy."""
        idx = self.rows[start:stop]
        consts = {name: values.index_select(0, idx) for name, values in self.per_token.items()}
        if not self.differentiate:
            with torch.no_grad():
                self.loss_sum += self._losses(logp, entropy, consts).sum()
            return None, None
        with torch.enable_grad():
            lp = logp.detach().requires_grad_()
            ent = None if entropy is None else entropy.detach().requires_grad_()
            losses = self._losses(lp, ent, consts)
            inputs = (lp,) if ent is None else (lp, ent)
            if losses.requires_grad:
                grads = torch.autograd.grad(losses.sum(), inputs, allow_unused=True)
            else:  # the loss does not depend on the log-probs (e.g. every row masked out)
                grads = (None,) * len(inputs)
        self.loss_sum += losses.detach().sum()
        g_lp = (torch.zeros_like(logp) if grads[0] is None else grads[0].float()).contiguous()
        g_ent = None if ent is None or grads[1] is None else grads[1].float().contiguous()
        if self.row_grads is not None:
            self.row_grads.append((g_lp, g_ent))
        return g_lp, g_ent

    def stacked_row_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every kept row's ``(g_lp [M], g_ent [M])`` so far (zeros where the loss ignored the entropy)."""
        g_lp = [g for g, _ in self.row_grads]
        g_ent = [torch.zeros_like(g) if h is None else h for g, h in self.row_grads]
        empty = torch.zeros(0, dtype=torch.float32, device=self.rows.device)
        return (torch.cat(g_lp) if g_lp else empty), (torch.cat(g_ent) if g_ent else empty)

    def _losses(self, logp, entropy, consts) -> torch.Tensor:
        losses = self.token_loss(logp, entropy, **consts)
        if not isinstance(losses, torch.Tensor) or losses.shape != logp.shape:
            got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(
                f"token_loss must return one loss per token, a tensor shaped like its logprobs argument "
                f"{tuple(logp.shape)}, got {got}; reduce after the op (it returns the sum), not inside token_loss"
            )
        if not losses.is_floating_point():
            raise TypeError(f"token_loss must return floating-point losses, got {losses.dtype}")
        return losses.float()


@dataclass(frozen=True, eq=False)
class _TokenLossCall:
    """Everything :class:`LinearTokenLossFunction` and :class:`HintedLogprobsFunction` take besides the
    differentiable hidden, weight and bias (the Functions rebuild ``head`` with those)."""

    head: HeadInputs
    backend: Backend
    tile_loss: _TileLoss
    return_entropy: bool  # the op returns the entropy
    need_entropy: bool  # the token loss reads it (computed either way when either is set)
    grad_enabled: bool

    def one_pass(self, head: HeadInputs, need: NeededGrads) -> Optional[HeadPass]:
        """The backend's one pass of the token loss, or ``None`` (nothing to differentiate, no such method,
        or the planner chose two passes)."""
        if not need.any or not hasattr(self.backend, "token_loss_with_grads"):
            return None
        return self.backend.token_loss_with_grads(
            head, self.tile_loss, need=need, return_entropy=self.return_entropy or self.need_entropy,
            grads_read_entropy=self.need_entropy,
        )


class LinearTokenLossFunction(torch.autograd.Function):
    """One pass when the backend can hold its working set (``token_loss_with_grads``; always on the torch
    reference): statistics, per-row loss gradients and head gradients tile by tile in the forward; backward
    scales them by the upstream factor. Otherwise forward computes statistics and the per-row loss gradients
    on all rows, and backward recomputes the tiles (``logprobs_backward``) with the factor folded in:
    8·N·H·V, the same result."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _TokenLossCall):
        # as given: the backends cast to the operands F.linear would compute from (HeadInputs.compute_dtype),
        # and the gradients go to the given tensors
        given = replace(call.head, hidden=hidden, weight=weight, bias=bias)
        rows, tile_loss = given.rows, call.tile_loss
        need = NeededGrads.of(ctx, bias, call.grad_enabled)
        ctx.backend, ctx.need = call.backend, need
        ctx.grads, ctx.row_grads = None, None
        lse = None
        with autocast_off(hidden.device.type):
            one_pass = call.one_pass(given, need)
            if one_pass is not None:
                ctx.grads = one_pass.grads
            else:
                # Statistics, then the loss and its per-row gradients on all rows at once (elementwise, so
                # the same values as tile by tile); backward recomputes the tiles.
                one_pass = call.backend.logprobs_forward(given, return_entropy=call.need_entropy)
                lse = one_pass.lse
                tile_loss.differentiate = need.any
                ctx.row_grads = tile_loss(0, rows.numel(), one_pass.logprobs, one_pass.entropy)
        logp, ent = one_pass.logprobs, one_pass.entropy
        given.save_for_backward(ctx, lse, ent)
        n = given.labels.numel()
        logprobs, entropy = per_token_outputs(hidden, rows, n, logp, ent, ent is not None)
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
            if ctx.grads is None:
                raise RuntimeError(
                    "linear_token_loss computed its gradients in the forward and handed them to backward once; "
                    "to backpropagate twice, call linear_token_loss again."
                )
            grads, ctx.grads = ctx.grads, None
        else:
            if ctx.row_grads is None:
                raise RuntimeError("linear_token_loss: backward ran twice; call linear_token_loss again.")
            (g_lp, g_ent), ctx.row_grads = ctx.row_grads, None
            g_lp = g_lp * factor
            g_ent = None if g_ent is None else g_ent * factor
            grads, rows = recompute_grads(ctx.backend, given, lse, ent, g_lp, g_ent, need)
            factor = 1.0
        return grads.input_grads(given.hidden, given.weight, given.bias, rows, factor) + (None,)


def _flat_per_token(per_token: Optional[Mapping[str, torch.Tensor]], labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """``per_token`` values flattened to ``[N]`` after checking them.

    Raises:
        TypeError: not a mapping of names to tensors.
        ValueError: a value not shaped like labels, on another device, or requiring grad.
    """
    if per_token is None:
        return {}
    if not isinstance(per_token, Mapping):
        raise TypeError(f"per_token must be a dict of tensors shaped like labels, got {type(per_token).__name__}")
    flat = {}
    for name, values in per_token.items():
        if name in ("logprobs", "entropy"):
            raise ValueError(f"per_token key {name!r} clashes with token_loss's own argument; rename it")
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"per_token[{name!r}] must be a tensor shaped like labels, got {type(values).__name__}; "
                "close over scalars in token_loss (e.g. functools.partial) instead"
            )
        if values.shape != labels.shape or values.device != labels.device:
            raise ValueError(
                f"per_token[{name!r}] must have labels' shape {tuple(labels.shape)} on {labels.device}, got "
                f"{tuple(values.shape)} on {values.device}"
            )
        if values.requires_grad:
            raise ValueError(
                f"per_token[{name!r}] requires grad, but per-token inputs are constants the op does not "
                "differentiate; pass values.detach() (or compute them under torch.no_grad())"
            )
        flat[name] = values.reshape(-1)
    return flat


def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLossFn,
    bias: Optional[torch.Tensor] = None,
    *,
    per_token: Optional[Mapping[str, torch.Tensor]] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    need_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> TokenLossOutput:
    """The summed loss ``Σ_t token_loss(logp_t, H_t; per_token_t)`` of a token-separable objective under the
    logits of ``hidden @ weight.T + bias``, with its gradients for hidden, weight and bias computed in the same
    pass over the tiles (6·N·H·V FLOPs), never materializing the ``[N, V]`` logits.

    Logits and log-probs as in :func:`~hf_fused.ops.linear_logprobs`: ``z = (h·Wᵀ + b)·logit_scale``, then
    ``softcap·tanh(z/softcap)``, then ``/temperature``; ``logp_t = z[y_t] − logsumexp(z)``,
    ``H_t = −Σ_j p_j log p_j``.

    Args:
        hidden: ``[..., H]`` hidden states aligned with ``labels`` (no shift here).
        weight: ``[V, H]`` lm_head weight.  bias: optional ``[V]``.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``. Ignored tokens are not passed to
            ``token_loss`` and contribute neither loss nor gradient.
        token_loss: ``token_loss(logprobs, entropy, **rows) -> losses``: the per-token loss, elementwise,
            written in plain PyTorch. ``logprobs`` is fp32 ``[r]`` for a tile's ``r`` kept tokens,
            ``entropy`` fp32 ``[r]`` (``None`` unless ``need_entropy``), ``rows`` the ``per_token`` tensors
            sliced to the same tokens (dtypes kept). It must return ``[r]`` floating losses in which token
            ``t``'s entry depends on token ``t``'s inputs only (module docstring: what is not separable); the
            op differentiates it per tile with autograd. It may be called several times (once per tile).
        per_token: optional dict of tensors shaped like ``labels`` (advantages, old/reference log-probs, masks,
            importance weights, per-token normalizers …), constants (not differentiated).
        ignore_index, temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy`.
        need_entropy: compute the entropy, pass it to ``token_loss`` (differentiable) and return it.

    Returns:
        :class:`TokenLossOutput` ``(loss, logprobs, entropy)``: fp32 scalar loss (0 when every token is
        ignored), and the detached fp32 per-token log-probs and entropies shaped like ``labels`` for metrics.

    Gradients: when the backend's budget holds the one-pass working set (always on the torch backend; on the
    GPU, room for the ``[V, H]`` weight-gradient accumulator, fp32 or for a bf16 weight the compensated pair,
    :func:`hf_fused.ops.tiling.one_pass_plan`) they are computed in the forward's pass and kept in fp32 (or as the
    pair) until backward scales them by the upstream
    gradient and rounds them once; otherwise forward computes the statistics and the per-token loss gradients
    and backward recomputes each tile with the upstream factor folded in (8·N·H·V). Exact under any upstream
    gradient on the loss either way (gradient accumulation, loss scaling).

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
    transform = LogitTransform(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    flat = flatten_head_inputs(hidden, weight, labels, bias, ignore_index)
    consts = _flat_per_token(per_token, labels)
    rows = flat.rows
    grad_enabled = torch.is_grad_enabled()
    tile_budget_bytes = validate_tile_budget(tile_budget_bytes)  # None stays None: the planner's default rule
    tile_loss = _TileLoss(token_loss, consts, rows, differentiate=grad_enabled)
    head = HeadInputs(flat.hidden, flat.weight, flat.bias, flat.labels, rows, transform, tile_budget_bytes,
                      autocast_dtype(flat.hidden.device.type))
    call = _TokenLossCall(head, get_backend(hidden.device, backend), tile_loss, bool(need_entropy),
                          bool(need_entropy), grad_enabled)
    loss, logprobs, entropy = LinearTokenLossFunction.apply(flat.hidden, flat.weight, flat.bias, call)
    logprobs = logprobs.view(flat.batch_shape)
    if entropy is not None:
        entropy = entropy.view(flat.batch_shape)
    return TokenLossOutput(loss, logprobs, entropy)


# ----------------------------------------------------------------------------------------------------------------
# A token loss as a gradient hint for linear_logprobs: the caller keeps its own loss code (e.g. TRL's), the op
# computes the gradients that loss will send in the forward's one pass and checks them in backward.


@dataclass
class TokenLossHint:
    """``linear_logprobs(grad_hint=TokenLossHint(token_loss, per_token))``: the loss the caller will compute from
    the returned log-probs (and entropies) is ``Σ_t token_loss(logp_t, H_t; per_token_t)`` up to one scalar factor,
    so the op can compute its gradients in the forward's single pass (6·N·H·V) like :func:`linear_token_loss`,
    while the caller's own code computes the loss and metrics from the returned tensors.

    Backward receives the gradients the caller's loss really sends to the log-probs and entropies and uses the
    forward's head gradients, times ``c``, only when they equal ``c·(∂Σ token_loss/∂logp, ∂/∂H)`` to ``HINT_RTOL``
    of their largest entry; otherwise it recomputes (exact either way; :class:`HintMissedWarning` says so).

    token_loss: as in :func:`linear_token_loss`.
    per_token: tensors shaped like the labels of the call, constants (rows whose label is ignored are never used).
    need_entropy: ``token_loss`` uses the entropy (it is then computed even if the call does not return it).
    """

    token_loss: TokenLossFn
    per_token: dict
    need_entropy: bool = False

    def __post_init__(self) -> None:
        if not callable(self.token_loss):
            raise TypeError(f"TokenLossHint.token_loss must be callable, got {self.token_loss!r}")
        if not self.per_token or not all(isinstance(v, torch.Tensor) for v in self.per_token.values()):
            raise TypeError("TokenLossHint.per_token must be a non-empty dict of tensors shaped like labels")
        shapes = {tuple(v.shape) for v in self.per_token.values()}
        if len(shapes) != 1:
            raise ValueError(f"TokenLossHint.per_token tensors must share one shape (labels'), got {sorted(shapes)}")

    @property
    def shape(self) -> torch.Size:
        return next(iter(self.per_token.values())).shape

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def _map(self, fn) -> "TokenLossHint":
        return TokenLossHint(self.token_loss, {k: fn(v) for k, v in self.per_token.items()}, self.need_entropy)

    def to(self, device) -> "TokenLossHint":
        return self._map(lambda v: v.to(device))

    def __getitem__(self, index) -> "TokenLossHint":
        return self._map(lambda v: v[index])

    def pad(self, left: int, right: int) -> "TokenLossHint":
        """Zeros added on the last dimension (positions the call ignores: their values are never used)."""
        return self._map(lambda v: F.pad(v, (left, right)))


def pad_hint(hint, left: int, right: int):
    """A ``grad_hint`` (tensor or :class:`TokenLossHint`) padded with zeros on its last dimension."""
    return hint.pad(left, right) if isinstance(hint, TokenLossHint) else F.pad(hint, (left, right))


class HintedLogprobsFunction(torch.autograd.Function):
    """:func:`~hf_fused.ops.linear_logprobs` outputs (differentiable) with a :class:`TokenLossHint`: one pass in the
    forward when the backend holds its working set, the head gradients kept for a backward that matches."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _TokenLossCall):
        # as given: the backends cast to the operands F.linear would compute from (HeadInputs.compute_dtype),
        # and the gradients go to the given tensors
        given = replace(call.head, hidden=hidden, weight=weight, bias=bias)
        ctx.set_materialize_grads(False)
        need = NeededGrads.of(ctx, bias, call.grad_enabled)
        ctx.backend, ctx.need = call.backend, need
        ctx.hinted = None
        with autocast_off(hidden.device.type):
            one_pass = call.one_pass(given, need)
            if one_pass is not None:
                ctx.hinted = call.tile_loss.stacked_row_grads() + (one_pass.grads,)
            else:
                one_pass = call.backend.logprobs_forward(given, return_entropy=call.return_entropy)
        logprobs, entropy = per_token_outputs(hidden, given.rows, given.labels.numel(), one_pass.logprobs,
                                              one_pass.entropy, call.return_entropy)
        given.save_for_backward(ctx, one_pass.lse, one_pass.entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        refuse_double_backward("linear_logprobs")
        given, (lse, ent) = HeadInputs.saved(ctx)
        need = ctx.need
        hinted, ctx.hinted = ctx.hinted, None  # handed over once; a second backward recomputes
        g_lp = None if grad_logprobs is None else grad_logprobs.float().index_select(0, given.rows)
        g_h = None if grad_entropy is None else grad_entropy.float().index_select(0, given.rows)
        if (g_lp is None and g_h is None) or not need.any:
            return None, None, None, None
        if hinted is not None:
            out = _token_hinted_grads(hinted[0], hinted[1], hinted[2], g_lp, g_h, given)
            if out is not None:
                return out + (None,)
        if g_h is not None and ent is None:  # cannot happen: entropy is returned only when computed
            raise RuntimeError("linear_logprobs: an entropy gradient without a saved entropy")
        grads, rows = recompute_grads(ctx.backend, given, lse, ent, g_lp, g_h, need)
        return grads.input_grads(given.hidden, given.weight, given.bias, rows) + (None,)


def _token_hinted_grads(hint_lp, hint_ent, grads, g_lp, g_h, given):
    """The forward's gradients times ``c`` as the inputs' gradients (:func:`~hf_fused.ops.logprobs.
    hinted_input_grads`) if the upstream ``(g_lp, g_h)`` is ``c·(hint_lp, hint_ent)`` to ``HINT_RTOL`` of its
    largest entry, else ``None`` after warning once (the caller recomputes). One host sync."""
    hint = torch.cat([hint_lp, hint_ent])
    up = torch.cat([torch.zeros_like(hint_lp) if g_lp is None else g_lp,
                    torch.zeros_like(hint_ent) if g_h is None else g_h])
    out = hinted_input_grads(grads, hint, up, given)
    if out is not None:
        return out
    warnings.warn(
        "linear_logprobs(grad_hint=TokenLossHint(...)): the gradient the loss sent to the log-probs/entropies is not "
        "a multiple of the hint's token loss gradient, so the gradients computed in the forward were dropped and "
        "recomputed (8·N·H·V FLOPs instead of 6). The gradients are exact; check the hint's token_loss against the "
        "loss (or pass no grad_hint).",
        HintMissedWarning, stacklevel=3,
    )
    return None


def hinted_logprobs(hidden, weight, labels, bias, hint: TokenLossHint, *, ignore_index, transform: LogitTransform,
                    return_entropy: bool, tile_budget_bytes, backend):
    """:func:`~hf_fused.ops.linear_logprobs` with a :class:`TokenLossHint` (it dispatches here): ``(logprobs,
    entropy)`` shaped like labels, differentiable, the head gradients of the hint's loss computed in the forward."""
    flat = flatten_head_inputs(hidden, weight, labels, bias, ignore_index)
    consts = _flat_per_token(hint.per_token, labels)
    rows = flat.rows
    tile_budget_bytes = validate_tile_budget(tile_budget_bytes)
    tile_loss = _TileLoss(hint.token_loss, consts, rows, differentiate=True, keep_row_grads=True)
    head = HeadInputs(flat.hidden, flat.weight, flat.bias, flat.labels, rows, transform, tile_budget_bytes,
                      autocast_dtype(flat.hidden.device.type))
    call = _TokenLossCall(head, get_backend(hidden.device, backend), tile_loss, bool(return_entropy),
                          bool(hint.need_entropy), torch.is_grad_enabled())
    logprobs, entropy = HintedLogprobsFunction.apply(flat.hidden, flat.weight, flat.bias, call)
    logprobs = logprobs.view(flat.batch_shape)
    return logprobs, None if entropy is None else entropy.view(flat.batch_shape)
