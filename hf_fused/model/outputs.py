"""Output types of the patched forward: the model's own output type with hf_fused's fields added as real
dataclass fields, so wrappers that rebuild an output from its keys (accelerate's fp32 conversion under
mixed precision, ``ModelOutput`` pytree flattening) keep them, and an absent one reads as ``None``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

#: Fields the patched forward may fill (``fused_output="logprobs"`` / ``"hidden_states"``).
FUSED_FIELDS = ("logprobs", "entropy", "last_hidden_state")


@functools.lru_cache(maxsize=None)
def fused_output_type(base: type) -> type:
    """``Fused<Base>``: a dataclass subclass of ``base`` (a transformers ``ModelOutput``) with the fields of
    :data:`FUSED_FIELDS` that ``base`` lacks, each defaulting to ``None``. Registered in this module under
    its name so outputs pickle."""
    have = {f.name for f in dataclasses.fields(base)}
    extra = [(name, Optional[torch.FloatTensor], None) for name in FUSED_FIELDS if name not in have]
    cls = dataclasses.make_dataclass(f"Fused{base.__name__}", extra, bases=(base,))
    cls.__module__ = __name__
    cls.__doc__ = f"{base.__name__} plus hf_fused's per-token outputs ({', '.join(FUSED_FIELDS)})."
    globals()[cls.__name__] = cls
    return cls


def to_tuple_with_logits_slot(out) -> tuple:
    """``out`` as transformers' ``return_dict=False`` tuple (its non-None fields in field order) with ``None``
    kept in the ``logits`` position, so positions match the unpatched model's tuple (``outputs[1]`` is
    where the logits were, not the KV cache)."""
    items = []
    for field in dataclasses.fields(out):
        value = getattr(out, field.name)
        if field.name == "logits" or value is not None:
            items.append(value)
    return tuple(items)
