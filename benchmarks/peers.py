"""One adapter per peer, all with the same interface.

An adapter turns a problem's :class:`~benchmarks.problems.Inputs` into the scalar loss to call
``backward()`` on, the way that peer is meant to be used:

* ``ce_loss(inputs)``: mean cross-entropy over the non-ignored tokens;
* ``grpo(inputs)``: ``(loss, logps [B, T] or None, entropy [B, T] or None)``; by default the peer's
  per-token log-probs (``logprobs``) feed the shared :func:`~benchmarks.problems.problem_loss` (TRL's loss,
  on- or off-policy with its KL term, as the problem says).

``load()`` imports the peer (``ImportError`` → the run records it as skipped); ``unsupported(kind,
device)`` returns why a problem kind or device is out of the peer's reach and ``unsupported_problem(problem)``
why one problem variant is (e.g. off-policy for a loss that assumes ratio 1), both recorded as ``n/a``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from typing import Optional

import torch
import torch.nn.functional as F

from .problems import (
    CISPO_EPSILON_HIGH, EPSILON_HIGH, EPSILON_LOW, IGNORE_INDEX, Inputs, Problem, loss_value_at_ratio_one,
    normalizer_weights, problem_loss, token_weights_at_ratio_one, trl_per_token_loss,
)

#: ``hf_fused (32 MiB tiles)``: the smaller tile budget variant.
SMALL_TILE_BUDGET = 32 * 1024**2


class Peer:
    key = ""  # CLI name
    label = ""  # table row
    dist: Optional[str] = None  # distribution whose version is recorded
    needs_cuda = False
    has_entropy = False  # returns the entropy in the GRPO problem

    def __init__(self, with_entropy: bool = True):
        self.with_entropy = with_entropy

    def load(self) -> None:
        """Import what the peer needs. Raises ImportError when it is not installed."""

    def version(self) -> Optional[str]:
        if self.dist is None:
            return None
        try:
            return importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> str:
        """The exact call benchmarked (goes into the JSON)."""
        return ""

    def unsupported(self, kind: str, device: torch.device) -> Optional[str]:
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if kind == "ce" and type(self).ce_loss is Peer.ce_loss:
            return "no cross-entropy entry point"
        if kind == "grpo" and type(self).grpo is Peer.grpo and type(self).logprobs is Peer.logprobs:
            return "no per-token log-probs"
        return None

    def unsupported_problem(self, problem: Problem) -> Optional[str]:
        """Why this problem variant is out of reach (``None``: it is not); see :meth:`unsupported` for kinds."""
        return None

    def step_context(self):
        """A context manager around each whole forward + backward step (default: none)."""
        return contextlib.nullcontext()

    def ce_loss(self, inp: Inputs) -> torch.Tensor:
        raise NotImplementedError

    def logprobs(self, inp: Inputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def grpo(self, inp: Inputs) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        logps, entropy = self.logprobs(inp)
        return problem_loss(logps, inp), logps, entropy


def _flat(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return inp.hidden.reshape(-1, inp.hidden.shape[-1]), inp.labels.reshape(-1)


class EagerPeer(Peer):
    key, label, dist = "eager", "eager PyTorch", "torch"
    has_entropy = True

    def describe(self):
        return ("ce: F.cross_entropy((hidden @ weight.T).float(), labels); grpo: (hidden @ weight.T).float() "
                "→ log_softmax → gather, entropy under no_grad in 128-row chunks (TRL entropy_from_logits)")

    def ce_loss(self, inp):
        hidden, labels = _flat(inp)
        logits = hidden @ inp.weight.t()  # bf16 [N, V], as the model's lm_head
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)

    def logprobs(self, inp):
        logits = (inp.hidden @ inp.weight.t()).float()
        logps = torch.log_softmax(logits, dim=-1).gather(-1, inp.token_ids.unsqueeze(-1)).squeeze(-1)
        entropy = None
        if self.with_entropy:
            with torch.no_grad():
                flat = logits.view(-1, logits.shape[-1])
                chunks = []
                for chunk in flat.split(128):
                    lse = torch.logsumexp(chunk, dim=-1)
                    chunks.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
                entropy = torch.cat(chunks).view(logps.shape)
        return logps, entropy


class LigerPeer(Peer):
    key, label, dist = "liger", "Liger FLCE", "liger-kernel"
    needs_cuda = True

    def load(self):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        self._cls = LigerFusedLinearCrossEntropyLoss

    def describe(self):
        return ("liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction=mean | "
                "none for grpo: logp = -loss)(weight, hidden2d, labels); default accum_dtype (weight grad in bf16)")

    def ce_loss(self, inp):
        hidden, labels = _flat(inp)
        return self._cls(ignore_index=IGNORE_INDEX, reduction="mean")(inp.weight, hidden, labels)

    def logprobs(self, inp):
        hidden, labels = _flat(inp)
        per_token = self._cls(ignore_index=IGNORE_INDEX, reduction="none")(inp.weight, hidden, labels)
        return -per_token.view(inp.labels.shape), None


class LigerGRPOPeer(Peer):
    """Liger's whole GRPO loss in one call. Checked against :func:`~benchmarks.problems.grpo_loss` with
    liger-kernel 0.8.5 on CPU (uncompiled, fp32, the ``--quick`` GRPO shape): loss and head gradients within 2e-6
    of the float64 reference for dapo, grpo, bnpo, dr_grpo, cispo and sapo, on-policy and off-policy with the KL
    term (``use_bias_correction_kl=True``); its luspo differs (:meth:`unsupported_problem`)."""

    key, label, dist = "liger_grpo", "Liger GRPO loss", "liger-kernel"
    needs_cuda = True

    def load(self):
        import inspect

        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        self._cls, self._fns = LigerFusedLinearGRPOLoss, {}
        self._options = frozenset(inspect.signature(LigerFusedLinearGRPOLoss.__init__).parameters)

    def describe(self):
        return ("liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(beta=0, use_ref_model=False, loss_type=<the "
                "problem's>, max_completion_length=T, epsilon_low=0.2, epsilon_high=0.28 (5.0 for cispo), "
                "compiled=True, chunk_size=1)(hidden[B,T,H], weight, ids, mask, advantages): the whole loss in one "
                "call (TRL's use_liger_kernel path before TRL 1.16); no log-probs out. Off-policy KL problems: "
                "beta=0.04, use_ref_model=True, use_bias_correction_kl=True, old_per_token_logps= / "
                "ref_per_token_logps= the problem's")

    def unsupported_problem(self, problem):
        options = getattr(self, "_options", frozenset())  # load() runs first in the runner
        # Liger 0.8.5 grpo_loss.py, luspo: (per_token_loss * attention_mask.sum(1, keepdim=True)).sum() / (B·T)
        if problem.loss_type == "luspo":
            return ("its luspo reduction weights every position, masked ones included, by the sequence length over "
                    "B·T (an older TRL formula), not TRL 1.16's (loss · mask).sum(-1).mean(): same value at ratio 1, "
                    "other gradients")
        if problem.loss_type in ("cispo", "sapo") and "sapo_temperature_pos" not in options:
            return (f"this Liger version predates its sapo loss type (no sapo_temperature_pos option): "
                    f"{problem.loss_type} not checked against it")
        if problem.off_policy_kl and "use_bias_correction_kl" not in options:  # Liger before the option: k3 only
            return ("its KL term is k3 without TRL 1.16's default bias correction (use_bias_correction_kl: k3 · ratio), "
                    "a different objective")
        return None

    def _loss_fn(self, inp):
        key = (inp.loss_type, inp.mask.shape[1], inp.beta, inp.ref_logps is not None)
        if key not in self._fns:
            options = dict(
                beta=inp.beta, use_ref_model=inp.ref_logps is not None, loss_type=inp.loss_type,
                max_completion_length=inp.mask.shape[1], epsilon_low=EPSILON_LOW,
                epsilon_high=CISPO_EPSILON_HIGH if inp.loss_type == "cispo" else EPSILON_HIGH, compiled=True,
                chunk_size=1,
            )
            if inp.ref_logps is not None:  # TRL 1.16's default; Liger's is False
                options["use_bias_correction_kl"] = True
            self._fns[key] = self._cls(**options)
        return self._fns[key]

    def grpo(self, inp):
        extra = {}
        if inp.old_logps is not None:
            extra["old_per_token_logps"] = inp.old_logps
        if inp.ref_logps is not None:
            extra["ref_per_token_logps"] = inp.ref_logps
        loss, _metrics = self._loss_fn(inp)(inp.hidden, inp.weight, inp.token_ids, inp.mask.long(), inp.advantages,
                                            **extra)
        return loss, None, None


class CCEPeer(Peer):
    key, label, dist = "cce", "Apple CCE", "cut-cross-entropy"
    needs_cuda = True
    filter_eps = "high"  # the library default

    def load(self):
        from cut_cross_entropy import linear_cross_entropy

        self._fn = linear_cross_entropy

    def describe(self):
        return (f"cut_cross_entropy.linear_cross_entropy(hidden, weight, labels, filter_eps={self.filter_eps!r}, "
                "reduction=mean | none for grpo: logp = -loss)")

    def ce_loss(self, inp):
        return self._fn(inp.hidden, inp.weight, inp.labels, ignore_index=IGNORE_INDEX, filter_eps=self.filter_eps)

    def logprobs(self, inp):
        per_token = self._fn(
            inp.hidden, inp.weight, inp.labels, ignore_index=IGNORE_INDEX, reduction="none",
            filter_eps=self.filter_eps,
        )
        return -per_token.float(), None


class QuackPeer(Peer):
    """QuACK's chunked linear cross-entropy (cross-entropy only: it has no per-token log-prob entry point).
    One pass with an fp32 weight-gradient accumulator; on Hopper in bf16 its scaled-exp pipeline computes the
    softmax exponent in the logits GEMM's epilogue."""

    key, label, dist = "quack", "QuACK", "quack-kernels"
    needs_cuda = True

    def load(self):
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        self._fn = chunked_linear_cross_entropy

    @staticmethod
    def _chunk(hidden_size: int) -> int:
        # QuACK 0.6.5 raised "m == n makes row/col inference ambiguous" when the chunk equals H (0.6.4 runs it).
        return 8192 if hidden_size == 4096 else 4096

    def describe(self):
        return ("quack.linear_cross_entropy.chunked_linear_cross_entropy(hidden2d, weight, labels, "
                "chunk_size=4096 (8192 where H = 4096), reduction='mean')")

    def ce_loss(self, inp):
        hidden, labels = _flat(inp)
        return self._fn(hidden, inp.weight, labels, chunk_size=self._chunk(hidden.shape[-1]),
                        ignore_index=IGNORE_INDEX, reduction="mean")


