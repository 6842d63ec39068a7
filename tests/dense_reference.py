"""Float64 dense reference for the fused head ops: materializes the full ``[N, V]`` logits with ordinary
autograd, so every fused result (values and gradients) has an independent ground truth.

Logits (the order of :mod:`hf_fused.ops.logit_transform`)::

    z = (h · Wᵀ + b) · logit_scale
    z = softcap · tanh(z / softcap)      (if softcap)
    z = z / temperature

Per token ``t`` with label ``y``: ``loss_t = logsumexp(z) − z[y]``, ``logp_t = −loss_t``,
``entropy_t = −Σ_j p_j log p_j``; ignored tokens contribute 0 (and get no gradient).

Inputs are cast to float64 *inside the graph* (``.double()``), so calling ``backward`` on a reference
result built from leaves of any dtype puts float64-accurate gradients (rounded once to the leaf dtype)
into ``.grad``. Tests normally pass float64 leaf copies (see :func:`leaf64`) to keep the gradients in
float64.
"""

from __future__ import annotations

from typing import Optional, Union

import pytest
import torch

Number = Union[int, float, torch.Tensor]


def leaf64(t: Optional[torch.Tensor], requires_grad: Optional[bool] = None) -> Optional[torch.Tensor]:
    """A float64 leaf copy of ``t`` (same values, exactly), requiring grad like ``t`` unless told."""
    if t is None:
        return None
    rg = t.requires_grad if requires_grad is None else requires_grad
    return t.detach().to(torch.float64).requires_grad_(rg)


def dense_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Float64 logits ``[..., V]`` after scale → softcap → temperature."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _token_stats(
    hidden, weight, labels, bias, ignore_index, logit_scale, softcap, temperature
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp [...], entropy [...], mask [...])`` in float64, zeros at ignored positions."""
    z = dense_logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels)).long()
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(mask, logp, zero), torch.where(mask, entropy, zero), mask


def dense_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: Optional[Number] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    token_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float64 cross-entropy with the contract of :func:`hf_fused.ops.linear_cross_entropy`:

    - ``"none"``: per-token losses ``[...]``, 0 at ignored positions;
    - ``"sum"``: sum over non-ignored tokens; ``"mean"``: that sum / number of non-ignored tokens
      (0 when every token is ignored, where ``F.cross_entropy`` would give NaN);
    - with ``num_items_in_batch`` (``"mean"``/``"sum"``): sum / num_items_in_batch (transformers'
      gradient-accumulation normalization);
    - ``token_weights``: each token's loss times its weight, before the reduction (the "mean" still
      divides by the number of non-ignored tokens).
    """
    logp, _, mask = _token_stats(hidden, weight, labels, bias, ignore_index, logit_scale, softcap, temperature)
    per_token = -logp if token_weights is None else -logp * token_weights.double()
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if num_items_in_batch is not None:
        denom = torch.as_tensor(num_items_in_batch, dtype=torch.float64)
        return total / denom
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / max(int(mask.sum()), 1)
    raise ValueError(f"unknown reduction {reduction!r}")


def dense_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(logprobs [...], entropy [...])`` with 0 at ignored positions."""
    logp, entropy, _ = _token_stats(hidden, weight, labels, bias, ignore_index, logit_scale, softcap, temperature)
    return logp, entropy


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (``|a − b| / |b|`` for scalars); ``‖a‖`` itself if ``b`` is all zero."""
    a = actual.detach().double()
    b = expected.detach().double()
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    nb = torch.linalg.vector_norm(b)
    diff = torch.linalg.vector_norm(a - b)
    return float(diff / nb) if nb > 0 else float(diff)


# -- random head inputs shared by the op tests ---------------------------------------------------------
IGNORE_PATTERNS = ("none", "some", "edges", "all")


