"""``FusedGRPOTrainer``: TRL's GRPO with every log-prob and entropy computed by hf_fused.

It is ``apply_fused_loss(model)`` + ``trl.GRPOTrainer`` (:mod:`hf_fused.integrations.trl`: TRL's fused-head
calls, ``model(..., labels=labels, fused_lm_head=True)`` for the policy, the old policy and the reference, are
answered by hf_fused's ops), plus what only a subclass can add:

1. ``__init__``: patches the policy before TRL sees it (the reference model TRL builds is then patched
   alongside), and lets a PEFT adapter sit on ``lm_head`` (TRL raises, because its head reads
   ``lm_head.weight`` and would silently skip the adapter; hf_fused folds the adapter into the head).
2. Speed only: when the policy's log-probs are on-policy (ratio ≡ 1) and nothing else of the loss depends
   on them (β = 0, no entropy bonus or mask, no off-policy mask, no vLLM correction, token-level
   importance sampling, a loss type listed in ``_HINTED_LOSS_TYPES``), TRL's loss sends them the gradient
   ``−A·mask`` times a per-sequence or global constant, known before the forward. ``_compute_loss`` then
   passes that as ``grad_hint`` (:func:`hf_fused.ops.linear_logprobs`) with the fused-head call: where the
   call's plan is the one pass (by default on a GPU whenever its working set fits in a quarter of the free
   memory; under an explicit ``tile_budget_bytes`` when that holds the ``[V, H]`` weight-gradient accumulator,
   fp32 or the compensated pair for a bf16 weight, and 512 tile rows; :func:`hf_fused.ops.describe_plan` says
   which schedule a call takes) the head's gradients come out of the forward's single pass (6·N·H·V FLOPs
   instead of 8). Backward checks that the gradient
   TRL's loss really sends matches and recomputes if not, so this can cost time, never exactness.
   Otherwise, for every loss type and option that is token-separable (off-policy ratios, β > 0, entropy
   bonus, vLLM importance sampling; :mod:`hf_fused.trainers.grpo_objective` lists what is not), the hint is
   TRL's loss as a per-token function (:class:`hf_fused.ops.TokenLossHint`): the op
   differentiates it tile by tile in the same single pass, and backward checks it the same way.

Everything else (batch chunking, ratios, clipping, KL, entropy masks and bonus, importance sampling,
normalizers, metrics) is TRL's own code, so objective, gradients and logged metrics are TRL's.

Under tensor parallelism (accelerate's ``ParallelismConfig(tp_size=n)``, a model loaded with transformers'
tensor-parallel plan) each tensor-parallel group trains as one data-parallel replica: the same completions on its
ranks, rewards and advantages gathered and sliced over the replicas, normalizers counting replicas
(:mod:`hf_fused.integrations.trl.tensor_parallel`, which serves TRL's ``GRPOTrainer`` and ``RLOOTrainer`` on a
patched model alike).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from trl import GRPOTrainer

from ..ops.hints import pad_hint
from ..integrations.trl.tensor_parallel import serve_tensor_parallel_rollouts
from .grpo_objective import trl_token_loss_hint

__all__ = ["FusedGRPOTrainer"]

#: ``∂loss/∂logp`` at ratio 1, up to one constant, for TRL 1.16's loss types whose policy term is linear in
#: the ratio there: ``−A·mask/|o_i|`` for the per-sequence means, ``−A·mask`` for the token sums
#: (``cispo``'s clamped ratio is a detached constant; ``sapo``'s soft clip has slope 1 at ratio 1).
_HINTED_LOSS_TYPES = {"grpo": True, "sapo": True, "bnpo": False, "dr_grpo": False, "dapo": False, "cispo": False,
                      "luspo": False}  # value: divide by the completion length


class FusedGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer` (TRL 1.16); same arguments, same objective,
    gradients and metrics. Differences: log-probs and entropies are computed tile by tile by hf_fused
    inside the model's forward, a PEFT adapter on ``lm_head`` is supported and trained, and on-policy
    steps can compute the head's gradients in the forward (module docstring, point 2).

    Args:
        model (str | transformers.PreTrainedModel): a model id (loaded as TRL loads it, then patched) or a
            causal LM (patched in place by :func:`hf_fused.apply_fused_loss` before TRL sees it). Every other
            argument is :class:`trl.GRPOTrainer`'s.
        fused_options: keyword arguments for :func:`hf_fused.apply_fused_loss` (``tile_budget_bytes``,
            ``backend``, ``verify``).

    Raises:
        TypeError, NotImplementedError, ValueError, FusedLossVerificationError: from
            :func:`hf_fused.apply_fused_loss`, for a model it cannot patch, a bad ``tile_budget_bytes`` or
            ``backend`` (an unknown key in ``fused_options`` is a ``TypeError``), or a patched forward that
            disagrees with the original on its probe; :class:`trl.GRPOTrainer`'s own errors otherwise.
    """

    def __init__(self, model, *args, fused_options: Optional[dict] = None, **kwargs):
        """Same arguments as :class:`trl.GRPOTrainer`, plus ``fused_options``: keyword arguments for
        :func:`hf_fused.apply_fused_loss` (``tile_budget_bytes``, ``backend``, ``verify``). By default on a GPU
        steps compute the head's gradients in the forward pass where that fits in a quarter of the free memory;
        an explicit ``tile_budget_bytes`` allows it where the budget holds the pass's working set: for a bf16 or
        fp16 head about ``2·V·H`` bytes of weight-gradient accumulator, ``rows·V·2`` of tile (512 rows at the
        least, 2048 for full speed, and ``4·H`` more per tile row) and ``3·H`` per token of held hidden-state
        gradient (bf16: the gradient itself and an int8 residual)
        (:func:`hf_fused.ops.describe_plan` says what a call takes; module docstring, point 2)."""
        from ..model import apply_fused_loss

        self._fused_options = dict(fused_options or {})
        if isinstance(model, str):  # patched before TRL sees it, so its add_fused_lm_head defers to hf_fused
            config = kwargs.get("args", args[1] if len(args) > 1 else None)
            model = _load_model_like_trl(model, config, kwargs.pop("quantization_config", None))
        apply_fused_loss(model, **self._fused_options)
        super().__init__(model, *args, **kwargs)  # TRL's lm_head-adapter check passes: hf_fused computes the head
        serve_tensor_parallel_rollouts(self)  # the hook on TRL's __init__ did, unless hf_fused refused TRL's protocol

    # ------------------------------------------------------------------------------------------------
    # Speed only: the gradient TRL's loss will send to the policy log-probs, when it is known.
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        hint = None
        if getattr(self, "_loss_inputs", None) is not None:  # the policy's call inside _compute_loss
            hint = self._policy_grad_hint(self._loss_inputs)
            if hint is None:  # off-policy, KL, entropy bonus, IS correction: TRL's loss as a per-token function
                hint = trl_token_loss_hint(self, self._loss_inputs)
        if hint is not None:
            model = _HintedCall(model, hint, input_ids.size(1))
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          *args, **kwargs)

    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _policy_grad_hint(self, inputs) -> Optional[torch.Tensor]:
        """``A·mask`` (``/|o_i|`` for per-sequence means) ``[B, T]`` when TRL 1.16's ``_compute_loss`` sends
        the policy log-probs a gradient proportional to it, else ``None``. See the module docstring (2)."""
        per_sequence = _HINTED_LOSS_TYPES.get(self.loss_type)
        if (
            per_sequence is None
            or inputs.get("old_per_token_logps") is not None  # ratio ≠ 1 once the policy has moved
            or self.beta != 0.0
            or self.top_entropy_quantile < 1.0
            or getattr(self, "_entropy_bonus_enabled", True)
            or self.off_policy_mask_threshold is not None
            or self.importance_sampling_level != "token"
            or (self.use_vllm and self.vllm_importance_sampling_correction)
        ):
            return None
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mask = mask.float()
        advantages = inputs["advantages"].float()
        hint = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * mask
        return hint / mask.sum(-1, keepdim=True).clamp(min=1.0) if per_sequence else hint


