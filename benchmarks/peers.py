"""One adapter per implementation, all with the same interface.

An adapter turns a problem's :class:`~benchmarks.problems.Inputs` into the scalar loss to call ``backward()`` on,
the way that implementation is meant to be used:

* ``ce_loss(inputs)``: mean cross-entropy over the kept tokens;
* ``grpo(inputs)``: ``(loss, logps [B, T] or None, entropy [B, T] or None)``; by default the peer's per-token
  log-probs (``logprobs``) feed the shared :func:`~benchmarks.losses.grpo_loss` (TRL's loss, on- or off-policy
  with its KL term, as the problem says);
* ``distill(inputs)``: the mean divergence over the kept tokens (TRL's ``DistillationTrainer`` loss);
* ``sparse(inputs)``: the mean divergence from a teacher's top-K log-probs over the kept tokens (TRL's
  ``AsyncDistillationTrainer`` loss, :func:`~benchmarks.losses.sparse_divergence`).

``load()`` imports the peer (any exception: the run records it as ``skipped``); ``unavailable(kind)`` says why an
installed peer lacks a kind's entry point in this version (also ``skipped``); ``unsupported(kind, device)`` and
``unsupported_problem(problem)`` why a kind, device or problem variant is out of the peer's reach (``n/a``).
Every hf_fused name used here is public (``hf_fused.ops``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import re
from typing import Optional

import torch
import torch.nn.functional as F

from . import measure
from .losses import (
    CISPO_EPSILON_HIGH, EPSILON_HIGH, EPSILON_LOW, IGNORE_INDEX, distillation_divergence, grpo_loss,
    normalizer_weights, sparse_divergence, token_weights_at_ratio_one, trl_per_token_loss,
)
from .problems import Inputs, Problem


def problem_loss(logps: torch.Tensor, inp: Inputs) -> torch.Tensor:
    """The GRPO problem's loss on ``[B, T]`` log-probs (:func:`~benchmarks.losses.grpo_loss` with its constants)."""
    return grpo_loss(logps, inp.mask, inp.advantages, inp.loss_type, inp.old_logps, inp.ref_logps, inp.beta)


