"""Mixed precision at the ops' boundary: the dtype the model's own lm_head call would compute in under autocast,
a block with autocast off for the tiled math, and the refusal of second-order gradients."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear layer in on ``device_type``, or ``None`` outside autocast."""
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextmanager
def autocast_off(device_type: str):
    """Run the tiled math with autocast disabled: its dtypes are chosen at the boundary.

    Under ``torch.autocast`` (what ``Trainer(bf16=True)`` does to an fp32 model) ``lm_head(h)`` is an ``F.linear``
    that autocast runs with ``h``, ``W`` and ``b`` cast to the autocast dtype. The ops make the same cast once
    (:meth:`~hf_fused.ops.head_inputs.HeadInputs.computed`, inside their autograd Functions) and run forward AND
    backward with autocast off: a Function's backward runs outside the forward's autocast region, so a backward
    that recomputed logits under other casting rules than its forward would normalize them with a log-sum-exp they
    did not come from (probabilities that do not sum to 1). The Functions take the tensors as given, so an fp32
    parameter's gradient is the fp32 accumulator rounded once to fp32 (not to bf16 first, as eager ``F.linear``
    under autocast rounds it), and no half-precision copy of the weight lives from forward to backward."""
    if autocast_dtype(device_type) is None:
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def refuse_double_backward(op: str) -> None:
    """Raise if backward runs with ``create_graph=True`` (grad mode on inside backward): the tiled
    backward is written by hand and is not itself differentiable, so second-order gradients would be
    silently wrong.

    Raises:
        RuntimeError: naming ``op`` and what to do instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support second-order gradients (backward with create_graph=True): its tiled "
            "backward is not differentiable. Compute the loss from logits for double backward, or call "
            "backward without create_graph."
        )
