"""Tensor parallelism at the lm_head intercept: a head sharded over the vocabulary read as its local rows and the
:class:`~hf_fused.ops.vocab_parallel.VocabShard` they are, so that the fused ops merge per-row statistics over the
tensor-parallel group instead of gathering ``[tokens, vocab]`` logits.

transformers' tensor-parallel plan (``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_size=...)``) shards lm_head as ``colwise_gather_output``: its weight (and
bias) a ``Shard(0)`` DTensor, its forward replaced by one that all-gathers the logits. torch's
``parallelize_module(..., {"lm_head": ColwiseParallel()})`` shards it the same way and converts its input to a
replicated DTensor in a forward pre-hook. The patched forward answers lm_head's call in place of either forward (the
hooks around it still run): :func:`local_hidden` takes the replicated input's local tensor, and
:func:`vocab_parallel_head` the weight's local rows and their offsets from the DTensor's own layout. DTensor's
``Shard(0)`` follows ``torch.chunk`` (ceil-sized shards, a short or empty last rank), so the offsets come from
``compute_local_shape_and_global_offset``, never from ``V // tp``. On a 2-D mesh (FSDP2 × TP) only the mesh
dimension with ``Shard(0)`` is the vocabulary split; any other dimension must be replicated there (FSDP2 has
gathered its own inside lm_head's call).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..ops.vocab_parallel import VocabShard


def _is_dtensor(tensor) -> bool:
    if not (torch.distributed.is_available() and isinstance(tensor, torch.Tensor)):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def vocab_parallel_head(weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``(weight, bias, shard)`` for the ops: a ``[V, H]`` DTensor weight sharded over the vocabulary as this rank's
    local rows ``[stop − start, H]`` (differentiable: the gradient comes back as a DTensor of the weight's layout),
    the bias likewise, and the :class:`~hf_fused.ops.vocab_parallel.VocabShard` ``(start, stop, group)``; a plain
    weight as it is, with shard ``None``.

    The weight's placements must be ``Shard(0)`` on exactly one mesh dimension (the tensor-parallel one: its process
    group is the shard's group) and ``Replicate()`` on every other; the bias, when there is one, a DTensor of the
    same layout (transformers' and torch's colwise styles shard it with the weight).

    Raises:
        NotImplementedError: another layout (a weight sharded over the hidden dimension, several vocabulary
            splits, a ``Partial`` or strided placement), a plain bias beside a sharded weight, or a DTensor bias
            beside a plain weight, naming the placements.
    """
    if not _is_dtensor(weight):
        if _is_dtensor(bias):
            raise NotImplementedError(
                f"hf_fused: lm_head's bias is a DTensor (placements {tuple(bias.placements)}) but its weight is not; "
                "shard both alike (a colwise tensor-parallel style) or neither"
            )
        return weight, bias, None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(weight.placements)
    vocab_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % weight.ndim == 0]
    others_replicated = all(type(p) is Replicate for i, p in enumerate(placements) if i not in vocab_dims)
    if len(vocab_dims) != 1 or not others_replicated or type(placements[vocab_dims[0]]) is not Shard:
        raise NotImplementedError(
            f"hf_fused computes a tensor-parallel lm_head sharded over the vocabulary (a DTensor weight with "
            f"Shard(0) on one mesh dimension, Replicate on the others), got placements {placements} on "
            f"{weight.device_mesh}. Shard lm_head colwise (transformers' colwise_gather_output, torch's "
            "ColwiseParallel), or gather it (full_tensor()) before the loss"
        )
    local = weight.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
    if tuple(local_shape) != tuple(local.shape):
        raise RuntimeError(
            f"hf_fused internal error: lm_head's local shard has shape {tuple(local.shape)} but its DTensor layout "
            f"says {tuple(local_shape)}"
        )
    shard = VocabShard(int(offset[0]), int(offset[0]) + int(local_shape[0]),
                       weight.device_mesh.get_group(vocab_dims[0]))
    if bias is not None:
        if not _is_dtensor(bias) or len(bias.placements) != len(placements) or not all(
            type(b) is Shard if i == vocab_dims[0] else type(b) is Replicate for i, b in enumerate(bias.placements)
        ):
            got = tuple(bias.placements) if _is_dtensor(bias) else "a plain tensor"
            raise NotImplementedError(
                f"hf_fused: lm_head's weight is sharded over the vocabulary ({placements}) but its bias is {got}; "
                "a vocabulary-parallel head needs the bias sharded with it (Shard(0) on the same mesh dimension)"
            )
        bias = bias.to_local()
    return local, bias, shard


