"""The benchmark problems: shapes, deterministic inputs, and the loss each one trains.

Two kinds:

* ``ce``: causal-LM cross-entropy over ``N`` tokens, mean over the non-ignored ones (10 % of the labels,
  at random positions, are ``-100``); backward gives the gradients of ``hidden [N, H]`` and
  ``weight [V, H]``.
* ``grpo``: per-token log-probabilities of ``B`` completions of ``T`` tokens (the last ``T/8`` of each
  completion masked out as padding), a GRPO-family loss on top (:func:`grpo_loss`; DAPO unless the
  problem names another ``loss_type``), then backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

IGNORE_INDEX = -100
#: Fraction of cross-entropy labels set to ``IGNORE_INDEX`` (random positions).
CE_IGNORED_FRACTION = 0.10
#: Fraction of each GRPO completion (its tail) that is masked out.
GRPO_MASKED_TAIL = 1 / 8
#: DAPO clipping (TRL's defaults for ``loss_type="dapo"``: epsilon=0.2, epsilon_high=0.28).
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
#: Target standard deviation of the logits: peaked enough to look like a trained LM head.
LOGIT_STD = 4.0
#: TRL loss types with the clipped-ratio per-token loss; they differ only in the normalization.
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")


@dataclass(frozen=True)
class Problem:
    """One benchmark case. ``kind`` is ``"ce"`` or ``"grpo"``; ``B``/``T`` are set for ``grpo``."""

    name: str
    kind: str
    N: int
    H: int
    V: int
    B: Optional[int] = None
    T: Optional[int] = None
    loss_type: str = "dapo"

    @property
    def flops_per_token_hv(self) -> int:
        """FLOPs per (valid token · H · V): 6 for cross-entropy (logits 2 + dX 2 + dW 2), 8 for GRPO
        (forward logits 2, backward recomputes them 2, dX 2, dW 2)."""
        return 6 if self.kind == "ce" else 8

    def describe(self) -> str:
        if self.kind == "ce":
            return f"cross-entropy N×H×V = {self.N}×{self.H}×{self.V}"
        return f"GRPO ({self.loss_type}) B×T×H×V = {self.B}×{self.T}×{self.H}×{self.V}"


def _ce(n: int, h: int, v: int) -> Problem:
    return Problem(f"ce-{_k(n)}-h{h}-v{_k(v)}", "ce", n, h, v)


def _grpo(b: int, t: int, h: int, v: int, loss_type: str = "dapo") -> Problem:
    suffix = "" if loss_type == "dapo" else f"-{loss_type}"
    return Problem(f"grpo-{b}x{_k(t)}-h{h}-v{_k(v)}{suffix}", "grpo", b * t, h, v, b, t, loss_type)


def _k(x: int) -> str:
    return f"{round(x / 1024)}k" if x >= 1024 and x % 1024 == 0 else (f"{round(x / 1000)}k" if x >= 1000 else str(x))


#: The full-size problems (bf16 on one GPU).
FULL_PROBLEMS = [
    _ce(8192, 2048, 151936),
    _ce(32768, 2048, 151936),
    _ce(16384, 4096, 128256),
    _grpo(16, 2048, 2048, 151936),
    _grpo(8, 4096, 4096, 151936),
]
#: The first GRPO shape under TRL's other clipped-ratio loss types (``--shapes grpo-loss-types``).
LOSS_TYPE_PROBLEMS = [_grpo(16, 2048, 2048, 151936, lt) for lt in GRPO_LOSS_TYPES[1:]]

#: Tiny problems for ``--quick`` (CPU smoke tests, CI).
QUICK_PROBLEMS = [
    _ce(128, 64, 1000),
    _ce(256, 64, 1000),
    _grpo(2, 64, 64, 1000),
    _grpo(4, 64, 64, 1000),
]
QUICK_LOSS_TYPE_PROBLEMS = [_grpo(2, 64, 64, 1000, lt) for lt in GRPO_LOSS_TYPES[1:]]


def select_problems(spec: Optional[str], quick: bool) -> list[Problem]:
    """Problems named by ``spec``: comma-separated names, kinds (``ce``, ``grpo``: the DAPO shapes),
    ``grpo-loss-types`` (the other loss types) or ``all`` (every shape, DAPO for GRPO).

    Raises:
        ValueError: a name that matches no problem (the message lists them).
    """
    pool = QUICK_PROBLEMS if quick else FULL_PROBLEMS
    loss_types = QUICK_LOSS_TYPE_PROBLEMS if quick else LOSS_TYPE_PROBLEMS
    if not spec or spec == "all":
        return list(pool)
    chosen: list[Problem] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = loss_types if item == "grpo-loss-types" else [p for p in pool + loss_types if item == p.name]
        matches = matches or [p for p in pool if item == p.kind]
        if not matches:
            names = ", ".join(p.name for p in pool + loss_types)
            raise ValueError(f"unknown shape {item!r}; choose from: all, ce, grpo, grpo-loss-types, {names}")
        chosen += [p for p in matches if p not in chosen]
    return chosen


@dataclass
class Inputs:
    """A problem's tensors, all on the benchmark device.

    hidden: ``[N, H]`` (ce) or ``[B, T, H]`` (grpo), leaf with ``requires_grad``.
    weight: ``[V, H]`` leaf with ``requires_grad``.
    labels: ``[N]`` / ``[B, T]`` int64 token ids with ``IGNORE_INDEX`` at ignored / masked positions.
    token_ids: ``[B, T]`` the completion ids without masking (grpo; peers that take a separate mask).
    mask: ``[B, T]`` bool, True where the token counts (grpo).
    advantages: ``[B]`` fp32 (grpo).
    loss_type: the GRPO loss on top (:func:`grpo_loss`).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    token_ids: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    loss_type: str = "dapo"
    extras: dict = field(default_factory=dict)

    @property
    def n_valid(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def tensors(self) -> list[torch.Tensor]:
        all_ = (self.hidden, self.weight, self.labels, self.token_ids, self.mask, self.advantages)
        return [t for t in all_ if t is not None]


def make_inputs(problem: Problem, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Deterministic inputs for ``problem`` (same seed → same tensors on the same device type)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n, h, v = problem.N, problem.H, problem.V
    # hidden ~ N(0, 1), weight ~ N(0, LOGIT_STD² / H): logits ~ N(0, LOGIT_STD²).
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=torch.float32).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device, dtype=torch.float32) * (LOGIT_STD / h**0.5)).to(dtype)
    ids = torch.randint(0, v, (n,), generator=gen, device=device)
    if problem.kind == "ce":
        n_ignored = round(CE_IGNORED_FRACTION * n)
        ignored = torch.randperm(n, generator=gen, device=device)[:n_ignored]
        labels = ids.index_fill(0, ignored, IGNORE_INDEX)
        return Inputs(hidden.requires_grad_(), weight.requires_grad_(), labels)
    b, t = problem.B, problem.T
    token_ids = ids.view(b, t)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask[:, t - int(t * GRPO_MASKED_TAIL) :] = False
    labels = token_ids.masked_fill(~mask, IGNORE_INDEX)
    advantages = torch.randn(b, generator=gen, device=device, dtype=torch.float32)
    return Inputs(
        hidden.view(b, t, h).requires_grad_(), weight.requires_grad_(), labels, token_ids, mask, advantages,
        problem.loss_type,
    )


