"""The distillation divergences of one resident tile of logits rows, and the student's logits gradient.

Per token, with both models' logits after their own scale and soft-cap and then the shared temperature ``T``
(:mod:`hf_fused.ops.logit_transform`), ``s = log p_s = log_softmax(z_s)``, ``t = log p_t = log_softmax(z_t)``, and
the convention of TRL 1.16 (``trl/kernels/chunked_divergence.py``; the same as Liger's ``LigerFusedLinearJSD``,
Unsloth's ``fused_linear_jsd`` and TRL's ``GKDTrainer.generalized_jsd_loss``, Eq. (1) of Agarwal et al., "On-Policy
Distillation of Language Models", arXiv 2306.13649)::

    β = 0        forward KL   D = KL(p_t ‖ p_s) = Σ_j p_t,j (t_j − s_j)
    β = 1        reverse KL   D = KL(p_s ‖ p_t) = Σ_j p_s,j (s_j − t_j)
    0 < β < 1    generalized JSD, m = (1 − β)·p_s + β·p_t:
                 D = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)

(the JSD tends to 0, not to either KL, as β → 0 or 1: the ends are special-cased, as TRL does). The student's
entropy ``H = −Σ_j p_s,j s_j`` is reported with it (detached: TRL logs it, no gradient).

The gradient reaches the student only. With the softmax Jacobian ``∂p_s,j/∂z_s,k = p_s,j (δ_jk − p_s,k)``, a
divergence whose derivative in the probabilities is ``g_j = ∂D/∂p_s,j`` has ``∂D/∂z_s,k = p_s,k (g_k − Σ_j p_s,j g_j)``:

- forward KL: ``D = Σ p_t t − Σ_j p_t,j (z_s,j − lse_s)``, so ``∂D/∂z_s = p_s − p_t`` directly (Σ p_t = 1);
- reverse KL: ``g = s − t + 1``, ``Σ p_s g = KL(p_s ‖ p_t) + 1``, so ``∂D/∂z_s = p_s ∘ (s − t − KL(p_s ‖ p_t))``;
- JSD: ``∂m_j/∂p_s,j = 1 − β``, so
  ``g_j = −β p_t,j (1 − β)/m_j + (1 − β)(s_j − log m_j) + (1 − β) − (1 − β)² p_s,j/m_j
  = (1 − β)(s_j − log m_j) + (1 − β)(1 − (β p_t,j + (1 − β) p_s,j)/m_j) = (1 − β)(s_j − log m_j)``
  (the bracket is ``1 − m_j/m_j = 0``), ``Σ p_s g = (1 − β) KL(p_s ‖ m)``, so
  ``∂D/∂z_s = (1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m))``.

These are TRL's ``_backward_tile`` formulas. They are gradients with respect to the tempered logits ``z_s``; the
student's :meth:`~hf_fused.ops.logit_transform.LogitTransform.backward` then multiplies by ``1/T``, the soft-cap's
``1 − tanh²`` and the scale, which gives the issue's ``(p_s − p_t)/T`` and ``p_s∘(s − t − KL)/T``. No ``T²`` factor
(Hinton et al.'s): TRL's trainer applies none.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

#: fp32 ``[rows, V]`` arrays alive at once in one tile of the plain-torch distillation pass (``distillation.py``):
#: the student's logits and its soft-cap's ``tanh``, the teacher's logits, and the three :func:`tile_divergence`
#: makes at most (the JSD's ``p_s``, ``p_t`` and ``log m``); beside them only :func:`_row_dot`'s
#: ``[rows, ≤ _DOT_COLS]`` product. Without soft-cap, or for a KL, one or two fewer. After the divergence at most
#: two remain (the student's logits gradient and the soft-cap's ``tanh``), beside the half of one that the
#: gradient's bf16 copy for the gradient matmuls takes on CUDA.
DISTILLATION_TILE_BUFFERS = 6

#: Columns per step of :func:`_row_dot`: its product temporary is ``[rows, ≤ this]``, a small part of a tile.
_DOT_COLS = 4096


def check_beta(beta) -> float:
    """``beta`` as a float, the divergence's mixing weight (the formulas above).

    Raises:
        ValueError: ``beta`` not a number in [0, 1] (a bool included)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 <= beta <= 1.0):
        raise ValueError(
            f"beta must be a number in [0, 1] (0: forward KL(teacher ‖ student), 1: reverse KL(student ‖ teacher), "
            f"between: the generalized JSD), got {beta!r}{_as_python_number(beta)}"
        )
    return float(beta)


