"""Float64 references and the tolerances every comparison in the suite uses.

References materialize the full ``[N, V]`` logits with ordinary autograd, so every fused result (values and
gradients) has an independent ground truth. Logits (the order of :mod:`hf_fused.ops.logit_transform`)::

    z = (h · Wᵀ + b) · logit_scale
    z = softcap · tanh(z / softcap)      (if softcap)
    z = z / temperature

Per token ``t`` with label ``y``: ``loss_t = logsumexp(z) − z[y]``, ``logp_t = −loss_t``,
``entropy_t = −Σ_j p_j log p_j``; ignored tokens contribute 0 (and get no gradient).

Inputs are cast to float64 *inside the graph* (``.double()``), so calling ``backward`` on a reference
result built from leaves of any dtype puts float64-accurate gradients (rounded once to the leaf dtype)
into ``.grad``. Tests normally pass float64 leaf copies (see :func:`leaf64`) to keep the gradients in
float64.

Tolerances: fp32 against float64 is held to ``RTOL = 1e-5`` in the relative error ``‖a − b‖ / ‖b‖``
(:func:`rel_err`); never loosen it to make a test pass, find the cause.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import pytest
import torch

from hf_fused.ops.tiling import TILE_BUFFERS, rows_per_tile

Number = Union[int, float, torch.Tensor]

#: fp32 against float64 (op outputs, a patched model against its unpatched copy): relative error ‖a − b‖ / ‖b‖.
RTOL = 1e-5


#: Logged metrics of DPO and KTO that are differences of summed log-probabilities (policy − reference): the rewards
#: are β × (a − b), KTO's KL estimate a − b, with |a|, |b| of tens of nats and TRL's default β = 0.1. Summed in
#: another order in fp32, a and b move by ~1e-5 of themselves, so the difference moves by ~1e-5 × factor ×
#: (|a| + |b|) absolute however small it is: relative 1e-5 of the difference would ask far more of the
#: log-probabilities than they are checked to.
LOGP_DIFFERENCES = {"rewards/chosen": 0.1, "rewards/rejected": 0.1, "rewards/margins": 0.1, "kl": 1.0}


def logp_difference_tol(key: str, logged: dict, default: float = 1e-7, factors: Optional[dict] = None) -> float:
    """The absolute tolerance of a logged metric: for a difference of log-probabilities (``factors``, by default
    ``LOGP_DIFFERENCES``: metric name -> the factor on the difference), ``RTOL`` of the log-probabilities it comes
    from (``logged``: the reference run's row at that step, with ``logps/chosen`` and ``logps/rejected``); ``default``
    for every other metric."""
    factors = LOGP_DIFFERENCES if factors is None else factors
    if key not in factors or "logps/chosen" not in logged:
        return default  # RLOO's and GRPO's "kl" is a mean of per-token estimates, not a difference of sums
    return RTOL * factors[key] * (abs(logged["logps/chosen"]) + abs(logged["logps/rejected"]))


# -- relative errors and the assertions built on them -----------------------------------------------------


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (``|a − b| / |b|`` for scalars); ``‖a‖`` itself if ``b`` is all zero."""
    a = actual.detach().double()
    b = expected.detach().double()
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    nb = torch.linalg.vector_norm(b)
    diff = torch.linalg.vector_norm(a - b)
    return float(diff / nb) if nb > 0 else float(diff)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |a − b| / max |b|`` in float64 (``max |a − b|`` if ``b`` is all zero): the worst element against the
    tensor's scale, for gradients whose small entries would dominate an elementwise relative error."""
    a, b = actual.double(), expected.double()
    denom = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / denom if denom > 0 else diff


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "", rtol: float = RTOL) -> None:
    """``a`` and ``b`` exist, have one shape, and ``rel_err(a, b) <= rtol``."""
    assert a is not None and b is not None, f"{what}: one side is None ({a is None}, {b is None})"
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def assert_same_grads(got: dict, ref: dict, rtol: float = RTOL, *, require_nonzero: bool = True) -> None:
    """Two ``{name: gradient or None}`` dicts (:func:`models.grads`): the same names, the same missing gradients,
    every other gradient within ``rtol``; with ``require_nonzero``, some reference gradient is not all zero."""
    assert got.keys() == ref.keys(), f"parameter names differ: {set(got) ^ set(ref)}"
    for name, r in ref.items():
        g = got[name]
        assert (g is None) == (r is None), f"{name}: gradient is None on one side only ({g is None}, {r is None})"
        if r is None:
            continue
        assert_close(g, r, f"grad {name}", rtol)
    if require_nonzero:
        assert any(r is not None and r.abs().sum() > 0 for r in ref.values()), "reference gradients are all zero"


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


# -- dense references ------------------------------------------------------------------------------------


def leaf64(t: Optional[torch.Tensor], requires_grad: Optional[bool] = None) -> Optional[torch.Tensor]:
    """A float64 leaf copy of ``t`` (same values, exactly), requiring grad like ``t`` unless told."""
    if t is None:
        return None
    rg = t.requires_grad if requires_grad is None else requires_grad
    return t.detach().to(torch.float64).requires_grad_(rg)


def apply_transform(z: torch.Tensor, transform: dict) -> torch.Tensor:
    """Logits ``z`` after ``transform``'s ``logit_scale`` → ``softcap`` → ``temperature`` (any missing: identity),
    in ``z``'s dtype."""
    z = z * transform.get("logit_scale", 1.0)
    if transform.get("softcap") is not None:
        z = transform["softcap"] * torch.tanh(z / transform["softcap"])
    return z / transform.get("temperature", 1.0)


