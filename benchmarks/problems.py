"""The benchmark problems: shapes and deterministic inputs. What each one trains is in :mod:`benchmarks.losses`.

Three kinds:

* ``ce``: causal-LM cross-entropy over ``N`` tokens, mean over the kept ones (:data:`CE_IGNORED_FRACTION` of the
  labels, at random positions, are ``-100``); backward gives the gradients of ``hidden [N, H]`` and
  ``weight [V, H]``.
* ``grpo``: per-token log-probabilities of ``B`` completions of ``T`` tokens (the last :data:`GRPO_MASKED_TAIL` of
  each completion masked out as padding), TRL 1.16's GRPO loss of the problem's ``loss_type`` on top
  (:func:`benchmarks.losses.grpo_loss`; DAPO unless named), then backward. ``--shapes grpo-loss-types`` runs the
  first GRPO shape under every other TRL loss type, on-policy (ratio 1, no KL term). **Off-policy with a KL term**
  (``--shapes grpo-offpolicy-kl``, ``grpo-loss-types-offpolicy-kl``): old log-probs that differ from the current
  ones (ratio ≠ 1, both DAPO clips active on some tokens) and a reference model's log-probs with ``beta`` =
  :data:`BETA` times TRL's k3 estimator per token, importance-weighted by the ratio as TRL 1.16 does by default
  (``use_bias_correction_kl=True``). The old and reference log-probs are the float64 log-probs of the inputs plus
  Gaussian noise (:data:`OLD_LOGP_NOISE`, :data:`REF_LOGP_NOISE`): deterministic, and about what a real step sees
  after one optimizer update.
* ``distill``: the divergence between a student (``hidden [N, H]``, ``weight [V, H]``) and a teacher of another
  width (``teacher_hidden [N, H_t]``, ``teacher_weight [V, H_t]``, no gradient), TRL 1.16's
  ``DistillationTrainer`` loss (:func:`benchmarks.losses.distillation_divergence`: forward KL at ``β = 0``,
  reverse KL at ``β = 1``, the generalized JSD between), mean over the kept tokens (:data:`CE_IGNORED_FRACTION`
  masked at random); backward gives the student's gradients.
* ``sparse``: distillation from a teacher known only by its top-``K`` log-probs per token (served or precomputed),
  TRL 1.16's experimental ``AsyncDistillationTrainer`` loss (:func:`benchmarks.losses.sparse_divergence`: forward KL
  on the support with the tail bucket, its defaults), mean over the kept tokens (:data:`CE_IGNORED_FRACTION` masked);
  backward gives the student's gradients. The teacher is a head of the same width whose logits correlate with the
  student's by :data:`DISTILL_LOGIT_CORRELATION`; its top-``K`` ids and fp32 log-probs are computed once with the
  inputs. ``--shapes sparse`` runs ``K`` ∈ :data:`SPARSE_KS` and the cross-entropy of the same head and tokens (the
  cost the fused op aims at).

Logits look like a trained head's: standard deviation :data:`LOGIT_STD` (random logits of standard deviation 0.5
are near-uniform over 150k tokens, and a peer that skips small probabilities then skips almost all of its work).
A distillation problem's student and teacher logits are correlated (:data:`DISTILL_LOGIT_CORRELATION`), as a real
pair's are: about 0.75 nats of KL per token between two heads with ~5 nats of entropy each at 151,936 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .losses import CISPO_EPSILON_HIGH, IGNORE_INDEX, TRL_LOSS_TYPES
from .reference import float64_logprobs

#: Fraction of cross-entropy labels (distillation tokens) set to ``IGNORE_INDEX`` (masked), at random positions.
CE_IGNORED_FRACTION = 0.10
#: Fraction of each GRPO completion (its tail) that is masked out.
GRPO_MASKED_TAIL = 1 / 8
#: Standard deviation of the logits: peaked enough to look like a trained LM head (~4-5 nats of entropy).
LOGIT_STD = 4.0
#: KL coefficient of the off-policy GRPO problems (the value of TRL's ``beta`` before it defaulted to 0).
BETA = 0.04
#: Standard deviation of ``old − current`` log-probs in the off-policy problems: exp(±0.2) crosses both clip
#: bounds (0.8, 1.28) for a sizeable fraction of the tokens.
OLD_LOGP_NOISE = 0.2
#: Standard deviation of ``ref − current`` log-probs in the off-policy problems.
REF_LOGP_NOISE = 0.1
#: Correlation of a distillation problem's student and teacher logits, token by token.
DISTILL_LOGIT_CORRELATION = 0.95
#: The divergences of the distillation problems: forward KL, reverse KL (TRL's default), the JSD halfway.
DISTILL_BETAS = (0.0, 1.0, 0.5)
#: Candidates per token of the sparse-teacher problems.
SPARSE_KS = (1, 8, 64, 256)
KINDS = ("ce", "grpo", "distill", "sparse")


@dataclass(frozen=True)
class Problem:
    """One benchmark case. ``kind`` is ``"ce"``, ``"grpo"`` (``B``/``T`` set), ``"distill"`` (``H_t``, ``beta``
    and ``temperature`` set; ``H`` is the student's width) or ``"sparse"`` (``K`` candidates per token, ``beta``)."""

    name: str
    kind: str
    N: int
    H: int
    V: int
    B: Optional[int] = None
    T: Optional[int] = None
    loss_type: str = "dapo"
    off_policy_kl: bool = False  # old log-probs ≠ current and a β·k3 KL term (module docstring)
    H_t: Optional[int] = None
    beta: Optional[float] = None
    temperature: float = 1.0
    K: Optional[int] = None

    def flops(self, n_kept: int) -> float:
        """The useful FLOPs of one forward+backward over ``n_kept`` kept tokens: 6·n·H·V for cross-entropy (logits,
        dX, dW), 8·n·H·V for GRPO's log-probs (logits in forward, recomputed in backward, dX, dW), (6·H + 2·H_t)·n·V
        for distillation (the student's logits, dX, dW and the teacher's logits, each once), 6·n·H·V for a sparse
        teacher (the student's logits, dX, dW: the teacher's log-probs are inputs)."""
        if self.kind == "distill":
            return (6 * self.H + 2 * self.H_t) * n_kept * self.V
        return (6 if self.kind in ("ce", "sparse") else 8) * n_kept * self.H * self.V

    def describe(self) -> str:
        if self.kind == "ce":
            return f"cross-entropy N×H×V = {self.N}×{self.H}×{self.V}"
        if self.kind == "distill":
            what = {0.0: "forward KL", 1.0: "reverse KL"}.get(self.beta, f"JSD β={self.beta:g}")
            return f"distillation ({what}, T={self.temperature:g}) N×H×H_t×V = {self.N}×{self.H}×{self.H_t}×{self.V}"
        if self.kind == "sparse":
            what = {0.0: "forward KL", 1.0: "reverse KL"}.get(self.beta, f"JSD β={self.beta:g}")
            return (f"sparse teacher (top-{self.K} log-probs, {what}, tail bucket) N×H×V = "
                    f"{self.N}×{self.H}×{self.V}")
        loss = f"cispo, ε_high={CISPO_EPSILON_HIGH}" if self.loss_type == "cispo" else self.loss_type
        extra = f", off-policy, KL β={BETA} (k3)" if self.off_policy_kl else ""
        return f"GRPO ({loss}{extra}) B×T×H×V = {self.B}×{self.T}×{self.H}×{self.V}"


def _k(x: int) -> str:
    return f"{round(x / 1024)}k" if x >= 1024 and x % 1024 == 0 else (f"{round(x / 1000)}k" if x >= 1000 else str(x))


def _ce(n: int, h: int, v: int) -> Problem:
    return Problem(f"ce-{_k(n)}-h{h}-v{_k(v)}", "ce", n, h, v)


def _grpo(b: int, t: int, h: int, v: int, loss_type: str = "dapo", off_policy_kl: bool = False) -> Problem:
    suffix = ("" if loss_type == "dapo" else f"-{loss_type}") + ("-offpolicy-kl" if off_policy_kl else "")
    return Problem(f"grpo-{b}x{_k(t)}-h{h}-v{_k(v)}{suffix}", "grpo", b * t, h, v, b, t, loss_type, off_policy_kl)


def _distill(n: int, h: int, h_t: int, v: int, beta: float) -> Problem:
    return Problem(f"distill-{_k(n)}-h{h}-t{h_t}-v{_k(v)}-beta{beta:g}", "distill", n, h, v, H_t=h_t, beta=beta)


def _sparse(n: int, h: int, v: int, k: int, beta: float = 0.0) -> Problem:
    return Problem(f"sparse-{_k(n)}-h{h}-v{_k(v)}-k{k}", "sparse", n, h, v, beta=beta, K=k)


#: The full-size problems (bf16 on one GPU): Qwen3-1.7B's head (H 2048, V 151936), Llama-3-8B's (4096, 128256);
#: distillation from a Qwen3-8B-shaped teacher (H 4096) to a Qwen3-1.7B-shaped student.
FULL_PROBLEMS = [
    _ce(8192, 2048, 151936),
    _ce(32768, 2048, 151936),
    _ce(16384, 4096, 128256),
    _grpo(16, 2048, 2048, 151936),
    _grpo(8, 4096, 4096, 151936),
    *(_distill(16384, 2048, 4096, 151936, beta) for beta in DISTILL_BETAS),
]
#: Tiny problems for ``--quick`` (CPU smoke tests, CI).
QUICK_PROBLEMS = [
    _ce(128, 64, 1000),
    _ce(256, 64, 1000),
    _grpo(2, 64, 64, 1000),
    _grpo(4, 64, 64, 1000),
    *(_distill(128, 32, 48, 1000, beta) for beta in DISTILL_BETAS),
]
#: Named groups of extra GRPO problems, selectable by their key in ``--shapes``: (full, quick).
PROBLEM_GROUPS = {
    "grpo-loss-types": ([_grpo(16, 2048, 2048, 151936, lt) for lt in TRL_LOSS_TYPES[1:]],
                        [_grpo(2, 64, 64, 1000, lt) for lt in TRL_LOSS_TYPES[1:]]),
    "grpo-offpolicy-kl": ([_grpo(16, 2048, 2048, 151936, off_policy_kl=True)],
                          [_grpo(2, 64, 64, 1000, off_policy_kl=True)]),
    "grpo-loss-types-offpolicy-kl": (
        [_grpo(16, 2048, 2048, 151936, lt, off_policy_kl=True) for lt in TRL_LOSS_TYPES[1:]],
        [_grpo(2, 64, 64, 1000, lt, off_policy_kl=True) for lt in TRL_LOSS_TYPES[1:]]),
    # a teacher's top-K log-probs on Qwen3-1.7B's head, and the cross-entropy of the same head and tokens
    "sparse": ([_ce(16384, 2048, 151936), *(_sparse(16384, 2048, 151936, k) for k in SPARSE_KS)],
               [_ce(128, 64, 1000), *(_sparse(128, 64, 1000, k) for k in SPARSE_KS)]),
}


def all_problems(quick: bool) -> list[Problem]:
    """Every problem ``--shapes`` can name, once each: the default ones, then the groups' (a group may repeat a
    default problem, e.g. the cross-entropy a sparse problem is compared with)."""
    extra = [p for full, small in PROBLEM_GROUPS.values() for p in (small if quick else full)]
    return list(dict.fromkeys((QUICK_PROBLEMS if quick else FULL_PROBLEMS) + extra))


def select_problems(spec: Optional[str], quick: bool) -> list[Problem]:
    """Problems named by ``spec``: comma-separated names, kinds (``ce``, ``grpo``: the DAPO shapes, ``distill``),
    group keys (:data:`PROBLEM_GROUPS`) or ``all``; ``None``/``all``: every default problem (the groups on request).

    Raises:
        ValueError: a name that matches no problem (the message lists them).
    """
    pool = QUICK_PROBLEMS if quick else FULL_PROBLEMS
    groups = {key: group[1 if quick else 0] for key, group in PROBLEM_GROUPS.items()}
    if not spec or spec == "all":
        return list(pool)
    chosen: list[Problem] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = groups.get(item) or [p for p in all_problems(quick) if item == p.name]
        matches = matches or [p for p in pool if item == p.kind]
        if not matches:
            names = ", ".join(p.name for p in all_problems(quick))
            raise ValueError(f"unknown shape {item!r}; choose from: all, {', '.join(KINDS)}, {', '.join(groups)}, "
                             f"{names}")
        chosen += [p for p in matches if p not in chosen]
    return chosen


@dataclass
class Inputs:
    """A problem's tensors, all on the benchmark device.

    hidden: ``[N, H]`` (ce, distill: the student's) or ``[B, T, H]`` (grpo), leaf with ``requires_grad``.
    weight: ``[V, H]`` leaf with ``requires_grad`` (distill: the student's lm_head).
    labels: ``[N]`` / ``[B, T]`` int64 token ids with ``IGNORE_INDEX`` at ignored / masked positions (ce, grpo).
    token_ids: ``[B, T]`` the completion ids without masking (grpo; peers that take a separate mask).
    mask: bool, True where the token counts: ``[B, T]`` (grpo), ``[N]`` (distill).
    advantages: ``[B]`` fp32 (grpo). loss_type: the GRPO loss on top.
    old_logps, ref_logps: ``[B, T]`` fp32 old-policy and reference log-probs of ``token_ids`` (off-policy problems;
        ``None`` otherwise: on-policy, no KL term). beta: the KL coefficient (0 without ``ref_logps``).
    teacher_hidden, teacher_weight: ``[N, H_t]``, ``[V, H_t]`` without gradient (distill).
    divergence_beta, temperature: the divergence's β and the softmax temperature (distill, sparse).
    support_ids, teacher_logprobs, support_mask: ``[N, K]`` the teacher's top-K ids (int64), its fp32 log-probs at
        them and their validity (bool) (sparse). add_tail_bucket: TRL's tail bucket (sparse).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: Optional[torch.Tensor] = None
    token_ids: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    loss_type: str = "dapo"
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    beta: float = 0.0
    teacher_hidden: Optional[torch.Tensor] = None
    teacher_weight: Optional[torch.Tensor] = None
    divergence_beta: Optional[float] = None
    temperature: float = 1.0
    support_ids: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    support_mask: Optional[torch.Tensor] = None
    add_tail_bucket: bool = True

    @property
    def valid(self) -> torch.Tensor:
        """bool, True at the tokens the loss counts (the shape of ``labels``, or of ``mask`` without labels)."""
        return self.labels != IGNORE_INDEX if self.labels is not None else self.mask

    @property
    def n_valid(self) -> int:
        return int(self.valid.sum())


def make_inputs(problem: Problem, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Deterministic inputs for ``problem`` (same seed → same tensors on the same device type)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if problem.kind == "distill":
        return _distillation_inputs(problem, device, dtype, gen)
    if problem.kind == "sparse":
        return _sparse_inputs(problem, device, dtype, gen)
    n, h, v = problem.N, problem.H, problem.V
    # hidden ~ N(0, 1), weight ~ N(0, LOGIT_STD² / H): logits ~ N(0, LOGIT_STD²).
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=torch.float32).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device, dtype=torch.float32) * (LOGIT_STD / h**0.5)).to(dtype)
    ids = torch.randint(0, v, (n,), generator=gen, device=device)
    if problem.kind == "ce":
        ignored = torch.randperm(n, generator=gen, device=device)[: round(CE_IGNORED_FRACTION * n)]
        return Inputs(hidden.requires_grad_(), weight.requires_grad_(), ids.index_fill(0, ignored, IGNORE_INDEX))
    b, t = problem.B, problem.T
    token_ids = ids.view(b, t)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask[:, t - int(t * GRPO_MASKED_TAIL) :] = False
    advantages = torch.randn(b, generator=gen, device=device, dtype=torch.float32)
    inputs = Inputs(hidden.view(b, t, h).requires_grad_(), weight.requires_grad_(), token_ids.masked_fill(~mask,
                    IGNORE_INDEX), token_ids, mask, advantages, problem.loss_type)
    if problem.off_policy_kl:
        # Of every position's token (the masked tail too: peers that score it see finite, close values there).
        current = float64_logprobs(hidden, weight, ids).view(b, t)
        noise = torch.randn(2, b, t, generator=gen, device=device, dtype=torch.float64)
        inputs.old_logps = (current + OLD_LOGP_NOISE * noise[0]).float()
        inputs.ref_logps = (current + REF_LOGP_NOISE * noise[1]).float()
        inputs.beta = BETA
    return inputs


def _distillation_inputs(problem: Problem, device: torch.device, dtype: torch.dtype, gen) -> Inputs:
    """Student and teacher hidden states that share their first ``k = min(H, H_t)`` columns ``u`` (both models read
    the same text) and heads whose logits are ``LOGIT_STD·(√ρ·s + √(1 − ρ)·r)``: ``s = u·c_j/√k`` from vocabulary
    directions ``C`` common to both heads, ``r`` each head's own ``h·r_j/√H`` (independent between the models).
    Every term has unit variance, so each model's logits have standard deviation ``LOGIT_STD`` and the two
    correlate by ``ρ`` = :data:`DISTILL_LOGIT_CORRELATION`."""
    n, v, widths = problem.N, problem.V, (problem.H, problem.H_t)
    k, rho = min(widths), DISTILL_LOGIT_CORRELATION

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    shared_rows, shared_vocab = randn(n, k), randn(v, k) / k**0.5
    hidden, weight = [], []
    for width in widths:
        hidden.append(torch.cat([shared_rows, randn(n, width - k)], 1).to(dtype))
        common = torch.nn.functional.pad(shared_vocab, (0, width - k))
        weight.append((LOGIT_STD * (rho**0.5 * common + (1 - rho) ** 0.5 * randn(v, width) / width**0.5)).to(dtype))
    mask = torch.ones(n, dtype=torch.bool, device=device)
    mask[torch.randperm(n, generator=gen, device=device)[: round(CE_IGNORED_FRACTION * n)]] = False
    return Inputs(hidden[0].requires_grad_(), weight[0].requires_grad_(), mask=mask, teacher_hidden=hidden[1],
                  teacher_weight=weight[1], divergence_beta=problem.beta, temperature=problem.temperature)


#: Rows of the teacher's logits computed at once for its top-K (fp32 ``[rows, V]``).
_TEACHER_ROWS = 1024


def _sparse_inputs(problem: Problem, device: torch.device, dtype: torch.dtype, gen) -> Inputs:
    """A student head as the cross-entropy problems' (logits of standard deviation ``LOGIT_STD``) and a teacher head
    of the same width, ``√ρ·W + √(1 − ρ)·R`` (``R`` independent, same scale: logits correlated by ``ρ`` =
    :data:`DISTILL_LOGIT_CORRELATION`), whose top-``K`` ids and fp32 log-probs per token (from its fp32 logits) are
    the teacher's side; every slot valid, :data:`CE_IGNORED_FRACTION` of the tokens masked."""
    n, h, v, rho = problem.N, problem.H, problem.V, DISTILL_LOGIT_CORRELATION
    hidden = torch.randn(n, h, generator=gen, device=device, dtype=torch.float32)
    weight = torch.randn(v, h, generator=gen, device=device, dtype=torch.float32) * (LOGIT_STD / h**0.5)
    own = torch.randn(v, h, generator=gen, device=device, dtype=torch.float32) * (LOGIT_STD / h**0.5)
    teacher_weight = rho**0.5 * weight + (1 - rho) ** 0.5 * own
    del own
    ids = torch.empty((n, problem.K), dtype=torch.long, device=device)
    logprobs = torch.empty((n, problem.K), dtype=torch.float32, device=device)
    for r0 in range(0, n, _TEACHER_ROWS):
        top = torch.topk(torch.log_softmax(hidden[r0 : r0 + _TEACHER_ROWS] @ teacher_weight.t(), dim=-1), problem.K,
                         dim=-1)
        ids[r0 : r0 + _TEACHER_ROWS], logprobs[r0 : r0 + _TEACHER_ROWS] = top.indices, top.values
        del top
    del teacher_weight
    mask = torch.ones(n, dtype=torch.bool, device=device)
    mask[torch.randperm(n, generator=gen, device=device)[: round(CE_IGNORED_FRACTION * n)]] = False
    return Inputs(hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), mask=mask,
                  divergence_beta=problem.beta, support_ids=ids, teacher_logprobs=logprobs,
                  support_mask=torch.ones_like(ids, dtype=torch.bool))
