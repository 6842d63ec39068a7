"""Fused losses over a sparse support (:func:`linear_support_loss`): per token, a loss of the log-probs at ``K``
candidate ids (and the entropy), with the head's gradients formed in the same pass over the tiles, never
materializing the ``[N, V]`` logits. The K-column generalisation of :func:`~hf_fused.ops.linear_token_loss`
(``K = 1`` with the label as the candidate is that op)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Protocol, runtime_checkable

import torch

from .backward import stored_grads, upstream_rows
from .grads import HeadGrads
from .head_inputs import HeadInputs, NeededGrads
from .logit_transform import LogitTransform
from .precision import autocast_off, refuse_double_backward
from .prepare import PreparedHead, prepare
from .tiling import rows_per_tile

#: ``support_loss(logprobs [r, K], entropy [r] or None, *, support_mask [r, K], **per_token_rows) -> losses [r]``
SupportLossFn = Callable[..., torch.Tensor]

_REDUCTIONS = ("sum", "none")
_NO_GRADS = NeededGrads(False, False, False)
#: Keyword names the op passes to ``support_loss`` itself; ``per_token`` may not use them.
_RESERVED = ("logprobs", "entropy", "support_mask")


class SupportLossOutput(NamedTuple):
    """What :func:`linear_support_loss` returns.

    loss: fp32; ``"sum"``: the scalar ``Σ_t support_loss(...)_t`` over kept tokens; ``"none"``: per token ``[...]``
        (0 at tokens the row ``mask`` drops). Differentiable with respect to hidden, weight and bias.
    token_losses: fp32 ``[...]`` the per-token losses, detached, 0 at dropped tokens.
    support_logprobs: fp32 ``[..., K]`` the log-probs at the candidate ids, detached: ``-inf`` at slots
        ``support_mask`` marks invalid, 0 on dropped tokens.
    entropy: fp32 ``[...]`` the entropy of the full-vocabulary distribution, detached (0 at dropped tokens), or
        ``None`` unless ``return_entropy`` or ``need_entropy``.
    """

    loss: torch.Tensor
    token_losses: torch.Tensor
    support_logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


class Support(NamedTuple):
    """The candidate ids of the kept rows (``[M, K]``, in the order of the head's ``rows``): ``ids`` int64 in
    ``[0, V)`` (invalid slots clamped into range, never read), ``valid`` bool."""

    ids: torch.Tensor
    valid: torch.Tensor


class SupportRowGrads(NamedTuple):
    """Per kept row, the gradient of the loss with respect to the support log-probs (fp32 ``[M, K]``, 0 at
    invalid slots) and to the entropy (fp32 ``[M]``, or ``None`` when the loss does not read it)."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


class SupportPass(NamedTuple):
    """What :func:`support_loss_pass` computes per kept row: ``support_logprobs`` fp32 ``[M, K]`` (``-inf`` at
    invalid slots), ``entropy`` fp32 ``[M]`` or ``None``, and the head's fp32 :class:`~hf_fused.ops.grads.HeadGrads`
    (hidden ``[M, H]``) or ``None`` when none was asked."""

    support_logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    grads: Optional[HeadGrads]


class SupportTileLoss:
    """Evaluates ``support_loss`` on a run of the kept rows, keeps each row's loss (:attr:`losses`, fp32 ``[M]``) and
    returns its gradients with respect to the rows' support log-probs and entropy, by autograd on the ``[r, K]``
    tensors. Called by the pass between a tile's statistics and its gradient."""

    def __init__(self, support_loss: SupportLossFn, per_token: dict[str, torch.Tensor], valid: torch.Tensor, *,
                 need_entropy: bool, differentiate: bool, keep_row_grads: bool = False):
        self.support_loss = support_loss
        self.per_token = per_token  # name -> [M, ...] at the kept rows
        self.valid = valid  # [M, K] bool
        self.need_entropy = need_entropy
        self.differentiate = differentiate
        self.losses = torch.zeros(valid.shape[0], dtype=torch.float32, device=valid.device)
        self._row_grads: Optional[list] = [] if keep_row_grads else None

    def __call__(self, start: int, stop: int, logprobs: torch.Tensor, entropy: Optional[torch.Tensor]):
        """``(g_s [r, K], g_H [r] or None)`` fp32 for kept rows ``start:stop`` from their fp32 support log-probs
        ``[r, K]`` and entropy ``[r]`` (``None`` unless :attr:`need_entropy`); ``(None, None)`` when not
        differentiating. ``g_s`` is 0 at invalid slots whatever the loss computed there (a log-sum-exp over
        ``-inf`` slots has NaN gradients there, which autograd would pass on)."""
        valid = self.valid[start:stop]
        rows = {name: values[start:stop] for name, values in self.per_token.items()}
        if not self.differentiate:
            with torch.no_grad():
                self.losses[start:stop] = self._losses(logprobs, entropy, valid, rows)
            return None, None
        with torch.enable_grad():
            lp = logprobs.detach().requires_grad_()
            ent = entropy.detach().requires_grad_() if entropy is not None else None
            losses = self._losses(lp, ent, valid, rows)
            inputs = (lp,) if ent is None else (lp, ent)
            if losses.requires_grad:
                grads = torch.autograd.grad(losses.sum(), inputs, allow_unused=True)
            else:  # the loss does not depend on the log-probs
                grads = (None,) * len(inputs)
        self.losses[start:stop] = losses.detach()
        g_s = torch.zeros_like(logprobs) if grads[0] is None else torch.where(valid, grads[0].float(), 0.0)
        g_ent = None if ent is None or grads[1] is None else grads[1].float().contiguous()
        if self._row_grads is not None:
            self._row_grads.append((g_s, g_ent))
        return g_s, g_ent

    def row_grads(self) -> SupportRowGrads:
        """Every kept row's gradients so far, in row order (zeros where the loss ignored the entropy)."""
        g_s = [g for g, _ in self._row_grads]
        empty = torch.zeros((0, self.valid.shape[1]), dtype=torch.float32, device=self.valid.device)
        g_ent = None
        if any(h is not None for _, h in self._row_grads):
            g_ent = torch.cat([torch.zeros(g.shape[0], dtype=torch.float32, device=g.device) if h is None else h
                               for g, h in self._row_grads])
        return SupportRowGrads(torch.cat(g_s) if g_s else empty, g_ent)

    def _losses(self, logprobs, entropy, valid, rows) -> torch.Tensor:
        losses = self.support_loss(logprobs, entropy, support_mask=valid, **rows)
        if not isinstance(losses, torch.Tensor) or losses.shape != logprobs.shape[:1]:
            got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(
                f"support_loss must return one loss per token, a tensor of shape {tuple(logprobs.shape[:1])} for "
                f"logprobs of shape {tuple(logprobs.shape)}, got {got}; sum over the K candidates inside "
                "support_loss, and reduce over tokens after the op"
            )
        if not losses.is_floating_point():
            raise TypeError(f"support_loss must return floating-point losses, got {losses.dtype}")
        return losses.float()


@runtime_checkable
class SupportLossBackend(Protocol):
    """A backend with its own support-loss pass, with the signature and contract of :func:`support_loss_pass` (its
    result as a :class:`SupportPass` or the plain tuple of its fields), or returning ``None`` for a call it leaves
    to the plain-PyTorch pass (which the op runs for backends without it).
    The GPU backend's: cuBLAS tiles, its statistics and gradient kernels, and two kernels for the candidate columns
    (:mod:`hf_fused.ops.backends.triton_cublas.support_pass`)."""

    def support_loss_pass(self, head: HeadInputs, support: Support, *, tile_loss: Optional[SupportTileLoss] = None,
                          row_grads: Optional[SupportRowGrads] = None, need: NeededGrads = _NO_GRADS,
                          return_entropy: bool = False) -> Optional[tuple]: ...


def support_loss_pass(
    head: HeadInputs,
    support: Support,
    *,
    tile_loss: Optional[SupportTileLoss] = None,
    row_grads: Optional[SupportRowGrads] = None,
    need: NeededGrads = _NO_GRADS,
    return_entropy: bool = False,
) -> SupportPass:
    """The plain-PyTorch pass over the kept rows (``rows_per_tile(V, head.tile_budget_bytes)`` rows per tile, the
    ``TILE_BUFFERS`` fp32 ``[rows, V]`` arrays of the reference backend: logits turned log-probs in place, the
    probabilities, the soft-cap's tanh). Per tile, with ``z`` the transformed logits::

        log p = log_softmax(z)       s_k = log p[id_k]  (−inf at invalid slots)       H = −Σ_j p_j log p_j

    (``log p`` from ``z − max z``, as ``log_softmax`` computes it), then the per-row gradients ``g_k = ∂L/∂s_k`` and
    ``g_H = ∂L/∂H`` from ``tile_loss`` (or from ``row_grads``, given: the recompute of ``reduction="none"``), and,
    when ``need`` asks for any, the logits gradient from the same tile (``∂s_k/∂z_j = 1[j = id_k] − p_j``,
    ``∂H/∂z_j = −p_j (log p_j + H)``)::

        dz_j = Σ_k g_k·1[j = id_k] − p_j·Σ_k g_k − g_H·p_j·(log p_j + H)

    through the transform's derivative into ``dh = dz·W``, ``dW += dzᵀ·h``, ``db += Σ dz`` (fp32 accumulators).
    Duplicate ids in a row add up. The head is taken as given and cast as autocast casts ``F.linear``'s operands;
    the logits are fp32 products of those operands; an fp32 copy of the weight is held beside the tiles.
    """
    head = head.computed()
    hidden, weight, rows, transform = head.hidden, head.weight, head.rows, head.transform
    weight32 = weight.float()
    bias32 = None if head.bias is None else head.bias.float()
    m, k = support.ids.shape
    vocab_size, hidden_size = weight.shape
    device = hidden.device
    differentiates = (tile_loss is not None and tile_loss.differentiate) or row_grads is not None
    grads = None
    if need.any and differentiates:
        grads = HeadGrads(
            hidden=torch.zeros((m, hidden_size), dtype=torch.float32, device=device) if need.hidden else None,
            weight=torch.zeros((vocab_size, hidden_size), dtype=torch.float32, device=device) if need.weight else None,
            bias=torch.zeros(vocab_size, dtype=torch.float32, device=device) if need.bias and bias32 is not None
            else None,
        )
    loss_reads_entropy = tile_loss is not None and tile_loss.need_entropy
    grads_read_entropy = grads is not None and row_grads is not None and row_grads.entropy is not None
    want_entropy = return_entropy or loss_reads_entropy or grads_read_entropy
    support_logprobs = torch.empty((m, k), dtype=torch.float32, device=device)
    entropy = torch.empty(m, dtype=torch.float32, device=device) if want_entropy else None
    step = rows_per_tile(vocab_size, head.tile_budget_bytes)
    for start in range(0, m, step):
        stop = min(start + step, m)
        h32 = hidden.index_select(0, rows[start:stop]).float()
        raw = h32 @ weight32.t()
        if bias32 is not None:
            raw += bias32
        z, tanh = transform.forward(raw)
        if grads is None:
            del tanh  # only the gradient needs it
            tanh = None
        # log p = (z − max) − log Σ exp(z − max), as log_softmax computes it: a log-prob near 0 (a likely candidate)
        # keeps its fp32 digits, which z − logsumexp(z) would cancel, and a tail bucket log(1 − Σ_k p_k) amplifies.
        shifted = z.sub_(z.amax(dim=1, keepdim=True))
        p = shifted.exp()
        sum_exp = p.sum(dim=1, keepdim=True)
        logp = shifted.sub_(sum_exp.log())  # log p_j, in place of z
        ids, valid = support.ids[start:stop], support.valid[start:stop]
        s = logp.gather(1, ids).masked_fill_(~valid, float("-inf"))
        support_logprobs[start:stop] = s
        if want_entropy or grads is not None:
            p.div_(sum_exp)
        else:
            del p
            p = None
        ent = None
        if entropy is not None:
            entropy[start:stop] = -torch.mul(p, logp).sum(1)
            ent = entropy[start:stop]
        g_s = g_ent = None
        if tile_loss is not None:
            g_s, g_ent = tile_loss(start, stop, s, ent if loss_reads_entropy else None)
        elif row_grads is not None:
            g_s = row_grads.logprobs[start:stop]
            g_ent = None if row_grads.entropy is None else row_grads.entropy[start:stop]
        if grads is not None:
            g_total = g_s.sum(1, keepdim=True)
            # dz in the two tile arrays already alive (logp, p): the working set stays TILE_BUFFERS arrays.
            if g_ent is not None:
                dz = logp.add_(ent.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))  # −g_H·p_j(log p_j + H)
                dz.sub_(p.mul_(g_total))
            else:
                dz = p.mul_(-g_total)
            dz.scatter_add_(1, ids, g_s)  # + Σ_k g_k·1[j = id_k] (g_k = 0 at invalid slots)
            dz = transform.backward(dz, tanh)  # × 1/T, × (1 − tanh²), × scale
            if grads.hidden is not None:
                torch.mm(dz, weight32, out=grads.hidden[start:stop])
            if grads.weight is not None:
                grads.weight.addmm_(dz.t(), h32)
            if grads.bias is not None:
                grads.bias += dz.sum(0)
            del dz
        del z, logp, p, tanh, h32, raw
    return SupportPass(support_logprobs, entropy, grads)


