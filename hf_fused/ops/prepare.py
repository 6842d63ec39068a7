"""The prologue every public op runs: check and flatten the head's inputs, settle the logit transform, the tile
budget, the autocast dtype and the backend, all in :func:`prepare`; and the causal shift of labels
(:func:`causal_shift`)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from .backends import Backend, get_backend
from .backends.vocab_parallel import vocab_parallel_backend
from .head_inputs import HeadInputs
from .kept_rows import KeptRows
from .logit_transform import LogitTransform
from .devices import kernel_device
from .precision import autocast_dtype
from .tiling import validate_tile_budget
from .vocab_parallel import VocabParallel, as_vocab_shard, resolve_vocab_shard, sum_gradient_over


#: Device types on which ``prepare(..., defer_count=True)`` reads the count of kept rows at its first use rather than
#: at once (a read on them waits for the device's queue, :mod:`hf_fused.ops.kept_rows`).
DEFERRED_COUNT_DEVICES = frozenset({"cuda"})


def causal_shift(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels`` ``[..., T]`` aligned with the positions that predict them (transformers' ``ForCausalLMLoss``):
    position ``t`` scores ``labels[..., t + 1]``, the last position scores nothing (``ignore_index``). The ops take
    aligned labels; a caller holding a model's ``labels`` passes ``causal_shift(labels)``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def logit_transform(transform: Optional[LogitTransform] = None, *, temperature=1.0, softcap=None,
                    logit_scale=1.0) -> LogitTransform:
    """The ops' logit transform: ``transform`` whole, or one built from the three keywords.

    Raises:
        TypeError: ``transform`` not a :class:`LogitTransform`.
        ValueError: ``transform`` together with a keyword other than its default (which one wins would be a
            guess); the keywords' own errors (:class:`LogitTransform`).
    """
    if transform is None:
        return LogitTransform(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    if not isinstance(transform, LogitTransform):
        raise TypeError(f"transform must be a LogitTransform, got {type(transform).__name__}")
    given = {k: v for k, v in (("temperature", temperature), ("softcap", softcap), ("logit_scale", logit_scale))
             if not _is_default(v, getattr(LogitTransform, k))}
    if given:
        raise ValueError(
            f"pass the logit transform either whole (transform=) or as temperature/softcap/logit_scale, not both "
            f"(got transform={transform} and {given}); use dataclasses.replace(transform, ...) to change one field"
        )
    return transform


def _is_default(value, default) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value is default or (number and default is not None and value == default)


@dataclass(frozen=True, eq=False)
class PreparedHead:
    """One op call's inputs after :func:`prepare`: what its autograd Function computes from.

    head: the flattened head (:class:`~hf_fused.ops.head_inputs.HeadInputs`: ``[N, H]`` hidden, ``[V, H]`` weight,
        ``[V]`` bias or ``None``, ``[N]`` int64 labels, the kept rows ``[M]``, transform, tile budget, autocast
        dtype).  backend: the backend chosen for the call.
    labels: the labels as the caller gave them (per-token inputs are checked against them).
    batch_shape: their shape, the leading ``...`` of hidden: per-token outputs go back to it (:meth:`shaped`).
    num_items_in_batch: as given, checked (a 0-d tensor stays on its device).
    grad_enabled: whether grad mode was on at the call (the Function runs its forward with it off).
    """

    head: HeadInputs
    backend: Backend
    labels: torch.Tensor
    batch_shape: torch.Size
    num_items_in_batch: object
    grad_enabled: bool

    @property
    def rows(self) -> torch.Tensor:
        """The kept rows, ``[M]`` int64 ascending (the first use reads their count: :mod:`hf_fused.ops.kept_rows`)."""
        return self.head.rows

    def with_rows(self, rows: torch.Tensor) -> "PreparedHead":
        """The same call restricted to ``rows`` (a subset of :attr:`rows`, ascending)."""
        return replace(self, head=self.head.with_rows(rows))

    def given(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> HeadInputs:
        """:attr:`head` holding the tensors an autograd Function received: its gradients go to them. The
        backends cast them to the operands ``F.linear`` would compute from (``HeadInputs.compute_dtype``)."""
        return replace(self.head, hidden=hidden, weight=weight, bias=bias)

    def apply(self, function: type[torch.autograd.Function], *args):
        """``function.apply(hidden [N, H], weight, bias, *args)``: the Function differentiates the head's tensors.
        It runs with the head's GPU as the current device: Triton launches its kernels on the current device, and
        lm_head may sit on another one (a model dispatched over several GPUs: the inputs' GPU is current there).
        Autograd runs the backward on the gradients' device itself."""
        hidden = self.head.hidden
        with kernel_device(hidden):
            out = function.apply(hidden, self.head.weight, self.head.bias, *args)
        self.head.rows  # the count and the input checks read at the latest here, whatever the Function used
        return out

    def per_token_rows(self, values, name: str, *, differentiable: bool = False) -> torch.Tensor:
        """A per-token tensor shaped like the labels (``token_weights``), named ``name`` in errors, as fp32 ``[M]`` at
        the kept rows (their count read, on a GPU a host sync); detached unless ``differentiable``.

        Raises:
            TypeError: not a floating-point tensor.
            ValueError: not shaped like the labels or on another device.
        """
        values = check_per_token(values, self.labels, name, detach=not differentiable)
        return values.reshape(-1).index_select(0, self.rows)

    def per_token_constants(self, per_token: Optional[Mapping[str, torch.Tensor]], *,
                            terms: bool = False) -> dict[str, torch.Tensor]:
        """Named per-token constants passed to a per-token function by keyword (``linear_token_loss``'s
        ``per_token``), each flattened to ``[N]`` (dtype kept); with ``terms`` (a ``TokenLossHint``'s), shaped like
        the labels plus one trailing dimension of terms, each flattened to ``[N, K]``.

        Raises:
            TypeError: not a mapping of names to tensors.
            ValueError: a value not shaped like the labels (with ``terms``: the labels plus a trailing dimension), on
                another device or requiring grad; a key named ``logprobs`` or ``entropy`` (the function's own
                arguments).
        """
        if per_token is None:
            return {}
        if not isinstance(per_token, Mapping):
            raise TypeError(f"per_token must be a dict of tensors shaped like labels, got {type(per_token).__name__}")
        labels, flat = self.labels, {}
        for name, values in per_token.items():
            if name in ("logprobs", "entropy"):
                raise ValueError(f"per_token key {name!r} clashes with token_loss's own argument; rename it")
            if not isinstance(values, torch.Tensor):
                raise TypeError(
                    f"per_token[{name!r}] must be a tensor shaped like labels, got {type(values).__name__}; "
                    "close over scalars in token_loss (e.g. functools.partial) instead"
                )
            token_shape = values.shape[:-1] if terms else values.shape
            if token_shape != labels.shape or values.device != labels.device:
                shape = f"labels' shape {tuple(labels.shape)}" + (" plus a trailing dimension of terms" if terms else "")
                raise ValueError(f"per_token[{name!r}] must have {shape} on {labels.device}, got "
                                 f"{tuple(values.shape)} on {values.device}")
            if values.requires_grad:
                raise ValueError(
                    f"per_token[{name!r}] requires grad, but per-token inputs are constants the op does not "
                    "differentiate; pass values.detach() (or compute them under torch.no_grad())"
                )
            flat[name] = values.reshape(labels.numel(), -1) if terms else values.reshape(-1)
        return flat

    def scatter(self, row_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[N]`` from the kept rows' ``[M]`` values (fp32 zeros on ``like``'s device elsewhere): an autograd
        Function's per-token output, before :meth:`shaped`."""
        return like.new_zeros(self.labels.numel(), dtype=torch.float32).index_copy_(0, self.rows, row_values)

    def shaped(self, values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-token ``[N]`` output viewed as the labels' shape (``None`` stays ``None``)."""
        return None if values is None else values.view(self.batch_shape)


def prepare(
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
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    num_items_in_batch=None,
    vocab_parallel: Optional[VocabParallel] = None,
    defer_count: bool = False,
) -> PreparedHead:
    """The prologue of every public op: the head's inputs checked and flattened, with everything the op's
    autograd Function needs to compute from them.

    Checks shapes, dtypes, layouts and devices, the label range and ``num_items_in_batch`` (errors say what was
    wrong and what to do); flattens ``[..., H]`` hidden states and ``[...]`` labels to ``[N, H]`` and ``[N]``;
    finds the kept rows (labels other than ``ignore_index``, ascending: ignored rows are compacted out before any
    matmul); builds the logit transform (:func:`logit_transform`: ``transform`` whole or the three keywords);
    checks the tile budget; reads the autocast dtype ``F.linear`` would compute in; picks the backend
    (``backend``, else ``$HF_FUSED_BACKEND``, else the fastest for the device). One host sync in all (the label
    checks, the count of kept rows and a tensor ``num_items_in_batch`` read together); with ``defer_count``, on a
    GPU, at the rows' first use (:class:`~hf_fused.ops.kept_rows.KeptRows`): a bad label or ``num_items_in_batch``
    then raises from there, inside the op (:meth:`PreparedHead.apply` reads the count at the latest when the
    Function returns).

    An op is then one autograd Function and this one call (the distillation divergence, say)::

        def linear_my_loss(hidden, weight, labels, bias=None, *, teacher_logprobs, **head_options):
            prepared = prepare(hidden, weight, labels, bias, **head_options)
            teacher = prepared.per_token_rows(teacher_logprobs, "teacher_logprobs")  # [M] at the kept rows
            loss, per_token = prepared.apply(MyLossFunction, _MyCall(prepared, teacher))
            return loss, prepared.shaped(per_token)

    where ``MyLossFunction.forward(ctx, hidden, weight, bias, call)`` takes ``given = call.prepared.given(hidden,
    weight, bias)`` (so that the gradients reach the caller's tensors), runs the backend's passes inside
    :func:`~hf_fused.ops.precision.autocast_off`, returns per-token outputs through :meth:`PreparedHead.scatter`,
    and its backward uses :mod:`hf_fused.ops.backward` (upstream rows, the recompute, one rounding of the
    gradients).

    Args:
        hidden: ``[..., H]`` floating hidden states, aligned with ``labels`` (no shift here: :func:`causal_shift`).
        weight: ``[V, H]`` floating lm_head weight.  bias: optional ``[V]``.
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``.
        transform, temperature, softcap, logit_scale: the logit transform (:func:`logit_transform`).
        tile_budget_bytes: ``None`` (the planner's rule) or a positive int.  backend: a registered name or ``None``.
        num_items_in_batch: ``None`` or one finite number > 0 (a Python number or a one-element tensor).
        defer_count: read the count of kept rows at their first use rather than here (on a device of
            :data:`DEFERRED_COUNT_DEVICES`, outside Dynamo, without ``vocab_parallel``): for an op whose labels are
            read only through :attr:`PreparedHead.rows` and whose pass launches work before that first use (the
            GPU backend's one pass launches its first tile), so that the host's set-up runs while the device
            works through its queue. An op that reads the labels otherwise must leave it False: their range is
            checked with the count.
        vocab_parallel: ``None``, or this rank's :class:`~hf_fused.ops.vocab_parallel.VocabShard` (or a
            ``(start, stop, group)`` tuple) of a head sharded over the vocabulary: ``weight`` (and ``bias``) are the
            rank's rows ``[start, stop)``, ``labels`` global ids. The shards are checked against the group's
            (:func:`~hf_fused.ops.vocab_parallel.resolve_vocab_shard`, a collective); with more than one rank the
            call runs :func:`~hf_fused.ops.backends.vocab_parallel.vocab_parallel_backend`'s choice (the GPU
            backend's schedules over the rank's rows for CUDA tensors, else the torch loop) and sums the hidden
            states' gradient over the group.

    Returns:
        :class:`PreparedHead`.

    Raises:
        TypeError: non-tensor inputs, non-floating hidden/weight/bias, non-integer labels, a sparse tensor, a
            non-integer ``ignore_index``, a bad ``num_items_in_batch`` type, a bad transform value's type.
        ValueError: shape mismatches, ``H = 0``, tensors on several devices or on the meta device, labels outside
            ``[0, V)`` other than ``ignore_index``, a bad ``num_items_in_batch``, transform or tile budget, an
            unknown backend; with ``vocab_parallel``, shards that do not tile the vocabulary, a weight of another
            width, ranks scoring different tokens, or a ``backend`` other than ``"torch"`` or ``"triton"``.
    """
    transform = logit_transform(transform, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    shard = None if vocab_parallel is None else as_vocab_shard(vocab_parallel)
    flat_hidden, flat_labels, rows, num_items_in_batch, layout = _flatten(hidden, weight, labels, bias, ignore_index,
                                                                          num_items_in_batch, shard, defer_count)
    head = HeadInputs(sum_gradient_over(flat_hidden, layout), weight, bias, flat_labels, rows, transform,
                      validate_tile_budget(tile_budget_bytes), autocast_dtype(flat_hidden.device.type))
    if layout is not None and layout.sharded:
        chosen = vocab_parallel_backend(layout, hidden.device, backend)
    else:
        chosen = get_backend(hidden.device, backend)
    return PreparedHead(head, chosen, labels, hidden.shape[:-1], num_items_in_batch, torch.is_grad_enabled())


def _flatten(hidden, weight, labels, bias, ignore_index, num_items_in_batch, shard=None, defer_count=False):
    """``(hidden [N, H], labels [N] int64, kept rows, num_items_in_batch, vocabulary layout or None)`` after the
    checks of :func:`prepare`. One host sync: every sync drains the GPU queue, and a training step of a patched
    model should cost no more of them than the unpatched model's. With ``defer_count`` on a device of
    :data:`DEFERRED_COUNT_DEVICES` it is left to the rows' first use (:class:`~hf_fused.ops.kept_rows.KeptRows`: the
    count, the label check and a tensor ``num_items_in_batch``'s check read together); otherwise, under Dynamo and
    for a vocabulary shard (whose collective check syncs anyway, :func:`resolve_vocab_shard`) it is read here."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _refuse_dtensors(hidden=hidden, weight=weight, bias=bias)
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    _check_index(ignore_index)
    tensors = (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias))
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}; pass {name}.to_dense()")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (lm_head.weight), got shape {tuple(weight.shape)}")
    vocab_size, hidden_size = weight.shape
    if hidden_size == 0:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}: a head with H = 0 hidden features computes logits that ignore "
            "hidden; pass lm_head.weight as [V, H] with H > 0 (an empty weight is often a partitioned parameter: "
            "under DeepSpeed ZeRO-3 gather it, or call the op inside the model's forward)"
        )
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
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}; "
            "move them to the weight's device (e.g. labels.to(weight.device))"
        )
    meta = [name for name, t in tensors if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        names = meta[0] if len(meta) == 1 else f"{', '.join(meta[:-1])} and {meta[-1]}"
        raise ValueError(
            f"{names} {'is' if len(meta) == 1 else 'are'} on the meta device, which holds shapes but no "
            "values, and the op computes values; materialize the model first (e.g. model.to_empty(device=...) and "
            "load its weights) or call the op on real tensors"
        )
    flat_labels = labels.reshape(-1).long()
    kept = flat_labels != ignore_index
    layout = None
    if shard is not None:
        layout = resolve_vocab_shard(shard, weight, kept, flat_labels)
        vocab_size = layout.vocab_size  # labels are global ids
    bad = kept & ((flat_labels < 0) | (flat_labels >= vocab_size))
    counts = [kept.sum(), bad.sum()]
    items_tensor = isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1
    if items_tensor:  # whether it is one finite number > 0, as an int64 flag (float64 is not on every device)
        items = num_items_in_batch.detach().reshape(())
        counts.append((torch.isfinite(items) & (items > 0)).to(device=kept.device, dtype=torch.int64))
        num_items_in_batch = num_items_in_batch.reshape(())  # stays on its device; checked with the count
    elif num_items_in_batch is not None:
        num_items_in_batch = check_num_items(num_items_in_batch)  # a number, or raises naming the bad value

    def check(host: list) -> None:
        if host[1]:
            first = flat_labels[bad][0].item()
            raise ValueError(
                f"labels contain {first}, outside [0, {vocab_size}) and not ignore_index={ignore_index}; "
                "mask padding with ignore_index or check the tokenizer/vocabulary size"
            )
        if items_tensor and not host[2]:
            check_num_items(num_items_in_batch)  # raises naming the bad value

    # read now for a sharded vocabulary (its ranks agree on it), under Dynamo (the graph breaks here) and off a GPU
    defer = defer_count and layout is None and not _tracing() and kept.device.type in DEFERRED_COUNT_DEVICES
    rows = KeptRows(kept, torch.stack(counts), check, defer=defer)
    return hidden.reshape(-1, hidden_size), flat_labels, rows, num_items_in_batch, layout


def _tracing() -> bool:
    """Whether Dynamo is tracing the call (``torch.compile``): the count is read in :func:`prepare` there, where the
    graph breaks before the op's autograd Function, rather than inside the Function's forward."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _refuse_dtensors(**tensors) -> None:
    """Raise for a DTensor among the head's tensors: the ops compute on each rank's local tensors, and a sharded
    weight read as a whole one would give wrong results."""
    for name, t in tensors.items():
        placements = getattr(t, "placements", None)
        if placements is not None and isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} is a DTensor (placements {tuple(placements)}); the ops compute on plain tensors. For lm_head "
                "sharded over the vocabulary (Shard(0), tensor parallelism) pass the rank's local rows and "
                "vocab_parallel=VocabShard(start, stop, group): hf_fused.model.tensor_parallel.vocab_parallel_head("
                "weight, bias) builds them from the DTensor; a whole weight sharded by FSDP2 is gathered with "
                "full_tensor()"
            )


def _check_index(ignore_index) -> None:
    try:
        operator.index(ignore_index)
    except TypeError:
        raise TypeError(
            f"ignore_index must be an integer label value (e.g. -100, the labels' padding), got {ignore_index!r}"
        ) from None


def check_per_token(values, labels: torch.Tensor, name: str, *, detach: bool = True) -> torch.Tensor:
    """A per-token tensor such as ``token_weights`` or ``grad_hint``, named ``name`` in errors, as fp32 (detached
    unless ``detach`` is False), after checking it against ``labels``.

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
    return values.detach().float() if detach else values.float()


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
