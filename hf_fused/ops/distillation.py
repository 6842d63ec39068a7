"""Fused dense distillation: the divergence between a student's and a teacher's next-token distributions from both
models' hidden states and lm_heads, with the student's gradients computed in the same pass, never materializing
either model's ``[N, V]`` logits.

One pass over token tiles: each tile computes both models' full-vocabulary logits rows (the teacher's under
``no_grad``, on its own device, then moved: the tile's result travels, never the weight), the per-token divergence,
the student's entropy and the student's logits gradient (:mod:`hf_fused.ops.distillation_math`), then
``dh = dz·W_s``, ``dW_s += dzᵀ·h``, ``db_s += Σ dz``, all in fp32. That is 6·N·H_s·V + 2·N·H_t·V FLOPs; TRL 1.16's
``ChunkedDivergenceFunction`` recomputes both models' logits in backward (8·N·H_s·V + 4·N·H_t·V for a KL,
10·N·H_s·V + 6·N·H_t·V for the JSD). Backward only multiplies the stored fp32 gradients by the upstream
gradient before rounding them once. ``reduction="none"`` cannot know each token's upstream weight in the forward,
so it computes statistics there and recomputes both models' tiles in backward with the weights folded in.

This is the plain-PyTorch pass (CPU, and CUDA through cuBLAS); a backend may provide a faster one
(``distillation_pass``, :class:`DistillationBackend`); none does yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Union, runtime_checkable

import torch

from .backends import get_backend
from .distillation_math import DISTILLATION_TILE_BUFFERS, tile_divergence
from .grads import HeadGrads
from .head_inputs import NeededGrads
from .logit_transform import LogitTransform
from .precision import autocast_dtype, autocast_off, refuse_double_backward
from .prepare import check_num_items
from .tiling import check_tile_budget, validate_tile_budget

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


@dataclass(frozen=True, eq=False)
class DistillationHead:
    """One model's flattened head: ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or ``None`` (all on
    one device), its logit ``transform``, and ``compute_dtype``: the dtype autocast would run this model's
    ``F.linear`` in on its device at the call (``None`` outside autocast)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    transform: LogitTransform
    compute_dtype: Optional[torch.dtype] = None

    def computed(self) -> "DistillationHead":
        """This head with hidden, weight and bias cast to :attr:`compute_dtype` as autocast casts ``F.linear``'s
        operands (itself outside autocast): forward and backward compute the logits from the same operands."""
        dtype = self.compute_dtype
        if dtype is None:
            return self
        bias = None if self.bias is None else self.bias.to(dtype)
        return DistillationHead(self.hidden.to(dtype), self.weight.to(dtype), bias, self.transform)


class DistillationPass(NamedTuple):
    """Per kept row (fp32 ``[M]``, in the order of ``rows``): ``divergence`` and student ``entropy``; ``grads``: the
    student's fp32 :class:`~hf_fused.ops.grads.HeadGrads` (hidden ``[M, H_s]``), or ``None`` when none was asked."""

    divergence: torch.Tensor
    entropy: torch.Tensor
    grads: Optional[HeadGrads]


@runtime_checkable
class DistillationBackend(Protocol):
    """A backend with its own distillation pass, with the signature and contract of :func:`distillation_pass`
    (the op runs the plain-PyTorch one for backends without it)."""

    def distillation_pass(self, student: DistillationHead, teacher: DistillationHead, rows: torch.Tensor,
                          beta: float, tile_budget_bytes: Optional[int], *,
                          row_grads: Union[None, float, torch.Tensor] = None,
                          need: NeededGrads = _NO_GRADS) -> DistillationPass: ...


def distillation_rows_per_tile(vocab_size: int, tile_budget_bytes: Optional[int]) -> int:
    """Token rows per tile so that ``DISTILLATION_TILE_BUFFERS`` fp32 ``[rows, vocab_size]`` arrays fit the budget
    (``DEFAULT_TILE_BUDGET_BYTES`` for ``None``).

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    return max(1, check_tile_budget(tile_budget_bytes) // (DISTILLATION_TILE_BUFFERS * 4 * max(1, vocab_size)))


def _fp32_logits(hidden: torch.Tensor, weight32: torch.Tensor, bias32: Optional[torch.Tensor],
                 idx: torch.Tensor, transform: LogitTransform):
    """``(h32, z, tanh)`` for the rows ``idx``: fp32 rows, tempered fp32 logits, the soft-cap's tanh or ``None``."""
    h32 = hidden.index_select(0, idx).float()
    raw = h32 @ weight32.t()
    if bias32 is not None:
        raw += bias32
    z, tanh = transform.forward(raw)
    return h32, z, tanh


