"""Mixed precision at the ops' boundary: compute the head in the dtype the model's own lm_head call would use.

Under ``torch.autocast`` (what ``Trainer(bf16=True)`` does to an fp32 model) ``lm_head(h)`` is an
``F.linear`` that autocast runs with ``h``, ``W`` and ``b`` cast to the autocast dtype. The ops do the
same cast once, at their boundary, and then run forward AND backward with autocast off: an autograd
Function's backward runs outside the forward's autocast region, so a backward that recomputed logits
under different casting rules than its forward would normalize them with a log-sum-exp they did not come
from (probabilities that do not sum to 1, gradients 2.5× further from float64 than eager's). With the
cast at the boundary both passes see the same bf16/fp16 operands, and autograd's cast node hands the fp32
parameters their gradients exactly as it does for the eager ``F.linear``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear layer in on ``device_type``, or ``None`` outside autocast."""
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_like_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """``(hidden, weight, bias)`` cast as autocast would cast ``F.linear``'s operands (unchanged outside
    autocast). Differentiable: the gradients reach the original tensors in their own dtypes."""
    dtype = autocast_dtype(hidden.device.type)
    if dtype is None:
        return hidden, weight, bias
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@contextmanager
def autocast_off(device_type: str):
    """Run the tiled math with autocast disabled: its dtypes are chosen at the boundary."""
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
