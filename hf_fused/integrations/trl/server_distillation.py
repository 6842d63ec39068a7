"""TRL's experimental ``ServerDistillationTrainer`` on hf_fused: its loss against the teacher's top-k log-probs (fetched
from a vLLM server) from the student's hidden states, by :func:`hf_fused.ops.sparse_distillation_loss`.

TRL 1.16's ``ServerDistillationTrainer.compute_loss`` calls the student without labels, so it builds the full
``[B, T, V]`` logits, takes their log-softmax over the completion positions, fetches the teacher's top-k log-probs
(``_get_teacher_token_logprobs_from_server``) and computes a divergence on a sparse support: at ``beta = 0`` forward KL
on the teacher's top-``loss_top_k`` (valid where the teacher's log-prob is finite), at ``beta > 0`` the generalized
JSD on the teacher's top-1 and the completion's own token (deduplicated; the completion's token alone at
``beta = 1``), with a tail bucket (``loss_add_tail``) or renormalized, averaged over the completion tokens
(``"batchmean"``) and divided by the gradient accumulation steps while training. The entry
:data:`TRL_SERVER_DISTILLATION` of the inventory wraps ``compute_loss``: for a patched student
(:func:`fused_server_loss`) the same support, teacher values and reduction, with the student's log-probs at the
support computed inside its lm_head call from its hidden states (no ``[B, T, V]`` tensor; engines hook the call as
in a forward; a LoRA adapter on lm_head included, as TRL's ``DistillationTrainer.__init__`` lets it through for a
patched model), by calling the student through its wrappers with :data:`CALL_KEYWORD`, which the extension
registered here answers (:func:`sparse_distillation_forward`).

Where its options do not allow it, ``compute_loss`` is TRL's (full logits) and, while training, a one-time
:class:`~hf_fused.model.FusedLossBypassedWarning` says why and what to do: ``return_outputs=True`` (the caller wants
the student's logits), ``reverse_kl_top_1_mode="argmax"`` (the student's own top-1, which TRL's config refuses), a
subclass overriding one of TRL's loss methods on the full log-probs (:data:`LOSS_METHODS`). An unpatched student gets
TRL's method silently. TRL's own errors for a teacher that misses required log-probs are raised as TRL raises them.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ...model import (
    FusedRequest, ModelExtension, as_kwargs, head_tensors, is_fused, register_extension, run_intercepted,
)
from ...ops import sparse_distillation_loss
from ..patching import ThirdPartyPatch
from .bypass import subclass_defines, warn_full_logits_once

#: The keyword of the patched student's call that computes the sparse divergence (:func:`sparse_distillation_forward`).
CALL_KEYWORD = "hf_fused_sparse_distillation"
#: ``ServerDistillationTrainer``'s methods and their parameters in TRL 1.16 that :func:`fused_server_loss` uses.
SERVER_METHODS = {
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "_compute_prompt_length": ("self", "inputs"),
    "_get_teacher_token_logprobs_from_server": ("self", "inputs", "aligned_prompt_length"),
}


@dataclass(frozen=True)
class SparseCall:
    """What ``model(..., hf_fused_sparse_distillation=SparseCall(...))`` computes at the positions that reach lm_head
    (``[B, L]``): :func:`hf_fused.ops.sparse_distillation_loss` of ``support_ids``, ``teacher_logprobs`` and
    ``support_mask`` (``[B, L, K]``) over the positions ``mask`` keeps, with ``beta``, ``temperature``,
    ``add_tail_bucket``, ``"mean"`` reduction."""

    support_ids: torch.Tensor
    teacher_logprobs: torch.Tensor
    support_mask: torch.Tensor
    mask: torch.Tensor
    beta: float
    temperature: float
    add_tail_bucket: bool


def _whole(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An FSDP2 DTensor gathered once (``full_tensor()``, differentiable), other tensors as given."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def student_sparse_divergence(lm_head: nn.Module, hidden: torch.Tensor, state, call: SparseCall) -> tuple:
    """``(loss, divergence, entropy, teacher_entropy)`` of :func:`hf_fused.ops.sparse_distillation_loss` for the
    student's ``lm_head`` (read as hf_fused reads it: a LoRA adapter included) on ``hidden`` ``[..., H]``, with the
    patched student's measured logit transform and options (``state``)."""
    head_hidden, weight, bias = head_tensors(lm_head, hidden)
    device = head_hidden.device
    out = sparse_distillation_loss(
        head_hidden, _whole(weight), call.support_ids.to(device), call.teacher_logprobs.to(device), _whole(bias),
        support_mask=call.support_mask.to(device), mask=call.mask.to(device), beta=call.beta,
        temperature=call.temperature, add_tail_bucket=call.add_tail_bucket, logit_scale=state.transform.logit_scale,
        softcap=state.transform.softcap, reduction="mean", tile_budget_bytes=state.tile_budget_bytes,
        backend=state.backend,
    )
    return out.loss, out.divergence, out.entropy, out.teacher_entropy


