"""Fused dense distillation: the divergence between a student's and a teacher's next-token distributions from both
models' hidden states and lm_heads, with the student's gradients computed in the same pass, never materializing
either model's ``[N, V]`` logits.

One pass over token tiles: each tile computes both models' full-vocabulary logits rows (the teacher's under
``no_grad``, on its own device, then moved: the tile's result travels, never the weight), the per-token divergence,
the student's entropy and the student's logits gradient (:mod:`hf_fused.ops.distillation_math`), then
``dh = dz·W_s``, ``dW_s += dzᵀ·h``, ``db_s += Σ dz``, accumulated in fp32. That is 6·N·H_s·V + 2·N·H_t·V FLOPs;
TRL 1.16's ``ChunkedDivergenceFunction`` recomputes both models' logits in backward (8·N·H_s·V + 4·N·H_t·V for a KL,
10·N·H_s·V + 6·N·H_t·V for the JSD). Backward only multiplies the stored fp32 gradients by the upstream
gradient before rounding them once. ``reduction="none"`` cannot know each token's upstream weight in the forward,
so it computes statistics there and recomputes both models' tiles in backward with the weights folded in.

This is the plain-PyTorch pass (CPU; on CUDA where the GPU backend does not run its own); a backend may provide a
faster one (``distillation_pass``, :class:`DistillationBackend`): the GPU backend's runs the same loop with the
per-tile elementwise work in Triton kernels (``backends/triton_cublas/distillation_pass.py``; fp16 operands keep this
pass). Its products, per model
(:func:`half_products`):

- bf16 operands on CUDA (with ``aten::mm.dtype``, torch >= 2.8): the operands in their own dtype, the products
  accumulated and written in fp32 by cuBLAS (``torch.mm(..., out_dtype=torch.float32)``), no fp32 copy of the
  weight. The logits are fp32-faithful (the fp32 accumulator's value, never rounded to bf16); the student's fp32
  logits gradient ``dz`` is rounded once to the operand dtype for its two matmuls (``dh`` and ``dW_s``, both written
  or accumulated in fp32), as every fused peer (TRL's ``ChunkedDivergenceFunction``, Liger's ``FusedLinearJSD``)
  and eager autograd round it; ``db_s`` sums the fp32 ``dz``.
- otherwise (CPU, fp32 or fp16 operands): fp32 copies of the weight and the tile's hidden rows, fp32 matmuls. fp16
  stays there: ``"mean"``'s ``dz`` carries the ``1/N`` of the reduction and not yet the upstream gradient (a
  ``GradScaler``'s loss scale, applied in backward), so rounding it to fp16 would flush most of its entries
  (``p/N`` below fp16's smallest subnormal, 6e-8), which eager fp16 under a loss scale keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Union, runtime_checkable

import torch

from .backward import stored_grads, upstream_rows
from .distillation_math import DISTILLATION_TILE_BUFFERS, check_beta, check_temperature, tile_divergence
from .distillation_tiles import DistillationPass, TileHead, half_products
from .grads import HeadGrads
from .head_inputs import HeadInputs, NeededGrads
from .precision import autocast_off, refuse_double_backward
from .prepare import PreparedHead, prepare
from .tiling import check_tile_budget

_REDUCTIONS = ("mean", "sum", "none")
_NO_GRADS = NeededGrads(False, False, False)


class DistillationOutput(NamedTuple):
    """What :func:`linear_distillation_loss` returns.

    loss: fp32; a scalar for ``"mean"``/``"sum"``, per-token ``[...]`` for ``"none"`` (0 at ignored positions);
        differentiable with respect to the student's hidden states, weight and bias only.
    divergence: fp32 ``[...]`` per-token divergence, detached, 0 at ignored positions.
    entropy: fp32 ``[...]`` per-token entropy of the student's tempered distribution, detached, 0 at ignored
        positions (TRL's ``entropy`` metric is its sum over kept tokens divided by their count).
    """

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: torch.Tensor


@runtime_checkable
class DistillationBackend(Protocol):
    """A backend with its own distillation pass, with the signature and contract of :func:`distillation_pass`; it
    returns ``None`` for inputs it leaves to the plain-PyTorch pass (which also serves backends without one)."""

    def distillation_pass(self, student: HeadInputs, teacher: HeadInputs, beta: float, *,
                          row_grads: Union[None, float, torch.Tensor] = None,
                          need: NeededGrads = _NO_GRADS) -> Optional[DistillationPass]: ...


def distillation_rows_per_tile(vocab_size: int, tile_budget_bytes: Optional[int]) -> int:
    """Token rows per tile so that ``DISTILLATION_TILE_BUFFERS`` fp32 ``[rows, vocab_size]`` arrays fit the budget
    (``DEFAULT_TILE_BUDGET_BYTES`` for ``None``).

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    return max(1, check_tile_budget(tile_budget_bytes) // (DISTILLATION_TILE_BUFFERS * 4 * max(1, vocab_size)))


def distillation_pass(
    student: HeadInputs,
    teacher: HeadInputs,
    beta: float,
    *,
    row_grads: Union[None, float, torch.Tensor] = None,
    need: NeededGrads = _NO_GRADS,
) -> DistillationPass:
    """The plain-PyTorch pass over the kept token rows (``student.rows`` on the student's device, ``teacher.rows``
    the same indices on the teacher's), ``distillation_rows_per_tile(V, student.tile_budget_bytes)`` rows per tile:
    per row the divergence and student entropy, and, when ``need`` asks for any and ``row_grads`` is given, the
    student's gradients of ``Σ_rows row_grads·divergence`` (``row_grads``: a Python float or 0-d fp32 tensor for
    every row, or fp32 ``[M]``) from the same tiles.

    Both heads are taken as given (cast here as autocast casts ``F.linear``'s operands, each with its own
    ``compute_dtype``); the logits are fp32 products of the operands, each model's on its own device, the teacher's
    moved to the student's (the tile travels, never the weight). Each model's products take the path of
    :func:`half_products` (module docstring): from bf16 operands on CUDA without a copy of its weight, else
    from an fp32 copy of it held beside the tiles.
    """
    s, t = TileHead.of(student), TileHead.of(teacher)
    device = student.hidden.device
    m, (vocab_size, hidden_size) = student.rows.numel(), s.weight.shape
    divergence = torch.empty(m, dtype=torch.float32, device=device)
    entropy = torch.empty_like(divergence)
    grads = None
    if row_grads is not None and need.any:
        grads = HeadGrads(
            hidden=torch.zeros((m, hidden_size), dtype=torch.float32, device=device) if need.hidden else None,
            weight=torch.zeros((vocab_size, hidden_size), dtype=torch.float32, device=device) if need.weight else None,
            bias=torch.zeros(vocab_size, dtype=torch.float32, device=device) if need.bias else None,
        )
    per_row = isinstance(row_grads, torch.Tensor) and row_grads.dim() == 1
    step = distillation_rows_per_tile(vocab_size, student.tile_budget_bytes)
    for start in range(0, m, step):
        stop = min(start + step, m)
        h, zs, tanh = s.logits(start, stop)
        if grads is None:
            del tanh  # only the gradient needs it
            tanh = None
        with torch.no_grad():  # the teacher gets no gradient; only its logits' values travel
            _, zt, _ = t.logits(start, stop)
            zt = zt.to(device)
        tile = tile_divergence(zs, zt, beta, with_grad=grads is not None)
        del zs, zt
        divergence[start:stop] = tile.divergence
        entropy[start:stop] = tile.entropy
        if grads is not None:
            g = row_grads[start:stop].unsqueeze(1) if per_row else row_grads
            dz = s.head.transform.backward(tile.grad.mul_(g), tanh)  # × 1/T, × (1 − tanh²), × scale
            s.add_grads(grads, dz, h, start, stop)
            del dz
        del tile, tanh, h
    return DistillationPass(divergence, entropy, grads)


@dataclass(frozen=True, eq=False)
class _DistillationCall:
    """Everything :class:`LinearDistillationFunction` takes besides the student's differentiable hidden states,
    weight and bias (``student.head`` holds them as the op passes them; the Function rebuilds it from its
    arguments)."""

    student: PreparedHead
    teacher: HeadInputs  # detached: no gradient reaches it
    beta: float
    per_token: bool  # reduction="none"
    grad_scale: Union[float, torch.Tensor]  # 1 / the normalizer of "mean"/"sum"

    def run(self, student: HeadInputs, row_grads=None, need: NeededGrads = _NO_GRADS) -> DistillationPass:
        own = getattr(self.student.backend, "distillation_pass", None)
        done = own(student, self.teacher, self.beta, row_grads=row_grads, need=need) if own is not None else None
        return done if done is not None else distillation_pass(student, self.teacher, self.beta, row_grads=row_grads,
                                                                 need=need)


class LinearDistillationFunction(torch.autograd.Function):
    """``(loss, divergence [N], entropy [N])`` of :func:`linear_distillation_loss`; only ``loss`` is differentiable,
    with respect to the student's hidden states, weight and bias.

    ``"mean"``/``"sum"``: one pass; the forward computes the student's gradients of the loss in fp32 and backward
    multiplies them by the upstream gradient before their one rounding (gradient accumulation and loss scaling
    stay exact). ``"none"``: the forward computes the statistics; backward recomputes both models' tiles with each
    token's upstream gradient folded into its logits gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _DistillationCall):
        prepared = call.student
        given = prepared.given(hidden, weight, bias)  # the gradients go to the tensors as given
        need = NeededGrads.of(ctx, bias, prepared.grad_enabled)
        ctx.call, ctx.need, ctx.grads = call, need, None
        one_pass = need.any and not call.per_token
        with autocast_off(hidden.device.type):
            out = call.run(given, call.grad_scale, need) if one_pass else call.run(given)
        ctx.grads = out.grads
        if not (need.any and call.per_token):
            ctx.call = None  # the teacher is not needed in backward: release it
        ctx.save_for_backward(hidden, weight, bias, given.rows)
        divergence, entropy = prepared.scatter(out.divergence, hidden), prepared.scatter(out.entropy, hidden)
        loss = divergence.clone() if call.per_token else out.divergence.sum() * call.grad_scale
        ctx.mark_non_differentiable(divergence, entropy)
        return loss, divergence, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_divergence, _grad_entropy):
        refuse_double_backward("linear_distillation_loss")
        hidden, weight, bias, rows = ctx.saved_tensors
        need = ctx.need
        if grad_loss is None or not need.any:
            return None, None, None, None
        call = ctx.call
        if call is None:  # one pass: the gradients were computed in the forward
            grads = stored_grads(ctx, "linear_distillation_loss")
            # an fp32 tensor on the device: no host sync, and the factor is never rounded to bf16
            factor = grad_loss.detach().to(torch.float32)
        else:  # "none": each token's upstream gradient, folded into a recompute of the tiles
            with autocast_off(hidden.device.type):
                grads = call.run(call.student.given(hidden, weight, bias), upstream_rows(grad_loss, rows), need).grads
            factor = 1.0
        return grads.input_grads(hidden, weight, bias, rows, factor) + (None,)


# -- validation ----------------------------------------------------------------------------------------------------


def _prepare(model: str, *args, **kwargs) -> PreparedHead:
    """:func:`~hf_fused.ops.prepare.prepare` for one model, its errors prefixed with the model's name."""
    try:
        return prepare(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{model}: {error}") from error


def _token_labels(mask, labels, ignore_index: int, student_hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(labels, ignore_index)`` that keep the tokens :func:`linear_distillation_loss` counts, for
    :func:`~hf_fused.ops.prepare.prepare`: ``labels`` and ``ignore_index`` themselves; for a ``mask``, 0 where it is
    nonzero and -100 elsewhere; with neither, 0 everywhere (the divergence reads no label values).

    Raises:
        ValueError: both given; a mask not shaped like the hidden states' leading dims or on another device.
        TypeError: a mask that is not a tensor.
    """
    if mask is not None and labels is not None:
        raise ValueError("pass mask or labels (with ignore_index), not both")
    if labels is not None:
        return labels, ignore_index
    if not isinstance(student_hidden, torch.Tensor):  # prepare says so
        return torch.zeros((), dtype=torch.long), -100
    batch_shape, device = student_hidden.shape[:-1], student_hidden.device
    if mask is None:
        return torch.zeros(batch_shape, dtype=torch.long, device=device), -100
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor shaped like the hidden states' leading dims, got "
                        f"{type(mask).__name__}")
    if mask.shape != batch_shape or mask.device != device:
        raise ValueError(
            f"mask must have student_hidden's leading shape {tuple(batch_shape)} on its device {device}, got "
            f"{tuple(mask.shape)} on {mask.device}"
        )
    return torch.where(mask != 0, 0, -100), -100




# -- the op --------------------------------------------------------------------------------------------------------


def linear_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    beta: float = 1.0,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    student_softcap: Optional[float] = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: Optional[float] = None,
    reduction: str = "mean",
    num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> DistillationOutput:
    """Divergence between the student's and the teacher's next-token distributions, from each model's hidden states
    and lm_head, with TRL 1.16's conventions (``DistillationTrainer``'s ``_chunked_divergence_loss``), never
    materializing either model's ``[N, V]`` logits.

    Logits of each model (its own scale and soft-cap, then the shared temperature, :mod:`~hf_fused.ops.logit_transform`):
    ``z = softcap·tanh((h·Wᵀ + b)·logit_scale / softcap) / temperature``; ``p_s = softmax(z_s)``, ``p_t = softmax(z_t)``.
    Per token (:mod:`hf_fused.ops.distillation_math`, with the derivations of the student's gradients):

    - ``beta = 0``: forward KL(p_t ‖ p_s); ``beta = 1``: reverse KL(p_s ‖ p_t);
    - otherwise the generalized JSD ``β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)``, ``m = (1 − β)·p_s + β·p_t``.

    Reduction as TRL's: ``"mean"`` is ``Σ_kept D / max(#kept, 1)``, with ``num_items_in_batch`` it is
    ``Σ_kept D / num_items_in_batch`` (``"sum"`` likewise, else the plain sum); no ``T²`` factor.

    Args:
        student_hidden: ``[..., H_s]`` the student's final hidden states (fp32/bf16/fp16), aligned with the tokens
            whose next-token distributions are compared (no causal shift happens here).
        student_weight: ``[V, H_s]`` the student's lm_head weight, on ``student_hidden``'s device.
        teacher_hidden: ``[..., H_t]`` the teacher's, with the student's leading shape; any width ``H_t``.
        teacher_weight: ``[V, H_t]``, the same vocabulary ``V``; on ``teacher_hidden``'s device, which may differ from
            the student's (each tile's teacher logits are moved, never the weight) and in any floating dtype.
        student_bias, teacher_bias: optional ``[V]`` lm_head biases on their model's device.
        mask: optional ``[...]`` tensor shaped like the leading dims (TRL's ``completion_mask``): tokens where it is
            nonzero count; values are not weights.
        labels, ignore_index: instead of ``mask``: ``[...]`` token ids in ``[0, V)`` or ``ignore_index``, on the
            student's device; tokens labelled ``ignore_index`` are ignored (the ids themselves are not used). With
            neither, every token counts.
        beta: in ``[0, 1]``, above (TRL's ``DistillationConfig.beta``, default 1.0).
        temperature: ``> 0``, applied to both models after their scale and soft-cap.
        student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap: each model's logit transform
            (Cohere/Granite scale, Gemma ``final_logit_softcapping``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token divergences ``[...]``, 0 at ignored tokens).
        num_items_in_batch: with ``"mean"``/``"sum"``, divide the sum by it instead (one finite number > 0, a
            Python number or a one-element tensor: the kept-token count of the whole accumulated batch).
        tile_budget_bytes: bound on one tile's working set (the plain-PyTorch pass: ``DISTILLATION_TILE_BUFFERS`` fp32
            ``[rows, V]`` arrays, :func:`distillation_rows_per_tile`; the GPU backend's: 12 bytes per row and
            vocabulary column, under ``backend`` below); ``None``: ``DEFAULT_TILE_BUDGET_BYTES`` (the GPU backend's
            default rule: under ``backend``). Each pass also holds the student's gradient accumulators; the
            plain-PyTorch pass also
            holds the student's fp32 gradients and, for a model whose products are not computed from bf16 operands
            on CUDA (CPU, fp32 or fp16 operands), an fp32 copy of its weight.
        backend: as the other ops (:func:`~hf_fused.ops.backends.get_backend`): the GPU backend (``"triton"``, CUDA's
            default) runs its own ``distillation_pass`` (:class:`DistillationBackend`: Triton kernels for each tile's
            elementwise work; its tiles hold two fp32 logits rows per token and two tiles' bf16 logits gradients for
            the gradient matmuls, 12 bytes per row and vocabulary column against the plain pass's 24 (16 for fp32
            operands), ``DISTILLATION_TILE_ROWS`` rows under the default rule when they fit in a quarter of the
            free memory; fp16 operands take the plain pass); a backend without one (``"torch"``) runs the
            plain-PyTorch pass on the tensors' device.

    Returns:
        :class:`DistillationOutput` ``(loss, divergence, entropy)``: ``loss`` fp32 (scalar, or ``[...]`` for
        ``"none"``), the detached fp32 per-token divergence and student entropy shaped like the leading dims, 0 at
        ignored tokens. All tokens ignored: loss 0 and zero gradients.

    Gradients reach the student's hidden states, weight and bias only (the teacher's tensors are read detached,
    as TRL's kernel reads them). ``"mean"``/``"sum"``: computed in the forward's one pass in fp32 and multiplied in
    backward by the upstream gradient before their one rounding to the inputs' dtypes (exact under gradient
    accumulation and loss scaling); a second backward through the same call raises. ``"none"``: recomputed in
    backward with each token's upstream gradient. A student weight with ``requires_grad=False`` skips its matmul.

    Mixed precision: under ``torch.autocast`` each model's hidden, weight and bias are cast to the autocast dtype of
    its device exactly as its ``F.linear`` (lm_head call) would cast them, and forward and backward both compute
    from those operands with autocast off, accumulating in fp32; the logits stay fp32 (never rounded to bf16). On
    CUDA with bf16 operands the products run in bf16 with fp32 accumulation and output (no fp32 copy of either
    weight), and the student's logits gradient is rounded once to bf16 for the two gradient matmuls, as eager
    autograd and the fused peers round it; elsewhere (fp16 included) the products are fp32 products of the
    operands' fp32 copies.

    Each model's inputs go through :func:`~hf_fused.ops.prepare.prepare` (one host sync each).

    Raises:
        ValueError: different vocabularies, leading shapes (token counts) that differ between the models, ``beta``
            outside ``[0, 1]``, ``temperature`` not > 0, unknown ``reduction``, ``num_items_in_batch`` with
            ``"none"``, ``mask`` and ``labels`` both given, a mask not shaped like the leading dims on the student's
            device; and :func:`~hf_fused.ops.prepare.prepare`'s errors for either model, prefixed ``"student: "`` or
            ``"teacher: "`` (bad shapes, a model's tensors on several devices or on the meta device, labels out of
            range, invalid scale/soft-cap, a bad ``num_items_in_batch``, ``tile_budget_bytes`` or ``backend``).
        TypeError: non-tensor or non-floating inputs, non-integer labels (prefixed likewise).
        RuntimeError: in backward, for second-order gradients (``create_graph=True``), or a second backward of a
            ``"mean"``/``"sum"`` call.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if reduction == "none" and num_items_in_batch is not None:
        raise ValueError("num_items_in_batch applies to reduction='mean' or 'sum', not 'none'")
    beta, temperature = check_beta(beta), check_temperature(temperature)
    token_labels, ignore_index = _token_labels(mask, labels, ignore_index, student_hidden)
    student = _prepare("student", student_hidden, student_weight, token_labels, student_bias,
                       ignore_index=ignore_index, temperature=temperature, softcap=student_softcap,
                       logit_scale=student_logit_scale, tile_budget_bytes=tile_budget_bytes, backend=backend,
                       num_items_in_batch=num_items_in_batch)
    batch_shape = student.batch_shape
    if isinstance(teacher_hidden, torch.Tensor) and teacher_hidden.shape[:-1] != batch_shape:
        raise ValueError(
            f"teacher_hidden must have student_hidden's leading shape {tuple(batch_shape)} (one row per token of "
            f"both models), got {tuple(teacher_hidden.shape[:-1])}"
        )
    if isinstance(teacher_weight, torch.Tensor) and teacher_weight.dim() == 2:
        if teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(
                f"the student and the teacher must share one vocabulary: student_weight has "
                f"{student_weight.shape[0]} rows, teacher_weight {teacher_weight.shape[0]}; if the extra rows of the "
                "larger head are padding beyond the tokenizer's vocabulary, pass that head's first rows (weight[:V], "
                "bias[:V])"
            )
    detached = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    teacher_device = getattr(teacher_hidden, "device", None)
    # backend "torch": the teacher's head is only read here, whatever backend computes the student's
    teacher = _prepare("teacher", detached(teacher_hidden), detached(teacher_weight),
                       token_labels.to(teacher_device) if teacher_device is not None else token_labels,
                       detached(teacher_bias), ignore_index=ignore_index, temperature=temperature,
                       softcap=teacher_softcap, logit_scale=teacher_logit_scale,
                       tile_budget_bytes=tile_budget_bytes, backend="torch")
    n_valid = student.rows.numel()
    grad_scale: Union[float, torch.Tensor] = 1.0
    items = student.num_items_in_batch
    if items is not None:
        grad_scale = 1.0 / (items.to(student.head.hidden.device, torch.float32) if isinstance(items, torch.Tensor)
                            else items)
    elif reduction == "mean":
        grad_scale = 1.0 / max(n_valid, 1)
    call = _DistillationCall(student, teacher.head, beta, reduction == "none", grad_scale)
    loss, divergence, entropy = student.apply(LinearDistillationFunction, call)
    if reduction == "none":
        loss = student.shaped(loss)
    return DistillationOutput(loss, student.shaped(divergence), student.shaped(entropy))