def _triton_reason(device: torch.device) -> Optional[str]:
    """Why a Triton-only peer cannot run on ``device`` (``None``: it can; on CPU under Triton's interpreter)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "needs a CUDA device (or TRITON_INTERPRET=1 on CPU)"


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
        try:
            return importlib.metadata.version(self.dist) if self.dist else None
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> str:
        """The exact call benchmarked (goes into the JSON)."""
        return ""

    def unavailable(self, kind: str) -> Optional[str]:
        """Why this installed peer has no entry point for ``kind`` in its version (recorded as ``skipped``)."""
        return None

    def cannot_run(self, problem: Problem, device: torch.device) -> Optional[str]:
        """Why this peer cannot run ``problem`` on ``device``, as the one-off tools print it (``"skipped (…)"``: it
        did not import; ``"n/a (…)"``: no entry point for it there), or ``None`` once loaded and able to."""
        try:
            self.load()
        except Exception as err:  # not installed, or a broken install raising something else on import
            return f"skipped ({measure.short_error(err)})"
        why = self.unsupported(problem.kind, device) or self.unsupported_problem(problem) or self.unavailable(
            problem.kind)
        return f"n/a ({why})" if why else None

    def unsupported(self, kind: str, device: torch.device) -> Optional[str]:
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if kind == "ce" and type(self).ce_loss is Peer.ce_loss:
            return "no cross-entropy entry point"
        if kind == "grpo" and type(self).grpo is Peer.grpo and type(self).logprobs is Peer.logprobs:
            return "no per-token log-probs"
        if kind == "distill" and type(self).distill is Peer.distill:
            return "no distillation entry point"
        if kind == "sparse" and type(self).sparse is Peer.sparse:
            return "no sparse-teacher distillation entry point"
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

    def distill(self, inp: Inputs) -> torch.Tensor:
        raise NotImplementedError

    def sparse(self, inp: Inputs) -> torch.Tensor:
        raise NotImplementedError


def _flat(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return inp.hidden.reshape(-1, inp.hidden.shape[-1]), inp.labels.reshape(-1)


def _mean_over(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_token.sum() / mask.sum().clamp(min=1)


class EagerPeer(Peer):
    key, label, dist = "eager", "eager PyTorch", "torch"
    has_entropy = True

    def describe(self):
        return ("ce: F.cross_entropy((hidden @ weight.T).float(), labels); grpo: (hidden @ weight.T).float() "
                "→ log_softmax → gather, entropy under no_grad in 128-row chunks (TRL entropy_from_logits); distill: "
                "both models' (hidden @ weight.T).float() → benchmarks.losses.distillation_divergence, masked mean; "
                "sparse: (hidden @ weight.T).float() → benchmarks.losses.sparse_divergence (TRL's _jsd_loss_chunk math "
                "on the whole logits), masked mean")

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
                chunks = []
                for chunk in logits.view(-1, logits.shape[-1]).split(128):
                    lse = torch.logsumexp(chunk, dim=-1)
                    chunks.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
                entropy = torch.cat(chunks).view(logps.shape)
        return logps, entropy

    def distill(self, inp):
        with torch.no_grad():
            teacher = (inp.teacher_hidden @ inp.teacher_weight.t()).float()
        student = (inp.hidden @ inp.weight.t()).float()
        per_token = distillation_divergence(student, teacher, inp.divergence_beta, inp.temperature)
        return _mean_over(per_token * inp.mask, inp.mask)

    def sparse(self, inp):
        student = (inp.hidden @ inp.weight.t()).float()
        per_token = sparse_divergence(student, inp.support_ids, inp.teacher_logprobs, inp.support_mask,
                                      inp.divergence_beta, inp.add_tail_bucket)
        return _mean_over(per_token * inp.mask, inp.mask)


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
    """Liger's whole GRPO loss in one call. Checked against :func:`~benchmarks.losses.grpo_loss` with liger-kernel
    0.8.5 on CPU (uncompiled, fp32, the ``--quick`` GRPO shape): loss and head gradients within 2e-6 of the float64
    reference for dapo, grpo, bnpo, dr_grpo, cispo and sapo, on-policy and off-policy with the KL term
    (``use_bias_correction_kl=True``); its luspo differs (:meth:`unsupported_problem`)."""

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
                "call; no log-probs out. Off-policy KL problems: beta=0.04, use_ref_model=True, "
                "use_bias_correction_kl=True, old_per_token_logps= / ref_per_token_logps= the problem's")

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


class LigerJSDPeer(Peer):
    """Liger's fused linear generalized JSD: the student's gradients in the forward, in torch elementwise code over
    fp32 ``[chunk, V]`` buffers. Its β is TRL's (0 forward KL, 1 reverse KL, mixture ``β·p_t + (1 − β)·p_s``) and it
    takes the mean over the tokens whose label is not ``ignore_index``: the masked tokens get -100, the others any
    id. Checked against :func:`~benchmarks.losses.distillation_divergence` in float64 on CPU under Triton's
    interpreter (``tests/benchmarks``)."""

    key, label, dist = "liger_jsd", "Liger FusedLinearJSD", "liger-kernel"

    def load(self):
        from liger_kernel.transformers import LigerFusedLinearJSD

        self._cls = LigerFusedLinearJSD

    def describe(self):
        return ("liger_kernel.transformers.LigerFusedLinearJSD(jsd_beta=β, temperature=T)(hidden, weight, "
                "teacher_hidden, teacher_weight, where(mask, 0, -100)); default accum_dtype (weight grad in bf16)")

    def unsupported(self, kind, device):
        return _triton_reason(device) or super().unsupported(kind, device)

    def distill(self, inp):
        labels = torch.where(inp.mask, 0, IGNORE_INDEX)
        fn = self._cls(jsd_beta=inp.divergence_beta, ignore_index=IGNORE_INDEX, temperature=inp.temperature)
        return fn(inp.hidden, inp.weight, inp.teacher_hidden, inp.teacher_weight, labels)


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
        per_token = self._fn(inp.hidden, inp.weight, inp.labels, ignore_index=IGNORE_INDEX, reduction="none",
                             filter_eps=self.filter_eps)
        return -per_token.float(), None


class CCEExactPeer(CCEPeer):
    """CCE without its gradient filter (which skips vocabulary blocks of small probability in backward)."""

    key, label = "cce_exact", "Apple CCE (no grad filter)"
    filter_eps = None


class QuackPeer(Peer):
    """QuACK's chunked linear cross-entropy (cross-entropy only: it has no per-token log-prob entry point)."""

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
                f"1.0, {getattr(self, '_chunk', 32768)}, None, 1.0, outputs) on the kept rows, as TRL does on "
                "CUDA; ce loss = -mean(logp); grpo outputs=('entropy',)")

    def _apply(self, inp, outputs):
        mask = inp.labels != IGNORE_INDEX
        return mask, self._fn.apply(inp.hidden[mask], inp.weight, None, inp.labels[mask], 1.0, self._chunk, None, 1.0,
                                    outputs)

    def ce_loss(self, inp):
        mask, (logps, *_) = self._apply(inp, ())
        return -logps.sum() / mask.sum().clamp(min=1)

    def logprobs(self, inp):
        mask, (logps, entropy, *_) = self._apply(inp, ("entropy",) if self.with_entropy else ())
        full = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
        if entropy is not None:
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        return full, entropy


