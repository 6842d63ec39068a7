"""``FusedGRPOTrainer``: TRL's GRPO with every log-prob and entropy computed by hf_fused.

TRL 1.16 computes every per-token log-prob (policy in ``_compute_loss``, old policy and reference in
``_generate_and_score_completions``) in one place, ``GRPOTrainer._get_per_token_logps_and_entropies``,
which calls ``model(**inputs, labels=labels, fused_lm_head=True)`` on a forward that TRL patched with
``trl.trainer.utils.add_fused_lm_head``. Everything downstream (ratios, clipping, KL, entropy masks and
bonus, importance-sampling corrections, normalizers, metrics) is plain ``[B, T]`` tensor code.

This subclass therefore changes four things and nothing else:

1. ``__init__``: lets a PEFT adapter sit on ``lm_head`` (TRL raises, because its head reads
   ``lm_head.weight`` and would silently skip the adapter; hf_fused folds the adapter into the head),
   then replaces TRL's fused head on the policy and the reference model by
   :func:`hf_fused.apply_fused_loss`. The patched forward is the original one without ``fused_output``,
   so generation is untouched.
2. ``_get_per_token_logps_and_entropies``: runs TRL's own method (batch chunking, multimodal slicing,
   autocast, MoE aux loss) but hands it a stand-in for the model whose call goes through hf_fused's
   model-level API (``fused_output="logprobs"``), inside the model's forward: only the completion
   positions (``logits_to_keep``) reach the head and no ``[B, T, V]`` tensor exists.
3. Nothing in the loss: ``_compute_loss`` is TRL's, unchanged, so objective, gradients and logged
   metrics are TRL's by construction.
4. Speed only: when the policy's log-probs are on-policy (ratio ≡ 1) and nothing else of the loss depends
   on them (β = 0, no entropy bonus or mask, no off-policy mask, no vLLM correction, token-level
   importance sampling, a loss type listed in ``_HINTED_LOSS_TYPES``), TRL's loss sends them the gradient
   ``−A·mask`` times a per-sequence or global constant, known before the forward. ``_compute_loss`` then
   passes that as ``grad_hint`` (:func:`hf_fused.ops.linear_logprobs`): with a ``tile_budget_bytes`` that
   holds the fp32 ``[V, H]`` weight-gradient accumulator the head's gradients come out of the forward's
   single pass (6·N·H·V FLOPs instead of 8). Backward checks that the gradient TRL's loss really sends
   matches and recomputes if not, so this can cost time, never exactness.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from trl import GRPOTrainer

__all__ = ["FusedGRPOTrainer"]

#: ``∂loss/∂logp`` at ratio 1, up to one constant, for TRL 1.16's loss types whose policy term is linear in
#: the ratio there: ``−A·mask/|o_i|`` for the per-sequence means, ``−A·mask`` for the token sums
#: (``cispo``'s clamped ratio is a detached constant; ``sapo``'s soft clip has slope 1 at ratio 1).
_HINTED_LOSS_TYPES = {"grpo": True, "sapo": True, "bnpo": False, "dr_grpo": False, "dapo": False, "cispo": False,
                      "luspo": False}  # value: divide by the completion length


class FusedGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer` (TRL 1.16); same arguments, same objective,
    gradients and metrics. Differences: log-probs and entropies are computed tile by tile by hf_fused
    inside the model's forward, and a PEFT adapter on ``lm_head`` is supported and trained."""

    def __init__(self, model, *args, fused_options: Optional[dict] = None, **kwargs):
        """Same arguments as :class:`trl.GRPOTrainer`, plus ``fused_options``: keyword arguments for
        :func:`hf_fused.apply_fused_loss` (``tile_budget_bytes``, ``backend``, ``verify``). A
        ``tile_budget_bytes`` of at least ``4·V·H + 512·V·2`` (``2048·V·2`` for full speed) lets on-policy
        steps compute the head's gradients in the forward pass (module docstring, point 4)."""
        self._fused_options = dict(fused_options or {})
        peft_config = kwargs.get("peft_config")
        if isinstance(model, str) and peft_config is not None and _targets_lm_head(peft_config):
            # The lm_head guard below needs the model instance before TRL wraps it with PEFT.
            config = kwargs.get("args", args[1] if len(args) > 1 else None)
            model = _load_model_like_trl(model, config, kwargs.get("quantization_config"))
        with _hide_lm_head_adapter_from_trl(model):
            super().__init__(model, *args, **kwargs)
        self._install_fused_heads()

    # ------------------------------------------------------------------------------------------------
    # Override 1 (construction): swap TRL's fused LM head for hf_fused's.
    def _install_fused_heads(self) -> None:
        from hf_fused import apply_fused_loss

        for target in (self.model, self.ref_model):
            if target is None:
                continue
            _remove_trl_fused_head(target)
            apply_fused_loss(target, **self._fused_options)

    # ------------------------------------------------------------------------------------------------
    # Override 2: the single place TRL computes log-probs and entropies (policy, old policy, reference).
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        hint = None
        if getattr(self, "_loss_inputs", None) is not None:  # the policy's call inside _compute_loss
            hint = self._policy_grad_hint(self._loss_inputs)
        fused_model = _FusedHeadCall(model, logits_to_keep, self.temperature, compute_entropy, hint)
        return super()._get_per_token_logps_and_entropies(
            fused_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, **kwargs,
        )


    # ------------------------------------------------------------------------------------------------
    # Override 4 (speed only): the gradient TRL's loss will send to the policy log-probs, when it is known.
    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _policy_grad_hint(self, inputs) -> Optional[torch.Tensor]:
        """``A·mask`` (``/|o_i|`` for per-sequence means) ``[B, T]`` when TRL 1.16's ``_compute_loss`` sends
        the policy log-probs a gradient proportional to it, else ``None``. See the module docstring (4)."""
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