def local_hidden(hidden: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``(hidden's local tensor, as_output)`` for what lm_head received: a replicated DTensor (torch's
    ``ColwiseParallel`` pre-hook makes one) as its local tensor, and ``as_output(placeholder)`` the empty logits
    placeholder as a DTensor of that layout for the style's output hook (which redistributes it: an exchange of
    nothing); a plain tensor as it is, with ``as_output`` the identity. The ops sum the hidden states' gradient over
    the group themselves, so the local tensor hands back a replicated gradient.

    Raises:
        NotImplementedError: a DTensor input that is not replicated (sequence parallelism before lm_head).
    """
    if not _is_dtensor(hidden):
        return hidden, _identity
    from torch.distributed.tensor import DTensor, Replicate

    placements, mesh = tuple(hidden.placements), hidden.device_mesh
    if not all(type(p) is Replicate for p in placements):
        raise NotImplementedError(
            f"hf_fused: lm_head received a DTensor with placements {placements}; the vocabulary-parallel head takes "
            "hidden states replicated over the tensor-parallel group (input_layouts=Replicate()). Sequence-parallel "
            "inputs are not supported yet"
        )

    def as_output(placeholder: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(placeholder, mesh, placements, run_check=False)

    return hidden.to_local(), as_output


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def refuse_data_parallel_shard(lm_head: nn.Module, weight: torch.Tensor) -> None:
    """Refuse a DTensor weight read outside lm_head's call when FSDP2 manages lm_head: FSDP2 gathers its own shards
    only around the call, so the DTensor there is (also) FSDP2's data-parallel shard, whose ranks hold different
    batches; reading it as a vocabulary split would merge unrelated tokens. (Inside the call, where the patched
    forward reads it, FSDP2 has gathered its dimension and what stays sharded is tensor parallelism's.)

    Raises:
        NotImplementedError: naming what to do instead.
    """
    if _is_dtensor(weight) and any(getattr(m, "_is_fsdp_managed_module", False) for m in lm_head.modules()):
        raise NotImplementedError(
            f"hf_fused: lm_head's weight is a DTensor (placements {tuple(weight.placements)}) read outside lm_head's "
            "call on a model FSDP2 manages, where it is FSDP2's shard: compute the loss inside the model's forward "
            "(apply_fused_loss), or call the loss module inside the FSDP2 root's forward"
        )


def check_tensor_parallel_head(lm_head: nn.Module) -> None:
    """Refuse a PEFT LoRA adapter on a vocabulary-sharded lm_head.

    Its ``lora_B`` ``[V, r]`` is replicated on every rank while lm_head's rows are split: each rank's logits
    gradient would reach only its own rows of ``lora_B``, whose gradient then needs a sum over the group (an
    ``[V, r]`` all-reduce) that no engine performs for a replicated parameter, so the ranks' adapters would drift
    apart. Not trivially exact, so refused.

    Raises:
        NotImplementedError: naming what to do instead.
    """
    if not all(hasattr(lm_head, name) for name in ("lora_A", "lora_B", "base_layer")):
        return
    base = getattr(lm_head.base_layer, "weight", None)
    if _is_dtensor(base) and not lm_head.disable_adapters and not lm_head.merged and any(
        name in lm_head.lora_A.keys() for name in lm_head.active_adapters
    ):
        raise NotImplementedError(
            f"hf_fused does not support a LoRA adapter on a tensor-parallel lm_head (weight placements "
            f"{tuple(base.placements)}): its lora_B is replicated while lm_head is sharded over the vocabulary, "
            "so each rank would train only its own rows of it. Leave lm_head out of target_modules (LoRA on the "
            "other layers trains exactly under tensor parallelism), or train without tensor parallelism"
        )