class TRLDivergencePeer(Peer):
    """TRL 1.16's distillation head: what ``DistillationTrainer._chunked_divergence_loss`` calls on CUDA, the kept
    rows of both models through ``ChunkedDivergenceFunction`` (two passes over the vocabulary for the JSD, both
    models' logits recomputed in backward), then the sum of the per-token divergence over the kept count."""

    key, label, dist = "trl_divergence", "TRL ChunkedDivergence", "trl"

    def load(self):
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        self._fn = ChunkedDivergenceFunction

    def describe(self):
        return ("trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply(hidden[mask], weight, None, "
                "teacher_hidden[mask], teacher_weight, None, β, T, 1.0, None, 1.0, None); loss = divergence.sum() / "
                "n_kept (DistillationTrainer._chunked_divergence_loss)")

    def distill(self, inp):
        mask = inp.mask
        divergence, _entropy = self._fn.apply(inp.hidden[mask], inp.weight, None, inp.teacher_hidden[mask],
                                              inp.teacher_weight, None, inp.divergence_beta, inp.temperature, 1.0,
                                              None, 1.0, None)
        return divergence.sum() / mask.sum().clamp(min=1)


class TRLSparsePeer(Peer):
    """TRL 1.16's sparse-teacher loss: ``AsyncDistillationTrainer._compute_loss``'s ``_chunked_jsd_loss`` on the kept
    rows (256-row chunks of fp32 logits from fp32 copies of the operands, each under activation checkpointing:
    recomputed in backward), divided by the kept count."""

    key, label, dist = "trl_sparse", "TRL chunked sparse", "trl"

    def load(self):
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.async_distillation import async_distillation_trainer as module

        self._fn, self._chunk = module._chunked_jsd_loss, module._CHUNKED_LM_HEAD_CHUNK_SIZE

    def describe(self):
        return ("trl.experimental.async_distillation.async_distillation_trainer._chunked_jsd_loss(hidden[mask], "
                "weight, None, 1.0, None, ids[mask], teacher_logprobs[mask], support_mask[mask], β, 1.0, "
                "add_tail_bucket, None, 1, 256)[0] / n_kept")

    def sparse(self, inp):
        mask = inp.mask
        loss = self._fn(inp.hidden[mask], inp.weight, None, 1.0, None, inp.support_ids[mask],
                        inp.teacher_logprobs[mask], inp.support_mask[mask], inp.divergence_beta, inp.temperature,
                        inp.add_tail_bucket, None, 1, self._chunk)[0]
        return loss / mask.sum().clamp(min=1)


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
        return F.linear_cross_entropy(hidden, inp.weight, labels, reduction=reduction, ignore_index=IGNORE_INDEX,
                                      options=torch.nn.LinearCrossEntropyOptions())

    def ce_loss(self, inp):
        return self._call(inp, "mean")

    def logprobs(self, inp):
        return -self._call(inp, "none").view(inp.labels.shape).float(), None


