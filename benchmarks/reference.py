"""The float64 ground truth, computed tile by tile on the benchmark device from the same bf16 inputs.

Per tile of non-ignored rows: float64 logits ``z = h Wᵀ`` against the whole vocabulary, then
``lse``, ``logp = z[y] − lse``, entropy ``lse − Σ p z``; the logits gradient
``dz = g · (onehot(y) − p)`` gives ``dh = dz W`` and ``dW += dzᵀ h``, all in float64. For GRPO a first
pass computes the log-probs, the problem's GRPO loss (:func:`~benchmarks.problems.problem_loss`: its loss
type, and off-policy its old / reference log-probs and KL term) and its gradient w.r.t. the log-probs run
in float64 autograd on ``[B, T]``, and a second pass turns that into ``dh`` / ``dW``. The results go to host memory so the
peers get the device to themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .problems import IGNORE_INDEX, Inputs, Problem, problem_loss

#: Memory for one tile's float64 temporaries (three ``[rows, V]`` arrays).
REFERENCE_TILE_BYTES = 3 * 1024**3


@dataclass
class Reference:
    """float64 results on the host. ``logps`` / ``entropy`` (``[N]`` flat, 0 at ignored) for GRPO."""

    loss: float
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    logps: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    seconds: float


def _row_tiles(rows: torch.Tensor, vocab: int, tile_bytes: int):
    step = max(1, tile_bytes // (3 * 8 * vocab))
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


@torch.no_grad()
def compute_reference(problem: Problem, inputs: Inputs, tile_bytes: int = REFERENCE_TILE_BYTES) -> Reference:
    """float64 loss, gradients (and GRPO log-probs / entropy) of ``problem`` on ``inputs``."""
    start = time.perf_counter()
    device = inputs.hidden.device
    hidden = inputs.hidden.detach().reshape(-1, problem.H)
    labels = inputs.labels.reshape(-1)
    rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    n_valid = max(rows.numel(), 1)
    w64 = inputs.weight.detach().double()
    dh = torch.zeros(hidden.shape, dtype=torch.float64, device=device)
    dw = torch.zeros(w64.shape, dtype=torch.float64, device=device)
    logps = entropy = None

    if problem.kind == "ce":
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for idx in _row_tiles(rows, problem.V, tile_bytes):
            h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
            z, lse, logp = _stats(h64, w64, y)
            loss_sum -= logp.sum()
            _accumulate_grads(z, lse, y, torch.full_like(lse, -1.0 / n_valid), h64, w64, dh, dw, idx)  # dL/dlogp
            del z
        loss = float(loss_sum / n_valid)
    else:
        n = labels.numel()
        logps = torch.zeros(n, dtype=torch.float64, device=device)
        entropy = torch.zeros(n, dtype=torch.float64, device=device)
        lses = torch.zeros(n, dtype=torch.float64, device=device)
        for idx in _row_tiles(rows, problem.V, tile_bytes):
            h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
            z, lse, logp = _stats(h64, w64, y)
            p = torch.softmax(z, dim=-1)
            entropy.index_copy_(0, idx, lse - (p * z).sum(-1))
            logps.index_copy_(0, idx, logp)
            lses.index_copy_(0, idx, lse)
            del z, p
        with torch.enable_grad():
            lp = logps.view(problem.B, problem.T).clone().requires_grad_()
            loss_t = problem_loss(lp, inputs)  # float64: the constants are cast to lp's dtype
            (g_logp,) = torch.autograd.grad(loss_t, lp)
        loss = float(loss_t)
        g_logp = g_logp.reshape(-1)
        for idx in _row_tiles(rows, problem.V, tile_bytes):
            h64, y = hidden.index_select(0, idx).double(), labels.index_select(0, idx)
            z = h64 @ w64.t()
            _accumulate_grads(z, lses.index_select(0, idx), y, g_logp.index_select(0, idx), h64, w64, dh, dw, idx)
            del z
        logps, entropy = logps.cpu(), entropy.cpu()

    del w64
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref = Reference(
        loss=loss,
        grad_hidden=dh.cpu(),
        grad_weight=dw.cpu(),
        logps=logps,
        entropy=entropy,
        seconds=time.perf_counter() - start,
    )
    del dh, dw
    return ref


@torch.no_grad()
def relative_error(value: torch.Tensor, ref: torch.Tensor, chunk_elems: int = 1 << 25) -> float:
    """``‖value − ref‖ / ‖ref‖`` in float64, streaming ``ref`` (host) to ``value``'s device in chunks."""
    v, r = value.detach().reshape(-1), ref.reshape(-1)
    if v.numel() != r.numel():
        raise ValueError(f"shape mismatch: {tuple(value.shape)} vs reference {tuple(ref.shape)}")
    num = torch.zeros((), dtype=torch.float64, device=v.device)
    den = torch.zeros((), dtype=torch.float64, device=v.device)
    for s in range(0, r.numel(), chunk_elems):
        rc = r[s : s + chunk_elems].to(v.device, non_blocking=False)
        num += (v[s : s + chunk_elems].double() - rc).square().sum()
        den += rc.square().sum()
    den_f = float(den)
    return float(num.sqrt()) / den_f**0.5 if den_f > 0 else float(num.sqrt())