def sparse_distillation_forward(causal_lm: nn.Module, *args, **kwargs) -> tuple:
    """Answer ``model(*args, hf_fused_sparse_distillation=call, **kwargs)`` on a patched causal LM: its original forward
    runs with ``labels=None`` and its lm_head call answered by :func:`student_sparse_divergence`.

    Returns:
        ``(loss, divergence [B, L], entropy [B, L], teacher_entropy [B, L])``.

    Raises:
        RuntimeError: the forward did not call its lm_head.
    """
    state = causal_lm._hf_fused
    original = state.original_forward(causal_lm)
    if args:
        kwargs = as_kwargs(inspect.signature(original), args, kwargs)
    call: SparseCall = kwargs.pop(CALL_KEYWORD)
    for name in ("labels", "shift_labels", "return_dict", "num_items_in_batch", "logits_to_keep"):
        kwargs.pop(name, None)
    kwargs["use_cache"] = False
    request = FusedRequest(mode="loss", state=state)
    request.head = lambda lm_head, hidden: student_sparse_divergence(lm_head, hidden, state, call)
    run_intercepted(causal_lm, original, kwargs, request,
                    "compute the sparse distillation loss from its hidden states")
    return tuple(request.result)


def fused_server_loss(trainer, model: nn.Module, inputs: dict) -> torch.Tensor:
    """``ServerDistillationTrainer.compute_loss(model, inputs)`` of TRL 1.16 for a patched student: the same inputs
    rebuilt from the generation's keys, the same teacher request (``trainer._get_teacher_token_logprobs_from_server``),
    the same support and reduction, the student's side from its hidden states (module docstring).

    Raises:
        ValueError: as TRL, when the teacher misses the realized token's or its top-1 log-prob at a completion
            position that needs it (``beta > 0``).
    """
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    completion_labels = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100))
    labels = torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1)
    inputs = {**inputs, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
              "prompt_attention_mask": prompt_mask}
    prompt_length = trainer._compute_prompt_length(inputs)
    teacher = trainer._get_teacher_token_logprobs_from_server(inputs, prompt_length)
    comp_len = teacher["actual_logprobs"].shape[1]
    tokens = input_ids[:, prompt_length:][:, :comp_len]
    required = labels[:, prompt_length:][:, :comp_len] != -100
    beta = float(trainer.beta)
    if beta > 0:
        ids, teacher_logprobs, valid = _top1_and_realized(trainer, teacher, tokens, required, beta)
    else:
        teacher_logprobs, ids = teacher["topk_logprobs"], teacher["topk_token_ids"]
        valid = teacher_logprobs > float("-inf")
    # The student's logits at position j predict token j + 1: its completion window starts at prompt_length − 1.
    batch, length = input_ids.shape
    k = ids.shape[-1]
    window = slice(prompt_length - 1, prompt_length - 1 + comp_len)
    full_ids = torch.zeros((batch, length, k), dtype=torch.long, device=input_ids.device)
    full_teacher = torch.zeros((batch, length, k), dtype=torch.float32, device=input_ids.device)
    full_valid = torch.zeros((batch, length, k), dtype=torch.bool, device=input_ids.device)
    mask = torch.zeros((batch, length), dtype=torch.bool, device=input_ids.device)
    full_ids[:, window] = torch.where(valid, ids, 0)
    full_teacher[:, window] = teacher_logprobs.float()
    full_valid[:, window] = valid
    mask[:, window] = required
    call = SparseCall(full_ids, full_teacher, full_valid, mask, beta, float(trainer.temperature),
                      bool(trainer.loss_add_tail))
    loss = model(input_ids=input_ids, attention_mask=attention_mask, **{CALL_KEYWORD: call})[0]
    if trainer.model.training:
        loss = loss / trainer.current_gradient_accumulation_steps
    return loss


