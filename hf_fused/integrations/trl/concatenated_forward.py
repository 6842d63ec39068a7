"""TRL's experimental ``ORPOTrainer`` and ``CPOTrainer`` on hf_fused: their ``concatenated_forward`` from hidden states.

Both trainers (TRL 1.16, ``trl.experimental.orpo`` / ``trl.experimental.cpo``) run the chosen and rejected rows in one
call of the model without labels, so it builds the full ``[B, T, V]`` logits, and return from them
``(chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss[, aux_loss])``:

* the log-probs of each row's completion (``get_batch_logps`` over ``concatenated_labels``; averaged per row for
  ORPO and for CPO's ``ipo`` / ``simpo``, summed otherwise);
* the negative log-likelihood of the chosen rows (``nn.CrossEntropyLoss``: ORPO over every attended token, prompt
  included; CPO over the completion, and 0 when ``cpo_alpha == 0``);
* the logits themselves, which ``get_batch_loss_metrics`` reads only as ``logits.detach().mean()`` (the
  ``logits/chosen`` and ``logits/rejected`` metrics; ORPO's without the last position).

The entries :data:`TRL_ORPO` and :data:`TRL_CPO` of the inventory wrap ``concatenated_forward``: for a patched model
(:func:`fused_concatenated_forward`) one call through TRL's fused-head protocol (``fused_lm_head=True``, answered by
:func:`~hf_fused.integrations.trl.head.trl_fused_forward` inside lm_head's call, as for ``DPOTrainer``) scores every
position's next token and its mean logit (the last position's with a placeholder label), and the tuple is formed
from those: the same log-probs, NLL and logits means, with no ``[B, T, V]`` tensor (each "logits" element is the
``[rows, positions]`` mean logits, whose mean is the logits' mean).

Where its options do not allow it, ``concatenated_forward`` is TRL's (full logits) and, while training, a one-time
:class:`~hf_fused.model.FusedLossBypassedWarning` says why: an encoder-decoder model, a subclass with its own
``get_batch_loss_metrics`` (it may read the logits), labels that are not the input ids where they count. An
unpatched model gets TRL's method silently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn as nn

from ...model import find_causal_lm, is_fused
from ..patching import ThirdPartyPatch
from .bypass import subclass_defines, warn_full_logits_once
from .protocol import OPTIONS_ATTR, TrlHeadOptions

#: ``concatenated_forward``'s parameters in TRL 1.16 and the methods :func:`fused_concatenated_forward` calls.
CONCATENATED_FORWARD = ("self", "model", "batch")
CONCATENATED_INPUTS = ("batch", "is_encoder_decoder", "padding_value", "device")
#: What TRL 1.16's labels hold where a token is not scored (``get_batch_logps``, ``concatenated_inputs``).
IGNORED = -100
#: The head's outputs asked for: every position's log-prob of its next token and its mean logit.
HEAD_OPTIONS = TrlHeadOptions(outputs=("log_probs", "mean_logits"))


def fused_concatenated_forward(trainer, model: nn.Module, batch: dict, kind: str) -> tuple:
    """``ORPOTrainer.concatenated_forward`` (``kind="orpo"``) or ``CPOTrainer``'s (``"cpo"``) of TRL 1.16 for a
    patched, decoder-only model whose ``concatenated_labels`` are its input ids or -100
    (:func:`_why_not_fused`): the module docstring's tuple from one fused-head call."""
    padding_value = trainer.padding_value if kind == "orpo" else trainer.pad_token_id
    concatenated = trainer.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=padding_value,
                                               device=trainer.accelerator.device)
    input_ids = concatenated["concatenated_input_ids"]
    attention_mask = concatenated["concatenated_attention_mask"]
    labels = concatenated["concatenated_labels"]
    len_chosen = batch["chosen_labels"].shape[0]
    # position t scores input_ids[t + 1]; the last position a placeholder, scored only for its mean logit
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    model_kwargs = {"output_router_logits": True} if trainer.aux_loss_enabled else {}
    with _head_options(model):
        out = model(input_ids, attention_mask=attention_mask, use_cache=False, shift_labels=next_ids,
                    fused_lm_head=True, **model_kwargs)
    logps, mean_logits = out.log_probs[:, :-1], out.mean_logits

    completion = labels[:, 1:] != IGNORED
    completion_logps = (logps * completion).sum(-1)
    if kind == "orpo" or trainer.loss_type in ("ipo", "simpo"):
        completion_logps = completion_logps / completion.sum(-1)
    if kind == "orpo":  # every attended token of the chosen rows, prompt included
        nll_loss = -logps[:len_chosen][attention_mask[:len_chosen, 1:] == 1].mean()
        chosen_logits, rejected_logits = mean_logits[:len_chosen, :-1], mean_logits[len_chosen:, :-1]
    else:
        if trainer.cpo_alpha == 0:
            nll_loss = torch.tensor(0.0).to(trainer.accelerator.device)
        else:
            nll_loss = -logps[:len_chosen][labels[:len_chosen, 1:] != IGNORED].mean()
        chosen_logits, rejected_logits = mean_logits[:len_chosen], mean_logits[len_chosen:]
    result = (completion_logps[:len_chosen], completion_logps[len_chosen:], chosen_logits, rejected_logits, nll_loss)
    return result + (out.aux_loss,) if trainer.aux_loss_enabled else result