def distillation_pass(
    student: DistillationHead,
    teacher: DistillationHead,
    rows: torch.Tensor,
    beta: float,
    tile_budget_bytes: Optional[int],
    *,
    row_grads: Union[None, float, torch.Tensor] = None,
    need: NeededGrads = _NO_GRADS,
) -> DistillationPass:
    """The plain-PyTorch pass over the kept token ``rows`` (int64 ``[M]`` on the student's device, ascending),
    ``distillation_rows_per_tile`` rows per tile: per row the divergence and student entropy, and, when ``need``
    asks for any and ``row_grads`` is given, the student's gradients of ``Σ_rows row_grads·divergence``
    (``row_grads``: a Python float or 0-d fp32 tensor for every row, or fp32 ``[M]``) from the same tiles.

    Both heads are taken as given (:meth:`DistillationHead.computed` casts them here); the logits are fp32 products
    of the operands (upcast, accumulated in fp32), each model's on its own device, the teacher's moved to the
    student's. Holds fp32 copies of both weights beside the tiles (a GPU backend's pass would not).
    """
    s, t = student.computed(), teacher.computed()
    device = s.hidden.device
    w_s32 = s.weight.float()
    b_s32 = None if s.bias is None else s.bias.float()
    w_t32 = t.weight.float()
    b_t32 = None if t.bias is None else t.bias.float()
    rows_t = rows.to(t.hidden.device)
    m = rows.numel()
    divergence = torch.empty(m, dtype=torch.float32, device=device)
    entropy = torch.empty_like(divergence)
    grads = None
    if row_grads is not None and need.any:
        grads = HeadGrads(
            hidden=torch.zeros((m, w_s32.shape[1]), dtype=torch.float32, device=device) if need.hidden else None,
            weight=torch.zeros(w_s32.shape, dtype=torch.float32, device=device) if need.weight else None,
            bias=torch.zeros(w_s32.shape[0], dtype=torch.float32, device=device) if need.bias else None,
        )
    per_row = isinstance(row_grads, torch.Tensor) and row_grads.dim() == 1
    step = distillation_rows_per_tile(w_s32.shape[0], tile_budget_bytes)
    for start in range(0, m, step):
        stop = min(start + step, m)
        h32, zs, tanh = _fp32_logits(s.hidden, w_s32, b_s32, rows[start:stop], s.transform)
        if grads is None:
            del tanh  # only the gradient needs it
            tanh = None
        with torch.no_grad():  # the teacher gets no gradient; only its logits' values travel
            _, zt, _ = _fp32_logits(t.hidden, w_t32, b_t32, rows_t[start:stop], t.transform)
            zt = zt.to(device)
        tile = tile_divergence(zs, zt, beta, with_grad=grads is not None)
        del zs, zt
        divergence[start:stop] = tile.divergence
        entropy[start:stop] = tile.entropy
        if grads is not None:
            g = row_grads[start:stop].unsqueeze(1) if per_row else row_grads
            dz = s.transform.backward(tile.grad.mul_(g), tanh)  # × 1/T, × (1 − tanh²), × scale
            if grads.hidden is not None:
                torch.mm(dz, w_s32, out=grads.hidden[start:stop])
            if grads.weight is not None:
                grads.weight.addmm_(dz.t(), h32)
            if grads.bias is not None:
                grads.bias += dz.sum(0)
            del dz
        del tile, tanh, h32
    return DistillationPass(divergence, entropy, grads)