def _top1_and_realized(trainer, teacher: dict, tokens, required, beta: float):
    """The ``beta > 0`` support of TRL's ``_compute_server_sparse_top_1_divergence_loss``: ``(ids, teacher log-probs,
    valid)``, ``[B, T, 1]`` (the realized token) at ``beta = 1``, else ``[B, T, 2]`` (the teacher's top-1 and the
    realized token, the second invalid where it is the first), after TRL's checks and its zeroing of padding."""
    top1, top1_ids, actual = teacher["topk_logprobs"], teacher["topk_token_ids"], teacher["actual_logprobs"]
    missing = required & ~torch.isfinite(actual)
    if missing.any():
        raise ValueError("Teacher server is missing actual-token logprobs for required reverse-KL positions: "
                         f"{int(missing.sum().item())}/{int(required.sum().item())}.")
    if beta < 1:
        missing = required & ~torch.isfinite(top1.squeeze(-1))
        if missing.any():
            raise ValueError("Teacher server is missing top-1 logprobs for required forward-KL positions: "
                             f"{int(missing.sum().item())}/{int(required.sum().item())}.")
    top1 = torch.where(~required.unsqueeze(-1), 0.0, top1).squeeze(-1)
    actual = torch.where(~required, 0.0, actual)
    if beta == 1:
        return tokens.unsqueeze(-1), actual.unsqueeze(-1), torch.ones_like(tokens, dtype=torch.bool).unsqueeze(-1)
    ids = torch.stack([top1_ids.squeeze(-1), tokens], dim=-1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[..., 1] = ids[..., 1] != ids[..., 0]
    return ids, torch.stack([top1, actual], dim=-1), valid


#: TRL's loss methods on the student's full log-probs: a subclass that overrides one keeps TRL's ``compute_loss``.
LOSS_METHODS = ("_compute_server_forward_kl_loss", "_compute_server_sparse_top_1_divergence_loss",
                "_compute_sparse_top_1_divergence_loss", "_reduce_divergence_loss")


def _why_not_fused(trainer, trainer_cls: type, return_outputs: bool) -> Optional[str]:
    """Why :func:`fused_server_loss` cannot answer this call for a patched student (``None`` when it can)."""
    if return_outputs:
        return ("the caller asked for the student's outputs (return_outputs=True), which hold its logits; call "
                "compute_loss without return_outputs to train on hf_fused's loss")
    if getattr(trainer, "reverse_kl_top_1_mode", "sampled") != "sampled":
        return ("reverse_kl_top_1_mode is not 'sampled': the student's own top-1 token is not a support the teacher "
                "server scored; use 'sampled' (TRL's config accepts no other)")
    overridden = [name for name in LOSS_METHODS if subclass_defines(type(trainer), trainer_cls, name)]
    if overridden:
        return (f"{type(trainer).__qualname__} overrides {', '.join(overridden)}, a loss of the student's full "
                "log-probs that hf_fused cannot compute from hidden states; keep TRL's methods, or compute your loss "
                "with hf_fused.ops.sparse_distillation_loss from model(..., fused_output='hidden_states')")
    return None


# -- the inventory's entry ---------------------------------------------------------------------------------------


def server_shape_mismatch(trainer_cls: type) -> Optional[str]:
    """Why the installed TRL's ``ServerDistillationTrainer`` is not the one answered here (``None`` when it is)."""
    for name, expected in SERVER_METHODS.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            return f"ServerDistillationTrainer has no {name}"
        found = tuple(inspect.signature(method).parameters)
        if found != expected:
            return f"ServerDistillationTrainer.{name} takes {found}, expected {expected}"
    return None


def _install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Wrap ``ServerDistillationTrainer.compute_loss`` (a patched student's loss from hidden states); or, for a TRL
    whose trainer has another shape, record why not and warn."""
    trainer_cls = module.ServerDistillationTrainer
    why = server_shape_mismatch(trainer_cls)
    if why is not None:
        patch.refuse(why, "ServerDistillationTrainer will compute its loss from the student's full logits, on patched "
                          "models too. hf_fused serves TRL 1.16's ServerDistillationTrainer.")
        return
    live = patch.liveness()
    original = trainer_cls.compute_loss

    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (live() and isinstance(self, trainer_cls) and is_fused(model)):
            return original(self, model, inputs, return_outputs=return_outputs,
                            num_items_in_batch=num_items_in_batch)
        why_not = _why_not_fused(self, trainer_cls, return_outputs)
        if why_not is None:
            return fused_server_loss(self, model, inputs)
        if model.training and torch.is_grad_enabled():
            warn_full_logits_once(model, "ServerDistillationTrainer.compute_loss computes its loss from the student's "
                                  f"full [tokens, vocab] logits here, not from hidden states, because {why_not}.")
        return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    compute_loss.__hf_fused__ = True
    patch.rebind(trainer_cls, "compute_loss", compute_loss)


TRL_SERVER_DISTILLATION = ThirdPartyPatch(
    name="ServerDistillationTrainer.compute_loss",
    module="trl.experimental.server_distillation.server_distillation_trainer",
    target="trl.experimental.server_distillation.server_distillation_trainer.ServerDistillationTrainer.compute_loss",
    trigger="first apply_fused_loss; applied when trl.experimental.server_distillation.server_distillation_trainer "
            "is imported (at once if it is)",
    versions="trl 1.16 (the methods' parameters checked at install: SERVER_METHODS; another shape: nothing wrapped, "
             "a warning)",
    why="ServerDistillationTrainer builds the student's full [B, T, V] logits for a loss on the teacher's top-k; "
        "hf_fused computes a patched student's from its hidden states in one pass",
    passes_through="an unpatched student, and (with a one-time warning saying why and what to do) return_outputs=True, "
                   "reverse_kl_top_1_mode='argmax' or a subclass's own loss methods: TRL's method",
    apply=_install,
)

register_extension(ModelExtension("sparse_distillation", call_keyword=CALL_KEYWORD,
                                  forward=sparse_distillation_forward))
