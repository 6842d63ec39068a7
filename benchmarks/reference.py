"""The float64 ground truth of a problem, computed tile by tile on the benchmark device from the same inputs the
peers get; the results go to host memory so that the peers get the device to themselves.

Per tile of kept rows, float64 logits against the whole vocabulary, then:

* ``ce``: ``lse``, ``logp = z[y] − lse``; the logits gradient ``dz = g · (onehot(y) − p)`` with ``g = −1/n_kept``
  gives ``dh = dz W`` and ``dW += dzᵀ h``.
* ``grpo``: a first pass computes the log-probs and entropies, the problem's GRPO loss
  (:func:`benchmarks.losses.grpo_loss`: its loss type, and off-policy its old / reference log-probs and KL term)
  and its gradient in the log-probs in float64 autograd on ``[B, T]``; a second pass turns that into ``dh``/``dW``.
* ``distill``: both models' logits, :func:`benchmarks.losses.distillation_divergence` and its gradient in the
  student's logits by float64 autograd on the tile, mean over the kept rows; ``dh``/``dW`` of the student only.
* ``sparse``: the student's logits, :func:`benchmarks.losses.sparse_divergence` against the teacher's top-K
  log-probs and its gradient by float64 autograd on the tile, mean over the kept rows.

Only the inputs' attributes are read (duck typing): this module sits below :mod:`benchmarks.problems`, which uses
:func:`float64_logprobs` to make its off-policy inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .losses import distillation_divergence, grpo_loss, sparse_divergence

#: Memory for one tile's float64 temporaries.
REFERENCE_TILE_BYTES = 3 * 1024**3


@dataclass
class Reference:
    """float64 results on the host. ``logps`` / ``entropy`` (``[N]`` flat, 0 at ignored) for GRPO only."""

    loss: float
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    logps: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    seconds: float


def _row_tiles(rows: torch.Tensor, vocab: int, tile_bytes: int, arrays: int = 3):
    step = max(1, tile_bytes // (arrays * 8 * vocab))
    for start in range(0, rows.numel(), step):
        yield rows[start : start + step]


def _stats(h64: torch.Tensor, w64: torch.Tensor, y: torch.Tensor):
    z = h64 @ w64.t()
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, y.unsqueeze(1)).squeeze(1) - lse
    return z, lse, logp


def _accumulate_grads(z, lse, y, g, h64, w64, dh, dw, idx):
    """``dz = g·(onehot(y) − softmax(z))`` → ``dh[idx] = dz W``, ``dW += dzᵀ h``. Overwrites ``z``."""
    p = z.sub_(lse.unsqueeze(1)).exp_()
    p.scatter_add_(1, y.unsqueeze(1), -torch.ones_like(y, dtype=p.dtype).unsqueeze(1))
    dz = p.mul_(-g.unsqueeze(1))  # g·(onehot − p)
    dh.index_copy_(0, idx, dz @ w64)
    dw.addmm_(dz.t(), h64)


@torch.no_grad()
def float64_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                     tile_bytes: int = REFERENCE_TILE_BYTES) -> torch.Tensor:
    """float64 ``log softmax(h Wᵀ)[y]`` of ``hidden [N, H]``, ``weight [V, H]``, ``ids [N]`` (every row), tile by
    tile on their device."""
    w64 = weight.detach().double()
    out = torch.empty(ids.numel(), dtype=torch.float64, device=hidden.device)
    for idx in _row_tiles(torch.arange(ids.numel(), device=hidden.device), weight.shape[0], tile_bytes):
        _, _, logp = _stats(hidden.detach().index_select(0, idx).double(), w64, ids.index_select(0, idx))
        out.index_copy_(0, idx, logp)
    return out


def _cross_entropy(hidden, labels, rows, w64, dh, dw, tile_bytes) -> float:
    n_valid = max(rows.numel(), 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for idx in _row_tiles(rows, w64.shape[0], tile_bytes):
        h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
        z, lse, logp = _stats(h64, w64, y)
        loss_sum -= logp.sum()
        _accumulate_grads(z, lse, y, torch.full_like(lse, -1.0 / n_valid), h64, w64, dh, dw, idx)  # dL/dlogp
        del z
    return float(loss_sum / n_valid)


def _grpo(inputs, hidden, labels, rows, w64, dh, dw, tile_bytes):
    """The GRPO loss, its log-probs and entropies ``[N]`` (0 at masked positions)."""
    n, device = labels.numel(), hidden.device
    logps, entropy, lses = (torch.zeros(n, dtype=torch.float64, device=device) for _ in range(3))
    for idx in _row_tiles(rows, w64.shape[0], tile_bytes):
        h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
        z, lse, logp = _stats(h64, w64, y)
        p = torch.softmax(z, dim=-1)
        entropy.index_copy_(0, idx, lse - (p * z).sum(-1))
        logps.index_copy_(0, idx, logp)
        lses.index_copy_(0, idx, lse)
        del z, p
    with torch.enable_grad():
        lp = logps.view(inputs.labels.shape).clone().requires_grad_()
        loss_t = grpo_loss(lp, inputs.mask, inputs.advantages, inputs.loss_type, inputs.old_logps, inputs.ref_logps,
                           inputs.beta)  # float64: the constants are cast to lp's dtype
        (g_logp,) = torch.autograd.grad(loss_t, lp)
    g_logp = g_logp.reshape(-1)
    for idx in _row_tiles(rows, w64.shape[0], tile_bytes):
        h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
        z = h64 @ w64.t()
        _accumulate_grads(z, lses.index_select(0, idx), y, g_logp.index_select(0, idx), h64, w64, dh, dw, idx)
        del z
    return float(loss_t), logps.cpu(), entropy.cpu()


def _distillation(inputs, hidden, rows, w64, dh, dw, tile_bytes) -> float:
    n_valid = max(rows.numel(), 1)
    wt64 = inputs.teacher_weight.detach().double()
    teacher = inputs.teacher_hidden.detach()
    loss_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
    # about ten [rows, V] float64 arrays alive at once: both logits, both log-softmaxes, m, products, the gradient
    for idx in _row_tiles(rows, w64.shape[0], tile_bytes, arrays=10):
        h64 = hidden.index_select(0, idx).double()
        zt = teacher.index_select(0, idx).double() @ wt64.t()
        with torch.enable_grad():
            zs = (h64 @ w64.t()).requires_grad_()
            tile_sum = distillation_divergence(zs, zt, inputs.divergence_beta, inputs.temperature).sum()
            (dz,) = torch.autograd.grad(tile_sum / n_valid, zs)
        loss_sum += tile_sum.detach()
        dh.index_copy_(0, idx, dz @ w64)
        dw.addmm_(dz.t(), h64)
        del zs, zt, dz
    return float(loss_sum / n_valid)


def _sparse(inputs, hidden, rows, w64, dh, dw, tile_bytes) -> float:
    n_valid = max(rows.numel(), 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
    # about eight [rows, V] float64 arrays alive at once: the logits, the log-softmax, autograd's buffers, the gradient
    for idx in _row_tiles(rows, w64.shape[0], tile_bytes, arrays=8):
        h64 = hidden.index_select(0, idx).double()
        with torch.enable_grad():
            zs = (h64 @ w64.t()).requires_grad_()
            tile_sum = sparse_divergence(zs, inputs.support_ids.index_select(0, idx),
                                         inputs.teacher_logprobs.index_select(0, idx).double(),
                                         inputs.support_mask.index_select(0, idx), inputs.divergence_beta,
                                         inputs.add_tail_bucket).sum()
            (dz,) = torch.autograd.grad(tile_sum / n_valid, zs)
        loss_sum += tile_sum.detach()
        dh.index_copy_(0, idx, dz @ w64)
        dw.addmm_(dz.t(), h64)
        del zs, dz
    return float(loss_sum / n_valid)


@torch.no_grad()
def compute_reference(problem, inputs, tile_bytes: int = REFERENCE_TILE_BYTES) -> Reference:
    """float64 loss and gradients of ``problem`` (its ``kind``: ``ce``, ``grpo``, ``distill`` or ``sparse``) on ``inputs`` (a
    :class:`benchmarks.problems.Inputs`), plus the log-probs and entropies for GRPO.

    Raises:
        ValueError: an unknown problem kind.
    """
    start = time.perf_counter()
    device = inputs.hidden.device
    hidden = inputs.hidden.detach().reshape(-1, inputs.hidden.shape[-1])
    rows = inputs.valid.reshape(-1).nonzero().squeeze(1)
    w64 = inputs.weight.detach().double()
    dh = torch.zeros(hidden.shape, dtype=torch.float64, device=device)
    dw = torch.zeros(w64.shape, dtype=torch.float64, device=device)
    logps = entropy = None
    if problem.kind == "ce":
        loss = _cross_entropy(hidden, inputs.labels.reshape(-1), rows, w64, dh, dw, tile_bytes)
    elif problem.kind == "grpo":
        loss, logps, entropy = _grpo(inputs, hidden, inputs.labels.reshape(-1), rows, w64, dh, dw, tile_bytes)
    elif problem.kind == "distill":
        loss = _distillation(inputs, hidden, rows, w64, dh, dw, tile_bytes)
    elif problem.kind == "sparse":
        loss = _sparse(inputs, hidden, rows, w64, dh, dw, tile_bytes)
    else:
        raise ValueError(f"unknown problem kind {problem.kind!r}; choose from ce, grpo, distill, sparse")
    del w64
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref = Reference(loss=loss, grad_hidden=dh.cpu(), grad_weight=dw.cpu(), logps=logps, entropy=entropy,
                    seconds=time.perf_counter() - start)
    del dh, dw
    return ref