class HFFusedPeer(Peer):
    """hf_fused's ops with their defaults (``tile_budget_bytes`` the class's, ``None`` here: the planner's rule).

    Distillation goes through ``hf_fused.ops.linear_distillation_loss(hidden, weight, teacher_hidden,
    teacher_weight, mask=mask, beta=β, temperature=T)`` where this hf_fused exports it (else the problem is recorded
    as skipped with that reason)."""

    key, label, dist = "hf_fused", "hf_fused", "hf_fused"
    has_entropy = True
    tile_budget_bytes: Optional[int] = None

    def __init__(self, with_entropy: bool = True, backend: Optional[str] = None):
        super().__init__(with_entropy)
        self.backend = backend

    def load(self):
        import hf_fused.ops as ops

        self._ce, self._lp = ops.linear_cross_entropy, ops.linear_logprobs
        self._distill = getattr(ops, "linear_distillation_loss", None)
        self._sparse = getattr(ops, "sparse_distillation_loss", None)

    def backend_name(self, device: torch.device) -> str:
        from hf_fused.ops import get_backend

        backend = get_backend(device, self.backend)
        return getattr(backend, "name", type(backend).__name__)

    def describe(self):
        return (f"hf_fused.ops.linear_cross_entropy / linear_logprobs(return_entropy=True) / linear_distillation_loss"
                f" / sparse_distillation_loss"
                f"(..., tile_budget_bytes={self.tile_budget_bytes}, backend={self.backend!r})")

    def unavailable(self, kind):
        if kind == "distill" and getattr(self, "_distill", None) is None:
            return "this hf_fused has no hf_fused.ops.linear_distillation_loss (no fused distillation op yet)"
        if kind == "sparse" and getattr(self, "_sparse", None) is None:
            return "this hf_fused has no hf_fused.ops.sparse_distillation_loss (no sparse-teacher op yet)"
        return None

    def ce_loss(self, inp):
        return self._ce(inp.hidden, inp.weight, inp.labels, tile_budget_bytes=self.tile_budget_bytes,
                        backend=self.backend)

    def logprobs(self, inp):
        return self._lp(inp.hidden, inp.weight, inp.labels, return_entropy=self.with_entropy,
                        tile_budget_bytes=self.tile_budget_bytes, backend=self.backend)

    def distill(self, inp):
        return self._distill(inp.hidden, inp.weight, inp.teacher_hidden, inp.teacher_weight, mask=inp.mask,
                             beta=inp.divergence_beta, temperature=inp.temperature,
                             tile_budget_bytes=self.tile_budget_bytes, backend=self.backend).loss

    def sparse(self, inp):
        return self._sparse(inp.hidden, inp.weight, inp.support_ids, inp.teacher_logprobs,
                            support_mask=inp.support_mask, mask=inp.mask, beta=inp.divergence_beta,
                            temperature=inp.temperature, add_tail_bucket=inp.add_tail_bucket,
                            tile_budget_bytes=self.tile_budget_bytes, backend=self.backend).loss


class HFFusedLeanPeer(HFFusedPeer):
    """The memory-lean two passes at a 256 MiB tile: ``tile_budget_bytes`` bounds everything the op holds."""

    key, label = "hf_fused_lean", "hf_fused (lean, 256 MiB)"
    tile_budget_bytes = 256 * 2**20


class HFFusedLargeBudgetPeer(HFFusedPeer):
    """A 4 GiB budget holds the fp32 ``[V, H]`` weight-gradient accumulator (1.2–2.1 GB at these shapes) and a tile of
    thousands of full-vocabulary rows, so cross-entropy takes the one pass (6·N·H·V) in wide tiles. Any other budget:
    ``--peers hf_fused_<n>mib`` or ``hf_fused_<n>gib`` (:func:`select_peers`)."""

    key, label = "hf_fused_4gib", "hf_fused (4 GiB)"
    tile_budget_bytes = 4 * 2**30


class HFFusedHintGRPOPeer(HFFusedPeer):
    """What ``FusedGRPOTrainer`` runs: ``linear_logprobs(grad_hint=..., return_entropy=True)``, on-policy the token
    weights ``A·mask/normalizer`` (:func:`~benchmarks.losses.token_weights_at_ratio_one`), off-policy a
    ``TokenLossHint`` of TRL's per-token loss; where the planner's default budget holds the one pass, the head's
    gradients come out of the forward (6·N·H·V) and the problem's own loss, whose backward sends what the hint said,
    recomputes nothing."""

    key, label = "hf_fused_hint", "hf_fused (grad_hint, as FusedGRPOTrainer)"

    def describe(self):
        return ("hf_fused.ops.linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=A·mask/normalizer "
                "(on-policy) | TokenLossHint(TRL's per-token loss, advantages/old/ref/normalizer) (off-policy KL)), "
                "then the problem's GRPO loss")

    def unsupported(self, kind, device):
        return "GRPO problems only" if kind != "grpo" else None

    def logprobs(self, inp):
        if inp.old_logps is None and inp.ref_logps is None:
            hint = token_weights_at_ratio_one(inp.mask, inp.advantages, inp.loss_type)
        else:  # off the ratio-1 point the gradient is no fixed weight per token: hint with the token loss itself
            from hf_fused.ops import TokenLossHint

            hint = TokenLossHint(_trl_token_loss_of(inp), _trl_per_token(inp))
        return self._lp(inp.hidden, inp.weight, inp.labels, return_entropy=self.with_entropy,
                        tile_budget_bytes=self.tile_budget_bytes, backend=self.backend, grad_hint=hint)


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
    """TRL's per-token loss of ``loss_type`` (:func:`~benchmarks.losses.trl_per_token_loss`, the code the other
    peers' log-probs go through) times the reduction's per-token weight: summed over tokens, the problem's loss."""
    return trl_per_token_loss(logprobs, advantages, old_logps, ref_logps, beta, loss_type) * scale


