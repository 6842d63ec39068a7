"""Distributed-engine glue for the lm_head intercept: DeepSpeed ZeRO-3's partitioned head parameters.

Under ZeRO-3 every parameter is a shard (``numel 0`` outside its module's call) that DeepSpeed
all-gathers around its module's forward and again, through hooks on the module's *outputs*, before its
backward. hf_fused computes the loss inside lm_head's call, so the forward sees the gathered weight;
but the loss is not an output of lm_head (lm_head returns an empty placeholder), so ZeRO-3's backward
hooks never gather the weight again for the op's backward, which recomputes logits tiles from it.

:func:`run_head` closes that gap, in the spirit of DeepSpeed's own tiled loss
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, ``TiledFusedLogitsLoss``) and TRL's chunked head
(``trl/trainer/utils.py``, ``maybe_gather_lm_head_ctx``): the head computation runs as one autograd node
whose forward gathers the directly read head parameters once per loss call (not once per tile) and whose
backward gathers them once again, differentiates the kept inner graph, and keeps the parameters whole
until autograd has accumulated their gradients (into a tensor of the parameter's shape) and ZeRO's
reduce hook has taken them. The fused ops hand the weight its gradient in one piece (their tile loop
accumulates into one fp32 buffer), so it reaches ZeRO's reduce hook exactly once per backward and no
``ds_grad_is_ready`` bookkeeping is needed (``TiledFusedLogitsLoss`` needs it: it backpropagates per shard).

:func:`gathered_per_module` lets a forward (the patch-time probe) run on a model built under
``deepspeed.zero.Init`` before ``deepspeed.initialize`` has hooked it.

ZeRO-1/2, DDP and FSDP2 need nothing here: their parameters are whole (ZeRO-1/2, DDP) or gathered by
FSDP2 around lm_head's call and kept for its unit's backward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

HeadResult = Any  # tensors, None, and tuples / lists / dicts of them


def run_head(lm_head: nn.Module, hidden: torch.Tensor, compute: Callable[[torch.Tensor], HeadResult]) -> HeadResult:
    """``compute(hidden)``, with lm_head's ZeRO-3 partitioned parameters gathered for its forward and backward.

    Args:
        lm_head: the output module (``nn.Linear``, a PEFT LoRA layer around one, PEFT ``modules_to_save``).
        hidden: ``[..., H]`` states lm_head received.
        compute: reads lm_head's parameters directly (see :func:`hf_fused.model.lm_head.head_tensors`) and
            returns tensors, ``None`` or tuples / lists / dicts of them (differentiable in ``hidden`` and the
            parameters).

    Returns:
        what ``compute`` returns. Without ZeRO-3 partitioned parameters it is exactly ``compute(hidden)``.
    """
    params = partitioned_head_params(lm_head)
    if not params:
        return compute(hidden)
    if not torch.is_grad_enabled():  # evaluation: no backward to prepare for
        with _gathered(params):
            return compute(hidden)
    trainable = [p for p in _unique(lm_head.parameters()) if p.requires_grad]
    flat: dict = {}
    # Whole while the node is created: autograd records each trainable parameter's shape for its
    # gradient there (a partitioned one would record numel 0).
    with _gathered(params + [p for p in trainable if hasattr(p, "ds_status")]):
        outputs = _ZeroGatheredHead.apply(compute, params, flat, hidden, *trainable)
    # autograd.Function returns tensors only: compute's structure (tuples, None) is rebuilt around them.
    leaves = [None if i in flat["none"] else o for i, o in enumerate(outputs)]
    return tree_unflatten(leaves, flat["spec"])


@contextmanager
def gathered_per_module(model: nn.Module):
    """Within this block, each module of a ZeRO-3 partitioned ``model`` that DeepSpeed has not hooked yet
    (built under ``deepspeed.zero.Init``, e.g. by ``from_pretrained`` with ZeRO-3 configured, before
    ``deepspeed.initialize``) gathers its own parameters around its call, one module at a time, as
    DeepSpeed's hooks would: so a forward (the patch-time probe) can run without holding the whole model.
    Collective: every rank must run the same forward. A no-op without ZeRO-3 or once DeepSpeed's hooks
    are installed (they set ``ds_id`` on every module)."""
    if not any(hasattr(p, "ds_status") for p in model.parameters()) or hasattr(model, "ds_id"):
        yield model
        return
    open_contexts: dict[int, list] = {}

    def gather(module, args):
        own = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_status")]
        open_contexts.setdefault(id(module), []).append(_gathered(own))

    def release(module, args, output):
        open_contexts[id(module)].pop().release()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(gather))
        handles.append(module.register_forward_hook(release, always_call=True))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def partitioned_head_params(lm_head: nn.Module) -> list[nn.Parameter]:
    """The ZeRO-3 parameters that the fused head reads directly (not through their own module's call),
    deduplicated; empty without ZeRO-3. A LoRA adapter's ``lora_A`` runs as a module call, so DeepSpeed's
    own hooks gather it; its ``lora_B`` weight and the base weight are read directly."""
    return [p for p in _unique(_directly_read(lm_head)) if hasattr(p, "ds_status")]


def _directly_read(module: nn.Module) -> list[nn.Parameter]:
    # Mirrors hf_fused.model.lm_head.head_tensors: which tensors it reads without calling their module.
    if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
        inner = [module.original_module, *module.modules_to_save.values()]
        return [p for m in inner for p in _directly_read(m)]
    if all(hasattr(module, n) for n in ("lora_A", "lora_B", "base_layer")):
        return _directly_read(module.base_layer) + [p for b in module.lora_B.values() for p in b.parameters()]
    return list(module.parameters(recurse=False))


def _unique(params) -> list[nn.Parameter]:
    return list({id(p): p for p in params if p is not None}.values())


def _gathered(params: Sequence[nn.Parameter]) -> "_Gather":
    return _Gather(params)


class _Gather:
    """All-gather those of ``params`` that are partitioned right now (inside lm_head's call DeepSpeed has
    gathered lm_head's own weight; a tied weight may be held by the embedding); :meth:`release`
    re-partitions them, except any that a DeepSpeed-hooked module holds by then (a tied weight during
    the embedding's backward): DeepSpeed releases those itself after that module. A context manager too.
    Collective: every rank must gather and release the same parameters."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = []
        self.add(params)

    def add(self, params: Sequence[nn.Parameter]) -> None:
        """Gather these too (those partitioned right now), to be released with the others."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = _unique(params)
        if any(p.ds_status == ZeroParamStatus.INFLIGHT for p in params):
            # DeepSpeed's prefetch is all-gathering it; its handle is private to DeepSpeed's coordinator.
            raise RuntimeError(
                "hf_fused needs lm_head's ZeRO-3 parameters whole, but DeepSpeed is prefetching them right now "
                "(status INFLIGHT). Set zero_optimization.stage3_prefetch_bucket_size to 0 in the DeepSpeed "
                "config, and report the model and config to hf_fused."
            )
        missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            missing[0].all_gather(param_list=missing)
            self.params += missing

    def release(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        free = [p for p in self.params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules]
        self.params = []
        if free:
            free[0].partition(param_list=free, has_been_updated=False)

    def __enter__(self) -> "_Gather":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _ZeroGatheredHead(torch.autograd.Function):
    """One autograd node around ``compute``: forward and backward each run with the head gathered.

    Forward builds ``compute``'s graph on a detached alias of ``hidden`` and keeps it; backward gathers the
    parameters and differentiates that inner graph with ``torch.autograd.grad`` (no gradient is
    accumulated inside, so no ZeRO hook fires in a nested graph task) and returns the gradients of
    ``hidden`` and of the trainable head parameters, which are this node's inputs: each parameter's
    gradient is accumulated once, by the outer backward, where ZeRO counts and reduces it like any other.
    """

    @staticmethod
    def forward(ctx, compute, params, flat, hidden, *trainable):
        ctx.set_materialize_grads(False)  # an output the loss does not use sends None: nothing to recompute
        inner_hidden = hidden.detach().requires_grad_(hidden.requires_grad)
        with _gathered(params), torch.enable_grad():
            result = compute(inner_hidden)
        results, flat["spec"] = tree_flatten(result)
        flat["none"] = {i for i, r in enumerate(results) if r is None}
        if any(r is not None and not isinstance(r, torch.Tensor) for r in results):
            raise TypeError("hf_fused's ZeRO-3 head computation must return tensors (in tuples, lists, dicts) or None")
        ctx.params, ctx.inner_hidden, ctx.trainable = params, inner_hidden, trainable
        ctx.inner = [(i, r) for i, r in enumerate(results) if r is not None and r.requires_grad]
        outputs = tuple(hidden.new_empty(0) if r is None else r.detach() for r in results)
        ctx.mark_non_differentiable(*(o for o, r in zip(outputs, results) if r is None or not r.requires_grad))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.inner is None:
            raise RuntimeError(
                "hf_fused's ZeRO-3 head computation was already backpropagated (its inner graph is freed "
                "after one backward); run the forward again to backpropagate again."
            )
        used = [(r, grads[i]) for i, r in ctx.inner if grads[i] is not None]
        ctx.inner = None
        wrt = ([ctx.inner_hidden] if ctx.inner_hidden.requires_grad else []) + list(ctx.trainable)
        got = [None] * len(wrt)
        if used and wrt:
            gather = _gathered(ctx.params)
            try:
                got = list(torch.autograd.grad([r for r, _ in used], wrt, [g for _, g in used], allow_unused=True))
            except BaseException:
                gather.release()
                raise
            # Autograd accumulates a gradient into a parameter of the parameter's own shape, so the
            # parameters stay whole until their gradients are accumulated (right after this node: the
            # engine runs accumulation first) and ZeRO's reduce hook has taken them, as around a module.
            # A LoRA ``lora_A`` was gathered and released again by DeepSpeed around its own backward
            # inside the grad call above: gather it once more.
            grads_of_trainable = got[len(got) - len(ctx.trainable):]
            pending = [p for p, g in zip(ctx.trainable, grads_of_trainable) if g is not None and hasattr(p, "ds_status")]
            gather.add(pending)
            _release_after_accumulation(gather, pending)
        grad_hidden = got.pop(0) if ctx.inner_hidden.requires_grad else None
        return (None, None, None, grad_hidden, *got)


def _release_after_accumulation(gather: _Gather, params: list[nn.Parameter]) -> None:
    """Release ``gather`` (re-partition) once each of ``params`` has had its gradient accumulated (a hook
    registered after ZeRO's reduce hook, so it runs after it), or at the end of this backward at the latest."""
    state = {"open": True, "pending": {id(p) for p in params}, "handles": []}

    def release():
        if state["open"]:
            state["open"] = False
            for handle in state["handles"]:
                handle.remove()
            gather.release()

    def accumulated(param):
        state["pending"].discard(id(param))
        if not state["pending"]:
            release()

    if not params:
        release()
        return
    state["handles"] = [p.register_post_accumulate_grad_hook(accumulated) for p in params]
    torch.autograd.Variable._execution_engine.queue_callback(release)
