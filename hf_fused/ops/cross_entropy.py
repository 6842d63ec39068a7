"""Fused linear cross-entropy: the causal-LM loss from hidden states and lm_head, tile by tile."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from .backward import stored_grads
from .head_inputs import HeadInputs, NeededGrads
from .logit_transform import LogitTransform
from .logprobs import logprobs_outputs
from .precision import autocast_off, refuse_double_backward
from .prepare import PreparedHead, check_per_token, prepare
from .vocab_parallel import VocabParallel

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True, eq=False)
class _CrossEntropyCall:
    """Everything :class:`LinearCrossEntropyFunction` takes besides the differentiable hidden, weight, bias and
    row weights. ``prepared``'s rows are the kept rows of non-zero weight."""

    prepared: PreparedHead
    scale: Union[None, float, torch.Tensor]  # 1 / (the loss's normalizer); None: 1 / (the number of kept rows)

    @property
    def grad_scale(self) -> Union[float, torch.Tensor]:
        """1 / (the loss's normalizer); for the mean over the kept rows, read from their count (the op reads it only
        once the one pass has launched its first tile: :mod:`hf_fused.ops.kept_rows`)."""
        return 1.0 / max(self.prepared.rows.numel(), 1) if self.scale is None else self.scale


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Loss and gradients in one forward pass over the tiles (6·N·H·V FLOPs) when the backend's budget
    holds the one-pass working set; backward then only scales the stored fp32 gradients by the
    upstream gradient before rounding them once, so gradient accumulation and loss scaling stay exact.
    Otherwise forward keeps per-token statistics and backward runs the gradient pass with the upstream
    factor folded in (8·N·H·V in all, nothing gradient-sized held between the two).

    ``row_weights`` (fp32 ``[M]`` per kept row, or ``None``) multiply each token's loss; when they require grad,
    backward also returns theirs, ``∂loss/∂w_m = −grad_scale·logp_m`` times the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, row_weights, call: _CrossEntropyCall):
        prepared = call.prepared
        given, backend = prepared.given(hidden, weight, bias), prepared.backend
        need = NeededGrads.of(ctx, bias, prepared.grad_enabled)
        need_row_weights = prepared.grad_enabled and row_weights is not None and ctx.needs_input_grad[3]
        ctx.grads, lse, one_pass = None, None, None
        with autocast_off(hidden.device.type):
            if need.any:  # the loss alone leaves the op: the one pass may keep its stored tiles' statistics
                # the row gradients are built when the pass first needs them: their size is the count of kept rows
                one_pass = backend.logprobs_with_grads(
                    replace(given, returns_logprobs=False),
                    lambda: _grad_logprobs(call.grad_scale, 1.0, row_weights, prepared.rows),
                    need=need,
                )
            if one_pass is not None:
                logp, ctx.grads = one_pass.logprobs, one_pass.grads
            else:
                statistics = backend.logprobs_forward(given)
                logp, lse = statistics.logprobs, statistics.lse
        grad_scale = call.grad_scale
        ctx.config = (grad_scale, backend, need, need_row_weights)
        given.save_for_backward(ctx, lse, row_weights, logp if need_row_weights else None)
        loss_sum = -(logp if row_weights is None else logp * row_weights).sum()
        return loss_sum * grad_scale

    @staticmethod
    def backward(ctx, grad_output):
        refuse_double_backward("linear_cross_entropy")
        given, (lse, row_weights, logp) = HeadInputs.saved(ctx)
        grad_scale, backend, need, need_row_weights = ctx.config
        # The upstream factor stays an fp32 tensor on the device: no host sync (each one drains the GPU queue),
        # and fp32 arithmetic keeps it unrounded inside bf16 gradients (e.g. 1/3 for gradient accumulation).
        factor = grad_output.detach().to(torch.float32)
        # loss = −grad_scale·Σ_m w_m·logp_m: each weight's gradient is its token's loss term.
        d_row_weights = _grad_logprobs(grad_scale, factor, None, given.rows) * logp if need_row_weights else None
        if not need.any:
            return None, None, None, d_row_weights, None
        if lse is None:  # one pass: the gradients were computed in the forward
            grads = stored_grads(ctx, "linear_cross_entropy")
        else:
            with autocast_off(given.hidden.device.type):
                g_lp = _grad_logprobs(grad_scale, factor, row_weights, given.rows)
                grads = backend.logprobs_backward(given, lse, None, g_lp, None, need=need)
            factor = 1.0
        d_hidden, d_weight, d_bias = grads.input_grads(given.hidden, given.weight, given.bias, given.rows, factor)
        return d_hidden, d_weight, d_bias, d_row_weights, None