@dataclass(frozen=True, eq=False)
class _SupportLossCall:
    """Everything :class:`LinearSupportLossFunction` takes besides the differentiable hidden, weight and bias."""

    prepared: PreparedHead
    support: Support
    support_loss: SupportLossFn
    per_token: dict  # name -> [M, ...] at the kept rows
    need_entropy: bool  # the loss reads the entropy
    return_entropy: bool
    per_token_loss: bool  # reduction="none"

    def tile_loss(self, differentiate: bool, keep_row_grads: bool = False) -> SupportTileLoss:
        return SupportTileLoss(self.support_loss, self.per_token, self.support.valid, need_entropy=self.need_entropy,
                               differentiate=differentiate, keep_row_grads=keep_row_grads)

    def run(self, head: HeadInputs, *, tile_loss=None, row_grads=None, need: NeededGrads = _NO_GRADS) -> SupportPass:
        """The backend's own pass where it has one and takes the call, else the plain-PyTorch one."""
        options = dict(tile_loss=tile_loss, row_grads=row_grads, need=need,
                       return_entropy=self.return_entropy or self.need_entropy)
        backend_pass = getattr(self.prepared.backend, "support_loss_pass", None)
        out = None if backend_pass is None else backend_pass(head, self.support, **options)
        return support_loss_pass(head, self.support, **options) if out is None else SupportPass(*out)