def _normalize(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s reduction of a ``[B, T]`` per-token loss (one process, no
    gradient accumulation): ``grpo`` mean over sequences of each one's token mean; ``bnpo`` and ``dapo``
    sum / unmasked tokens; ``dr_grpo`` sum / (B·T)."""
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / per_token.numel()
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}")


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """TRL's clipped-ratio loss on-policy (old log-probs = ``logps.detach()``, no KL term):
    ``−min(r·A, clamp(r, 1−0.2, 1+0.28)·A)`` per token with ``r = exp(logp − old)``, reduced as
    ``loss_type`` says (:func:`_normalize`). Works in the dtype of ``logps`` (the reference runs it in
    float64).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    ratio = torch.exp(logps - logps.detach())
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPSILON_LOW, 1 + EPSILON_HIGH) * adv)
    return _normalize(per_token, mask, loss_type)


def token_weights_at_ratio_one(mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """``[B, T]`` fp32 weights ``w`` with ``∇ grpo_loss = ∇ Σ w·CE`` on-policy: at ratio 1 neither clip is
    active, so ``∂loss/∂logp = −A·mask / normalizer``, i.e. ``w = A·mask / normalizer``; and
    ``grpo_loss = −Σ w`` there."""
    ones = torch.ones(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (per_token,) = torch.autograd.grad(_normalize(ones, mask, loss_type), ones)  # linear: mask / normalizer
    return per_token * advantages.float().unsqueeze(-1)
