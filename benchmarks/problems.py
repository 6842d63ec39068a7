"""The benchmark problems: shapes, deterministic inputs, and the loss each one trains.

Two kinds:

* ``ce``: causal-LM cross-entropy over ``N`` tokens, mean over the non-ignored ones (10 % of the labels,
  at random positions, are ``-100``); backward gives the gradients of ``hidden [N, H]`` and
  ``weight [V, H]``.
* ``grpo``: per-token log-probabilities of ``B`` completions of ``T`` tokens (the last ``T/8`` of each
  completion masked out as padding), a GRPO-family loss on top (:func:`grpo_loss`; DAPO unless the
  problem names another ``loss_type``), then backward.

The GRPO loss is TRL 1.16's ``GRPOTrainer._compute_loss`` for every token-level loss type it has
(:data:`TRL_LOSS_TYPES`; token-level importance sampling, TRL's default, no vLLM correction): the clipped-ratio
types ``dapo``, ``grpo``, ``bnpo``, ``dr_grpo``, ``luspo`` (one per-token loss, five reductions), ``cispo``
(clipped, detached ratio times the log-prob, ``epsilon_high`` = :data:`CISPO_EPSILON_HIGH`) and ``sapo``
(sigmoid gate, TRL's default temperatures). ``--shapes grpo-loss-types`` runs the first GRPO shape under every
type but ``dapo`` on-policy (ratio 1, no KL term).

A GRPO problem may be **off-policy with a KL term** (``--shapes grpo-offpolicy-kl`` for DAPO,
``grpo-loss-types-offpolicy-kl`` for the other types): old log-probs that differ from the current ones (so the
ratio is not 1 and both DAPO clips are active on some tokens) and a reference model's log-probs, with ``beta`` =
:data:`BETA` times TRL's k3 estimator added per token, importance-weighted by the ratio as TRL 1.16 does by
default (``use_bias_correction_kl=True``), whatever the loss type. The old and reference log-probs are fixed at
input setup: the float64 log-probs of the current inputs plus Gaussian noise (:data:`OLD_LOGP_NOISE`,
:data:`REF_LOGP_NOISE`), so they are deterministic and close to what a real step sees after one optimizer update.
That noise stays far below cispo's clamp at ratio 5 (the TRL comparison test crosses it on purpose), so there the
ratio acts as an unclamped, detached per-token weight.
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
#: TRL loss types with the clipped-ratio per-token loss (TRL 1.16 ``_compute_loss``: ``loss_type in ["grpo",
#: "bnpo", "dr_grpo", "dapo", "luspo"]``); they differ only in the reduction. On-policy their value is the
#: constant ``−Σ token_weights_at_ratio_one`` (tests/test_ops_token_weights.py checks it for each of these; not so
#: for cispo and sapo, hence the two tuples).
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")
#: Every token-level TRL 1.16 loss type the benchmark runs: the clipped-ratio ones, then CISPO and SAPO, each with
#: its own per-token loss (:func:`trl_per_token_loss`). TRL's ``vespo`` is left out: its weight is a function of
#: the whole sequence's log-ratio, no per-token loss.
TRL_LOSS_TYPES = GRPO_LOSS_TYPES + ("cispo", "sapo")
#: TRL's ``epsilon_high`` in the cispo problems: the upper clamp of cispo's detached ratio (the ScaleRL paper's
#: ε_max; GRPOConfig's docstring recommends 5.0 for cispo, where DAPO's 0.28 would clamp almost every ratio).
CISPO_EPSILON_HIGH = 5.0
#: SAPO's gate temperatures for positive / non-positive advantages (TRL 1.16 ``GRPOConfig.sapo_temperature_pos`` /
#: ``sapo_temperature_neg`` defaults).
SAPO_TEMPERATURE_POS, SAPO_TEMPERATURE_NEG = 1.0, 1.05
#: KL coefficient of the off-policy problem (the value of TRL's ``beta`` before it defaulted to 0).
BETA = 0.04
#: Standard deviation of ``old − current`` log-probs in the off-policy problem: exp(±0.2) crosses both clip
#: bounds (0.8, 1.28) for a sizeable fraction of the tokens.
OLD_LOGP_NOISE = 0.2
#: Standard deviation of ``ref − current`` log-probs in the off-policy problem.
REF_LOGP_NOISE = 0.1


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
    off_policy_kl: bool = False  # old log-probs ≠ current and a β·k3 KL term (module docstring)

    @property
    def flops_per_token_hv(self) -> int:
        """FLOPs per (valid token · H · V): 6 for cross-entropy (logits 2 + dX 2 + dW 2), 8 for GRPO
        (forward logits 2, backward recomputes them 2, dX 2, dW 2)."""
        return 6 if self.kind == "ce" else 8

    def describe(self) -> str:
        if self.kind == "ce":
            return f"cross-entropy N×H×V = {self.N}×{self.H}×{self.V}"
        loss = f"cispo, ε_high={CISPO_EPSILON_HIGH}" if self.loss_type == "cispo" else self.loss_type
        extra = f", off-policy, KL β={BETA} (k3)" if self.off_policy_kl else ""
        return f"GRPO ({loss}{extra}) B×T×H×V = {self.B}×{self.T}×{self.H}×{self.V}"


def _ce(n: int, h: int, v: int) -> Problem:
    return Problem(f"ce-{_k(n)}-h{h}-v{_k(v)}", "ce", n, h, v)


def _grpo(b: int, t: int, h: int, v: int, loss_type: str = "dapo", off_policy_kl: bool = False) -> Problem:
    suffix = ("" if loss_type == "dapo" else f"-{loss_type}") + ("-offpolicy-kl" if off_policy_kl else "")
    return Problem(f"grpo-{b}x{_k(t)}-h{h}-v{_k(v)}{suffix}", "grpo", b * t, h, v, b, t, loss_type, off_policy_kl)


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
#: The first GRPO shape under TRL's other loss types, on-policy (``--shapes grpo-loss-types``).
LOSS_TYPE_PROBLEMS = [_grpo(16, 2048, 2048, 151936, lt) for lt in TRL_LOSS_TYPES[1:]]
#: The first GRPO shape off-policy with the KL term (``--shapes grpo-offpolicy-kl``).
OFFPOLICY_KL_PROBLEMS = [_grpo(16, 2048, 2048, 151936, off_policy_kl=True)]
#: The first GRPO shape under TRL's other loss types, off-policy with the KL term
#: (``--shapes grpo-loss-types-offpolicy-kl``; DAPO's is ``grpo-offpolicy-kl``).
LOSS_TYPE_OFFPOLICY_KL_PROBLEMS = [_grpo(16, 2048, 2048, 151936, lt, off_policy_kl=True) for lt in TRL_LOSS_TYPES[1:]]

#: Tiny problems for ``--quick`` (CPU smoke tests, CI).
QUICK_PROBLEMS = [
    _ce(128, 64, 1000),
    _ce(256, 64, 1000),
    _grpo(2, 64, 64, 1000),
    _grpo(4, 64, 64, 1000),
]
QUICK_LOSS_TYPE_PROBLEMS = [_grpo(2, 64, 64, 1000, lt) for lt in TRL_LOSS_TYPES[1:]]
QUICK_OFFPOLICY_KL_PROBLEMS = [_grpo(2, 64, 64, 1000, off_policy_kl=True)]
QUICK_LOSS_TYPE_OFFPOLICY_KL_PROBLEMS = [_grpo(2, 64, 64, 1000, lt, off_policy_kl=True) for lt in TRL_LOSS_TYPES[1:]]
#: Named groups of extra problems, selectable by their key in ``--shapes``: (full, quick).
PROBLEM_GROUPS = {
    "grpo-loss-types": (LOSS_TYPE_PROBLEMS, QUICK_LOSS_TYPE_PROBLEMS),
    "grpo-offpolicy-kl": (OFFPOLICY_KL_PROBLEMS, QUICK_OFFPOLICY_KL_PROBLEMS),
    "grpo-loss-types-offpolicy-kl": (LOSS_TYPE_OFFPOLICY_KL_PROBLEMS, QUICK_LOSS_TYPE_OFFPOLICY_KL_PROBLEMS),
}


def select_problems(spec: Optional[str], quick: bool) -> list[Problem]:
    """Problems named by ``spec``: comma-separated names, kinds (``ce``, ``grpo``: the DAPO shapes), group keys
    (``grpo-loss-types``: the other loss types; ``grpo-offpolicy-kl``: DAPO off-policy with a KL term;
    ``grpo-loss-types-offpolicy-kl``: the other loss types off-policy with a KL term) or ``all`` (every shape,
    on-policy DAPO for GRPO).

    Raises:
        ValueError: a name that matches no problem (the message lists them).
    """
    pool = QUICK_PROBLEMS if quick else FULL_PROBLEMS
    groups = {key: group[1 if quick else 0] for key, group in PROBLEM_GROUPS.items()}
    extras = [p for group in groups.values() for p in group]
    if not spec or spec == "all":
        return list(pool)
    chosen: list[Problem] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = groups.get(item) or [p for p in pool + extras if item == p.name]
        matches = matches or [p for p in pool if item == p.kind]
        if not matches:
            names = ", ".join(p.name for p in pool + extras)
            raise ValueError(f"unknown shape {item!r}; choose from: all, ce, grpo, {', '.join(groups)}, {names}")
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
    old_logps, ref_logps: ``[B, T]`` fp32 old-policy and reference log-probs of ``token_ids`` (off-policy
        problem; ``None`` otherwise: on-policy, no KL term). beta: the KL coefficient (0 without ``ref_logps``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    token_ids: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    loss_type: str = "dapo"
    extras: dict = field(default_factory=dict)
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    beta: float = 0.0

    @property
    def n_valid(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def tensors(self) -> list[torch.Tensor]:
        all_ = (self.hidden, self.weight, self.labels, self.token_ids, self.mask, self.advantages, self.old_logps,
                self.ref_logps)
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
    inputs = Inputs(
        hidden.view(b, t, h).requires_grad_(), weight.requires_grad_(), labels, token_ids, mask, advantages,
        problem.loss_type,
    )
    if problem.off_policy_kl:
        from .reference import float64_logprobs  # the reference module imports this one

        # Of every position's token (the masked tail too: peers that score it see finite, close values there).
        current = float64_logprobs(hidden, weight, ids).view(b, t)
        noise = torch.randn(2, b, t, generator=gen, device=device, dtype=torch.float64)
        inputs.old_logps = (current + OLD_LOGP_NOISE * noise[0]).float()
        inputs.ref_logps = (current + REF_LOGP_NOISE * noise[1]).float()
        inputs.beta = BETA
    return inputs


def _normalize(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s reduction of a ``[B, T]`` per-token loss (one process, no
    gradient accumulation): ``grpo`` and ``sapo`` mean over sequences of each one's token mean; ``bnpo``,
    ``dapo`` and ``cispo`` sum / unmasked tokens (``num_items_in_batch``, which is that count here);
    ``dr_grpo`` sum / (B·T) (``T`` is ``max_completion_length``); ``luspo`` sum over each sequence's tokens,
    mean over sequences (``(per_token_loss * mask).sum(-1).mean()``)."""
    m = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo"):
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / per_token.numel()
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {TRL_LOSS_TYPES}")


