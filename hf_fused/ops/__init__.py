"""The math: fused lm_head losses on plain tensors (no transformers, no trl imports).

Public: the ops (:func:`linear_cross_entropy`, :func:`linear_logprobs`, :func:`linear_token_loss`,
:func:`linear_grpo_loss`), their option and result types, :func:`describe_plan` (which schedule a call takes)
and the backend registry. Other names importable from here (``rows_per_tile``) are internals kept for tests."""

from .backends import available_backends, get_backend, register_backend
from .cross_entropy import linear_cross_entropy
from .logit_transform import LogitTransform
from .logprobs import HintMissedWarning, linear_logprobs
from .tiling import DEFAULT_TILE_BUDGET_BYTES, describe_plan, rows_per_tile
from .rl_objectives import GRPOLossOutput, GRPOObjective, grpo_token_loss, linear_grpo_loss
from .token_loss import TokenLossHint, TokenLossOutput, linear_token_loss

__all__ = [
    "DEFAULT_TILE_BUDGET_BYTES",
    "GRPOLossOutput",
    "GRPOObjective",
    "HintMissedWarning",
    "LogitTransform",
    "available_backends",
    "describe_plan",
    "get_backend",
    "grpo_token_loss",
    "linear_cross_entropy",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_token_loss",
    "register_backend",
    "TokenLossHint",
    "TokenLossOutput",
]