def check_temperature(temperature) -> float:
    """``temperature`` as a float, the shared temperature ``T`` both models' logits are divided by.

    Raises:
        ValueError: ``temperature`` not a finite number > 0 (a bool included)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}"
                         f"{_as_python_number(temperature)}")
    return float(temperature)


def _as_python_number(value) -> str:
    """What to do where a tensor (or NumPy scalar) was given for a Python number."""
    return "" if isinstance(value, (int, float)) else "; pass a Python float (e.g. float(value))"


class TileDivergence(NamedTuple):
    """What :func:`tile_divergence` computes for ``r`` rows: ``divergence`` and student ``entropy`` fp32 ``[r]``;
    ``grad`` the fp32 ``[r, V]`` ``∂divergence/∂z_s`` (module docstring), or ``None`` when not asked."""

    divergence: torch.Tensor
    entropy: torch.Tensor
    grad: Optional[torch.Tensor]


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_j a_j·b_j`` per row, fp32 ``[r]``, through a temporary of at most ``_DOT_COLS`` columns (an elementwise
    product and sum, not a matmul: an fp32 matmul may run in TF32 where a user enabled it)."""
    out = torch.zeros(a.shape[0], dtype=torch.float32, device=a.device)
    for c0 in range(0, a.shape[1], _DOT_COLS):
        out += (a[:, c0 : c0 + _DOT_COLS] * b[:, c0 : c0 + _DOT_COLS]).sum(1)
    return out


def tile_divergence(zs: torch.Tensor, zt: torch.Tensor, beta: float, *, with_grad: bool) -> TileDivergence:
    """The divergence of the module docstring between the rows of ``zs`` (student) and ``zt`` (teacher), both
    fp32 ``[r, V]`` tempered logits on one device, which this consumes (overwritten in place); with ``with_grad``
    also ``∂D/∂z_s`` (in one of those buffers).

    ``beta``: ``0`` forward KL, ``1`` reverse KL, strictly between: the generalized JSD (the caller checks the range).
    """
    log_ps = zs.sub_(torch.logsumexp(zs, dim=1, keepdim=True))  # s, in place of z_s
    log_pt = zt.sub_(torch.logsumexp(zt, dim=1, keepdim=True))  # t, in place of z_t
    ps = log_ps.exp()
    entropy = -_row_dot(ps, log_ps)
    if beta == 0.0:
        # KL(p_t ‖ p_s) = Σ p_t (t − s);  ∂/∂z_s = p_s − p_t
        diff = log_ps.neg_().add_(log_pt)  # t − s (s is not needed any more)
        pt = log_pt.exp_()
        divergence = _row_dot(pt, diff)
        grad = ps.sub_(pt) if with_grad else None
    elif beta == 1.0:
        # KL(p_s ‖ p_t) = Σ p_s (s − t);  ∂/∂z_s = p_s ∘ (s − t − KL)
        diff = log_ps.sub_(log_pt)
        del log_pt
        divergence = _row_dot(ps, diff)
        grad = diff.sub_(divergence.unsqueeze(1)).mul_(ps) if with_grad else None
    else:
        # m = (1 − β) p_s + β p_t, in logs: log m = logaddexp(s + log(1 − β), t + log β)
        pt = log_pt.exp()
        log_m = log_ps + math.log1p(-beta)
        log_bpt = log_pt.add_(math.log(beta))  # log(β p_t), in place of t
        torch.logaddexp(log_m, log_bpt, out=log_m)
        # KL(p_t ‖ m) = Σ p_t (t − log m) = Σ p_t (log(β p_t) − log m) − log β · Σ p_t
        kl_teacher = _row_dot(pt, log_bpt.sub_(log_m)) - math.log(beta) * pt.sum(1)
        del pt, log_bpt
        diff = log_ps.sub_(log_m)  # s − log m
        del log_m
        kl_student = _row_dot(ps, diff)  # KL(p_s ‖ m)
        divergence = beta * kl_teacher + (1.0 - beta) * kl_student
        # ∂/∂z_s = (1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m))
        grad = diff.sub_(kl_student.unsqueeze(1)).mul_(ps).mul_(1.0 - beta) if with_grad else None
    return TileDivergence(divergence, entropy, grad)
