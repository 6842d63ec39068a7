"""Installing hf_fused's answer to TRL's fused head: process-wide patches of TRL's modules, made when they are imported.

The first :func:`hf_fused.apply_fused_loss` installs the patches below (:mod:`hf_fused.integrations.inventory`):
those on TRL modules already loaded at once, the others right after the module is imported, before any trainer
can be built from it (:func:`hf_fused.integrations.import_hooks.when_imported`). So patching never imports TRL
(seconds, for its trainers); a process pays for TRL only when it imports it, and whatever order the user takes
(patch, then import and build a trainer; or import, patch, build; or build, then patch) finds them in place.

* :data:`TRL_FUSED_HEAD`: ``add_fused_lm_head`` (in ``trl.trainer.utils`` and every loaded TRL module that imported
  it) is wrapped: for a patched model it only records the trainer's options on the model; a reference model added
  while a trainer around a patched policy is being built is patched too; every other model gets TRL's head.
* :data:`TRL_HEAD_ADAPTER_CHECKS`: TRL's trainers are let through their "no PEFT adapter on lm_head" check while they
  are built around a patched model (hf_fused computes the head with the adapter), and tell
  :data:`TRL_FUSED_HEAD` which trainer is being built (the policy whose reference model it adds); a GRPO or RLOO
  trainer so built under tensor parallelism then trains each tensor-parallel group as one data-parallel replica
  (:mod:`hf_fused.integrations.trl.tensor_parallel`).

Per model: :func:`serve_trl_fused_head` reads the options of a TRL head already installed on a model patched after
its trainer was built; :func:`forget_trl_head` (on :func:`hf_fused.remove_fused_loss`) takes the recorded options
off the model and gives it TRL's own head with them, where hf_fused had withheld it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import sys
import types
from typing import Any, Callable, Optional

import torch.nn as nn

from ...model import apply_fused_loss, find_causal_lm, is_fused
from ..patching import ThirdPartyPatch
from .protocol import OPTIONS_ATTR, TrlHeadOptions, protocol_mismatch, trl_head_options_in
from .tensor_parallel import serve_tensor_parallel_rollouts

#: TRL 1.16 trainers that refuse a PEFT adapter on lm_head (their head would read the bare weight); the ones that
#: add a fused head to a reference model are among them.
_TRAINERS_REFUSING_HEAD_ADAPTERS = {
    "trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
    "trl.trainer.kto_trainer": "KTOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer",
    "trl.trainer.grpo_trainer": "GRPOTrainer",
}

# The TRL trainer whose __init__ is running (innermost), set by the wrapped __init__ of the trainers above and reset
# when it returns: the add_fused_lm_head wrapper reads its policy from here. Never found by walking the stack:
# reading a frame's f_locals (Python < 3.13) snapshots the locals onto the frame, and a long-lived caller's frame
# then kept its deleted model alive.
_TRAINER_BEING_BUILT: contextvars.ContextVar = contextvars.ContextVar("hf_fused_trl_trainer_being_built",
                                                                      default=None)


def serve_trl_fused_head(causal_lm: nn.Module) -> None:
    """On :func:`hf_fused.apply_fused_loss` (the TRL extension's ``on_patch``): read the options of a TRL head already
    installed on ``causal_lm`` (patched after the trainer was built) and keep them on the model, so hf_fused's forward
    answers its fused calls. Does not import TRL; no-op without TRL.

    Raises:
        TrlProtocolError: a TRL head is installed on the model but its shape is not TRL 1.16's.
    """
    if importlib.util.find_spec("trl") is None:
        return
    options = trl_head_options_in(causal_lm._hf_fused.original_forward(causal_lm))
    if options is not None:
        setattr(causal_lm, OPTIONS_ATTR, options)


def forget_trl_head(causal_lm: nn.Module) -> None:
    """On :func:`hf_fused.remove_fused_loss` (after the forward is restored): take the TRL head options off
    ``causal_lm``; if hf_fused had withheld TRL's head from it (patched before its trainer was built), install TRL's
    own head with those options, so the trainer's fused calls get TRL's answer, as without hf_fused."""
    options = causal_lm.__dict__.pop(OPTIONS_ATTR, None)
    if options is None or trl_head_options_in(causal_lm.forward) is not None:  # none, or TRL's head is back
        return
    add_fused_lm_head = trl_add_fused_lm_head()
    if add_fused_lm_head is not None:
        add_fused_lm_head(causal_lm, options.temperature, options.cast_lm_head_to_fp32, options.outputs)


def trl_head_options(model: nn.Module) -> Optional[TrlHeadOptions]:
    """The TRL head options hf_fused serves on ``model`` (``None`` if no TRL trainer asked for a head)."""
    return find_causal_lm(model).__dict__.get(OPTIONS_ATTR)


def trl_add_fused_lm_head() -> Optional[Callable[..., Any]]:
    """TRL's own ``add_fused_lm_head`` (not hf_fused's wrapper), if ``trl.trainer.utils`` is loaded."""
    original = TRL_FUSED_HEAD.state.get("original")
    if original is not None:
        return original
    trl_utils = sys.modules.get("trl.trainer.utils")
    found = vars(trl_utils).get("add_fused_lm_head") if trl_utils is not None else None
    return None if found is None or getattr(found, "__hf_fused__", False) else found


def refused_reason() -> Optional[str]:
    """Why hf_fused does not serve the installed TRL's fused-head protocol (``None`` when it does, or TRL's
    ``trl.trainer.utils`` was not imported yet)."""
    return TRL_FUSED_HEAD.state.get("refused")


def _wrap_add_fused_lm_head(trl_utils: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Wrap ``add_fused_lm_head`` (see the module docstring) in ``trl.trainer.utils`` and in every loaded TRL module
    that imported it; or, for a TRL whose protocol is not 1.16's, record why not and warn."""
    original = trl_utils.add_fused_lm_head
    patch.state["original"] = original
    why = protocol_mismatch(trl_utils)
    if why is not None:
        patch.refuse(why, "TRL's trainers will use TRL's own fused head on this model, not hf_fused's; a fused call "
                          "on a patched model raises. hf_fused serves TRL 1.16's protocol.")
        return
    live = patch.liveness()

    @functools.wraps(original)
    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        if not live():
            return original(model, temperature, cast_lm_head_to_fp32, outputs)
        options = TrlHeadOptions(float(temperature), bool(cast_lm_head_to_fp32), tuple(outputs))
        if not is_fused(model):
            policy = _patched_policy_of_trainer_being_built(model)
            if policy is None:
                return original(model, temperature, cast_lm_head_to_fp32, outputs)
            # A reference model: computed by hf_fused like the policy it is compared with.
            state = policy._hf_fused
            apply_fused_loss(model, tile_budget_bytes=state.tile_budget_bytes, backend=state.backend)
        setattr(find_causal_lm(model), OPTIONS_ATTR, options)

    add_fused_lm_head.__hf_fused__ = True
    patch.rebind(trl_utils, "add_fused_lm_head", add_fused_lm_head)
    for module in list(sys.modules.values()):  # trainer modules bound the name at import
        # vars(), not getattr: a lazy TRL module would import its optional submodules on attribute access.
        name = getattr(module, "__name__", None)
        if (isinstance(name, str) and name.startswith("trl.") and module is not trl_utils
                and vars(module).get("add_fused_lm_head") is original):
            patch.rebind(module, "add_fused_lm_head", add_fused_lm_head)