class _HintedCall:
    """Stands in for ``model`` inside ``GRPOTrainer._get_per_token_logps_and_entropies``, whose only use of it
    is ``model(**model_inputs, labels=labels, fused_lm_head=True)``; adds hf_fused's ``grad_hint`` for the rows
    of this call. TRL's fused output is ``[B, T − 1]`` (position ``t`` scores token ``t + 1``) and the completion
    is its last ``k`` positions, so the ``[B, k]`` hint is padded with zeros on the prompt positions."""

    def __init__(self, model, grad_hint: torch.Tensor, seq_len: int):
        self.model = model
        self.grad_hint = grad_hint  # [B, k] for the whole batch; TRL calls once per chunk of rows, in order
        self.seq_len = seq_len
        self.row = 0

    def __call__(self, *args, labels: torch.Tensor, fused_lm_head: bool = True, **model_inputs: Any):
        rows = slice(self.row, self.row + labels.size(0))
        self.row = rows.stop
        hint = self.grad_hint[rows].to(labels.device)
        hint = pad_hint(hint, labels.size(1) - 1 - hint.size(1), 0)
        return self.model(*args, labels=labels, fused_lm_head=fused_lm_head, grad_hint=hint, **model_inputs)


# ----------------------------------------------------------------------------------------------------
# Helpers for __init__.


def _load_model_like_trl(model_id: str, args, quantization_config) -> torch.nn.Module:
    """The model TRL 1.16's ``GRPOTrainer.__init__`` would load from ``model_id`` (same helper, same kwargs)."""
    from trl.trainer.utils import create_model_from_path

    model_init_kwargs = dict((args.model_init_kwargs if args is not None else None) or {})
    if quantization_config is not None:
        model_init_kwargs["quantization_config"] = quantization_config
    if args is not None and args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        model_init_kwargs["device_map"] = None
    model_init_kwargs.setdefault("trust_remote_code", getattr(args, "trust_remote_code", False))
    return create_model_from_path(model_id, **model_init_kwargs)