@contextlib.contextmanager
def _head_options(model: nn.Module):
    """The patched model's TRL head options set to :data:`HEAD_OPTIONS` for one call (another trainer's put back)."""
    causal_lm = find_causal_lm(model)
    previous = causal_lm.__dict__.get(OPTIONS_ATTR)
    setattr(causal_lm, OPTIONS_ATTR, HEAD_OPTIONS)
    try:
        yield
    finally:
        if previous is None:
            delattr(causal_lm, OPTIONS_ATTR)
        else:
            setattr(causal_lm, OPTIONS_ATTR, previous)


def _why_not_fused(trainer, trainer_cls: type, batch: dict, kind: str) -> Optional[str]:
    """Why this call keeps TRL's method (full logits), or ``None``."""
    if trainer.is_encoder_decoder:
        return "the model is an encoder-decoder, which hf_fused does not patch"
    if subclass_defines(type(trainer), trainer_cls, "get_batch_loss_metrics"):
        return (f"{type(trainer).__qualname__} overrides get_batch_loss_metrics, which may read the full logits; keep "
                "TRL's method, or compute from model(..., fused_output='logprobs')")
    for side in ("chosen", "rejected"):
        ids, labels = batch[f"{side}_input_ids"], batch[f"{side}_labels"]
        if ids.shape != labels.shape or not bool(((labels == ids) | (labels == IGNORED)).all()):
            return (f"{side}_labels are not the input ids (or -100) where they count, so the scored tokens are not "
                    "the next input tokens hf_fused computes")
    return None


# -- the inventory's entries -------------------------------------------------------------------------------------


def shape_mismatch(trainer_cls: type) -> Optional[str]:
    """Why the installed TRL's trainer is not the one answered here (``None`` when it is)."""
    for method, expected in (("concatenated_forward", CONCATENATED_FORWARD),
                             ("concatenated_inputs", CONCATENATED_INPUTS)):
        found = tuple(inspect.signature(getattr(trainer_cls, method)).parameters)
        if found != expected:
            return f"{trainer_cls.__name__}.{method} takes {found}, expected {expected}"
    return None


def _installer(kind: str, class_name: str):
    def install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
        """Wrap ``concatenated_forward`` (a patched model's from hidden states); or, for a TRL whose trainer has
        another shape, record why not and warn."""
        trainer_cls = getattr(module, class_name)
        why = shape_mismatch(trainer_cls)
        if why is not None:
            patch.refuse(why, f"{class_name} will build the full logits, on patched models too. hf_fused serves TRL "
                              f"1.16's {class_name}.")
            return
        live = patch.liveness()
        original = trainer_cls.concatenated_forward

        @functools.wraps(original)
        def concatenated_forward(self, model, batch):
            if not (live() and isinstance(self, trainer_cls) and is_fused(model)):
                return original(self, model, batch)
            why_not = _why_not_fused(self, trainer_cls, batch, kind)
            if why_not is None:
                return fused_concatenated_forward(self, model, batch, kind)
            if model.training and torch.is_grad_enabled():
                warn_full_logits_once(model, f"{class_name}.concatenated_forward builds the model's full [tokens, "
                                      f"vocab] logits here, not hf_fused's tiles, because {why_not}.")
            return original(self, model, batch)

        concatenated_forward.__hf_fused__ = True
        patch.rebind(trainer_cls, "concatenated_forward", concatenated_forward)

    return install


def _entry(kind: str, class_name: str) -> ThirdPartyPatch:
    module = f"trl.experimental.{kind}.{kind}_trainer"
    return ThirdPartyPatch(
        name=f"{class_name}.concatenated_forward",
        module=module,
        target=f"{module}.{class_name}.concatenated_forward",
        trigger=f"first apply_fused_loss; applied when {module} is imported (at once if it is)",
        versions="trl 1.16 (concatenated_forward's and concatenated_inputs' parameters checked at install; another "
                 "shape: nothing wrapped, a warning)",
        why=f"{class_name} computes its log-probs, NLL and logits metrics from the model's full [B, T, V] logits; "
            "hf_fused computes them for a patched model from its hidden states",
        passes_through="an unpatched model, and (with a one-time warning saying why) an encoder-decoder, a subclass's "
                       "own get_batch_loss_metrics or labels that are not the input ids: TRL's method",
        apply=_installer(kind, class_name),
    )


TRL_ORPO = _entry("orpo", "ORPOTrainer")
TRL_CPO = _entry("cpo", "CPOTrainer")