@dataclass(frozen=True, eq=False)
class _DistillationCall:
    """Everything :class:`LinearDistillationFunction` takes besides the student's differentiable hidden states,
    weight and bias (``student`` holds them as the op passes them; the Function rebuilds it from its arguments)."""

    student: DistillationHead
    teacher: DistillationHead  # detached: no gradient reaches it
    rows: torch.Tensor  # [M] int64, the kept rows, ascending, on the student's device
    beta: float
    tile_budget_bytes: Optional[int]
    backend: object
    per_token: bool  # reduction="none"
    grad_scale: Union[float, torch.Tensor]  # 1 / the normalizer of "mean"/"sum"
    grad_enabled: bool

    def run(self, student: DistillationHead, row_grads=None, need: NeededGrads = _NO_GRADS) -> DistillationPass:
        pass_ = getattr(self.backend, "distillation_pass", None) or distillation_pass
        return pass_(student, self.teacher, self.rows, self.beta, self.tile_budget_bytes, row_grads=row_grads,
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
        given = DistillationHead(hidden, weight, bias, call.student.transform, call.student.compute_dtype)
        rows, n = call.rows, hidden.shape[0]
        need = NeededGrads.of(ctx, bias, call.grad_enabled)
        ctx.call, ctx.need, ctx.grads = call, need, None
        one_pass = need.any and not call.per_token
        with autocast_off(hidden.device.type):
            out = call.run(given, call.grad_scale, need) if one_pass else call.run(given)
        ctx.grads = out.grads
        if not (need.any and call.per_token):
            ctx.call = None  # the teacher is not needed in backward: release it
        ctx.save_for_backward(hidden, weight, bias, rows)
        divergence = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, out.divergence)
        entropy = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, out.entropy)
        if call.per_token:
            loss = divergence.clone()
        else:
            loss = out.divergence.sum() * call.grad_scale
        ctx.mark_non_differentiable(divergence, entropy)
        return loss, divergence, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_divergence, _grad_entropy):
        refuse_double_backward("linear_distillation_loss")
        hidden, weight, bias, rows = ctx.saved_tensors
        need = ctx.need
        if grad_loss is None or not need.any:
            return None, None, None, None
        # The upstream factor stays an fp32 tensor on the device: no host sync, and it is never rounded to bf16.
        factor = grad_loss.detach().to(torch.float32)
        call = ctx.call
        if call is None:  # one pass: the gradients were computed in the forward
            if ctx.grads is None:
                raise RuntimeError(
                    "linear_distillation_loss computed its gradients in the forward and handed them to backward "
                    "once; to backpropagate twice, call linear_distillation_loss again (or use reduction='none', "
                    "which recomputes)."
                )
            grads, ctx.grads = ctx.grads, None  # freed as soon as they are handed over
        else:  # "none": each token's upstream gradient, folded into a recompute of the tiles
            given = DistillationHead(hidden, weight, bias, call.student.transform, call.student.compute_dtype)
            with autocast_off(hidden.device.type):
                grads = call.run(given, factor.reshape(-1).index_select(0, rows), need).grads
            factor = 1.0
        return grads.input_grads(hidden, weight, bias, rows, factor) + (None,)


# -- validation ----------------------------------------------------------------------------------------------------


def _check_head(name: str, hidden, weight, bias) -> None:
    """Types, shapes and devices of one model's ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]``.

    Raises:
        TypeError: a non-tensor, or a non-floating tensor.
        ValueError: shapes that do not fit or tensors on different devices.
    """
    for part, tensor in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if tensor is None and part == "bias":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}_{part} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name}_{part} must be floating point, got {tensor.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}_weight must be [V, H] (the {name}'s lm_head.weight), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}_hidden must be [..., H] with H = {name}_weight.shape[1] = {weight.shape[1]}, got shape "
            f"{tuple(hidden.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{name}_bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    devices = {t.device for t in (hidden, weight, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"{name}_hidden, {name}_weight and {name}_bias must be on one device, got "
            f"{hidden.device}, {weight.device}{'' if bias is None else ', ' + str(bias.device)}; the student and the "
            "teacher may each sit on their own device"
        )


