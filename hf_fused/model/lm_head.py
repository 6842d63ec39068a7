"""Turn whatever lm_head module a model has into plain ``(hidden, weight, bias)`` for the ops.

A PEFT LoRA adapter on lm_head computes ``h·Wᵀ + s·dropout(h)·Aᵀ·Bᵀ``. That is one linear map of an
augmented input: ``[h, s·A(dropout(h))] · [W, B]ᵀ``, so the fused ops see the adapter exactly
(dropout included) and autograd carries the gradient to ``lora_A`` and ``lora_B``. Peers that read
``lm_head.weight`` silently train without the adapter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


def check_head_supported(lm_head: nn.Module) -> None:
    """Raise before patching if :func:`head_tensors` could not read ``lm_head``.

    Raises:
        NotImplementedError: as :func:`head_tensors` (naming the type), never ``AttributeError``.
    """
    if _is_modules_to_save(lm_head):
        for module in [lm_head.original_module, *lm_head.modules_to_save.values()]:
            check_head_supported(module)
        return
    if _is_lora_layer(lm_head):
        check_head_supported(lm_head.base_layer)
        if not (lm_head.disable_adapters or lm_head.merged):
            for name in lm_head.active_adapters:
                if name in lm_head.lora_A.keys():
                    _check_lora_adapter(lm_head, name)
        return
    if not _is_plain_linear(lm_head):
        raise _unsupported(lm_head)


def _check_lora_adapter(layer: nn.Module, name: str) -> None:
    """Raise ``NotImplementedError`` for an adapter on lm_head whose map :func:`head_tensors` cannot fold into
    ``[h, A h]·[W, B]ᵀ``: a LoRA variant (DoRA) or a LoRA bias."""
    what = None
    if name in getattr(layer, "lora_variant", {}):
        what = f"uses {type(layer.lora_variant[name]).__name__} (e.g. DoRA), whose map is not linear in [h, A h]"
    elif layer.lora_B[name].bias is not None:
        what = "has a bias (lora_bias=True)"
    if what is not None:
        raise NotImplementedError(
            f"hf_fused supports vanilla LoRA on lm_head; adapter {name!r} {what}. Leave lm_head out of the "
            "adapter's target_modules, merge the adapter into lm_head first, or call remove_fused_loss(model) to "
            "train with the original loss."
        )


def _is_plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear or (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward)


def _unsupported(lm_head: nn.Module) -> NotImplementedError:
    return NotImplementedError(
        f"hf_fused supports an lm_head that is nn.Linear, a PEFT LoRA layer around one, or PEFT "
        f"modules_to_save; got {type(lm_head).__module__}.{type(lm_head).__name__}. "
        "Remove the patch (remove_fused_loss) to train this model with the original loss."
    )


def head_tensors(lm_head: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(hidden', weight [V, H'], bias [V] or None)`` with ``lm_head(hidden) == hidden' · weightᵀ + bias``.

    Supports ``nn.Linear``, PEFT ``lora.Linear`` (any number of active vanilla LoRA adapters, merged or
    disabled) and PEFT ``ModulesToSaveWrapper``.

    Raises:
        NotImplementedError: for lm_head types whose map is not a plain linear one (DoRA and other LoRA
            variants, quantized layers), naming the type.
    """
    if _is_modules_to_save(lm_head):
        if lm_head.disable_adapters or not lm_head.active_adapters:
            return head_tensors(lm_head.original_module, hidden)
        return head_tensors(lm_head.modules_to_save[lm_head.active_adapters[0]], hidden)
    if _is_lora_layer(lm_head):
        return _lora_head_tensors(lm_head, hidden)
    if _is_plain_linear(lm_head):
        return hidden, lm_head.weight, lm_head.bias
    raise _unsupported(lm_head)


def _is_modules_to_save(module: nn.Module) -> bool:
    return hasattr(module, "modules_to_save") and hasattr(module, "original_module")


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("lora_A", "lora_B", "base_layer", "scaling"))


def _lora_head_tensors(layer: nn.Module, hidden: torch.Tensor):
    base_hidden, weight, bias = head_tensors(layer.base_layer, hidden)
    if layer.disable_adapters or layer.merged:
        return base_hidden, weight, bias
    extra_hidden, extra_weight = [], []
    for name in layer.active_adapters:
        if name not in layer.lora_A.keys():
            continue
        _check_lora_adapter(layer, name)
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        x = layer.lora_dropout[name](hidden.to(lora_A.weight.dtype))
        extra_hidden.append((lora_A(x) * layer.scaling[name]).to(hidden.dtype))
        extra_weight.append(_whole_weight(lora_B, hidden.device).to(weight.dtype))
    if not extra_hidden:
        return base_hidden, weight, bias
    return torch.cat([base_hidden, *extra_hidden], dim=-1), torch.cat([weight, *extra_weight], dim=1), bias


def _whole_weight(linear: nn.Module, device: torch.device) -> torch.Tensor:
    """``linear.weight`` ``[out, in]`` as the module's own call would use it (on ``device``, the hidden states').

    Read directly, except for a module FSDP1 wraps as a unit of its own (accelerate applies PEFT's auto-wrap
    policy, which makes every trainable LoRA matrix one): outside its call its weight is a flat shard, whole only
    inside the call, between FSDP's hooks. There the weight is recovered through the call, ``linear(I)ᵀ = W``
    (exact: a product with the identity, with autocast off so it is not rounded to bf16 on the way), and its
    gradient flows back through FSDP's hooks like any LoRA forward's.
    """
    if not is_fsdp1_unit(linear):
        return linear.weight
    inner = linear.module
    eye = torch.eye(inner.in_features, dtype=inner.weight.dtype, device=device)  # the weight may be offloaded
    with torch.autocast(eye.device.type, enabled=False):
        return linear(eye).t()


def is_fsdp1_unit(module: nn.Module) -> bool:
    """Whether ``module`` is FSDP1's ``FullyShardedDataParallel`` wrapper (a unit of its own)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)
