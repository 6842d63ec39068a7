"""Installing hf_fused's answer to TRL's fused head: once per process, when TRL's modules are imported.

The first :func:`hf_fused.apply_fused_loss` registers the hooks below on TRL's modules
(:func:`hf_fused.integrations.import_hooks.when_imported`): those already loaded are adjusted at once, the others
right after they are imported, before any trainer can be built from them. So patching never imports TRL (seconds,
for its trainers); a process pays for TRL only when it imports it, and whatever order the user takes
(patch, then import and build a trainer; or import, patch, build; or build, then patch) finds the hooks in place.

* ``add_fused_lm_head`` (in ``trl.trainer.utils`` and every loaded TRL module that imported it) is wrapped: for a
  patched model it only records the trainer's options; a reference model added while a trainer around a patched
  policy is being built is patched too; every other model gets TRL's head.
* TRL's trainers are let through their "no PEFT adapter on lm_head" check while they are built around a patched
  model (hf_fused computes the head with the adapter).
* ``DistillationTrainer`` warns, once, that its divergence loss stays on TRL's kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
import warnings
from typing import Optional

import torch.nn as nn

from ...model.patch import is_fused
from ...model.unwrap import find_causal_lm
from ..import_hooks import when_imported
from .protocol import OPTIONS_ATTR, TrlHeadOptions, protocol_mismatch, trl_head_options_in


def serve_trl_fused_head(causal_lm: nn.Module) -> None:
    """Make ``causal_lm`` (just patched by :func:`hf_fused.apply_fused_loss`) answer TRL's fused-head calls.

    Reads the options of a TRL head already installed on the model (patched after the trainer was built) and
    has TRL's ``add_fused_lm_head`` wrapped (once per process, when TRL's modules are imported; see the module
    docstring) for trainers built afterwards. Does not import TRL. No-op without TRL.

    Raises:
        TrlProtocolError: a TRL head is installed on the model but its shape is not TRL 1.16's.
    """
    if importlib.util.find_spec("trl") is None:
        return
    _install_hooks()
    options = trl_head_options_in(causal_lm._hf_fused.original_forward(causal_lm))
    if options is not None:
        setattr(causal_lm, OPTIONS_ATTR, options)


def trl_head_options(model: nn.Module) -> Optional[TrlHeadOptions]:
    """The TRL head options hf_fused serves on ``model`` (``None`` if no TRL trainer asked for a head)."""
    return find_causal_lm(model).__dict__.get(OPTIONS_ATTR)


_HOOK: dict = {}  # "installed": hooks registered; "original": TRL's add_fused_lm_head; "refused": why not served


def _install_hooks() -> None:
    """Once per process: register the hooks on TRL's modules (run now for those already imported)."""
    if _HOOK:
        return
    _HOOK["installed"] = True
    when_imported("trl.trainer.utils", _wrap_add_fused_lm_head)
    for module_name in _TRAINERS_REFUSING_HEAD_ADAPTERS:
        when_imported(module_name, _let_trainer_accept_lm_head_adapters)
    when_imported("trl.trainer.distillation_trainer", _warn_on_distillation_trainer)