class LinearSupportLossFunction(torch.autograd.Function):
    """``(loss, token_losses [N], support_logprobs [N, K], entropy [N] or None)`` of :func:`linear_support_loss`;
    only ``loss`` is differentiable, with respect to hidden, weight and bias.

    ``"sum"``: one pass; the forward computes the head's gradients of the summed loss in fp32 and backward
    multiplies them by the upstream gradient before their one rounding (gradient accumulation and loss scaling stay
    exact). ``"none"``: the forward computes the losses and each row's gradients with respect to its support
    log-probs and entropy (``[M, K]``, ``[M]``); backward scales those by each token's upstream gradient and
    recomputes the tiles (8·N·H·V in all)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _SupportLossCall):
        prepared = call.prepared
        given = prepared.given(hidden, weight, bias)  # the gradients go to the tensors as given
        need = NeededGrads.of(ctx, bias, prepared.grad_enabled)
        ctx.need, ctx.call, ctx.grads, ctx.row_grads = need, None, None, None
        one_pass = need.any and not call.per_token_loss
        tile_loss = call.tile_loss(differentiate=need.any, keep_row_grads=need.any and call.per_token_loss)
        with autocast_off(hidden.device.type):
            out = call.run(given, tile_loss=tile_loss, need=need if one_pass else _NO_GRADS)
        if one_pass:
            ctx.grads = out.grads
        elif need.any:  # "none": the rows' gradients, scaled by the upstream ones in backward
            ctx.call, ctx.row_grads = call, tile_loss.row_grads()
        ctx.save_for_backward(hidden, weight, bias, given.rows)
        rows = given.rows
        token_losses = prepared.scatter(tile_loss.losses, hidden)
        support_logprobs = hidden.new_zeros((prepared.labels.numel(), call.support.ids.shape[1]),
                                             dtype=torch.float32).index_copy_(0, rows, out.support_logprobs)
        entropy = None if not call.return_entropy else prepared.scatter(out.entropy, hidden)
        loss = token_losses.clone() if call.per_token_loss else tile_loss.losses.sum()
        if entropy is None:
            ctx.mark_non_differentiable(token_losses, support_logprobs)
        else:
            ctx.mark_non_differentiable(token_losses, support_logprobs, entropy)
        return loss, token_losses, support_logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_token_losses, _grad_support_logprobs, _grad_entropy):
        refuse_double_backward("linear_support_loss")
        hidden, weight, bias, rows = ctx.saved_tensors
        need = ctx.need
        if grad_loss is None or not need.any:
            return None, None, None, None
        call = ctx.call
        if call is None:  # one pass: the gradients were computed in the forward
            grads = stored_grads(ctx, "linear_support_loss")
            factor = grad_loss.detach().to(torch.float32)  # on the device: no host sync, never rounded to bf16
        else:  # "none": each token's upstream gradient, folded into a recompute of the tiles
            up = upstream_rows(grad_loss, rows).unsqueeze(1)
            g_s, g_ent = ctx.row_grads
            scaled = SupportRowGrads(g_s * up, None if g_ent is None else g_ent * up.squeeze(1))
            with autocast_off(hidden.device.type):
                grads = call.run(call.prepared.given(hidden, weight, bias), row_grads=scaled, need=need).grads
            factor = 1.0
        return grads.input_grads(hidden, weight, bias, rows, factor) + (None,)


# -- validation ----------------------------------------------------------------------------------------------------


def row_labels(mask: Optional[torch.Tensor], hidden) -> torch.Tensor:
    """Labels that keep the tokens where ``mask`` is nonzero (all tokens for ``None``) for
    :func:`~hf_fused.ops.prepare.prepare`: 0 where kept, -100 elsewhere (the support ops read no label values).

    Raises:
        TypeError: a mask that is not a tensor.
        ValueError: a mask not shaped like hidden's leading dims or on another device.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:  # prepare says what is wrong
        return torch.zeros((), dtype=torch.long)
    batch_shape, device = hidden.shape[:-1], hidden.device
    if mask is None:
        return torch.zeros(batch_shape, dtype=torch.long, device=device)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor shaped like hidden's leading dims, got {type(mask).__name__}")
    if mask.shape != batch_shape or mask.device != device:
        raise ValueError(
            f"mask must have hidden's leading shape {tuple(batch_shape)} on its device {device}, got "
            f"{tuple(mask.shape)} on {mask.device}"
        )
    return torch.where(mask != 0, 0, -100)