def make_head_inputs(
    batch_shape: tuple[int, ...],
    hidden_size: int,
    vocab_size: int,
    *,
    bias: bool = True,
    ignore: str = "none",
    ignore_index: int = -100,
    dtype: torch.dtype = torch.float32,
    weight_std: float = 2.0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(hidden [*batch, H], weight [V, H], bias [V] or None, labels [*batch])``, leaves requiring grad.

    Logits have a standard deviation of about ``weight_std`` so that a soft-cap of a few units bends
    them. ``ignore``: ``"none"``, ``"some"`` (about a third, at random), ``"edges"`` (first and last
    token), ``"all"``. Labels never equal ``ignore_index`` unless set to it by the pattern.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*batch_shape, hidden_size, generator=g)
    weight = torch.randn(vocab_size, hidden_size, generator=g) * (weight_std / hidden_size**0.5)
    b = torch.randn(vocab_size, generator=g) * 0.5 if bias else None
    labels = torch.randint(0, vocab_size, batch_shape, generator=g)
    if 0 <= ignore_index < vocab_size:  # keep ignore_index only where the pattern puts it
        labels = torch.where(labels == ignore_index, (labels + 1) % vocab_size, labels)
    flat = labels.view(-1)
    if ignore == "some":
        drop = torch.rand(flat.shape, generator=g) < 0.35
        drop[0] = False  # at least one token counts
        flat[drop] = ignore_index
    elif ignore == "edges":
        flat[0] = ignore_index
        flat[-1] = ignore_index
    elif ignore == "all":
        flat[:] = ignore_index
    elif ignore != "none":
        raise ValueError(ignore)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return leaves[0], leaves[1], leaves[2], labels


def bf16_cuda_head(n: int, h: int, v: int, *, seed: int, ignore_every: int):
    """``(hidden [n, h], weight [v, h], labels [n])`` for the GPU bf16 tests: leaves requiring grad on CUDA, logits
    of standard deviation ~4 (a trained head's softmax), every ``ignore_every``-th label ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::ignore_every] = -100
    return hidden, weight, labels


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch():
    """Run a test module's tiny tensors (V ≤ 300, H ≤ 32) on one intra-op thread, then restore.

    Import it into a test module to apply it there. Tiles this small gain nothing from intra-op
    parallelism, and on a shared 2-core machine OpenMP workers spin-wait for busy cores: the op tests
    ran ~5× slower with the default thread count under load.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def assert_head_grads(fused_inputs, dense_inputs, grad_tol: float) -> None:
    """The fused op's .grad of (hidden, weight, bias) against the float64 dense ones: frozen inputs get
    none, the others a finite gradient of the input's dtype and shape within ``grad_tol`` (rel_err)."""
    for name, fused, dense in zip(("hidden", "weight", "bias"), fused_inputs, dense_inputs):
        if fused is None:
            continue
        if not fused.requires_grad:
            assert fused.grad is None, f"frozen {name} got a gradient"
            continue
        assert fused.grad is not None, f"no gradient for {name}"
        assert fused.grad.dtype == fused.dtype and fused.grad.shape == fused.shape
        assert torch.isfinite(fused.grad).all()
        err = rel_err(fused.grad, dense.grad)
        assert err <= grad_tol, f"d{name}: relative error {err:.2e} > {grad_tol:.0e}"


def assert_rounded_like(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, fp32_logits_grad: bool) -> None:
    """bf16 gradient ``ours`` rounded once, like ``theirs`` from a path that had the upstream factor from
    the start. With an fp32 logits-gradient (torch backend) the two round alike bit for bit (≤ 1% of
    elements differ; a second rounding changes about a third); with a bf16 logits-gradient tile
    (Triton backend), rounded at a different scale on each path, ``ours`` is no further from float64
    ``exact`` than ``theirs`` (measured 0.98×; 1.08× when rounded twice)."""
    assert ours.dtype == torch.bfloat16
    if fp32_logits_grad:
        mismatch = (ours != theirs).float().mean().item()
        assert mismatch <= 0.01, mismatch
    else:
        assert rel_err(ours, exact) <= 1.03 * rel_err(theirs, exact), (rel_err(ours, exact), rel_err(theirs, exact))


# -- shared test parameters ----------------------------------------------------------------------
from hf_fused.ops.tiling import TILE_BUFFERS, rows_per_tile  # noqa: E402

RTOL = 1e-5  # fp32 vs float64; never loosen (see module docstring)
H = 16

TRANSFORMS = {
    "identity": {},
    "softcap": {"softcap": 3.0},
    "logit_scale": {"logit_scale": 0.4},
    "temperature": {"temperature": 0.7},
    "combined": {"logit_scale": 1.5, "softcap": 4.0, "temperature": 0.8},
}


def budget_for(tile_rows: int, vocab_size: int) -> int:
    """The smallest ``tile_budget_bytes`` whose tiles hold exactly ``tile_rows`` token rows."""
    budget = tile_rows * TILE_BUFFERS * 4 * vocab_size
    assert rows_per_tile(vocab_size, budget) == tile_rows
    return budget
