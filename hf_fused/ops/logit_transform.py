"""The architecture-specific map from raw head outputs to the logits a model samples from
(:class:`LogitTransform`: scale, soft-cap, temperature) and its derivative."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LogitTransform:
    """Scale, soft-cap and temperature applied to raw head outputs, in the order transformers' models use, then
    sampling temperature last::

        z = (h · Wᵀ + b) · logit_scale          # Cohere `logit_scale`, Granite `1 / logits_scaling`
        z = softcap · tanh(z / softcap)         # Gemma 2/3 `final_logit_softcapping`
        z = z / temperature                     # sampling temperature (TRL divides logits by it)

    Its derivative is what every backward multiplies the logits-gradient by::

        ∂z_out/∂z_raw = logit_scale · (1 − tanh²(z_scaled / softcap)) / temperature

    Each value is one number (a one-element tensor is read as its value), the same for every token.

    Raises:
        TypeError: a value that is not a number.
        ValueError: for a non-positive or non-finite ``temperature``/``softcap``, a non-finite or zero
            ``logit_scale``, a tensor of several elements or one that requires grad.
    """

    logit_scale: float = 1.0
    softcap: Optional[float] = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("logit_scale", "softcap", "temperature"):
            _check_number(name, getattr(self, name))
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a finite number > 0, got {self.softcap!r}")
        if not math.isfinite(self.logit_scale) or self.logit_scale == 0:
            raise ValueError(f"logit_scale must be a finite non-zero number, got {self.logit_scale!r}")

    @property
    def is_identity(self) -> bool:
        return self.logit_scale == 1.0 and self.softcap is None and self.temperature == 1.0

    def forward(self, raw: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Transform fp32 raw logits in place.

        Returns ``(logits, tanh)`` where ``tanh`` is the soft-cap's ``tanh(z / softcap)`` that
        :meth:`backward` needs (``None`` without soft-capping).
        """
        z = raw
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        tanh = None
        if self.softcap is not None:
            tanh = z.div_(self.softcap).tanh_()
            # The soft-capped logits are softcap·tanh; ``tanh`` is kept separately for backward.
            z = tanh * self.softcap
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z, tanh

    def backward(self, grad_logits: torch.Tensor, tanh: Optional[torch.Tensor]) -> torch.Tensor:
        """Turn d loss / d logits into d loss / d raw, in place (``tanh`` is overwritten)."""
        factor = self.logit_scale / self.temperature
        if tanh is not None:
            # d/dx softcap·tanh(x/softcap) = 1 − tanh²; computed in tanh's storage (consumed here)
            grad_logits.mul_(tanh.square_().neg_().add_(1.0))
        if factor != 1.0:
            grad_logits.mul_(factor)
        return grad_logits


def _check_number(name: str, value) -> None:
    """Raise unless ``value`` is one real number the checks in ``__post_init__`` can read (``softcap`` may be
    ``None``)."""
    if value is None and name == "softcap":
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be one number, got a tensor of shape {tuple(value.shape)}: the logit transform is the "
                f"same for every token; pass a float"
            )
        if value.requires_grad:
            raise ValueError(
                f"{name} requires grad, but the ops do not differentiate the logit transform; pass a float "
                f"({name}.item()) or a detached tensor"
            )
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a tensor of dtype {value.dtype}")
        return
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