def _wrap_add_fused_lm_head(trl_utils: types.ModuleType) -> None:
    """Wrap ``add_fused_lm_head`` (see the module docstring) in ``trl.trainer.utils`` and in every loaded TRL module
    that imported it; or, for a TRL whose protocol is not 1.16's, record why not and warn."""
    original = trl_utils.add_fused_lm_head
    _HOOK["original"] = original
    why = protocol_mismatch(trl_utils)
    if why is not None:
        _HOOK["refused"] = why
        warnings.warn(
            f"hf_fused: {why}. TRL's trainers will use TRL's own fused head on this model, not hf_fused's; a "
            "fused call on a patched model raises. hf_fused serves TRL 1.16's protocol.",
            stacklevel=3,
        )
        return

    @functools.wraps(original)
    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        options = TrlHeadOptions(float(temperature), bool(cast_lm_head_to_fp32), tuple(outputs))
        if not is_fused(model):
            policy = _patched_policy_of_trainer_being_built(model)
            if policy is None:
                return original(model, temperature, cast_lm_head_to_fp32, outputs)
            from ...model.patch import apply_fused_loss

            # A reference model: computed by hf_fused like the policy it is compared with.
            state = policy._hf_fused
            apply_fused_loss(model, tile_budget_bytes=state.tile_budget_bytes, backend=state.backend)
        setattr(find_causal_lm(model), OPTIONS_ATTR, options)

    add_fused_lm_head.__hf_fused__ = True
    for module in list(sys.modules.values()):  # trainer modules bound the name at import
        # vars(), not getattr: a lazy TRL module would import its optional submodules on attribute access.
        name = getattr(module, "__name__", None)
        if isinstance(name, str) and name.startswith("trl") and vars(module).get("add_fused_lm_head") is original:
            module.add_fused_lm_head = add_fused_lm_head


#: TRL 1.16 trainers that refuse a PEFT adapter on lm_head (their head would read the bare weight).
_TRAINERS_REFUSING_HEAD_ADAPTERS = {
    "trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
    "trl.trainer.kto_trainer": "KTOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer",
    "trl.trainer.grpo_trainer": "GRPOTrainer",
}


def _let_trainer_accept_lm_head_adapters(module: types.ModuleType) -> None:
    """TRL's trainers raise when a PEFT adapter sits on lm_head, because TRL's head would ignore it. On a patched
    model hf_fused computes the head with the adapter (:func:`hf_fused.model.lm_head.head_tensors`), so while such a
    trainer is built around a patched model its lm_head check sees the layer under the adapter. Not where hf_fused
    refused TRL's protocol (TRL's head then computes, without the adapter)."""
    if "refused" in _HOOK:
        return
    cls = getattr(module, _TRAINERS_REFUSING_HEAD_ADAPTERS[module.__name__])
    init = cls.__init__
    if getattr(init, "__hf_fused__", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        with lm_head_adapter_hidden_from_trl(model):
            init(self, *args, **kwargs)

    __init__.__hf_fused__ = True
    cls.__init__ = __init__


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


def _patched_policy_of_trainer_being_built(model: nn.Module) -> Optional[nn.Module]:
    """The patched causal LM of the trainer whose ``__init__`` is adding a head to ``model`` (its reference
    model), found on the call stack; ``None`` when there is none or its policy is not patched."""
    from transformers import Trainer

    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            policy = getattr(owner, "model", None)
            if isinstance(policy, nn.Module) and policy is not model and is_fused(policy):
                return find_causal_lm(policy)
            return None
        frame = frame.f_back
    return None


def _warn_on_distillation_trainer(module: types.ModuleType) -> None:
    """``DistillationTrainer`` computes a student–teacher divergence from the lm_head weights itself, which
    hf_fused has no op for: say so once when it is given a patched model, and leave it on TRL's kernel."""
    if "refused" in _HOOK:
        return
    DistillationTrainer = module.DistillationTrainer
    init = DistillationTrainer.__init__
    if getattr(init, "__hf_fused__", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models = [getattr(self, "model", None), getattr(self, "teacher_model", None)]
        if any(isinstance(m, nn.Module) and is_fused(m) for m in models) and not _DISTILLATION_WARNED:
            _DISTILLATION_WARNED.append(True)
            warnings.warn(
                "hf_fused does not compute DistillationTrainer's loss: its student–teacher divergence reads both "
                "lm_head weights directly (trl/kernels/chunked_divergence.py) and hf_fused has no divergence op. "
                "Training uses TRL's chunked kernel, which also never builds the full logits; apply_fused_loss "
                "has no effect on this trainer's loss (generation is unchanged).",
                UserWarning,
                stacklevel=2,
            )

    __init__.__hf_fused__ = True
    DistillationTrainer.__init__ = __init__


_DISTILLATION_WARNED: list = []