def _kept_rows(mask, labels, ignore_index: int, batch_shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The flat indices of the kept tokens, int64 ascending on ``device``: ``mask != 0``, else
    ``labels != ignore_index``, else every token.

    Raises:
        ValueError: both given, a shape other than ``batch_shape``, or another device.
        TypeError: a non-tensor, or labels that are not integers.
    """
    if mask is not None and labels is not None:
        raise ValueError("pass mask or labels (with ignore_index), not both")
    given = mask if mask is not None else labels
    if given is None:
        return torch.arange(math.prod(batch_shape), device=device)
    name = "mask" if mask is not None else "labels"
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor shaped like the hidden states' leading dims, got "
                        f"{type(given).__name__}")
    if labels is not None and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        raise TypeError(f"labels must be an integer tensor (ignore_index marks ignored tokens), got {labels.dtype}")
    if given.shape != batch_shape or given.device != device:
        raise ValueError(
            f"{name} must have the hidden states' leading shape {tuple(batch_shape)} on the student's device "
            f"{device}, got {tuple(given.shape)} on {given.device}"
        )
    kept = given.reshape(-1) != 0 if mask is not None else given.reshape(-1) != ignore_index
    return kept.nonzero().squeeze(1)


def _check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 <= beta <= 1.0):
        raise ValueError(
            f"beta must be a number in [0, 1] (0: forward KL(teacher ‖ student), 1: reverse KL(student ‖ teacher), "
            f"between: the generalized JSD), got {beta!r}"
        )
    return float(beta)


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


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
        labels, ignore_index: instead of ``mask``: tokens whose label is ``ignore_index`` are ignored (the label
            values themselves are not used). With neither, every token counts.
        beta: in ``[0, 1]``, above (TRL's ``DistillationConfig.beta``, default 1.0).
        temperature: ``> 0``, applied to both models after their scale and soft-cap.
        student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap: each model's logit transform
            (Cohere/Granite scale, Gemma ``final_logit_softcapping``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token divergences ``[...]``, 0 at ignored tokens).
        num_items_in_batch: with ``"mean"``/``"sum"``, divide the sum by it instead (one finite number > 0, a
            Python number or a one-element tensor: the kept-token count of the whole accumulated batch).
        tile_budget_bytes: bound on one tile's working set (``DISTILLATION_TILE_BUFFERS`` fp32 ``[rows, V]`` arrays,
            :func:`distillation_rows_per_tile`); ``None``: ``DEFAULT_TILE_BUDGET_BYTES``. The plain-PyTorch pass also
            holds fp32 copies of both weights and the student's fp32 gradients.
        backend: as the other ops (:func:`~hf_fused.ops.backends.get_backend`); a backend without its own
            ``distillation_pass`` (:class:`DistillationBackend`; all of them today) runs the plain-PyTorch pass on the
            tensors' device.

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
    from those operands with autocast off, accumulating in fp32; the logits stay fp32 (never rounded to bf16).

    Raises:
        ValueError: different vocabularies, leading shapes (token counts) that differ between the models, ``beta``
            outside ``[0, 1]``, ``temperature`` not > 0, invalid scale/soft-cap, unknown ``reduction``,
            ``num_items_in_batch`` with ``"none"`` or not one finite number > 0, ``mask`` and ``labels`` both given
            or not shaped like the leading dims on the student's device, bad shapes, a model's tensors on several
            devices, a bad ``tile_budget_bytes`` or ``backend``.
        TypeError: non-tensor or non-floating inputs, non-integer labels.
        RuntimeError: in backward, for second-order gradients (``create_graph=True``), or a second backward of a
            ``"mean"``/``"sum"`` call.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if reduction == "none" and num_items_in_batch is not None:
        raise ValueError("num_items_in_batch applies to reduction='mean' or 'sum', not 'none'")
    beta, temperature = _check_beta(beta), _check_temperature(temperature)
    _check_head("student", student_hidden, student_weight, student_bias)
    _check_head("teacher", teacher_hidden, teacher_weight, teacher_bias)
    vocab_size = student_weight.shape[0]
    if teacher_weight.shape[0] != vocab_size:
        raise ValueError(
            f"the student and the teacher must share one vocabulary: student_weight has {vocab_size} rows, "
            f"teacher_weight {teacher_weight.shape[0]}; if the extra rows of the larger head are padding beyond the "
            "tokenizer's vocabulary, pass that head's first rows (weight[:V], bias[:V])"
        )
    batch_shape = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != batch_shape:
        raise ValueError(
            f"teacher_hidden must have student_hidden's leading shape {tuple(batch_shape)} (one row per token of "
            f"both models), got {tuple(teacher_hidden.shape[:-1])}"
        )
    student_transform = LogitTransform(student_logit_scale, student_softcap, temperature)
    teacher_transform = LogitTransform(teacher_logit_scale, teacher_softcap, temperature)
    tile_budget_bytes = validate_tile_budget(tile_budget_bytes)
    device = student_hidden.device
    chosen = get_backend(device, backend)
    rows = _kept_rows(mask, labels, ignore_index, batch_shape, device)
    n_valid = rows.numel()
    grad_scale: Union[float, torch.Tensor] = 1.0
    if num_items_in_batch is not None:
        items = check_num_items(num_items_in_batch)
        if isinstance(items, torch.Tensor):
            grad_scale = 1.0 / items.to(device=device, dtype=torch.float32)
        else:
            grad_scale = 1.0 / items
    elif reduction == "mean":
        grad_scale = 1.0 / max(n_valid, 1)
    student = DistillationHead(student_hidden.reshape(-1, student_hidden.shape[-1]), student_weight, student_bias,
                               student_transform, autocast_dtype(device.type))
    teacher = DistillationHead(teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]), teacher_weight.detach(),
                               None if teacher_bias is None else teacher_bias.detach(), teacher_transform,
                               autocast_dtype(teacher_hidden.device.type))
    call = _DistillationCall(student, teacher, rows, beta, tile_budget_bytes, chosen, reduction == "none", grad_scale,
                             torch.is_grad_enabled())
    loss, divergence, entropy = LinearDistillationFunction.apply(student.hidden, student_weight, student_bias, call)
    if reduction == "none":
        loss = loss.view(batch_shape)
    return DistillationOutput(loss, divergence.view(batch_shape), entropy.view(batch_shape))