class CCEExactPeer(CCEPeer):
    key, label = "cce_exact", "Apple CCE (no grad filter)"
    filter_eps = None


class TRLPeer(Peer):
    key, label, dist = "trl", "TRL ChunkedLogProb", "trl"
    has_entropy = True

    def load(self):
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        try:  # the vocabulary chunk TRL's own lm_head path uses
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
        except Exception:  # backward imports trl.trainer.utils too: a broken import fails the run there
            chunk = 32768
        self._fn, self._chunk = ChunkedLogProbFunction, int(chunk)

    def describe(self):
        return (f"trl.kernels.chunked_logprob.ChunkedLogProbFunction.apply(hidden[mask], weight, None, labels[mask], "
                f"1.0, {getattr(self, '_chunk', 32768)}, None, 1.0, outputs) on the non-ignored rows, as TRL does on "
                "CUDA; ce loss = -mean(logp); grpo outputs=('entropy',)")

    def _apply(self, inp, outputs):
        mask = inp.labels != IGNORE_INDEX
        return mask, self._fn.apply(
            inp.hidden[mask], inp.weight, None, inp.labels[mask], 1.0, self._chunk, None, 1.0, outputs
        )

    def ce_loss(self, inp):
        mask, (logps, *_) = self._apply(inp, ())
        return -logps.sum() / mask.sum().clamp(min=1)

    def logprobs(self, inp):
        mask, (logps, entropy, *_) = self._apply(inp, ("entropy",) if self.with_entropy else ())
        full = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
        if entropy is not None:
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        return full, entropy


