"""TRL's experimental ``OnlineDPOTrainer`` on hf_fused: the completions' log-probs from hidden states.

TRL 1.16's ``OnlineDPOTrainer._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)`` (policy,
reference and the adapter-disabled reference of a PEFT policy) runs the model without labels on the prompt and the
generated completion, so it builds the full ``[B, T, V]`` logits, and returns the log-probs of the completion tokens
(``torch.take_along_dim(logits[:, prompt_len − 1 : −1].log_softmax(−1), completion_ids)``, the prompt truncated on
the left to ``max_length``). The entry :data:`TRL_ONLINE_DPO` of the inventory wraps ``_forward``: for a patched model
(:func:`fused_completion_logprobs`) the same truncation and the same positions, scored by the patched forward's
``fused_output="logprobs"`` (no ``[B, T, V]`` tensor). Vision inputs keep TRL's method (a one-time
:class:`~hf_fused.model.FusedLossBypassedWarning` says so while training); an unpatched model gets it silently.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn as nn

from ...model import is_fused
from ..patching import ThirdPartyPatch
from .bypass import warn_full_logits_once

#: ``OnlineDPOTrainer._forward``'s parameters in TRL 1.16.
FORWARD_PARAMETERS = ("self", "model", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                      "vision_inputs")
#: What labels hold at a position no completion token is scored at.
IGNORED = -100


def fused_completion_logprobs(trainer, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                              completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """``OnlineDPOTrainer._forward`` of TRL 1.16 for a patched model and no vision inputs: the completion tokens'
    log-probs ``[B, C]`` fp32, position ``prompt_len − 1 + j`` scoring ``completion_ids[:, j]`` (position ``j``
    without a prompt, as TRL slices it), from the patched forward's ``fused_output="logprobs"``."""
    truncate = max(prompt_ids.size(1) + completion_ids.size(1) - trainer.max_length, 0)
    prompt_ids, prompt_mask = prompt_ids[:, truncate:], prompt_mask[:, truncate:]
    input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
    attention_mask = torch.cat((prompt_mask, completion_mask), dim=1)
    start = prompt_ids.size(1) - 1 if prompt_ids.size(1) > 0 else 0
    width = completion_ids.size(1)
    labels = torch.full_like(input_ids, IGNORED)
    labels[:, start : start + width] = completion_ids
    out = model(input_ids, attention_mask=attention_mask, shift_labels=labels, fused_output="logprobs")
    return out.logprobs[:, start : start + width]


# -- the inventory's entry ---------------------------------------------------------------------------------------


def forward_shape_mismatch(trainer_cls: type) -> Optional[str]:
    """Why the installed TRL's ``OnlineDPOTrainer`` is not the one answered here (``None`` when it is)."""
    found = tuple(inspect.signature(trainer_cls._forward).parameters)
    if found != FORWARD_PARAMETERS:
        return f"OnlineDPOTrainer._forward takes {found}, expected {FORWARD_PARAMETERS}"
    return None


def _install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Wrap ``OnlineDPOTrainer._forward`` (a patched model's log-probs from hidden states); or, for a TRL whose
    trainer has another shape, record why not and warn."""
    trainer_cls = module.OnlineDPOTrainer
    why = forward_shape_mismatch(trainer_cls)
    if why is not None:
        patch.refuse(why, "OnlineDPOTrainer will build the full logits, on patched models too. hf_fused serves TRL "
                          "1.16's OnlineDPOTrainer.")
        return
    live = patch.liveness()
    original = trainer_cls._forward

    @functools.wraps(original)
    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        if not (live() and isinstance(self, trainer_cls) and is_fused(model)):
            return original(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        if vision_inputs is None:
            return fused_completion_logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if model.training and torch.is_grad_enabled():
            warn_full_logits_once(model, "OnlineDPOTrainer._forward builds the model's full [tokens, vocab] logits "
                                         "here, not hf_fused's tiles, because the batch has vision inputs, which "
                                         "hf_fused does not route.")
        return original(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)

    _forward.__hf_fused__ = True
    patch.rebind(trainer_cls, "_forward", _forward)


TRL_ONLINE_DPO = ThirdPartyPatch(
    name="OnlineDPOTrainer._forward",
    module="trl.experimental.online_dpo.online_dpo_trainer",
    target="trl.experimental.online_dpo.online_dpo_trainer.OnlineDPOTrainer._forward",
    trigger="first apply_fused_loss; applied when trl.experimental.online_dpo.online_dpo_trainer is imported (at "
            "once if it is)",
    versions="trl 1.16 (_forward's parameters checked at install; another shape: nothing wrapped, a warning)",
    why="OnlineDPOTrainer builds the model's full [B, T, V] logits for its completions' log-probs (policy and "
        "reference); hf_fused computes them for a patched model from its hidden states",
    passes_through="an unpatched model, and (with a one-time warning while training) a batch with vision inputs: "
                   "TRL's method",
    apply=_install,
)