class _FusedHeadCall:
    """Stands in for ``model`` inside ``GRPOTrainer._get_per_token_logps_and_entropies``, whose only use of
    it is ``model(**model_inputs, labels=labels, fused_lm_head=True)`` followed by
    ``outputs.log_probs[:, -logits_to_keep:]``, ``outputs.entropy[:, -logits_to_keep:]`` and
    ``outputs.aux_loss``.

    TRL's ``labels`` are the input ids with ``-100`` on padding and on every position before the last
    ``k = logits_to_keep`` (the completion); its head shifts them, so the hidden state at position ``t``
    scores token ``t + 1``. Here only the last ``k + 1`` hidden states reach the head
    (``logits_to_keep=k + 1``): position ``T - k - 1 + j`` scores completion token ``j`` for ``j < k`` and
    the final position scores nothing (``-100``), hence ``shift_labels = pad(labels[:, -k:], (0, 1), -100)``.
    Scores of ignored positions are 0, as in TRL.
    """

    def __init__(self, model, logits_to_keep: int, temperature: float, compute_entropy: bool,
                 grad_hint: Optional[torch.Tensor] = None):
        self.model = model
        self.k = int(logits_to_keep)
        self.temperature = temperature
        self.compute_entropy = compute_entropy
        self.grad_hint = grad_hint  # [B, k] for the whole batch; TRL calls once per chunk of rows, in order
        self.row = 0

    def __call__(self, *, labels: torch.Tensor, fused_lm_head: bool = True, **model_inputs: Any):
        if not fused_lm_head:  # pragma: no cover - TRL 1.16 always asks for the fused head
            raise ValueError("FusedGRPOTrainer only routes fused log-prob calls")
        k = self.k
        if k + 1 > labels.size(1):
            raise ValueError(f"logits_to_keep={k} needs at least one prompt token (sequence length {labels.size(1)})")
        shift_labels = F.pad(labels[:, -k:], (0, 1), value=-100)
        hint = {}
        if self.grad_hint is not None:
            rows = slice(self.row, self.row + labels.size(0))
            hint["grad_hint"] = F.pad(self.grad_hint[rows].to(labels.device), (0, 1))
            self.row = rows.stop
        out = self.model(
            **model_inputs,
            logits_to_keep=k + 1,
            shift_labels=shift_labels,
            fused_output="logprobs",
            temperature=self.temperature,
            return_entropy=self.compute_entropy,
            **hint,
        )
        aux_loss = getattr(out, "aux_loss", None)
        if model_inputs.get("output_router_logits") and aux_loss is None:
            raise NotImplementedError("the fused forward returned no MoE aux_loss, which TRL's loss needs")
        return types.SimpleNamespace(
            log_probs=out.logprobs[:, :k],
            entropy=None if out.entropy is None else out.entropy[:, :k],
            aux_loss=aux_loss,
        )


# ----------------------------------------------------------------------------------------------------
# Helpers for __init__.


def _inner_causal_lm(model):
    """The transformers model under PEFT / DDP wrappers (the object whose ``forward`` TRL patched)."""
    from hf_fused.model.unwrap import find_causal_lm

    return find_causal_lm(model)


def _remove_trl_fused_head(model) -> None:
    """Undo ``trl.trainer.utils.add_fused_lm_head``: it stores ``types.MethodType(_fused_forward, model)``
    as an instance ``forward`` and keeps the previous forward in its closure as ``original_forward``."""
    inner = _inner_causal_lm(model)
    patched = inner.__dict__.get("forward")
    fn = getattr(patched, "__func__", None)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name != "_fused_forward" or "original_forward" not in code.co_freevars:
        raise RuntimeError(
            "FusedGRPOTrainer expected TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) on the model; "
            "this TRL version patches it differently. FusedGRPOTrainer is written against TRL 1.16."
        )
    original = fn.__closure__[code.co_freevars.index("original_forward")].cell_contents
    if getattr(original, "__self__", None) is inner and getattr(original, "__func__", None) is type(inner).forward:
        del inner.forward  # back to the class's forward
    else:
        inner.forward = original


def _targets_lm_head(peft_config) -> bool:
    from peft.tuners.tuners_utils import check_target_module_exists

    try:
        return bool(check_target_module_exists(peft_config, "lm_head"))
    except Exception:  # non-LoRA configs without target_modules
        return False


@contextlib.contextmanager
def _hide_lm_head_adapter_from_trl(model):
    """During ``GRPOTrainer.__init__``, make ``get_output_embeddings()`` return the layer *under* a PEFT adapter
    on lm_head, so TRL's "adapter on lm_head is not supported" check passes. Only the instance attribute is
    touched and it is removed on exit; hf_fused (not TRL) computes the head, and it includes the adapter."""
    if isinstance(model, str):
        yield
        return
    inner = _inner_causal_lm(model)
    if "get_output_embeddings" in inner.__dict__:  # someone else's instance patch: leave everything alone
        yield
        return
    cls_get = type(inner).get_output_embeddings

    def get_output_embeddings(self):
        head = cls_get(self)
        from peft.tuners.tuners_utils import BaseTunerLayer

        while isinstance(head, BaseTunerLayer):
            head = head.get_base_layer()
        return head

    inner.get_output_embeddings = types.MethodType(get_output_embeddings, inner)
    try:
        yield
    finally:
        del inner.get_output_embeddings


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
