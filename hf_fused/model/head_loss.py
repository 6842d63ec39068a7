"""``LinearCrossEntropyLoss``: a loss module that owns the output layer.

For training loops where the model returns hidden states and the loss owns lm_head: pipeline-parallel
schedules (``torch.distributed.pipelining``: the last stage returns hidden states, the schedule calls
``loss_fn(output, target)``), custom loops, or a model whose head is applied outside its forward.
The loss is :func:`hf_fused.ops.linear_cross_entropy` on lm_head's weight (and a PEFT LoRA adapter on it,
through :func:`~hf_fused.model.lm_head.head_tensors`), so the ``[tokens, vocab]`` logits never exist.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import LogitTransform, linear_cross_entropy
from .distributed import run_head
from .forward import check_op_options, head_operands
from .lm_head import check_head_supported
from .tensor_parallel import check_tensor_parallel_head, refuse_data_parallel_shard, vocab_parallel_head
from .transform_probe import config_logit_transform, measure_logit_transform
from .unwrap import find_causal_lm

_REDUCTIONS = ("mean", "sum", "none")


class LinearCrossEntropyLoss(nn.Module):
    """Causal-LM cross-entropy of ``lm_head(hidden_states)`` without building the logits.

    ``loss(hidden_states, labels)`` equals transformers' ``ForCausalLMLoss`` on
    ``transform(lm_head(hidden_states))``: labels ``[B, T]`` are shifted inside (position ``t`` predicts
    ``labels[t + 1]``; pass ``shift_labels`` ``[B, T]`` already aligned instead), ``ignore_index`` tokens
    contribute nothing, and the result is the mean over non-ignored tokens or, with
    ``num_items_in_batch``, their sum divided by it (transformers' gradient-accumulation normalization;
    also what makes per-microbatch losses of a pipeline schedule add up to the full batch's loss).

    Args:
        lm_head: the output layer: ``nn.Linear``, a PEFT LoRA layer around one, PEFT ``modules_to_save``.
            It becomes this module's submodule (its parameters are this loss's parameters).
        ignore_index: label value to ignore.
        reduction: ``"mean"`` / ``"sum"`` (scalar fp32) or ``"none"`` (``[B, T]`` fp32 per-token losses).
        logit_scale, softcap: the model's logit transform ``softcap·tanh(z·logit_scale / softcap)``.
            :meth:`from_model` measures them from the model's forward.
        tile_budget_bytes, backend: as in :func:`hf_fused.ops.linear_cross_entropy`.

    Raises:
        NotImplementedError: an lm_head hf_fused cannot read (quantized, not linear, an active DoRA or
            ``lora_bias`` adapter).
        ValueError: unknown ``reduction``; ``tile_budget_bytes`` not ``None`` or a positive int; an unregistered
            ``backend``; a ``softcap`` or ``logit_scale`` :class:`~hf_fused.ops.LogitTransform` refuses.
        TypeError: a ``softcap`` or ``logit_scale`` that is not a number.
    """

    def __init__(self, lm_head: nn.Module, *, ignore_index: int = -100, reduction: str = "mean",
                 logit_scale: float = 1.0, softcap: Optional[float] = None,
                 tile_budget_bytes: Optional[int] = None, backend: Optional[str] = None):
        super().__init__()
        check_head_supported(lm_head)
        check_op_options(tile_budget_bytes, backend, "LinearCrossEntropyLoss")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.lm_head = lm_head
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.transform = LogitTransform(logit_scale=logit_scale, softcap=softcap)
        self.tile_budget_bytes = tile_budget_bytes
        self.backend = backend

    @classmethod
    def from_model(cls, model: nn.Module, *, verify: bool = True, **kwargs) -> "LinearCrossEntropyLoss":
        """The loss for ``model``'s own lm_head (found through PEFT / DDP / DeepSpeed / compile wrappers) with the
        logit transform its forward applies, the one :func:`hf_fused.apply_fused_loss` uses:

        - a model patched by :func:`~hf_fused.apply_fused_loss`: the transform the patch holds (measured at patch
          time, or read from the config under ``apply_fused_loss(..., verify=False)``);
        - otherwise measured from the forward
          (:func:`~hf_fused.model.transform_probe.measure_logit_transform`): one ``[2, 8]`` forward on random
          tokens, in eval mode, without gradients (training flags restored). The config's transform (Gemma's
          soft-cap, Cohere's / Granite's scale) is taken when it reproduces what the forward does; a config
          attribute the forward ignores changes nothing, and a scale or soft-cap applied in code is measured.
          The model's forward must be runnable, so call this before splitting it into pipeline stages (or
          moving parts to the meta device); with ``verify=False`` the config's transform is read unchecked.

        Keywords are passed to the constructor; ``logit_scale`` / ``softcap`` override the transform.

        Raises:
            TypeError: no causal LM with an lm_head inside ``model``.
            FusedLossVerificationError: the forward transforms its logits in a way hf_fused cannot reproduce
                (pass ``verify=False``, or ``logit_scale`` / ``softcap``, to build the loss anyway).
        """
        causal_lm = find_causal_lm(model)
        state = causal_lm.__dict__.get("_hf_fused")  # patched by apply_fused_loss
        if "logit_scale" in kwargs and "softcap" in kwargs:
            transform = None  # both given: nothing to measure
        elif state is not None:
            transform = state.transform
        elif verify:
            transform = measure_logit_transform(causal_lm)
        else:
            transform = config_logit_transform(causal_lm)
        options = {} if transform is None else dict(logit_scale=transform.logit_scale, softcap=transform.softcap)
        options.update(kwargs)
        return cls(causal_lm.get_output_embeddings(), **options)

    def forward(self, hidden_states: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None) -> torch.Tensor:
        """Loss of ``hidden_states`` ``[B, T, H]`` (what lm_head would receive) against ``labels`` ``[B, T]``.

        Raises:
            ValueError: neither ``labels`` nor ``shift_labels``; labels not shaped like ``hidden_states[..., 0]``;
                the ops' own checks (labels out of range, bad ``num_items_in_batch``, tensors on several devices).
            TypeError: ``hidden_states``, ``labels`` or ``shift_labels`` not a tensor; labels that are not integer
                tensors (the ops' check).
            NotImplementedError: a head adapter activated since construction that hf_fused cannot read (DoRA).
        """
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"LinearCrossEntropyLoss: hidden_states must be a tensor [B, T, H], got "
                            f"{type(hidden_states).__name__}")
        for name, value in (("labels", labels), ("shift_labels", shift_labels)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"LinearCrossEntropyLoss: {name} must be a tensor [B, T], got {type(value).__name__}")
        if shift_labels is None:
            if labels is None:
                raise ValueError("LinearCrossEntropyLoss needs `labels` (shifted inside) or `shift_labels` (aligned)")
            shift_labels = F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
        if shift_labels.shape != hidden_states.shape[:-1]:
            raise ValueError(
                f"labels of shape {tuple(shift_labels.shape)} do not match hidden states of shape "
                f"{tuple(hidden_states.shape)}: expected labels shaped {tuple(hidden_states.shape[:-1])}"
            )

        def compute(hidden: torch.Tensor) -> torch.Tensor:
            check_tensor_parallel_head(self.lm_head)
            head_hidden, weight, bias, labels, _ = head_operands(self.lm_head, hidden, shift_labels)
            refuse_data_parallel_shard(self.lm_head, weight)  # read outside lm_head's call: not FSDP2's shard
            weight, bias, shard = vocab_parallel_head(weight, bias)  # tensor parallelism: this rank's rows
            return linear_cross_entropy(
                head_hidden, weight, labels, bias, ignore_index=self.ignore_index,
                reduction=self.reduction, num_items_in_batch=num_items_in_batch, softcap=self.transform.softcap,
                logit_scale=self.transform.logit_scale, tile_budget_bytes=self.tile_budget_bytes,
                backend=self.backend, vocab_parallel=shard,
            )

        # ZeRO-3: lm_head's partitioned weight gathered for this call and its backward.
        return run_head(self.lm_head, hidden_states, compute)

    def forward_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits for inference: ``lm_head(hidden_states)`` with the logit transform applied,
        as the model's own forward returns them. This materializes the logits; use it for generation or
        evaluation on a few positions (e.g. the last)."""
        logits, _ = self.transform.forward(self.lm_head(hidden_states))  # in place on lm_head's fresh output
        return logits

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, transform={self.transform}"
