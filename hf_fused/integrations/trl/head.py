"""The answer to ``model(..., labels=..., fused_lm_head=True)`` on a patched model: TRL's ``FusedCausalLMOutput``,
every field computed by hf_fused's ops from the states lm_head receives."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...model import FusedRequest, as_kwargs, head_operands, op_options, run_intercepted
from ...model.tensor_parallel import check_tensor_parallel_head, vocab_parallel_head
from ...ops import TokenLossHint, linear_logprobs
from ...ops.hints import pad_hint
from .hooks import refused_reason
from .protocol import OPTIONS_ATTR, STATISTICS_FIELDS, TrlHeadOptions, TrlProtocolError


def trl_fused_forward(model: nn.Module, *args, **kwargs):
    """Answer ``model(*args, labels=..., fused_lm_head=True, **kwargs)`` as TRL's fused head would, with hf_fused.

    Args (besides the model's own): ``labels`` ``[B, T]`` (shifted here: the output is ``[B, T − 1]``) or
    ``shift_labels`` ``[B, T]`` (already aligned: output ``[B, T]``); ``num_items_in_batch``; and hf_fused's
    ``grad_hint`` (shaped like the output, see :func:`hf_fused.ops.linear_logprobs`).

    Returns:
        ``trl.trainer.utils.FusedCausalLMOutput`` with TRL's fields: per-token fields 0 (``False``) where the label
        is -100 and ``None`` unless listed in the trainer's ``outputs``; ``loss = −Σ log_probs / (num_items_in_batch
        or the number of labelled tokens)`` plus ``router_aux_loss_coef · aux_loss`` when router logits are
        requested; ``label_mask``; ``aux_loss``.

    Raises:
        TrlProtocolError: no TRL trainer asked this model for a fused head, or TRL's protocol has changed.
        ValueError: neither ``labels`` nor ``shift_labels``.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    state = model._hf_fused
    options = model.__dict__.get(OPTIONS_ATTR)
    if options is None:
        raise TrlProtocolError(
            "model(..., fused_lm_head=True) on a model patched by hf_fused, but no TRL trainer added a fused head to "
            "it through trl.trainer.utils.add_fused_lm_head"
            + (f" ({refused_reason()})" if refused_reason() is not None else "")
            + ". Build the TRL trainer with this model, or call apply_fused_loss after building it."
        )
    original = state.original_forward(model)
    if args:
        kwargs = as_kwargs(inspect.signature(original), args, kwargs)
    kwargs.pop("fused_lm_head")
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    grad_hint = kwargs.pop("grad_hint", None)
    kwargs.pop("return_dict", None)
    kwargs["use_cache"] = False
    text_config = model.config.get_text_config()
    if getattr(text_config, "output_router_logits", False):  # as TRL's head: the model's own MoE default
        kwargs.setdefault("output_router_logits", True)

    if shift_labels is not None:
        aligned, trim = shift_labels, False
    elif labels is not None:
        aligned, trim = F.pad(labels[:, 1:], (0, 1), value=-100), True  # the last position predicts nothing
    else:
        raise ValueError("model(..., fused_lm_head=True) needs `labels` or `shift_labels` (TRL's fused-head protocol)")
    if grad_hint is not None and trim:
        grad_hint = pad_hint(grad_hint, 0, 1)

    request = FusedRequest(mode="logprobs", state=state, labels=aligned)
    request.head = functools.partial(_head, labels=aligned, options=options, state=state, grad_hint=grad_hint)
    out = run_intercepted(model, original, kwargs, request, "serve TRL's head")

    fields = {k: (None if v is None else (v[:, :-1] if trim else v)) for k, v in request.result.items()}
    mask = (aligned != -100)[:, :-1] if trim else aligned != -100
    mask = mask.to(fields["log_probs"].device)
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / denominator
    aux_loss = out.get("aux_loss") if kwargs.get("output_router_logits") else None
    if aux_loss is not None:
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)


def _head(lm_head: nn.Module, hidden: torch.Tensor, *, labels, options: TrlHeadOptions, state, grad_hint):
    """Every per-token field TRL's head returns, from the states lm_head received (``[B, T, H]``): the log-probs,
    entropy and requested metrics (``is_top1``, ``mean_logits``, ``log_sum_sq_probs``) in one pass over the logits.
    A tensor-parallel lm_head (sharded over the vocabulary) computes on this rank's rows, the per-row statistics
    merged over its group (:func:`~hf_fused.model.tensor_parallel.vocab_parallel_head`): no logits gathered."""
    check_tensor_parallel_head(lm_head)
    head_hidden, weight, bias, labels, precision = head_operands(
        lm_head, hidden, labels, fp32=options.cast_lm_head_to_fp32  # TRL: the projection in fp32, outside autocast
    )
    weight, bias, shard = vocab_parallel_head(weight, bias)
    statistics = [name for name in STATISTICS_FIELDS if name in options.outputs]
    if statistics and isinstance(grad_hint, TokenLossHint):
        # No TRL trainer asks for both (GRPO/RLOO log no such metric); the statistics forward + recompute backward
        # costs the 8·N·H·V FLOPs of the hint's one pass plus a statistics pass, and the gradients are the same.
        grad_hint = None
    with precision:
        log_probs, entropy, stats = linear_logprobs(
            head_hidden, weight, labels, bias, return_entropy="entropy" in options.outputs, backend=state.backend,
            grad_hint=None if grad_hint is None else grad_hint.to(weight.device), statistics=statistics,
            vocab_parallel=shard, **op_options(state), temperature=options.temperature,
        )
    return {"log_probs": log_probs, "entropy": entropy, **{name: stats.get(name) for name in STATISTICS_FIELDS}}