def support_rows(prepared: PreparedHead, support_ids, support_mask) -> Support:
    """The candidate ids and their validity at the kept rows, after checking them (one host sync).

    Raises:
        TypeError: ids that are not an integer tensor; a mask that is not a bool or integer tensor.
        ValueError: ids not shaped ``[..., K]`` with hidden's leading dims and ``K ≥ 1``, or on another device; a
            mask of another shape (a different ``K``) or device; a valid slot of a kept row with an id outside
            ``[0, V)``.
    """
    batch_shape, device = prepared.batch_shape, prepared.labels.device
    if not isinstance(support_ids, torch.Tensor):
        raise TypeError(f"support_ids must be a torch.Tensor of token ids [..., K], got {type(support_ids).__name__}")
    if support_ids.is_floating_point() or support_ids.is_complex() or support_ids.dtype == torch.bool:
        raise TypeError(f"support_ids must be an integer tensor of token ids, got {support_ids.dtype}")
    if support_ids.dim() != len(batch_shape) + 1 or support_ids.shape[:-1] != batch_shape:
        raise ValueError(
            f"support_ids must be [..., K] with hidden's leading shape {tuple(batch_shape)}, got shape "
            f"{tuple(support_ids.shape)}"
        )
    k = support_ids.shape[-1]
    if k == 0:
        raise ValueError("support_ids has K = 0 candidates per token; pass at least one candidate id per token")
    if support_ids.device != device:
        raise ValueError(f"support_ids must be on hidden's device {device}, got {support_ids.device}")
    if support_mask is None:
        valid = torch.ones(support_ids.shape, dtype=torch.bool, device=device)
    else:
        if not isinstance(support_mask, torch.Tensor):
            raise TypeError(f"support_mask must be a bool tensor shaped like support_ids, got "
                            f"{type(support_mask).__name__}")
        if support_mask.is_floating_point() or support_mask.is_complex():
            raise TypeError(f"support_mask must be a bool (or integer: nonzero is valid) tensor, got "
                            f"{support_mask.dtype}")
        if support_mask.shape != support_ids.shape or support_mask.device != device:
            raise ValueError(
                f"support_mask must have support_ids' shape {tuple(support_ids.shape)} (K = {k}) on {device}, got "
                f"{tuple(support_mask.shape)} on {support_mask.device}"
            )
        valid = support_mask != 0
    vocab_size = prepared.head.weight.shape[0]
    rows = prepared.rows
    ids = support_ids.reshape(-1, k).index_select(0, rows).long()
    valid = valid.reshape(-1, k).index_select(0, rows)
    bad = valid & ((ids < 0) | (ids >= vocab_size))
    if bool(bad.any()):
        first = ids[bad][0].item()
        raise ValueError(
            f"support_ids contain {first} at a valid slot, outside [0, {vocab_size}); mark padding slots invalid in "
            "support_mask (TRL pads candidates with -1) or check the tokenizer/vocabulary size"
        )
    return Support(ids.clamp(0, vocab_size - 1), valid)


