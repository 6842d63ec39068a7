"""The math: fused lm_head losses on plain tensors (no transformers, no trl imports).

Public: the ops (:func:`linear_cross_entropy`, :func:`linear_logprobs`, :func:`linear_token_loss`,
:func:`linear_grpo_loss`, :func:`linear_token_statistics`, :func:`linear_distillation_loss`,
:func:`linear_support_loss`, :func:`sparse_distillation_loss`, :func:`linear_topk_logprobs`), their option and
result types, :func:`causal_shift`
(labels aligned with the positions that predict them), :class:`VocabShard` (a rank's rows of a head sharded over the
vocabulary: the ops' ``vocab_parallel=``), :func:`describe_plan` (which schedule a call takes) and the backend
registry. Each op is one autograd Function behind one call to :func:`hf_fused.ops.prepare.prepare`.
Other names importable from here (``rows_per_tile``) are internals kept for tests."""

from .backends import available_backends, describe_plan, get_backend, register_backend
from .backward import HintMissedWarning
from .cross_entropy import linear_cross_entropy
from .distillation import DistillationOutput, linear_distillation_loss
from .hints import TokenLossHint
from .logit_transform import LogitTransform
from .logprobs import linear_logprobs
from .prepare import causal_shift
from .rl_objectives import GRPOLossOutput, GRPOObjective, grpo_token_loss, linear_grpo_loss
from .sparse_distillation import SparseDistillationOutput, sparse_distillation_loss
from .support_loss import SupportLossOutput, linear_support_loss
from .tiling import DEFAULT_TILE_BUDGET_BYTES, rows_per_tile
from .token_loss import TokenLossOutput, linear_token_loss
from .token_statistics import TOKEN_STATISTICS, linear_token_statistics
from .topk_logprobs import TopKLogprobs, linear_topk_logprobs
from .vocab_parallel import VocabShard

__all__ = [
    "DEFAULT_TILE_BUDGET_BYTES",
    "DistillationOutput",
    "GRPOLossOutput",
    "GRPOObjective",
    "HintMissedWarning",
    "LogitTransform",
    "SparseDistillationOutput",
    "SupportLossOutput",
    "TOKEN_STATISTICS",
    "available_backends",
    "causal_shift",
    "describe_plan",
    "get_backend",
    "grpo_token_loss",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_support_loss",
    "linear_token_loss",
    "linear_token_statistics",
    "linear_topk_logprobs",
    "register_backend",
    "sparse_distillation_loss",
    "TokenLossHint",
    "TokenLossOutput",
    "TopKLogprobs",
    "VocabShard",
]
