"""The head's inputs: validation and flattening shared by the public ops (``[..., H]`` hidden states and
``[...]`` labels become ``[N, H]`` and ``[N]``, with errors that say what was wrong), and :class:`HeadInputs`,
the operands every backend method takes (:mod:`hf_fused.ops.backends.protocol`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from .logit_transform import LogitTransform


@dataclass(frozen=True, eq=False)
class HeadInputs:
    """The operands a backend computes from: one flattened head and how to tile it.

    hidden: ``[N, H]``.  weight: ``[V, H]``.  bias: ``[V]`` or ``None``.  labels: ``[N]`` int64.
    rows: ``[M]`` int64, the rows to compute, ascending; every per-row tensor of the contract is ``[M]`` in
        this order.
    transform: the logit transform.  tile_budget_bytes: the working-set bound the planner
        (:mod:`hf_fused.ops.tiling`) tiles within; ``None``: its default rule.
    compute_dtype: the dtype ``F.linear`` would compute in under autocast (``None`` outside it). Backends take
        the head as the op was given it and compute from operands in :attr:`operand_dtype`: the one passes from
        a :meth:`computed` head (hidden, weight and bias cast whole), the GPU two passes casting one vocabulary
        chunk of the weight at a time (:meth:`weight_rows`), so that an fp32 weight (fp32 master weights under
        ``Trainer(bf16=True)``, TRL's GRPOTrainer default) costs no whole half-precision copy there. The ops'
        autograd Functions keep the tensors as given, so that an fp32 parameter's gradient comes back in fp32
        straight from the fp32 accumulators (never rounded to bf16 on the way, as eager autocast's is) and no
        half-precision copy of the weight is held from forward to backward.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    labels: torch.Tensor
    rows: torch.Tensor
    transform: LogitTransform
    tile_budget_bytes: Optional[int]
    compute_dtype: Optional[torch.dtype] = None
    #: In a :meth:`computed` head: the given weight's dtype, which its gradient comes back in (an fp32 weight under
    #: autocast gets an fp32 gradient: backends write it in fp32 instead of the compute dtype).
    weight_grad_dtype: Optional[torch.dtype] = None

    @property
    def operand_dtype(self) -> torch.dtype:
        """The dtype the matmuls' operands are in: :attr:`compute_dtype` under autocast, else the weight's."""
        return self.compute_dtype or self.weight.dtype

    def casts_weight(self) -> bool:
        """Whether the weight is not in :attr:`operand_dtype` (an fp32 weight under bf16 autocast)."""
        return self.weight.dtype != self.operand_dtype

    def weight_rows(self, v0: int, v1: int, buf: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight[v0:v1]`` in :attr:`operand_dtype`: the slice itself when no cast is needed, else cast into the
        first ``v1 − v0`` rows of ``buf`` (``[≥ v1 − v0, H]``, contiguous) and that view returned."""
        rows = self.weight[v0:v1]
        if not self.casts_weight():
            return rows
        return buf[: v1 - v0].copy_(rows)

    def computed(self, *, meta: bool = False) -> "HeadInputs":
        """This head with hidden, weight and bias cast to :attr:`compute_dtype` as autocast casts ``F.linear``'s
        operands (itself when there is none). ``meta``: tensors of those shapes and dtypes on the meta device
        instead, no copy made (what a planner reads before deciding to make them; :meth:`cast_bytes` is their
        size)."""
        dtype = self.compute_dtype
        if dtype is None:
            return self
        cast = (lambda t: torch.empty(t.shape, dtype=dtype, device="meta")) if meta else (lambda t: t.to(dtype))
        bias = None if self.bias is None else cast(self.bias)
        return replace(self, hidden=cast(self.hidden), weight=cast(self.weight), bias=bias,
                       compute_dtype=None, weight_grad_dtype=self.weight.dtype)

    def cast_bytes(self) -> int:
        """Bytes the copies :meth:`computed` makes hold: hidden, weight and bias where not already in
        :attr:`compute_dtype` (0 outside autocast)."""
        dtype = self.compute_dtype
        if dtype is None:
            return 0
        return sum(t.numel() * dtype.itemsize for t in (self.hidden, self.weight, self.bias)
                   if t is not None and t.dtype != dtype)

    def with_rows(self, rows: torch.Tensor) -> "HeadInputs":
        """The same head restricted to ``rows`` (a subset of :attr:`rows`, ascending)."""
        return replace(self, rows=rows)

    def save_for_backward(self, ctx, *tensors: Optional[torch.Tensor]) -> None:
        """Save this head (its tensors through ``ctx.save_for_backward``, so that they are freed after backward
        and checked for in-place changes) and ``tensors`` after them, for :meth:`saved`."""
        ctx.save_for_backward(self.hidden, self.weight, self.bias, self.labels, self.rows, *tensors)
        ctx.head_settings = (self.transform, self.tile_budget_bytes, self.compute_dtype)

    @staticmethod
    def saved(ctx) -> tuple["HeadInputs", list]:
        """``(head, [tensors])`` as :meth:`save_for_backward` saved them."""
        hidden, weight, bias, labels, rows, *tensors = ctx.saved_tensors
        return HeadInputs(hidden, weight, bias, labels, rows, *ctx.head_settings), tensors


class NeededGrads(NamedTuple):
    """Which of the head's inputs a gradient is requested for."""

    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, ctx, bias: Optional[torch.Tensor], enabled: bool = True) -> "NeededGrads":
        """What an autograd Function taking ``(hidden, weight, bias, ...)`` must compute: its
        ``ctx.needs_input_grad`` for the three, none when ``enabled`` is False (the op was called with grad mode
        off) and none for an absent bias."""
        need = ctx.needs_input_grad
        return cls(enabled and need[0], enabled and need[1], enabled and bias is not None and need[2])

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


@dataclass
class FlatHeadInputs:
    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    bias: Optional[torch.Tensor]  # [V]
    labels: torch.Tensor  # [N] int64
    batch_shape: torch.Size  # the leading ``...`` of hidden, to restore per-token outputs
    rows: torch.Tensor  # [M] int64: the non-ignored rows, ascending (ignored rows are compacted out before any matmul)
    num_items_in_batch: object = None  # as given, after :func:`check_num_items`


def flatten_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    num_items_in_batch=None,
) -> FlatHeadInputs:
    """Check shapes, dtypes, devices, label range and ``num_items_in_batch`` (:func:`check_num_items`); flatten;
    find the non-ignored rows.

    One host sync in all (the label checks, the count of kept rows and a tensor ``num_items_in_batch`` are read
    together; the rows then come from ``nonzero_static`` with that count): every sync drains the GPU queue, and
    a training step of a patched model should cost no more of them than the unpatched model's.

    Raises:
        TypeError: non-tensor inputs, non-floating hidden/weight, non-integer labels.
        ValueError: shape mismatches or labels outside ``[0, V)`` other than ``ignore_index``.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (lm_head.weight), got shape {tuple(weight.shape)}")
    vocab_size, hidden_size = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden must be [..., H] with H = weight.shape[1] = {hidden_size}, got shape {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}; "
            "labels are aligned with hidden (already shifted for causal LM)"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias must be None or a floating-point tensor, got {type(bias).__name__}")
        if bias.shape != (vocab_size,):
            raise ValueError(f"bias must be a [V] = [{vocab_size}] tensor, got shape {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias must be on weight's device {weight.device}, got {bias.device}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    flat_labels = labels.reshape(-1).long()
    kept = flat_labels != ignore_index
    bad = kept & ((flat_labels < 0) | (flat_labels >= vocab_size))
    counts = [kept.sum(), bad.sum()]
    items_tensor = isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1
    if items_tensor:  # whether it is one finite number > 0, as an int64 flag (float64 is not on every device)
        items = num_items_in_batch.detach().reshape(())
        counts.append((torch.isfinite(items) & (items > 0)).to(device=kept.device, dtype=torch.int64))
    host = torch.stack(counts).tolist()  # the one host sync
    if host[1]:
        first = flat_labels[bad][0].item()
        raise ValueError(
            f"labels contain {first}, outside [0, {vocab_size}) and not ignore_index={ignore_index}; "
            "mask padding with ignore_index or check the tokenizer/vocabulary size"
        )
    if items_tensor and host[2]:
        num_items_in_batch = num_items_in_batch.reshape(())  # valid: stays on its device
    elif num_items_in_batch is not None:
        num_items_in_batch = check_num_items(num_items_in_batch)  # a number, or raises naming the bad value
    return FlatHeadInputs(
        hidden=hidden.reshape(-1, hidden_size),
        weight=weight,
        bias=bias,
        labels=flat_labels,
        batch_shape=hidden.shape[:-1],
        rows=torch.nonzero_static(kept, size=int(host[0])).squeeze(1),
        num_items_in_batch=num_items_in_batch,
    )


def check_per_token(values, labels: torch.Tensor, name: str) -> torch.Tensor:
    """A per-token tensor such as ``token_weights`` or ``grad_hint``, named ``name`` in errors, as fp32 and
    detached, after checking it against ``labels``.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: not shaped like ``labels`` or on another device.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor shaped like labels, got {values!r}")
    if values.shape != labels.shape or values.device != labels.device:
        raise ValueError(
            f"{name} must have labels' shape {tuple(labels.shape)} on {labels.device}, "
            f"got {tuple(values.shape)} on {values.device}"
        )
    return values.detach().float()


def check_num_items(num_items_in_batch):
    """``num_items_in_batch`` (transformers' gradient-accumulation normalizer) as given, after checking that
    it is one finite number > 0: a Python number or a one-element tensor (a 0-d tensor on the model's
    device is what ``Trainer`` passes).

    Raises:
        ValueError: several elements, NaN, inf, or not > 0.
        TypeError: neither a real number nor a tensor.
    """
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                f"num_items_in_batch must be one number (the token count of the whole accumulated batch), got a "
                f"tensor of shape {tuple(num_items_in_batch.shape)}"
            )
        value = num_items_in_batch.item()
    elif isinstance(num_items_in_batch, (int, float)) and not isinstance(num_items_in_batch, bool):
        value = num_items_in_batch
    else:
        raise TypeError(f"num_items_in_batch must be a number or a one-element tensor, got {num_items_in_batch!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"num_items_in_batch must be a finite number > 0, got {value!r}")
    return num_items_in_batch.reshape(()) if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch


def per_token_outputs(hidden: torch.Tensor, rows: torch.Tensor, n: int, logp_rows: torch.Tensor,
                      ent_rows: Optional[torch.Tensor], return_entropy: bool):
    """``(logprobs [N], entropy [N] or None)`` fp32 from the kept rows' values (0 at ignored rows)."""
    logprobs = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, logp_rows)
    entropy = None
    if return_entropy:
        entropy = hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, ent_rows)
    return logprobs, entropy