def per_token_rows(prepared: PreparedHead, per_token: Optional[Mapping[str, torch.Tensor]]) -> dict:
    """Named per-token constants (``[...]`` or ``[..., *trailing]`` with hidden's leading dims), at the kept rows
    ``[M, *trailing]`` (dtypes kept).

    Raises:
        TypeError: not a mapping of names to tensors.
        ValueError: a value with other leading dims or on another device, one requiring grad, or a key among
            ``logprobs``, ``entropy``, ``support_mask`` (``support_loss``'s own arguments).
    """
    if per_token is None:
        return {}
    if not isinstance(per_token, Mapping):
        raise TypeError(f"per_token must be a dict of tensors with hidden's leading dims, got "
                        f"{type(per_token).__name__}")
    batch_shape, device, out = prepared.batch_shape, prepared.labels.device, {}
    for name, values in per_token.items():
        if name in _RESERVED:
            raise ValueError(f"per_token key {name!r} clashes with support_loss's own argument; rename it")
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"per_token[{name!r}] must be a tensor with hidden's leading dims, got {type(values).__name__}; "
                "close over scalars in support_loss (e.g. functools.partial) instead"
            )
        if values.shape[: len(batch_shape)] != batch_shape or values.device != device:
            raise ValueError(
                f"per_token[{name!r}] must have hidden's leading shape {tuple(batch_shape)} on {device}, got "
                f"{tuple(values.shape)} on {values.device}"
            )
        if values.requires_grad:
            raise ValueError(
                f"per_token[{name!r}] requires grad, but per-token inputs are constants the op does not "
                "differentiate; pass values.detach() (or compute them under torch.no_grad())"
            )
        trailing = values.shape[len(batch_shape):]
        out[name] = values.reshape(-1, *trailing).index_select(0, prepared.rows)
    return out


