"""The model layer's extension point: how a library's own calls reach a patched model.

A patched forward answers transformers' calls (:mod:`hf_fused.model.forward`). Training libraries call a model in
their own ways too (TRL's trainers: ``model(..., labels=..., fused_lm_head=True)``) and may need process-wide
adjustments while a model is patched. The model layer knows none of them: :mod:`hf_fused.integrations` registers a
:class:`ModelExtension` here (on ``import hf_fused``), and the model layer calls it back:

* ``call_keyword`` and ``forward``: a call of the patched forward with that keyword set (truthy) is answered by
  ``forward(causal_lm, *args, **kwargs)`` (the keyword still in ``kwargs``) instead of by the fused forward. The
  handler builds a :class:`~hf_fused.model.forward.FusedRequest` (``head=`` its own computation of the head) and
  runs the original forward under :func:`~hf_fused.model.forward.intercept_lm_head`.
* ``on_patch(causal_lm)``: after :func:`~hf_fused.apply_fused_loss` has patched ``causal_lm`` (or updated its
  options), before the patch-time verification probe; in registration order.
* ``on_remove(causal_lm)``: after :func:`~hf_fused.remove_fused_loss` has restored ``causal_lm``'s forward; in
  reverse registration order (what was set up last is undone first). :func:`patched_models` no longer lists it.

A model patched by ``torch.load`` or ``copy.deepcopy`` of a patched model is listed by :func:`patched_models` but
gets no ``on_patch`` call (it was patched by copying, not by ``apply_fused_loss``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn


@dataclass(frozen=True)
class ModelExtension:
    """What an integration plugs into patched models (see the module docstring). Every part is optional."""

    name: str
    call_keyword: Optional[str] = None
    forward: Optional[Callable[..., Any]] = None
    on_patch: Optional[Callable[[nn.Module], None]] = None
    on_remove: Optional[Callable[[nn.Module], None]] = None

    def __post_init__(self) -> None:
        if (self.call_keyword is None) != (self.forward is None):
            raise ValueError(f"ModelExtension {self.name!r}: call_keyword and forward go together (both or neither)")


_EXTENSIONS: dict[str, ModelExtension] = {}
# Causal LMs whose forward is hf_fused's: weak, so that listing a model never keeps it alive.
_PATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def register_extension(extension: ModelExtension) -> None:
    """Add ``extension`` (or replace the one registered under its name, keeping its place in the order).

    Raises:
        ValueError: another extension already answers ``extension.call_keyword``.
    """
    if extension.call_keyword is not None:
        for other in _EXTENSIONS.values():
            if other.name != extension.name and other.call_keyword == extension.call_keyword:
                raise ValueError(
                    f"ModelExtension {extension.name!r}: keyword {extension.call_keyword!r} is already answered by "
                    f"{other.name!r}; unregister that one first"
                )
    _EXTENSIONS[extension.name] = extension


def unregister_extension(name: str) -> Optional[ModelExtension]:
    """Remove the extension registered under ``name``; returns it (``None`` if there was none)."""
    return _EXTENSIONS.pop(name, None)


def registered_extensions() -> tuple[ModelExtension, ...]:
    """The registered extensions, in registration order."""
    return tuple(_EXTENSIONS.values())


def patched_models() -> list[nn.Module]:
    """The causal LMs whose forward is hf_fused's patched forward right now (those still alive)."""
    return [m for m in list(_PATCHED) if "_hf_fused" in m.__dict__]


def call_handler(kwargs: dict) -> Optional[Callable[..., Any]]:
    """The ``forward`` of the extension whose ``call_keyword`` is set in ``kwargs``, or ``None``."""
    for extension in _EXTENSIONS.values():
        if extension.call_keyword is not None and kwargs.get(extension.call_keyword):
            return extension.forward
    return None


def track_patched(causal_lm: nn.Module) -> None:
    """Record ``causal_lm`` as patched (called when its patched forward is created, copies included)."""
    _PATCHED.add(causal_lm)


def notify_patched(causal_lm: nn.Module) -> None:
    """Run every extension's ``on_patch`` on ``causal_lm``, in registration order."""
    for extension in registered_extensions():
        if extension.on_patch is not None:
            extension.on_patch(causal_lm)


def notify_removed(causal_lm: nn.Module) -> None:
    """Forget ``causal_lm`` as patched, then run every extension's ``on_remove`` on it, in reverse order."""
    _PATCHED.discard(causal_lm)
    for extension in reversed(registered_extensions()):
        if extension.on_remove is not None:
            extension.on_remove(causal_lm)