def _patched_policy_of_trainer_being_built(model: nn.Module) -> Optional[nn.Module]:
    """The patched causal LM of the TRL trainer whose ``__init__`` is adding a head to ``model`` (its reference
    model); ``None`` when no trainer is being built or its policy is not patched."""
    trainer = _TRAINER_BEING_BUILT.get()
    policy = getattr(trainer, "model", None)
    if isinstance(policy, nn.Module) and policy is not model and is_fused(policy):
        return find_causal_lm(policy)
    return None


def _wrap_trainer_init(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """TRL's trainers raise when a PEFT adapter sits on lm_head, because TRL's head would ignore it. On a patched
    model hf_fused computes the head with the adapter (:func:`hf_fused.model.lm_head.head_tensors`), so while such a
    trainer is built around a patched model its lm_head check sees the layer under the adapter. The wrapped
    ``__init__`` also names the trainer being built (for reference models) and, once it has returned, has a GRPO or
    RLOO trainer under tensor parallelism train each tensor-parallel group as one data-parallel replica
    (:func:`~hf_fused.integrations.trl.tensor_parallel.serve_tensor_parallel_rollouts`). Not where hf_fused refused
    TRL's protocol (TRL's head then computes, without the adapter)."""
    if refused_reason() is not None:
        return
    cls = getattr(module, _TRAINERS_REFUSING_HEAD_ADAPTERS[module.__name__])
    init = cls.__init__
    live = patch.liveness()

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not live():
            return init(self, *args, **kwargs)
        model = kwargs.get("model", args[0] if args else None)
        token = _TRAINER_BEING_BUILT.set(self)
        try:
            with lm_head_adapter_hidden_from_trl(model):
                init(self, *args, **kwargs)
        finally:
            _TRAINER_BEING_BUILT.reset(token)
        if isinstance(model, nn.Module) and is_fused(model):  # GRPO, RLOO under tensor parallelism: per group
            serve_tensor_parallel_rollouts(self)

    __init__.__hf_fused__ = True
    patch.rebind(cls, "__init__", __init__)


@contextlib.contextmanager
def lm_head_adapter_hidden_from_trl(model):
    """While a TRL trainer is built around a patched ``model``, ``get_output_embeddings()`` returns the layer *under*
    a PEFT adapter on lm_head, so TRL's "adapter on lm_head is not supported" check passes. Only the causal LM's
    instance attribute is touched, and it is removed on exit. No-op for an unpatched model (TRL's check stands)."""
    if not isinstance(model, nn.Module) or not is_fused(model):
        yield
        return
    inner = find_causal_lm(model)
    if "get_output_embeddings" in inner.__dict__:  # someone else's instance patch (or ours, nested): leave it
        yield
        return
    cls_get = type(inner).get_output_embeddings

    def get_output_embeddings(self):
        head = cls_get(self)
        while hasattr(head, "get_base_layer") and hasattr(head, "active_adapters"):  # peft BaseTunerLayer
            head = head.get_base_layer()
        return head

    inner.get_output_embeddings = types.MethodType(get_output_embeddings, inner)
    try:
        yield
    finally:
        del inner.get_output_embeddings


_TRL_VERSIONS = "trl 1.16 (its fused-head protocol, checked at install: protocol.ADD_HEAD_PARAMETERS, OUTPUT_FIELDS)"

TRL_FUSED_HEAD = ThirdPartyPatch(
    name="add_fused_lm_head",
    module="trl.trainer.utils",
    target="trl.trainer.utils.add_fused_lm_head, and the same name in every TRL module that imported it",
    trigger="first apply_fused_loss; applied when trl.trainer.utils is imported (at once if it is)",
    versions=_TRL_VERSIONS,
    why="TRL's trainers install their own chunked head, which reads lm_head.weight and bypasses the patched forward",
    passes_through="unpatched models (other than a patched policy's reference model): TRL's head, unchanged",
    apply=_wrap_add_fused_lm_head,
    aliases_in="trl",
)

TRL_HEAD_ADAPTER_CHECKS = tuple(
    ThirdPartyPatch(
        name=f"{cls}.__init__",
        module=module,
        target=f"{module}.{cls}.__init__",
        trigger=f"first apply_fused_loss; applied when {module} is imported (at once if it is)",
        versions=_TRL_VERSIONS,
        why="TRL refuses a PEFT adapter on lm_head (its head would skip it); hf_fused computes the head with it; "
            "names the trainer being built, whose reference model is patched like its policy",
        passes_through="an unpatched model: TRL's check and __init__, unchanged",
        apply=_wrap_trainer_init,
    )
    for module, cls in _TRAINERS_REFUSING_HEAD_ADAPTERS.items()
)