def support_loss_call(
    hidden, weight, support_ids, support_loss: SupportLossFn, bias=None, *, support_mask=None, mask=None,
    per_token=None, reduction: str = "sum", transform: Optional[LogitTransform] = None, temperature=1.0,
    softcap=None, logit_scale=1.0, need_entropy: bool = False, return_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None, backend: Optional[str] = None, num_items_in_batch=None,
) -> tuple[SupportLossOutput, PreparedHead]:
    """:func:`linear_support_loss`, and the :class:`~hf_fused.ops.prepare.PreparedHead` it ran on (the kept rows, a
    checked ``num_items_in_batch``), for ops built on it."""
    if not callable(support_loss):
        raise TypeError(f"support_loss must be callable (logprobs, entropy, *, support_mask, **per_token) -> losses, "
                        f"got {support_loss!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    prepared = prepare(hidden, weight, row_labels(mask, hidden), bias, transform=transform, temperature=temperature,
                       softcap=softcap, logit_scale=logit_scale, tile_budget_bytes=tile_budget_bytes, backend=backend,
                       num_items_in_batch=num_items_in_batch)
    support = support_rows(prepared, support_ids, support_mask)
    call = _SupportLossCall(prepared, support, support_loss, per_token_rows(prepared, per_token), bool(need_entropy),
                            bool(return_entropy or need_entropy), reduction == "none")
    loss, token_losses, support_logprobs, entropy = prepared.apply(LinearSupportLossFunction, call)
    k = support.ids.shape[1]
    out = SupportLossOutput(
        prepared.shaped(loss) if reduction == "none" else loss,
        prepared.shaped(token_losses),
        support_logprobs.view(*prepared.batch_shape, k),
        prepared.shaped(entropy),
    )
    return out, prepared