class TorchPeer(Peer):
    key, label, dist = "torch", "torch F.linear_cross_entropy", "torch"

    def load(self):
        if not hasattr(F, "linear_cross_entropy"):
            raise ImportError(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
        if not hasattr(torch.nn, "LinearCrossEntropyOptions"):  # without it there is only the unfused reference path
            raise ImportError(f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions (chunked path)")

    def describe(self):
        return ("torch.nn.functional.linear_cross_entropy(hidden2d, weight, labels, ignore_index=-100, "
                "options=torch.nn.LinearCrossEntropyOptions()) (chunked path; reduction=none for grpo: logp = -loss)")

    def _call(self, inp, reduction):
        hidden, labels = _flat(inp)
        return F.linear_cross_entropy(
            hidden, inp.weight, labels, reduction=reduction, ignore_index=IGNORE_INDEX,
            options=torch.nn.LinearCrossEntropyOptions(),
        )

    def ce_loss(self, inp):
        return self._call(inp, "mean")

    def logprobs(self, inp):
        return -self._call(inp, "none").view(inp.labels.shape).float(), None


class HFFusedPeer(Peer):
    key, label, dist = "hf_fused", "hf_fused", "hf_fused"
    has_entropy = True
    tile_budget_bytes: Optional[int] = None

    def __init__(self, with_entropy: bool = True, backend: Optional[str] = None):
        super().__init__(with_entropy)
        self.backend = backend

    def load(self):
        from hf_fused.ops import linear_cross_entropy, linear_logprobs

        self._ce, self._lp = linear_cross_entropy, linear_logprobs

    def backend_name(self, device: torch.device) -> str:
        from hf_fused.ops import get_backend

        return getattr(get_backend(device, self.backend), "name", type(get_backend(device, self.backend)).__name__)

    def describe(self):
        return (f"hf_fused.ops.linear_cross_entropy / linear_logprobs(return_entropy=True)(hidden, weight, labels, "
                f"tile_budget_bytes={self.tile_budget_bytes}, backend={self.backend!r})")

    def budget(self, inp) -> Optional[int]:
        """The ``tile_budget_bytes`` of a call on ``inp`` (the class's, unless a subclass sizes it to the shape)."""
        return self.tile_budget_bytes

    def ce_loss(self, inp):
        return self._ce(inp.hidden, inp.weight, inp.labels, tile_budget_bytes=self.budget(inp), backend=self.backend)

    def logprobs(self, inp):
        return self._lp(
            inp.hidden, inp.weight, inp.labels, return_entropy=self.with_entropy,
            tile_budget_bytes=self.budget(inp), backend=self.backend,
        )


class HFFusedSmallTilesPeer(HFFusedPeer):
    key, label = "hf_fused_32mib", "hf_fused (32 MiB tiles)"
    tile_budget_bytes = SMALL_TILE_BUDGET


class HFFusedLeanPeer(HFFusedPeer):
    """The memory-lean two passes at a 256 MiB tile: what ``tile_budget_bytes=None`` chooses when the one pass
    does not fit a quarter of free memory (and the default before the planner's rule)."""

    key, label = "hf_fused_lean", "hf_fused (lean, 256 MiB)"
    tile_budget_bytes = 256 * 2**20


class HFFusedLeanCublasPeer(HFFusedLeanPeer):
    """The lean two passes with cuBLAS's logits tiles and the Triton statistics and gradient kernels reading them
    (``logits_epilogues.forced(False)``): what the lean path ran before the fused epilogues, for A/B runs."""

    key, label = "hf_fused_lean_cublas", "hf_fused (lean, 256 MiB, cuBLAS tiles)"

    def describe(self):
        return super().describe() + " inside hf_fused.ops.backends.logits_epilogues.forced(False)"

    def step_context(self):
        from hf_fused.ops.backends import logits_epilogues

        return logits_epilogues.forced(False)


class HFFusedLargeBudgetPeer(HFFusedPeer):
    """A 4 GiB budget holds the fp32 [V, H] weight-gradient accumulator (1.2–2.1 GB at these shapes) and
    a tile of thousands of full-vocabulary rows, so cross-entropy takes the one-pass (6·N·H·V) path;
    log-probs are unaffected but for wider tiles."""

    key, label = "hf_fused_4gib", "hf_fused (4 GiB, one pass)"
    tile_budget_bytes = 4 * 2**30


class HFFused8GiBPeer(HFFusedLargeBudgetPeer):
    """An 8 GiB budget: the one pass in two tiles at 32768×2048×151936 (25,080 and 4,411 of the 29,491 kept rows,
    against three of up to 11,136 at 4 GiB: fewer passes over the fp32 accumulator), the budget at which it reached 91 % of the H100's bf16 GEMM ceiling on 6·N·H·V
    over all tokens with QuACK installed (issue 13's measure; docs/gpu_results.md, fourteenth session). On request
    only (``--peers hf_fused_8gib``)."""

    key, label = "hf_fused_8gib", "hf_fused (8 GiB, one pass)"
    tile_budget_bytes = 8 * 2**30


def _pair_one_pass_budget(inp: Inputs, rows: int = 2048) -> int:
    """``tile_budget_bytes`` holding the one pass with the compensated pair as its weight-gradient accumulator
    (an int8 ``[V, H]`` residual beside the bf16 gradient) and ``rows`` full-vocabulary rows of logits with their
    gathered hidden rows, plus the kept rows' fp32 hidden gradient (counted for every token: no host sync for the
    kept count, so a few more rows where tokens are ignored), but not the fp32 accumulator with as many rows
    (V·H bytes more: it would leave about H/2 rows fewer):
    the planner's choice when only the pair fits."""
    vocab_size, hidden_size = inp.weight.shape
    elem, tokens = inp.weight.element_size(), inp.labels.numel()
    return vocab_size * hidden_size + rows * (vocab_size + hidden_size) * elem + tokens * hidden_size * 4


class HFFusedPairPeer(HFFusedPeer):
    """The one pass with the compensated pair (bf16 gradient + int8 residual, V·H bytes) instead of the fp32
    ``[V, H]`` accumulator (2·V·H beside the gradient): what the default rule takes when only the pair fits a quarter
    of free memory, forced here by a budget sized to the shape (:func:`_pair_one_pass_budget`). Cross-entropy only: log-probs
    without a hint take two passes whatever the budget."""

    key, label = "hf_fused_pair", "hf_fused (one pass, pair accumulator)"

    def describe(self):
        return ("hf_fused.ops.linear_cross_entropy(hidden, weight, labels, tile_budget_bytes=V·H + 2048·(V + H)·2 + "
                "N·H·4): the one pass with the int8-residual pair as its weight-gradient accumulator")

    def unsupported(self, kind, device):
        return "cross-entropy only (see hf_fused_hint_pair for GRPO)" if kind != "ce" else None

    def budget(self, inp):
        return _pair_one_pass_budget(inp)


def _one_pass_budget(weight: torch.Tensor, rows: int) -> int:
    """``tile_budget_bytes`` holding the fp32 ``[V, H]`` weight-gradient accumulator (``2·V·H`` beside a bf16
    gradient, :data:`hf_fused.ops.tiling.ACCUMULATOR_BYTES`) and ``rows`` full-vocabulary rows of logits (the GPU
    backend's one-pass condition)."""
    from hf_fused.ops.tiling import ACCUMULATOR_BYTES

    vocab_size, hidden_size = weight.shape
    return vocab_size * hidden_size * ACCUMULATOR_BYTES["fp32"] + rows * vocab_size * weight.element_size()


class HFFusedOnePassGRPOPeer(HFFusedPeer):
    """The GRPO problem's loss, on-policy and KL-free, as token-weighted cross-entropy. At ratio 1 every loss
    type's gradient is ``−Σ A·mask·∇logp / normalizer`` = that of ``Σ w·CE`` with ``w = A·mask / normalizer``
    (:func:`~benchmarks.problems.token_weights_at_ratio_one`), which ``linear_cross_entropy(token_weights=w)``
    computes in its forward (one pass, 6·N·H·V) with a budget holding the fp32 ``[V, H]`` weight-gradient
    accumulator plus 2048 full-vocabulary rows. The loss value is the loss at ratio 1
    (:func:`~benchmarks.problems.loss_value_at_ratio_one`: a constant, ``−Σ w`` for the clipped-ratio types; for
    cispo ``Σ w·CE`` itself), with that gradient attached. No log-probs or entropy come out (like Liger's fused
    GRPO loss)."""

    key, label = "hf_fused_1pass", "hf_fused (one pass, token weights)"
    has_entropy = False
    rows_per_tile = 2048

    def describe(self):
        return ("hf_fused.ops.linear_cross_entropy(hidden, weight, labels, token_weights=A·mask/normalizer, "
                "reduction='sum', tile_budget_bytes=2·V·H + 2048·V·2): the on-policy KL-free gradient of the "
                "problem's loss type in one pass; loss value the loss at ratio 1 (a constant, −Σ token_weights for "
                "the clipped-ratio types; the weighted sum itself for cispo)")

    def unsupported(self, kind, device):
        return "GRPO problem only (its cross-entropy is the hf_fused rows)" if kind != "grpo" else None

    def unsupported_problem(self, problem):
        if problem.off_policy_kl:
            return "on-policy, KL-free only (its token weights are the gradient at ratio 1); see hf_fused_token_loss"
        return None

    def grpo(self, inp):
        budget = _one_pass_budget(inp.weight, self.rows_per_tile)
        token_weights = token_weights_at_ratio_one(inp.mask, inp.advantages, inp.loss_type)
        surrogate = self._ce(
            inp.hidden, inp.weight, inp.labels, token_weights=token_weights, reduction="sum",
            tile_budget_bytes=budget, backend=self.backend,
        )
        at_ratio_one = loss_value_at_ratio_one(surrogate.detach(), inp.mask, inp.advantages, inp.loss_type)
        return surrogate + (at_ratio_one - surrogate).detach(), None, None


class HFFusedHintGRPOPeer(HFFusedPeer):
    """What ``FusedGRPOTrainer`` runs on-policy with default options: ``linear_logprobs(grad_hint=A·mask/normalizer,
    return_entropy=True)``; by the planner's default rule (room for the fp32 ``[V, H]`` accumulator plus 2048
    full-vocabulary rows in a quarter of free memory) the head's gradients come out of the forward's single
    pass (6·N·H·V); then the problem's own loss on those log-probs, whose backward sends a multiple of the
    hint and so recomputes nothing. Unlike the token-weights row it returns log-probs and entropy and runs the
    unchanged loss code."""

    key, label = "hf_fused_hint", "hf_fused (grad_hint, default)"

    def describe(self):
        return ("hf_fused.ops.linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=A·mask/normalizer "
                "(on-policy) | TokenLossHint(TRL's per-token loss, advantages/old/ref/normalizer) (off-policy KL), "
                "tile_budget_bytes=None), then the problem's GRPO loss")

    def unsupported(self, kind, device):
        return "GRPO problem only (its cross-entropy is the hf_fused rows)" if kind != "grpo" else None

    def logprobs(self, inp):
        if inp.old_logps is None and inp.ref_logps is None:
            hint = token_weights_at_ratio_one(inp.mask, inp.advantages, inp.loss_type)
        else:  # off the ratio-1 point the gradient is no fixed weight per token: hint with the token loss itself
            from hf_fused.ops import TokenLossHint

            hint = TokenLossHint(_trl_token_loss_of(inp), _trl_per_token(inp))
        return self._lp(
            inp.hidden, inp.weight, inp.labels, return_entropy=self.with_entropy, tile_budget_bytes=self.budget(inp),
            backend=self.backend, grad_hint=hint,
        )


class HFFusedHintPairGRPOPeer(HFFusedHintGRPOPeer):
    """:class:`HFFusedHintGRPOPeer` with the compensated pair as the one pass's weight-gradient accumulator (int8
    residual beside the bf16 gradient) instead of the fp32 ``[V, H]`` buffer: a budget sized to the shape
    (:func:`_pair_one_pass_budget`) that holds the pair's one pass but not the fp32 one."""

    key, label = "hf_fused_hint_pair", "hf_fused (grad_hint, pair accumulator)"

    def describe(self):
        return super().describe().replace("tile_budget_bytes=None", "tile_budget_bytes=V·H + 2048·(V + H)·2 + N·H·4")

    def budget(self, inp):
        return _pair_one_pass_budget(inp)


def _trl_per_token(inp: Inputs) -> dict:
    """The problem's per-token constants for :func:`_trl_token_loss`, all ``[B, T]`` like the labels."""
    consts = {"advantages": inp.advantages.float().unsqueeze(-1).expand(inp.mask.shape).contiguous(),
              "scale": normalizer_weights(inp.mask, inp.loss_type)}
    if inp.old_logps is not None:
        consts["old_logps"] = inp.old_logps
    if inp.ref_logps is not None:
        consts["ref_logps"] = inp.ref_logps
    return consts


def _trl_token_loss(logprobs, entropy, *, advantages, scale, old_logps=None, ref_logps=None, beta=0.0,
                    loss_type="dapo"):
    """TRL's per-token loss of ``loss_type`` (:func:`~benchmarks.problems.trl_per_token_loss`, the same code the
    other peers' log-probs go through) times the reduction's per-token weight: summed over tokens, the problem's
    loss (every TRL reduction is linear in the per-token loss, :func:`~benchmarks.problems.normalizer_weights`)."""
    return trl_per_token_loss(logprobs, advantages, old_logps, ref_logps, beta, loss_type) * scale


def _trl_token_loss_of(inp: Inputs):
    """:func:`_trl_token_loss` with the problem's scalars bound (its tensors come per token)."""
    return functools.partial(_trl_token_loss, beta=inp.beta, loss_type=inp.loss_type)


class HFFusedTokenLossPeer(HFFusedPeer):
    """The problem's whole GRPO objective, on- or off-policy with its KL term, through
    ``hf_fused.ops.linear_token_loss`` with default options: TRL's per-token loss times the reduction's
    per-token weight (``mask / normalizer``), summed, with the head gradients computed in the forward's single
    pass (6·N·H·V) when the planner's default budget holds it. Returns the log-probs (and the entropy when asked
    for, not used by the loss)."""

    key, label = "hf_fused_token_loss", "hf_fused (linear_token_loss)"

    def load(self):
        super().load()
        from hf_fused.ops import linear_token_loss

        self._tl = linear_token_loss

    def describe(self):
        return ("hf_fused.ops.linear_token_loss(hidden, weight, labels, token_loss=TRL 1.16's per-token GRPO loss "
                "of the problem's loss type (vs old log-probs, + β·k3·ratio KL vs reference) × mask/normalizer, "
                "per_token={advantages, scale, old_logps, ref_logps}, need_entropy=True, tile_budget_bytes=None)")

    def unsupported(self, kind, device):
        return "GRPO problem only (its cross-entropy is the hf_fused rows)" if kind != "grpo" else None

    def grpo(self, inp):
        out = self._tl(
            inp.hidden, inp.weight, inp.labels, _trl_token_loss_of(inp),
            per_token=_trl_per_token(inp), need_entropy=self.with_entropy, backend=self.backend,
        )
        return out.loss, out.logprobs, out.entropy


#: Every adapter, in table order.
ALL_PEERS = [EagerPeer, LigerPeer, LigerGRPOPeer, CCEPeer, CCEExactPeer, QuackPeer, TRLPeer, TorchPeer, HFFusedPeer,
             HFFusedLeanPeer, HFFusedLeanCublasPeer, HFFusedSmallTilesPeer, HFFusedLargeBudgetPeer, HFFused8GiBPeer, HFFusedPairPeer, HFFusedOnePassGRPOPeer,
             HFFusedHintGRPOPeer, HFFusedHintPairGRPOPeer, HFFusedTokenLossPeer]
#: Run when ``--peers`` is not given (``cce_exact``, the A/B peer ``hf_fused_lean_cublas`` and ``hf_fused_8gib`` only
#: on request).
DEFAULT_PEERS = [p.key for p in ALL_PEERS if p.key not in ("cce_exact", "hf_fused_lean_cublas", "hf_fused_8gib")]


def select_peers(spec: Optional[str], with_entropy: bool = True, hf_backend: Optional[str] = None) -> list[Peer]:
    """Adapters named by ``spec`` (comma-separated keys, or ``all``), in table order.

    Raises:
        ValueError: an unknown key (the message lists them).
    """
    by_key = {p.key: p for p in ALL_PEERS}
    if not spec:
        keys = DEFAULT_PEERS
    elif spec == "all":
        keys = list(by_key)
    else:
        keys = [k.strip() for k in spec.split(",") if k.strip()]
        unknown = [k for k in keys if k not in by_key]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; choose from: {', '.join(by_key)}")
    peers = []
    for cls in ALL_PEERS:
        if cls.key in keys:
            peers.append(cls(with_entropy, hf_backend) if issubclass(cls, HFFusedPeer) else cls(with_entropy))
    return peers