def dense_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    transform: Optional[dict] = None,
    *,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Float64 logits ``[..., V]`` after scale → softcap → temperature, given as keywords or as one ``transform``
    dict (the kernel tests' parameters, :data:`KERNEL_TRANSFORMS`)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if transform is None:
        transform = dict(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    return apply_transform(z, transform)


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


def shifted_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Reference ``(logprobs [B, T], entropy [B, T], mask [B, T])`` from a model's full logits (fp32), aligned like
    the fused output: position t scores ``labels[t + 1]``; 0 where the target is -100 (and at the last position)."""
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    mask = targets != -100
    logp = logp_all.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, mask


@torch.no_grad()
def dense_logps(model, input_ids, attention_mask, logits_to_keep, temperature=1.0, dtype=torch.float64):
    """A model's per-token ``(log-probs, entropies) [B, logits_to_keep]`` of its completions from the full logits
    (the original forward, no labels) in ``dtype``; 0 where ``attention_mask`` is 0."""
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out.logits[:, -logits_to_keep - 1 : -1].to(dtype) / temperature
    logp_all = logits.log_softmax(-1)
    targets = input_ids[:, -logits_to_keep:]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    keep = attention_mask[:, -logits_to_keep:].bool()
    return logp.masked_fill(~keep, 0.0), ent.masked_fill(~keep, 0.0)


# -- the op tests' inputs and parameters -------------------------------------------------------------------

#: Hidden size of the op tests' random heads.
H = 16

#: Logit transforms by name, as keyword arguments of the ops and of :func:`dense_logits`.
TRANSFORMS = {
    "identity": {},
    "softcap": {"softcap": 3.0},
    "logit_scale": {"logit_scale": 0.4},
    "temperature": {"temperature": 0.7},
    "combined": {"logit_scale": 1.5, "softcap": 4.0, "temperature": 0.8},
}

#: The GPU kernel tests' transforms (plain, soft-cap, scale with temperature, soft-cap with temperature).
KERNEL_TRANSFORMS = [{}, {"softcap": 3.0}, {"logit_scale": 0.5, "temperature": 0.7},
                     {"softcap": 2.0, "temperature": 1.3}]

#: How a batch falls into tiles: id → (batch shape, token rows per tile); :func:`budget_for` gives the budget.
TILE_LAYOUTS = {
    "one_token_N": ((1,), 1),
    "one_token_BT": ((1, 1), 4),
    "single_tile_larger_than_N": ((7,), 64),
    "one_row_per_tile": ((9,), 1),
    "exactly_full_last_tile_N": ((12,), 4),
    "partial_last_tile_N": ((13,), 4),
    "exactly_full_last_tile_BT": ((3, 4), 4),
    "partial_last_tile_BT": ((2, 7), 3),
}


def budget_for(tile_rows: int, vocab_size: int) -> int:
    """The smallest ``tile_budget_bytes`` whose tiles hold exactly ``tile_rows`` token rows."""
    budget = tile_rows * TILE_BUFFERS * 4 * vocab_size
    assert rows_per_tile(vocab_size, budget) == tile_rows
    return budget


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


#: The GPU backend's kernels on both devices: CPU tensors under Triton's interpreter (conftest sets it when there is
#: no GPU), and a ``gpu`` twin running the compiled kernels on CUDA tensors.
INTERPRETER_AND_GPU = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def bf16_cuda_head(n: int, h: int, v: int, *, seed: int, ignore_every: int):
    """``(hidden [n, h], weight [v, h], labels [n])`` for the GPU bf16 tests: leaves requiring grad on CUDA, logits
    of standard deviation ~4 (a trained head's softmax), every ``ignore_every``-th label ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::ignore_every] = -100
    return hidden, weight, labels


def kernel_head_inputs(n, h, v, device, dtype, bias, seed=0, ignore_every=5):
    """``(hidden [n, h], weight [v, h], bias [v] or None, labels [n])`` for the GPU kernel tests, leaves requiring
    grad on ``device`` in ``dtype``; every ``ignore_every``-th label ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.25).to(device, dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[::ignore_every] = -100
    return hid, w, b, y.to(device)


def check_triton_matches_float64(device, dtype, n, h, v, kw, bias, budget, tol):
    """The GPU backend's (``backend="triton"``) cross-entropy and log-probs + entropy on
    :func:`kernel_head_inputs`: the loss, the log-probs and entropies, and every gradient (hidden, weight, bias;
    for the log-probs under random upstream weights) within ``tol`` of float64 (``rel_err``)."""
    import torch.nn.functional as F

    from hf_fused.ops import linear_cross_entropy, linear_logprobs

    hid, w, b, y = kernel_head_inputs(n, h, v, device, dtype, bias)
    params = [t for t in (hid, w, b) if t is not None]
    ref_params = [t.detach().double().requires_grad_() for t in params]
    rh, rw, rb = ref_params[0], ref_params[1], ref_params[2] if bias else None
    z = dense_logits(rh, rw, rb, kw)

    loss = linear_cross_entropy(hid, w, y, b, backend="triton", tile_budget_bytes=budget, **kw)
    grads = torch.autograd.grad(loss, params)
    ref = F.cross_entropy(z, y, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, ref_params, retain_graph=True)
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) <= tol

    lp, ent = linear_logprobs(hid, w, y, b, backend="triton", tile_budget_bytes=budget, return_entropy=True, **kw)
    mask = y != -100
    ref_lp = torch.log_softmax(z, -1).gather(1, y.clamp_min(0)[:, None])[:, 0] * mask
    ref_ent = -(z.softmax(-1) * torch.log_softmax(z, -1)).sum(-1) * mask
    assert rel_err(lp, ref_lp) <= tol and rel_err(ent, ref_ent) <= tol
    gen = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
    grads = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), params)
    ref_grads = torch.autograd.grad((ref_lp * w1.double()).sum() + (ref_ent * w2.double()).sum(), ref_params)
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) <= tol