def _trl_token_loss_of(inp: Inputs):
    """:func:`_trl_token_loss` with the problem's scalars bound (its tensors come per token)."""
    return functools.partial(_trl_token_loss, beta=inp.beta, loss_type=inp.loss_type)


class HFFusedTokenLossPeer(HFFusedPeer):
    """The problem's whole GRPO objective through ``hf_fused.ops.linear_token_loss`` with default options: TRL's
    per-token loss times the reduction's per-token weight, summed, with the head gradients computed in the forward's
    single pass (6·N·H·V) where the planner's default budget holds it."""

    key, label = "hf_fused_token_loss", "hf_fused (linear_token_loss)"

    def load(self):
        super().load()
        from hf_fused.ops import linear_token_loss

        self._tl = linear_token_loss

    def describe(self):
        return ("hf_fused.ops.linear_token_loss(hidden, weight, labels, token_loss=TRL 1.16's per-token GRPO loss "
                "of the problem's loss type (vs old log-probs, + β·k3·ratio KL vs reference) × mask/normalizer, "
                "per_token={advantages, scale, old_logps, ref_logps}, need_entropy=True)")

    def unsupported(self, kind, device):
        return "GRPO problems only" if kind != "grpo" else None

    def grpo(self, inp):
        out = self._tl(inp.hidden, inp.weight, inp.labels, _trl_token_loss_of(inp), per_token=_trl_per_token(inp),
                       need_entropy=self.with_entropy, backend=self.backend)
        return out.loss, out.logprobs, out.entropy


#: Every adapter, in table order.
ALL_PEERS = [EagerPeer, LigerPeer, LigerGRPOPeer, LigerJSDPeer, CCEPeer, CCEExactPeer, QuackPeer, TRLPeer,
             TRLDivergencePeer, TRLSparsePeer, TorchPeer, HFFusedPeer, HFFusedLeanPeer, HFFusedLargeBudgetPeer, HFFusedHintGRPOPeer,
             HFFusedTokenLossPeer]
#: Run when ``--peers`` is not given (``cce_exact`` only on request).
DEFAULT_PEERS = [p.key for p in ALL_PEERS if p.key != "cce_exact"]
#: ``hf_fused_<n>mib`` / ``hf_fused_<n>gib``: hf_fused's defaults with that ``tile_budget_bytes``.
_BUDGET_KEY = re.compile(r"hf_fused_(\d+)(mib|gib)")


def budget_peer(key: str) -> Optional[type]:
    """The :class:`HFFusedPeer` subclass of a ``hf_fused_<n>mib`` / ``hf_fused_<n>gib`` key (``None`` for another)."""
    match = _BUDGET_KEY.fullmatch(key)
    if not match:
        return None
    n, unit = int(match[1]), match[2]
    label = f"hf_fused ({n} {'MiB' if unit == 'mib' else 'GiB'})"
    return type("HFFusedBudgetPeer", (HFFusedPeer,), {"key": key, "label": label,
                                                      "tile_budget_bytes": n * 2 ** (20 if unit == "mib" else 30)})


def peer_order(key: str) -> int:
    """A peer's row in the tables: its place in :data:`ALL_PEERS`, a budget variant after the hf_fused rows."""
    keys = [p.key for p in ALL_PEERS]
    return keys.index(key) if key in keys else len(keys)


def select_peers(spec: Optional[str], with_entropy: bool = True, hf_backend: Optional[str] = None) -> list[Peer]:
    """Adapters named by ``spec`` (comma-separated keys, ``hf_fused_<n>mib``/``hf_fused_<n>gib`` for another budget,
    or ``all``), in table order.

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
        unknown = [k for k in keys if k not in by_key and budget_peer(k) is None]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; choose from: {', '.join(by_key)}, or hf_fused_<n>mib / "
                             "hf_fused_<n>gib for another tile budget")
    classes = sorted((by_key.get(k) or budget_peer(k) for k in dict.fromkeys(keys)), key=lambda c: peer_order(c.key))
    return [cls(with_entropy, hf_backend) if issubclass(cls, HFFusedPeer) else cls(with_entropy) for cls in classes]