# -- the op --------------------------------------------------------------------------------------------------------


def linear_support_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    support_ids: torch.Tensor,
    support_loss: SupportLossFn,
    bias: Optional[torch.Tensor] = None,
    *,
    support_mask: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    per_token: Optional[Mapping[str, torch.Tensor]] = None,
    reduction: str = "sum",
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    need_entropy: bool = False,
    return_entropy: bool = False,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> SupportLossOutput:
    """The loss ``Σ_t support_loss(s_t, H_t; per_token_t)`` of an objective that reads each token's log-probs at
    ``K`` candidate ids ``s_t = log p_t[ids_t]`` (and its entropy ``H_t``) under the logits of
    ``hidden @ weight.T + bias``, with the head's gradients computed in the same pass over the tiles (6·N·H·V FLOPs),
    never materializing the ``[N, V]`` logits.

    Logits as in :func:`~hf_fused.ops.linear_logprobs`: ``z = (h·Wᵀ + b)·logit_scale``, then
    ``softcap·tanh(z/softcap)``, then ``/temperature``; ``s_k = z[id_k] − logsumexp(z)`` (``-inf`` at invalid slots),
    ``H = −Σ_j p_j log p_j`` over the full vocabulary.

    With a tile's full-vocabulary rows resident, its log-sum-exp (and entropy) known and the ``K`` logits gathered,
    the op evaluates ``support_loss`` on the tile's rows, differentiates it there with ordinary autograd
    (``g_k = ∂L/∂s_k``, ``g_H = ∂L/∂H``), and forms the logits gradient in the same pass (``∂s_k/∂z_j = 1[j = id_k]
    − p_j``; the entropy's as in DESIGN.md, "The math")::

        dz_j = Σ_k g_k·1[j = id_k] − p_j·Σ_k g_k − g_H·p_j·(log p_j + H)

    then ``dh = dz·W``, ``dW += dzᵀ·h`` (:func:`support_loss_pass`). So any objective on a sparse support is one
    ``support_loss`` away: distillation from a teacher's top-k log-probs
    (:func:`~hf_fused.ops.sparse_distillation_loss`, TRL's semantics), the sampled token's reverse KL of on-policy
    distillation (``K = 1``), importance-weighted sampled targets ("random sampling KD", Anshumann et al., ACL 2025,
    whose estimator is unbiased where top-k truncation is not).

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16), aligned with the tokens whose next-token distributions
            are scored (no causal shift here).
        weight: ``[V, H]`` lm_head weight.  bias: optional ``[V]``.
        support_ids: ``[..., K]`` integer candidate ids, ``K ≥ 1``, in ``[0, V)`` at valid slots (invalid slots may
            hold anything, e.g. TRL's -1). Duplicates are allowed (each slot is its own log-prob).
        support_loss: ``support_loss(logprobs, entropy, *, support_mask, **rows) -> losses``, the per-token loss in
            plain PyTorch: ``logprobs`` fp32 ``[r, K]`` for a tile's ``r`` kept tokens (``-inf`` at invalid slots),
            ``entropy`` fp32 ``[r]`` (``None`` unless ``need_entropy``), ``support_mask`` bool ``[r, K]``, ``rows``
            the ``per_token`` tensors at the same tokens. It returns ``[r]`` floating losses, token ``t``'s from
            token ``t``'s inputs only; it may be called once per tile. Its gradient at invalid slots is ignored.
        support_mask: optional ``[..., K]`` bool (or integer, nonzero valid) tensor: which slots are candidates.
        mask: optional ``[...]`` tensor: tokens where it is nonzero count; the others are not computed and get loss
            0 and no gradient. With ``None`` every token counts.
        per_token: optional dict of constant tensors with hidden's leading dims (``[...]`` or ``[..., *trailing]``,
            e.g. the teacher's log-probs ``[..., K]``), passed to ``support_loss`` at the tile's rows.
        reduction: ``"sum"`` (a scalar, the one pass) or ``"none"`` (per-token losses; backward recomputes the tiles
            with each token's upstream gradient).
        transform, temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy`. The GPU backend runs its own one pass
            (:class:`SupportLossBackend`: fp32 cuBLAS tiles from the operands in their dtype, Triton kernels for the
            statistics, the gradient and the candidate columns, the logits gradient rounded once to the operands'
            dtype for its two matmuls); the others run the plain-PyTorch pass on the tensors' device.
        need_entropy: pass the entropy to ``support_loss`` (differentiable) and return it.
        return_entropy: return the entropy (a metric; no gradient) without passing it to ``support_loss``.

    Returns:
        :class:`SupportLossOutput` ``(loss, token_losses, support_logprobs, entropy)``. All tokens dropped: loss 0
        and zero gradients.

    Gradients: ``"sum"``: computed in the forward's pass in fp32 and multiplied in backward by the upstream gradient
    before their one rounding to the inputs' dtypes (exact under gradient accumulation and loss scaling); a second
    backward through the same call raises. ``"none"``: recomputed in backward with each token's upstream gradient.

    Mixed precision: as :func:`~hf_fused.ops.linear_cross_entropy` (operands cast as ``F.linear`` would be under
    autocast, fp32 logits; ``support_loss`` runs in fp32 with autocast off).

    Two host syncs: :func:`~hf_fused.ops.prepare.prepare`'s checks, and the candidate ids' range.

    Raises:
        ValueError / TypeError: as :func:`~hf_fused.ops.linear_cross_entropy`; ``support_ids`` not an integer
            ``[..., K]`` tensor with hidden's leading dims on its device, or with an id outside ``[0, V)`` at a valid
            slot of a counted token; ``support_mask`` of another shape (a different ``K``); a bad ``mask`` or
            ``per_token`` (other leading dims or device, requiring grad, a reserved key); an unknown ``reduction``;
            ``support_loss`` not callable or not returning one floating loss per token.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``) or a second backward of a
            ``"sum"`` call.
    """
    out, _ = support_loss_call(
        hidden, weight, support_ids, support_loss, bias, support_mask=support_mask, mask=mask, per_token=per_token,
        reduction=reduction, transform=transform, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
        need_entropy=need_entropy, return_entropy=return_entropy, tile_budget_bytes=tile_budget_bytes,
        backend=backend,
    )
    return out