def _grad_logprobs(grad_scale, factor, row_weights, rows) -> torch.Tensor:
    """``∂(factor · grad_scale · Σ w·loss)/∂logp = −factor·grad_scale·w`` per row, fp32 ``[M]`` (loss = −logp)."""
    if isinstance(grad_scale, torch.Tensor):
        g = grad_scale.to(device=rows.device, dtype=torch.float32).neg() * factor
    else:  # torch.full fills on the device; as_tensor of a Python float would copy it over (a host sync)
        g = torch.full((), -grad_scale, dtype=torch.float32, device=rows.device) * factor
    return g.expand(rows.numel()).contiguous() if row_weights is None else g * row_weights


def _raise_not_finite():
    raise ValueError(
        "token_weights must be finite at non-ignored positions (NaN or inf found); ignored positions "
        "may hold anything"
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    token_weights: Optional[torch.Tensor] = None,
    vocab_parallel: Optional[VocabParallel] = None,
) -> torch.Tensor:
    """Cross-entropy of ``labels`` under the logits of ``hidden @ weight.T + bias``, never materializing
    the ``[N, V]`` logits.

    Logits per token (the order transformers' models use): ``z = (h·Wᵀ + b) · logit_scale``, then
    ``softcap · tanh(z / softcap)``, then ``/ temperature``. The loss of a token is
    ``logsumexp(z) − z[label]``; it equals ``F.cross_entropy`` on those logits.

    Args:
        hidden: ``[..., H]`` final hidden states (fp32/bf16/fp16). Already aligned with ``labels``:
            no causal shift happens here.
        weight: ``[V, H]`` lm_head weight on ``hidden``'s device (the GPU backend computes in weight's dtype).
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.
        bias: optional ``[V]`` lm_head bias.
        ignore_index: label value that contributes neither loss nor gradient.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"``, or ``"none"`` (per-token losses
            ``[...]`` fp32, 0 at ignored positions).
        num_items_in_batch: with ``"mean"``/``"sum"``, return ``sum / num_items_in_batch`` instead
            (transformers' gradient-accumulation normalization).
        transform: the logit transform above as one :class:`~hf_fused.ops.LogitTransform` (a model's, e.g.
            ``dataclasses.replace(transform, temperature=0.7)``), instead of the three keywords below.
        temperature, softcap, logit_scale: the logit transform above, field by field (default: the identity); not with
            ``transform`` (which would win is a guess: a ``ValueError``).
        tile_budget_bytes: ``None`` (default): the planner's rule
            (:mod:`hf_fused.ops.backends.triton_cublas.plan`): on a CUDA
            device the one pass below when its working set (the ``[V, H]`` weight-gradient accumulator — fp32,
            else for a bf16 weight the compensated pair, an int8 residual beside the gradient — a 2048-row tile and
            the hidden-state gradient held until backward, for bf16 hidden states the gradient itself and an int8
            residual of the kept rows) fits in a quarter of the free device memory, else the lean two
            passes with a 256 MiB tile; elsewhere a 256 MiB bound. An int: a hard bound in bytes on everything
            the op holds beyond its inputs and outputs on the GPU backend (tile, accumulators, the kept hidden
            rows, :func:`hf_fused.ops.backends.triton_cublas.two_pass_rule.lean_two_pass_plan`), and on the tile on
            the CPU reference. Not
            counted: under autocast, the compute-dtype copies of fp32 hidden states and weight, which autocast's
            ``F.linear`` makes too.
        backend: force a backend by name (see :mod:`hf_fused.ops.backends`).
        token_weights: optional ``[...]`` floating tensor shaped like ``labels``: each token's loss is
            multiplied by its weight before the reduction (``"mean"`` still divides by the number of
            non-ignored tokens, or by ``num_items_in_batch``). Tokens of weight 0 are skipped like ignored ones,
            unless the weights require grad: then they are learned, and their gradient is each token's loss
            term, ``∂loss/∂w_t = −logp_t`` divided as the loss is (0 at ignored positions). With
            ``weight_t = A_t·mask_t`` this is the on-policy, KL-free policy-gradient objective ``−Σ A_t·logp_t``
            (GRPO/DAPO's gradient at ratio 1).
        vocab_parallel: ``None``, or this rank's :class:`~hf_fused.ops.vocab_parallel.VocabShard` (or
            ``(start, stop, group)``) when lm_head is sharded over the vocabulary (tensor parallelism): ``weight``
            and ``bias`` are then the rank's rows ``[start, stop)`` and ``labels`` global ids; every rank of the group
            calls the op with the same hidden states and labels, and each tile's per-row statistics are merged over
            the group with one O(rows) all-reduce pair (:mod:`hf_fused.ops.vocab_parallel`). Each rank gets the
            gradient of its own weight rows and the whole hidden states' gradient (summed over the group).

    Returns:
        fp32 scalar for ``"mean"``/``"sum"``, fp32 ``[...]`` for ``"none"``. All-ignored input gives 0
        and zero gradients.

    Gradients w.r.t. hidden, weight and bias, for ``"mean"``/``"sum"``: when the backend's budget holds
    the one-pass working set (always on the torch backend; on the GPU, the planner's rule: room for the ``[V, H]``
    weight-gradient accumulator, fp32 or the compensated pair) they are computed in the forward's single pass
    (6·N·H·V FLOPs), kept in fp32 (or as the pair) and scaled by the upstream gradient in backward before their
    one rounding to the inputs' dtypes; otherwise forward computes per-token statistics only and backward the
    gradients, with the upstream factor folded in (8·N·H·V). Either way gradient accumulation and loss scaling stay exact.
    ``"none"`` recomputes in backward so per-token upstream weights are exact. A weight with
    ``requires_grad=False`` skips the weight-gradient matmul.

    Raises:
        ValueError: unknown reduction, bad shapes (``H = 0`` included), labels out of range,
            ``num_items_in_batch`` that is not one finite number > 0, invalid transform values (a tensor of
            several elements among them), ``transform`` with a transform keyword, ``token_weights`` not shaped like
            labels, on another device or not finite at a non-ignored position, tensors on the meta device or on
            several devices, ``reduction="none"`` with ``num_items_in_batch``, ``tile_budget_bytes`` not a
            positive int, an unknown ``backend`` (or ``"triton"`` off CUDA without Triton's interpreter), a
            ``vocab_parallel`` whose shards do not tile the vocabulary.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``).
        TypeError: non-tensor, sparse or wrongly typed inputs (``ignore_index`` not an integer; a
            ``vocab_parallel`` neither a :class:`~hf_fused.ops.VocabShard` nor a ``(start, stop, group)`` tuple
            of ints and a group).

    Mixed precision: under ``torch.autocast`` hidden, weight and bias are cast to the autocast dtype
    exactly as ``F.linear`` (the model's lm_head call) would cast them, and forward and backward both
    compute from those operands with autocast off; accumulation stays fp32 and the gradients reach the
    original tensors in their own dtypes.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if reduction == "none" and num_items_in_batch is not None:
        raise ValueError("num_items_in_batch applies to reduction='mean' or 'sum', not 'none'")
    prepared = prepare(hidden, weight, labels, bias, ignore_index=ignore_index, transform=transform,
                       temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       tile_budget_bytes=tile_budget_bytes, backend=backend, num_items_in_batch=num_items_in_batch,
                       vocab_parallel=vocab_parallel, defer_count=True)
    if reduction == "none":
        logprobs, _ = logprobs_outputs(prepared)
        if token_weights is None:
            return -logprobs
        weights = check_per_token(token_weights, labels, "token_weights", detach=False)
        # Ignored tokens have loss 0 whatever their weight (a NaN weight there must not poison it).
        kept = labels != ignore_index
        if bool((~torch.isfinite(weights) & kept).any()):
            _raise_not_finite()
        return -logprobs * torch.where(kept, weights, 0.0)
    row_weights, n_kept = None, None
    if token_weights is not None:
        n_kept = prepared.rows.numel()  # the mean's normalizer counts the tokens of weight 0 skipped below
        learned = prepared.grad_enabled and getattr(token_weights, "requires_grad", False)
        row_weights = prepared.per_token_rows(token_weights, "token_weights", differentiable=learned)
        nonzero = row_weights != 0
        finite, all_nonzero = torch.stack([torch.isfinite(row_weights).all(), nonzero.all()]).tolist()  # one sync
        if not finite:
            _raise_not_finite()
        # e.g. a GRPO group whose advantages are all 0; a learned weight's gradient needs its token's loss
        if not all_nonzero and not learned:
            keep = nonzero.nonzero().squeeze(1)
            prepared, row_weights = prepared.with_rows(prepared.rows[keep]), row_weights[keep]
    if num_items_in_batch is not None:
        grad_scale = 1.0 / prepared.num_items_in_batch
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.to(device=hidden.device, dtype=torch.float32)
    elif reduction == "mean":
        # 1 / the number of kept rows; without token weights read where the Function first needs it
        grad_scale = None if n_kept is None else 1.0 / max(n_kept, 1)
    else:
        grad_scale = 1.0
    return prepared.apply(LinearCrossEntropyFunction, row_weights, _CrossEntropyCall(prepared, grad_scale))