def _policy_loss(logps: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL 1.16 ``_compute_loss``'s per-token policy term of ``loss_type`` (before the KL term)::

        clipped-ratio (GRPO_LOSS_TYPES):  −min(r·A, clamp(r, 1 − 0.2, 1 + 0.28)·A)
        cispo:                            −clamp(r, max=CISPO_EPSILON_HIGH).detach() · A · logp
        sapo:                             −sigmoid(τ·(r − 1)) · 4/τ · A,   τ = 1.0 where A > 0 else 1.05
    """
    if loss_type == "cispo":  # REINFORCE with the ratio as a clamped, detached weight: no gradient through r
        return -torch.clamp(ratio, max=CISPO_EPSILON_HIGH).detach() * adv * logps
    if loss_type == "sapo":  # τ in adv's dtype (TRL's torch.where of two floats is fp32): 1.05 exact in float64
        tau = torch.full_like(adv, SAPO_TEMPERATURE_NEG).masked_fill_(adv > 0, SAPO_TEMPERATURE_POS)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    if loss_type in GRPO_LOSS_TYPES:
        return -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPSILON_LOW, 1 + EPSILON_HIGH) * adv)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose from {TRL_LOSS_TYPES}")


def trl_per_token_loss(logps: torch.Tensor, advantages: torch.Tensor, old_logps: Optional[torch.Tensor] = None,
                       ref_logps: Optional[torch.Tensor] = None, beta: float = 0.0,
                       loss_type: str = "dapo") -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s per-token loss before masking and reduction (token-level
    importance sampling, no vLLM correction), elementwise on any one shape::

        r  = exp(logp − old)                                   (old = logp.detach() when None: r = 1)
        pg = the loss type's policy term (:func:`_policy_loss`; DAPO's −min(r·A, clamp(r, 0.8, 1.28)·A))
        kl = (exp(ref − logp) − (ref − logp) − 1) · r          (k3, bias-corrected; only when ref is given)
        loss = pg + β·kl

    The ``· r`` is TRL 1.16's default ``GRPOConfig.use_bias_correction_kl=True`` (``per_token_kl * coef_1``),
    applied to the KL term whatever the loss type. ``cispo`` uses ``epsilon_high`` =
    :data:`CISPO_EPSILON_HIGH` (TRL's recommended value for it), ``sapo`` TRL's default temperatures.

    ``advantages`` broadcasts against ``logps`` (``[B, 1]`` for per-sequence advantages of ``[B, T]``); constants
    are cast to ``logps``' dtype, so the float64 reference runs it all in float64.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    ratio = torch.exp(logps - old)
    per_token = _policy_loss(logps, ratio, advantages.to(logps.dtype), loss_type)
    if ref_logps is not None and beta != 0.0:
        d = ref_logps.to(logps.dtype) - logps
        per_token = per_token + beta * (torch.exp(d) - d - 1) * ratio
    return per_token


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo",
              old_logps: Optional[torch.Tensor] = None, ref_logps: Optional[torch.Tensor] = None,
              beta: float = 0.0) -> torch.Tensor:
    """TRL 1.16's GRPO loss of ``loss_type`` on ``[B, T]`` log-probs: :func:`trl_per_token_loss` with ``[B]``
    advantages, reduced as ``loss_type`` says (:func:`_normalize`). On-policy without a KL term when
    ``old_logps`` / ``ref_logps`` are ``None``. Works in the dtype of ``logps`` (the reference runs it in
    float64).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    per_token = trl_per_token_loss(logps, advantages.unsqueeze(-1), old_logps, ref_logps, beta, loss_type)
    return _normalize(per_token, mask, loss_type)


def problem_loss(logps: torch.Tensor, inp: Inputs) -> torch.Tensor:
    """The GRPO problem's loss on ``[B, T]`` log-probs (:func:`grpo_loss` with the inputs' constants)."""
    return grpo_loss(logps, inp.mask, inp.advantages, inp.loss_type, inp.old_logps, inp.ref_logps, inp.beta)


def normalizer_weights(mask: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """``[B, T]`` fp32 ``s`` with ``_normalize(x, mask, loss_type) = Σ s·x`` for every ``x`` (the reduction is
    linear in the per-token loss): ``mask / normalizer`` per token, a per-sequence normalizer for ``grpo``."""
    ones = torch.ones(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(_normalize(ones, mask, loss_type), ones)
    return weights


def token_weights_at_ratio_one(mask: torch.Tensor, advantages: torch.Tensor, loss_type: str = "dapo") -> torch.Tensor:
    """``[B, T]`` fp32 weights ``w`` with ``∇ grpo_loss = ∇ Σ w·CE`` on-policy, KL-free, for every loss type:
    at ratio 1 each per-token loss has ``∂/∂logp = −A`` (clipped-ratio: no clip active, ``−r·A``; cispo:
    ``−clamp(1, max=5)·A``; sapo: ``−σ'(0)·τ·4/τ·r·A = −A``), so ``∂loss/∂logp = −A·mask / normalizer``, i.e.
    ``w = A·mask / normalizer``. The loss *value* there is :func:`loss_value_at_ratio_one`."""
    return normalizer_weights(mask, loss_type) * advantages.float().unsqueeze(-1)


def loss_value_at_ratio_one(weighted_ce: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                            loss_type: str = "dapo") -> torch.Tensor:
    """:func:`grpo_loss`'s value on-policy, KL-free, given ``weighted_ce = Σ w·CE = −Σ w·logp`` with ``w`` =
    :func:`token_weights_at_ratio_one`. At ratio 1 the per-token loss is a constant for all but cispo (clipped
    ratio: ``−A``, so the loss is ``−Σ w``; sapo: ``−σ(0)·4/τ·A = −2A/τ``), which this reduces from log-probs of 0;
    cispo's is ``−clamp(1, max=5)·A·logp = −A·logp``, whose reduction is ``weighted_ce`` itself."""
    if loss_type == "cispo":
        return weighted_ce
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # the value does not depend on logp
    return grpo_loss(zeros, mask, advantages.float(), loss_type)
