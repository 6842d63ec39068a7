"""The GPU backend's support-loss pass (cuBLAS's fp32 logits chunk by chunk, the chunk kernel writing a tile of
block-shifted logits, ``hf_fused/ops/backends/triton_cublas/shifted_tile.py``, and the candidate-column kernels of
``support_kernels.py``) against float64 dense references.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest): the chunk kernel (statistics, candidates, the shifted
store) and the tile's gradient kernel on their own against float64, with chunk boundaries inside rows; the whole op in
fp32, held to ``RTOL`` of float64 on the loss, the support log-probs, the entropy and every gradient, for each option
of :func:`hf_fused.ops.linear_support_loss` (reductions, the entropy read by the loss, duplicate and invalid candidate
ids, dropped tokens, bias, logit scale, soft-cap, temperature, uneven tiles, forced narrow chunks) and of
:func:`hf_fused.ops.sparse_distillation_loss` (β, tail bucket); and in bf16, where the fp32 statistics keep the loss
at ``RTOL`` of float64 on the same bf16 values and the shifted tile keeps the gradients as close to float64 as an
fp32 tile's. The ``gpu`` tests run the real kernels on the whole op: in bf16 the loss at ``RTOL`` of float64 and the
gradients no further than TRL's fp32-upcast way plus one bf16 rounding of ``dz``; in fp32 at ``RTOL``; a memory peak
below one ``[N, V]`` bf16 logits tensor and within 1.1× the fused cross-entropy's.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy  # noqa: E402
from hf_fused.ops.backends.triton_cublas import fp32_logits_rule  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402
from hf_fused.ops.backends.triton_cublas.plan import forced_plans  # noqa: E402
from hf_fused.ops.sparse_distillation import (  # noqa: E402
    sparse_distillation_loss, support_distribution, support_divergence,
)
from hf_fused.ops.support_loss import linear_support_loss  # noqa: E402

from quack_stand_in import SHIFT_WINDOW  # noqa: E402
from references import dense_logits, leaf64, rel_err  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402

RTOL = 1e-5
V, H = 97, 16
TRANSFORMS = {"identity": {}, "scaled_and_capped": {"logit_scale": 0.5, "softcap": 5.0, "temperature": 0.8},
              "tempered": {"temperature": 1.7}}

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it when there is no GPU)")


def _head(n=23, k=5, *, seed=0, v=V, h=H, bias=True, device="cpu", dtype=torch.float32, duplicates=True,
          logit_std=3.0):
    """A student head (leaves), a correlated teacher's top-``k`` ids and log-probs, about a fifth of the slots invalid
    (one row with none valid), a duplicate id in some rows, and a token mask dropping about a third."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g)
    ws = torch.randn(v, h, generator=g) * (logit_std / h**0.5)
    bs = torch.randn(v, generator=g) * 0.5 if bias else None
    wt = ws + 0.6 * torch.randn(v, h, generator=g) / h**0.5
    top = (hs.double() @ wt.double().t()).log_softmax(-1).topk(k, dim=-1)
    ids, teacher = top.indices.clone(), top.values.float()
    valid = torch.rand(ids.shape, generator=g) > 0.2
    valid[0] = True
    valid[1] = False
    if duplicates and k > 2:
        ids[2:: 3, -1] = ids[2:: 3, 0]
        valid[2:: 3, 0] = valid[2:: 3, -1] = True
    ids = torch.where(valid, ids, -1)
    mask = torch.rand(n, generator=g) > 0.3
    mask[:3] = True
    leaves = [None if t is None else t.to(device, dtype).requires_grad_() for t in (hs, ws, bs)]
    support = dict(support_ids=ids.to(device), teacher_logprobs=teacher.to(device), support_mask=valid.to(device),
                   mask=mask.to(device))
    return leaves, support


def _weighted_loss(logprobs, entropy, *, support_mask, weights, alpha):
    """A loss reading both inputs: ``−Σ_k w_k·s_k − α·H`` over the valid slots (each duplicate slot its own term)."""
    return -torch.where(support_mask, weights * logprobs, 0.0).sum(-1) - alpha * entropy


@contextlib.contextmanager
def _one_pass(rows, path="chunked"):
    """The one pass at ``rows`` per tile, its logits from cuBLAS's chunks (``"chunked"``) or from the fused matmul
    (``"fused"``: the statistics from its accumulator, the shifted tile from its epilogue, the candidates' logits by
    gathered dot products)."""
    with forced_plans(one_pass=OnePassPlan(rows, "fp32", 0)), fp32_logits_rule.forced(path == "fused"):
        yield


PATHS = pytest.mark.parametrize("path", ["chunked", "fused"])


def _assert_grads(leaves, ref, tol=RTOL):
    for name, ours, exact in zip(("hidden", "weight", "bias"), leaves, ref):
        if ours is None:
            continue
        assert ours.grad is not None and ours.grad.dtype == ours.dtype, name
        assert exact.grad.abs().sum() > 0, f"d{name}: the reference gradient is zero"
        err = rel_err(ours.grad, exact.grad)
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e}"


@interpreted
@PATHS
@pytest.mark.parametrize("tile_rows", [8, 16, 64], ids=["tiles-of-8", "tiles-of-16", "one-tile"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_generic_support_loss_matches_float64(transform, reduction, tile_rows, path):
    """Loss, per-token losses, support log-probs (``-inf`` at invalid slots), entropy and the gradients of hidden,
    weight and bias: the entropy's gradient term, duplicate ids adding up, per-token constants of both shapes, an
    upstream gradient per token for ``"none"`` (its recompute)."""
    tkw = TRANSFORMS[transform]
    leaves, support = _head(seed=1)
    ids, valid, mask = support["support_ids"], support["support_mask"], support["mask"]
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(ids.shape, generator=g)
    alpha = torch.randn(ids.shape[:-1], generator=g) * 0.1
    with _one_pass(tile_rows, path):
        out = linear_support_loss(leaves[0], leaves[1], ids, _weighted_loss, leaves[2], support_mask=valid,
                                  mask=mask, per_token={"weights": weights, "alpha": alpha}, need_entropy=True,
                                  reduction=reduction, backend="triton", **tkw)
        up = torch.randn(mask.shape, generator=g) if reduction == "none" else torch.tensor(1.6)
        (out.loss * up).sum().backward()
    ref = [leaf64(t) for t in leaves]
    logp = dense_logits(*ref, **tkw).log_softmax(-1)
    s = torch.where(valid, logp.gather(-1, ids.clamp(0, V - 1)), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    per_token = torch.where(mask, -(weights.double() * s).sum(-1) - alpha.double() * entropy, 0.0)
    expected = per_token.sum() if reduction == "sum" else per_token
    (expected * up.double()).sum().backward()
    assert rel_err(out.loss, expected) <= RTOL
    assert rel_err(out.token_losses, per_token) <= RTOL
    assert rel_err(out.entropy, torch.where(mask, entropy, 0.0)) <= RTOL
    kept = valid & mask.unsqueeze(-1)
    assert rel_err(torch.where(kept, out.support_logprobs, 0.0), torch.where(kept, s, 0.0)) <= RTOL
    assert torch.isneginf(out.support_logprobs[~valid & mask.unsqueeze(-1)]).all()
    _assert_grads(leaves, ref)


def _dense_divergence(ref, support, *, beta, add_tail_bucket, **tkw):
    """Float64 per-token divergence with TRL's support semantics (the op's own support functions in float64)."""
    logp = dense_logits(*ref, **tkw).log_softmax(-1)
    valid = support["support_mask"]
    s = logp.gather(-1, support["support_ids"].clamp(0, V - 1))
    student, svalid = support_distribution(s, valid, add_tail_bucket)
    teacher, _ = support_distribution(support["teacher_logprobs"].double(), valid, add_tail_bucket)
    div = support_divergence(student, teacher, svalid, beta).sum(-1)
    return torch.where(support["mask"], div, 0.0)


@interpreted
@pytest.mark.parametrize("add_tail_bucket", [True, False], ids=["tail", "renormalized"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("transform", ["identity", "scaled_and_capped"])
@PATHS
def test_sparse_distillation_matches_float64(transform, beta, add_tail_bucket, path):
    """TRL's divergence on the support through the GPU backend's pass: loss (mean over counted tokens), per-token
    divergence and the student's gradients."""
    tkw = TRANSFORMS[transform]
    leaves, support = _head(seed=2, k=6, duplicates=False)
    with _one_pass(8, path):
        out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                       leaves[2], support_mask=support["support_mask"], mask=support["mask"],
                                       beta=beta, add_tail_bucket=add_tail_bucket, backend="triton", **tkw)
        out.loss.backward()
    ref = [leaf64(t) for t in leaves]
    div = _dense_divergence(ref, support, beta=beta, add_tail_bucket=add_tail_bucket, **tkw)
    loss = div.sum() / support["mask"].sum()
    loss.backward()
    assert rel_err(out.loss, loss) <= RTOL
    assert rel_err(out.divergence, div) <= RTOL
    _assert_grads(leaves, ref)


@interpreted
@pytest.mark.parametrize("beta", [0.0, 0.5])
@PATHS
def test_bf16_operands_keep_fp32_logits(beta, path):
    """bf16 hidden states and weight: the loss, per-token divergence and entropy at ``RTOL`` of float64 on the same
    bf16 values (the statistics and candidates read fp32 logits; bf16 ones would be ``|z|·2⁻⁸`` off), the gradients
    within one rounding of ``dz`` and one of its shifted logits to bf16 (``2⁻⁷``) and one of the result (``2⁻⁸``),
    bias included."""
    leaves, support = _head(n=37, k=6, seed=10, dtype=torch.bfloat16, duplicates=True)
    with _one_pass(16, path):
        out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                       leaves[2], support_mask=support["support_mask"], mask=support["mask"],
                                       beta=beta, temperature=0.9, backend="triton")
        out.loss.backward()
    ref = [leaf64(t) for t in leaves]
    div = _dense_divergence(ref, support, beta=beta, add_tail_bucket=True, temperature=0.9)
    loss = div.sum() / support["mask"].sum()
    loss.backward()
    logp = dense_logits(*ref, temperature=0.9).log_softmax(-1)
    entropy = torch.where(support["mask"], -(logp.exp() * logp).sum(-1), 0.0)
    assert rel_err(out.loss, loss) <= RTOL and rel_err(out.divergence, div) <= RTOL
    assert rel_err(out.entropy, entropy) <= RTOL
    _assert_grads(leaves, ref, tol=2.0**-7 + 2.0**-8)


@interpreted
def test_same_results_as_the_plain_pytorch_pass(monkeypatch):
    """The two passes compute the same math: fp32 results within ``RTOL`` of each other, gradients included; the
    GPU backend's call is answered by its own pass, not the plain-PyTorch fallback."""
    from hf_fused.ops.backends.triton_cublas import support_pass

    answered = []
    run = support_pass.run_support_pass
    monkeypatch.setattr(support_pass, "run_support_pass", lambda *a, **kw: answered.append(run(*a, **kw)) or
                        answered[-1])
    results = []
    for backend in ("torch", "triton"):
        leaves, support = _head(seed=4, k=8)
        with _one_pass(16):
            out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                           leaves[2], support_mask=support["support_mask"], mask=support["mask"],
                                           beta=0.5, temperature=0.9, backend=backend)
            out.loss.backward()
        results.append((out, [t.grad for t in leaves]))
    assert len(answered) == 1 and answered[0] is not None
    (a, ga), (b, gb) = results
    for x, y in ((a.loss, b.loss), (a.divergence, b.divergence), (a.entropy, b.entropy), *zip(ga, gb)):
        assert rel_err(x, y) <= RTOL


@interpreted
@PATHS
def test_all_tokens_dropped_and_frozen_weight(path):
    """No kept token: loss 0 and zero gradients; a frozen weight: hidden's gradient only, as float64's."""
    leaves, support = _head(seed=5)
    with _one_pass(8, path):
        out = linear_support_loss(leaves[0], leaves[1], support["support_ids"],
                                  lambda lp, ent, *, support_mask: -torch.where(support_mask, lp, 0.0).sum(-1),
                                  leaves[2], support_mask=support["support_mask"],
                                  mask=torch.zeros_like(support["mask"]), backend="triton")
        out.loss.backward()
    assert out.loss.item() == 0.0 and all(t.grad.abs().sum() == 0 for t in leaves)
    leaves, support = _head(seed=6, bias=False)
    leaves[1].requires_grad_(False)
    with _one_pass(8, path):
        out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                       support_mask=support["support_mask"], mask=support["mask"], backend="triton")
        out.loss.backward()
    ref = [leaf64(leaves[0]), leaf64(leaves[1], requires_grad=False)]
    div = _dense_divergence(ref + [None], support, beta=0.0, add_tail_bucket=True)
    (div.sum() / support["mask"].sum()).backward()
    assert leaves[1].grad is None
    assert rel_err(leaves[0].grad, ref[0].grad) <= RTOL


@interpreted
def test_rows_the_fused_matmul_cannot_read_take_the_chunked_logits():
    """Hidden states whose rows the fused matmul cannot read (a row stride of 68 bytes, no TMA descriptor) where the
    fused logits are asked for: the chunked logits answer instead, loss and gradients at ``RTOL`` of float64."""
    leaves, support = _head(seed=7, k=6, duplicates=False, bias=False)
    support["mask"] = torch.ones_like(support["mask"])  # every row kept: no compact copy of the rows
    padded = torch.zeros(leaves[0].shape[0], H + 1)
    padded[:, 1:] = leaves[0].detach()
    hidden = padded[:, 1:].requires_grad_()
    with _one_pass(8, "fused"):
        out = sparse_distillation_loss(hidden, leaves[1], support["support_ids"], support["teacher_logprobs"],
                                       support_mask=support["support_mask"], mask=support["mask"], backend="triton")
        out.loss.backward()
    ref = [leaf64(leaves[0]), leaf64(leaves[1])]
    div = _dense_divergence(ref + [None], support, beta=0.0, add_tail_bucket=True)
    (div.sum() / support["mask"].sum()).backward()
    assert rel_err(out.loss, div.sum() / support["mask"].sum()) <= RTOL
    assert rel_err(hidden.grad, ref[0].grad) <= RTOL and rel_err(leaves[1].grad, ref[1].grad) <= RTOL


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_candidate_logits_match_float64(dtype):
    """The fused path's candidate logits: ``h·W[id] + b`` as float64 computes it on the same values, to fp32's
    summation error, over more slots than one program holds and a hidden size that is no multiple of its step;
    invalid slots (ids of -1) are written 0 and read nothing."""
    from hf_fused.ops.backends.triton_cublas.support_kernels import GATHER_BLOCK_K, candidate_logits_

    g = torch.Generator().manual_seed(21)
    rows, k, v, hidden = 9, GATHER_BLOCK_K + 7, 101, 200
    h, w = torch.randn(rows, hidden, generator=g).to(dtype), torch.randn(v, hidden, generator=g).to(dtype)
    bias = torch.randn(v, generator=g).to(dtype)
    ids = torch.randint(0, v, (rows, k), generator=g)
    valid = torch.rand(rows, k, generator=g) > 0.25
    ids = torch.where(valid, ids, -1)
    raw = torch.full((rows, k), float("nan"))
    candidate_logits_(h, w, bias, ids, valid, raw)
    exact = (h.double().unsqueeze(1) * w.double()[ids.clamp(min=0)]).sum(-1) + bias.double()[ids.clamp(min=0)]
    assert rel_err(raw[valid], exact[valid]) <= 1e-6
    assert (raw[~valid] == 0).all()


def test_candidate_logits_step_is_the_fused_matmuls():
    """The candidates' products run over the hidden size in the fused matmul's own K steps (every launch shape's),
    so that each logit is accumulated as the statistics' is."""
    from hf_fused.ops.backends.triton_cublas import fused_matmul
    from hf_fused.ops.backends.triton_cublas.support_kernels import GATHER_BLOCK_H

    assert {c.block_k for c in fused_matmul.CONFIGS} == {GATHER_BLOCK_H}


# -- the chunk and gradient kernels of the shifted tile ------------------------------------------------------------


def _transformed64(raw, transform):
    """Float64 ``z`` of raw logits (bias included) through ``transform``'s keywords (scale → soft-cap → 1/T)."""
    z = raw * transform.get("logit_scale", 1.0)
    if transform.get("softcap") is not None:
        z = transform["softcap"] * torch.tanh(z / transform["softcap"])
    return z / transform.get("temperature", 1.0)


def _run_chunks(x32, bias, ids, tile_dtype, cols, transform, *, in_place=False):
    """The pass's chunk loop on given fp32 raw logits ``x32 [rows, V]``: each chunk copied into a scratch (or, with
    ``in_place``, in an fp32 tile's own columns) and read by :func:`logits_chunk_`; returns
    ``(tile, offsets, block, (max, Σexp, Σexp·z), raw)``."""
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends.triton_cublas.shifted_tile import chunk_block, logits_chunk_
    from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars, new_row_stats

    rows, v = x32.shape
    scalars = kernel_scalars(LogitTransform(**transform), bias)
    block = chunk_block(cols, v)
    tile = x32.clone() if in_place else torch.full((rows, v), float("nan"), dtype=tile_dtype)
    offsets = torch.full((rows, -(-v // block)), float("nan"))
    stats = new_row_stats(rows, x32.device)
    raw = torch.full(ids.shape, float("nan"))
    for c0 in range(0, v, cols):
        c1 = min(c0 + cols, v)
        x = tile[:, c0:c1] if in_place else x32[:, c0:c1].contiguous()
        logits_chunk_(x, tile[:, c0:c1], offsets, c0, block, bias, ids, stats, raw, scalars, True)
    return tile, offsets, block, stats[:3], raw


def _chunk_inputs(rows=7, v=97, k=9, seed=0, bias=True):
    """fp32 raw logits of standard deviation 3, a bias, and candidate ids spread over the vocabulary (so over several
    chunks) with a duplicate in every row."""
    g = torch.Generator().manual_seed(seed)
    x32 = torch.randn(rows, v, generator=g) * 3.0
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    ids = torch.randint(0, v, (rows, k), generator=g)
    ids[:, -1] = ids[:, 0]
    return x32, b, ids


@interpreted
@pytest.mark.parametrize("cols", [32, 24, 97], ids=["chunks-of-32", "chunks-of-24-blocks-of-8", "one-chunk"])
@pytest.mark.parametrize("tile_dtype", [torch.float32, torch.bfloat16], ids=["fp32-tile", "bf16-tile"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_chunk_kernel_matches_float64(bias, transform, tile_dtype, cols):
    """:func:`logits_chunk_` over a row's chunks (boundaries inside the row, candidates in several chunks, duplicates):
    the log-sum-exp and entropy of the transformed logits at ``RTOL`` of float64, each candidate's raw logit plus bias
    exactly (fp32), each block's maximum at ``RTOL``, and the stored ``z − m_b`` its fp32 value rounded once to the
    tile's dtype (to nearest, ties to even, as torch rounds; bit for bit without a transform)."""
    tkw = TRANSFORMS[transform]
    x32, b, ids = _chunk_inputs(bias=bias)
    tile, offsets, block, (run_max, run_sum, run_zp), raw = _run_chunks(x32, b, ids, tile_dtype, cols, tkw)
    raw64 = x32.double() + (0.0 if b is None else b.double())
    z64 = _transformed64(raw64, tkw)
    lse64 = torch.logsumexp(z64, -1)
    logp64 = z64 - lse64[:, None]
    lse = run_max + run_sum.log()
    assert rel_err(lse, lse64) <= RTOL
    assert rel_err(lse - run_zp / run_sum, -(logp64.exp() * logp64).sum(-1)) <= RTOL
    assert torch.equal(raw, (x32 + (0.0 if b is None else b)).gather(-1, ids))
    v = x32.shape[1]
    pad = -v % block
    block_max64 = F.pad(z64, (0, pad), value=float("-inf")).view(z64.shape[0], -1, block).amax(-1)
    assert rel_err(offsets, block_max64) <= RTOL
    m_b = offsets.repeat_interleave(block, dim=1)[:, :v]
    shifted = tile.double() + m_b.double()
    if tile_dtype == torch.float32:
        assert rel_err(shifted, z64) <= RTOL
    else:
        # one rounding of z − m_b: |error| ≤ 2⁻⁸·|z − m_b| (+ fp32's own arithmetic)
        err = (shifted - z64).abs()
        assert (err <= 2.0**-8 * (z64 - m_b.double()).abs() + 1e-6 * (z64.abs() + 1)).all()
        if transform == "identity":
            z32 = x32 + (0.0 if b is None else b)
            assert torch.equal(tile, (z32 - m_b).to(torch.bfloat16))


@interpreted
def test_chunk_kernel_in_place_on_an_fp32_tile():
    """An fp32 tile's chunks read and rewritten in place (cuBLAS's output is the tile's own columns): the same results
    as through a scratch, bit for bit."""
    x32, b, ids = _chunk_inputs(seed=3)
    tkw = TRANSFORMS["scaled_and_capped"]
    apart = _run_chunks(x32, b, ids, torch.float32, 32, tkw)
    in_place = _run_chunks(x32, b, ids, torch.float32, 32, tkw, in_place=True)
    for a, c in zip(apart[:2] + apart[3] + apart[4:], in_place[:2] + in_place[3] + in_place[4:]):
        assert torch.equal(a, c)


@interpreted
@pytest.mark.parametrize("with_entropy", [True, False], ids=["g_ent", "no-g_ent"])
@pytest.mark.parametrize("tile_dtype", [torch.float32, torch.bfloat16], ids=["fp32-tile", "bf16-tile"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_shifted_gradient_matches_float64(transform, tile_dtype, with_entropy):
    """:func:`shifted_gradient_` on a tile written in chunks: ``dz = ∂L/∂raw`` of ``L = Σ_r g_r·(−log-sum-exp) +
    g_H,r·H_r`` (the tile's bulk: ``−g·p − g_H·p·(log p + H)`` through the transform) against float64 autograd; on an
    fp32 tile at ``RTOL``; on a bf16 tile each element within its own rounding (``2⁻⁸·|dz|``) plus the stored
    logit's (``2⁻⁸·|z − m_b|``) carried through ``∂dz/∂z``, which the shift keeps small where ``p`` is large."""
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends.triton_cublas.shifted_tile import shifted_gradient_
    from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars

    tkw = TRANSFORMS[transform]
    x32, b, ids = _chunk_inputs(seed=5, rows=6, v=150)
    tile, offsets, block, (run_max, run_sum, run_zp), _ = _run_chunks(x32, b, ids, tile_dtype, 40, tkw)
    g = torch.Generator().manual_seed(6)
    g_lp = torch.randn(x32.shape[0], generator=g)
    g_ent = torch.randn(x32.shape[0], generator=g) * 0.3 if with_entropy else None
    lse = run_max + run_sum.log()
    ent = lse - run_zp / run_sum
    shifted_gradient_(tile, offsets, block, lse, ent, g_lp, g_ent, kernel_scalars(LogitTransform(**tkw), b))
    raw64 = (x32.double() + (0.0 if b is None else b.double())).requires_grad_()
    z64 = _transformed64(raw64, tkw)
    logp64 = z64.log_softmax(-1)
    loss = (g_lp.double() * -torch.logsumexp(z64, -1)).sum()
    if g_ent is not None:
        loss = loss + (g_ent.double() * -(logp64.exp() * logp64).sum(-1)).sum()
    dz64, dz_dz = (t.detach() for t in torch.autograd.grad(loss, [raw64, z64]))
    if tile_dtype == torch.float32:
        assert rel_err(tile, dz64) <= RTOL
        return
    with torch.no_grad():
        z, lp = z64.detach(), logp64.detach()
        p, scale, temperature = lp.exp(), tkw.get("logit_scale", 1.0), tkw.get("temperature", 1.0)
        h64 = -(p * lp).sum(-1, keepdim=True)
        # ∂(∂L/∂z)/∂z of the bulk, per element: −g·p − g_H·p·(log p + H + 1)
        g_h = 0.0 if g_ent is None else g_ent.double()[:, None]
        d2 = -g_lp.double()[:, None] * p - g_h * p * (lp + h64 + 1)
        # ∂z/∂raw, and how much it moves per unit of z (the soft-cap's tanh is read back from z)
        th = torch.tanh(raw64.detach() * scale / tkw["softcap"]) if "softcap" in tkw else torch.zeros_like(z)
        dz_draw = scale * (1 - th * th) / temperature
        ddraw_dz = scale * 2 * th.abs() / tkw["softcap"] if "softcap" in tkw else torch.zeros_like(z)
        m_b = offsets.repeat_interleave(block, dim=1)[:, : z.shape[1]].double()
        stored = 2.0**-8 * (z - m_b).abs()  # the stored logit's rounding
        bound = (2.0**-8 * dz64.abs() + stored * (d2.abs() * dz_draw + dz_dz.abs() * ddraw_dz)
                 + 1e-6 * dz64.abs().amax())
    assert ((tile.double() - dz64).abs() <= bound).all()
    assert rel_err(tile, dz64) <= 2.0**-8


@interpreted
@pytest.mark.parametrize("block", [64, 192], ids=["blocks-of-64", "blocks-of-192"])
@pytest.mark.parametrize("transform", [{}, {"temperature": 0.7, "logit_scale": 0.5}], ids=["raw", "scaled"])
def test_an_exponential_tiles_gradient_needs_no_logarithm(transform, block):
    """:func:`shifted_gradient_` on a tile of exponentials ``E = exp(z − offset)`` (QuACK's scaled-exp matmul: a
    power-of-two shift per row and block) without an entropy gradient or soft-cap takes ``p = E·exp(offset − lse)``
    (one exponential per run of columns, no logarithm): each element the general kernel's (``log E + offset``, read
    through ``g_ent = 0``) or its bf16 neighbour, and within its own rounding plus the stored ``E``'s (``2⁻⁸·|dz|``
    each) of float64's ``g·(1[label] − p)·∂z/∂raw`` (the label's ``p`` from its fp32 logit, a row without a label
    column, a row of zero weight)."""
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends.triton_cublas.shifted_tile import shifted_gradient_
    from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars

    rows, v = 5, 3 * block
    g = torch.Generator().manual_seed(7)
    z = torch.randn(rows, v, generator=g) * 4  # the transformed logits, as the matmul's epilogue forms them
    z[:, 5] += 12  # a likely token
    ln2 = torch.log(torch.tensor(2.0))
    offsets = torch.round(z.view(rows, -1, block).amax(-1) / ln2) * ln2
    tile = (z - offsets.repeat_interleave(block, 1)).exp().to(torch.bfloat16)
    lse = torch.logsumexp(z.double(), -1)
    labels = torch.tensor([5, 0, v - 1, -100, 17])
    g_lp = torch.randn(rows, generator=g)
    g_lp[4] = 0.0
    label_logit = z.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    scalars = kernel_scalars(LogitTransform(**transform), None)
    fast, general = tile.clone(), tile.clone()
    shifted_gradient_(fast, offsets, block, lse.float(), lse.float(), g_lp, None, scalars, labels=labels,
                      label_logit=label_logit, log_tile=True)
    shifted_gradient_(general, offsets, block, lse.float(), lse.float(), g_lp, torch.zeros(rows), scalars,
                      labels=labels, label_logit=label_logit, log_tile=True)
    # two roundings of fp32 values a few ulps apart land on the same bf16 value or on neighbours (2⁻⁷·|x| apart at most)
    one_ulp = 2.0**-7 * general.double().abs() + 1e-30
    assert ((fast.double() - general.double()).abs() <= one_ulp).all()
    assert (fast == general).float().mean() > 0.99
    chain = 1 / transform.get("temperature", 1.0) * transform.get("logit_scale", 1.0)
    p = (z.double() - lse[:, None]).exp()
    is_label = torch.arange(v)[None, :] == labels[:, None]
    dz64 = g_lp.double()[:, None] * (is_label.double() - p) * chain
    stored = 2.0**-8 * (g_lp.double()[:, None] * p * chain).abs()
    assert ((fast.double() - dz64).abs() <= 2.0**-8 * dz64.abs() + stored + 1e-12).all()
    assert (fast[4] == 0).all() and not (fast[:4] == 0).all()


@interpreted
@pytest.mark.parametrize("block", [64, 192], ids=["blocks-of-64", "blocks-of-192"])
@pytest.mark.parametrize("transform", [{}, {"temperature": 0.7, "logit_scale": 0.5}], ids=["raw", "scaled"])
def test_an_exponential_tile_scaled_per_row_is_its_gradient(transform, block):
    """:func:`exp_tile_row_factors_` makes an exponential tile (shifts windowed as QuACK's epilogue does:
    0 for a block whose maximum is within ±64 powers of two) ``dz``'s row-scaled form: afterwards every row has one
    shift (blocks below the row's largest rescaled by exact powers of two) and ``s[:, None]·tile`` is float64's
    ``g·(1[label] − p)·∂z/∂raw`` within the stored ``E``'s rounding (``2⁻⁸·|dz|``; no rounding of ``dz`` itself)
    and the label's (``2⁻⁸`` of its value: set from the fp32 logit, rounded once); the hidden and weight gradients
    ``s·(tile @ W)`` and ``tileᵀ·(s·h)`` within ``2⁻⁸`` of float64, near those of the gradient kernel's ``dz``.
    Rows: in the window; every block above it; one block above it; every block below it; a row without a label
    column; a row of zero weight; then a trained head's."""
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends.triton_cublas.shifted_tile import exp_tile_row_factors_, scaled_rows_, shifted_gradient_
    from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars

    rows, v, h = 64, 4 * block, 32  # six rows of special cases, the rest a trained head's
    g = torch.Generator().manual_seed(8)
    z = torch.randn(rows, v, generator=g, dtype=torch.float64) * 4  # the transformed logits
    z[1] += 90  # every block above the window (44 nats)
    z[2, :block] += 70  # one block above it: the others are rescaled to its shift
    z[3] -= 80  # every block below it
    z[:, 5] += 12  # a likely token
    ln2 = math.log(2.0)
    k = torch.round(z.view(rows, -1, block).amax(-1) / ln2)
    k -= k.clamp(-SHIFT_WINDOW, SHIFT_WINDOW)
    offsets = (k * ln2).float()
    tile = torch.exp2(z / ln2 - k.repeat_interleave(block, 1)).to(torch.bfloat16)
    stored_e = tile.double() * torch.exp2(k.repeat_interleave(block, 1))  # exp(z) as stored
    lse = torch.logsumexp(z, -1)
    labels = torch.cat([torch.tensor([5, 0, v - 1, 17, -100, 3]), torch.randint(0, v, (rows - 6,), generator=g)])
    g_lp = torch.randn(rows, generator=g)
    g_lp[5] = 0.0
    label_logit = z.gather(1, labels.clamp(min=0)[:, None])[:, 0].float()
    scalars = kernel_scalars(LogitTransform(**transform), None)
    general, general_offsets = tile.clone(), offsets.clone()
    shifted_gradient_(general, general_offsets, block, lse.float(), lse.float(), g_lp, None, scalars, labels=labels,
                      label_logit=label_logit, log_tile=True)
    s = exp_tile_row_factors_(tile, offsets, block, lse.float(), g_lp, scalars, labels, label_logit)
    assert (offsets == offsets.amax(1, keepdim=True)).all()
    assert (offsets[0] == 0).all() and (offsets[1] > 0).all() and (offsets[3] < 0).all()
    chain = 1 / transform.get("temperature", 1.0) * transform.get("logit_scale", 1.0)
    p = (z - lse[:, None]).exp()
    is_label = torch.arange(v)[None, :] == labels[:, None]
    dz64 = g_lp.double()[:, None] * (is_label.double() - p) * chain
    dz = s.double()[:, None] * tile.double()
    # the rescaled blocks' values are the stored E's to the bit (powers of two), so E's rounding is all off p
    assert torch.equal(tile.double()[~is_label] * torch.exp2(torch.round(offsets.double() / ln2)).repeat_interleave(block, 1)[
        ~is_label], stored_e[~is_label])
    stored = 2.0**-8 * (g_lp.double()[:, None] * p * chain).abs()
    assert ((dz - dz64).abs() <= 2.0**-8 * dz64.abs() + stored + 1e-12).all()
    assert (dz[5] == 0).all() and s[5] == 0
    hidden, weight = torch.randn(rows, h, generator=g).bfloat16(), torch.randn(v, h, generator=g).bfloat16()
    dh64, dw64 = dz64 @ weight.double(), dz64.T @ hidden.double()
    dh = s[:, None] * (tile.float() @ weight.float())
    scaled = scaled_rows_(torch.empty_like(hidden), hidden, s)
    assert torch.equal(scaled, (hidden.float() * s[:, None]).bfloat16())  # one fp32 product, rounded to nearest
    dw = tile.float().T @ scaled.float()
    # against the kernel's dz: dh carries the same rounding of E (its dz's own rounding gone, within 10 %); dW the
    # rounding of s·h to bf16 where the kernel rounds dz (1.03-1.29x the kernel's error in these cases)
    for got, kernel, want, ratio in ((dh, general.float() @ weight.float(), dh64, 1.1),
                                     (dw, general.float().T @ hidden.float(), dw64, 1.5)):
        error = ((got.double() - want).norm() / want.norm()).item()
        kernel_error = ((kernel.double() - want).norm() / want.norm()).item()
        assert error < 2.0**-8 and error < ratio * kernel_error, (error, kernel_error)


def test_row_factors_refuse_what_no_row_scale_can_hold():
    """A soft-cap's derivative differs per logit, and shifts that do not tile the vocabulary: a clear error each."""
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends.triton_cublas.shifted_tile import exp_tile_row_factors_
    from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars

    tile, rows = torch.ones(2, 128, dtype=torch.bfloat16), torch.zeros(2)
    labels = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="soft-cap"):
        exp_tile_row_factors_(tile, torch.zeros(2, 2), 64, rows, rows, kernel_scalars(LogitTransform(softcap=30.0), None),
                              labels, rows)
    with pytest.raises(ValueError, match="3 blocks of 64 columns are not V = 128"):
        exp_tile_row_factors_(tile, torch.zeros(2, 3), 64, rows, rows, kernel_scalars(LogitTransform(), None), labels,
                              rows)


@interpreted
@pytest.mark.parametrize("cols", [16, 40], ids=["chunks-of-16", "chunks-of-40-blocks-of-8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_pass_matches_float64(dtype, cols):
    """The whole op through the pass with vocabulary chunks of ``cols`` columns (boundaries inside every row, the
    candidates in several chunks, duplicate and invalid ids, bias, scale, soft-cap, temperature, uneven tiles, the
    entropy read by the loss): fp32 at ``RTOL`` of float64 everywhere; bf16 with the loss, log-probs and entropy at
    ``RTOL`` of float64 on the same bf16 values and the gradients within the bf16 bounds of
    :func:`test_bf16_operands_keep_fp32_logits`."""
    from hf_fused.ops.backends.triton_cublas.support_pass import forced_chunk_cols

    tkw = TRANSFORMS["scaled_and_capped"]
    leaves, support = _head(n=29, k=7, seed=11, dtype=dtype)
    ids, valid, mask = support["support_ids"], support["support_mask"], support["mask"]
    g = torch.Generator().manual_seed(12)
    weights = torch.rand(ids.shape, generator=g)
    alpha = torch.randn(ids.shape[:-1], generator=g) * 0.1
    with _one_pass(8), forced_chunk_cols(cols):
        out = linear_support_loss(leaves[0], leaves[1], ids, _weighted_loss, leaves[2], support_mask=valid,
                                  mask=mask, per_token={"weights": weights, "alpha": alpha}, need_entropy=True,
                                  backend="triton", **tkw)
        out.loss.backward()
    ref = [leaf64(t) for t in leaves]
    logp = dense_logits(*ref, **tkw).log_softmax(-1)
    s = torch.where(valid, logp.gather(-1, ids.clamp(0, V - 1)), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    per_token = torch.where(mask, -(weights.double() * s).sum(-1) - alpha.double() * entropy, 0.0)
    per_token.sum().backward()
    kept = valid & mask.unsqueeze(-1)
    assert rel_err(out.loss, per_token.sum()) <= RTOL
    assert rel_err(out.entropy, torch.where(mask, entropy, 0.0)) <= RTOL
    assert rel_err(torch.where(kept, out.support_logprobs, 0.0), torch.where(kept, s, 0.0)) <= RTOL
    _assert_grads(leaves, ref, tol=RTOL if dtype == torch.float32 else 2.0**-7 + 2.0**-8)


@interpreted
def test_shifted_tile_keeps_an_fp32_tiles_gradient_accuracy():
    """bf16 operands with a trained head's logits (standard deviation 5, the likely tokens' ``z`` near 15) and one
    candidate per token, forward KL with the tail bucket (the gradient's mass off the candidates): the gradients no
    further from float64 than 1.25× those of ``dz`` from fp32 logits rounded once to bf16 (an fp32 tile's); a bf16
    tile of unshifted logits (``|z|·2⁻⁸`` per logit) is further than that on the same problem, so the bound tells
    the two apart."""
    leaves, support = _head(n=48, k=1, seed=13, v=1000, h=32, dtype=torch.bfloat16, duplicates=False, logit_std=5.0)
    kw = dict(support_mask=support["support_mask"], mask=support["mask"], beta=0.0)
    with _one_pass(16):
        out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                       leaves[2], backend="triton", **kw)
        out.loss.backward()
    ref = [leaf64(t) for t in leaves]
    exact_loss, _ = _divergence_of_logits(dense_logits(*ref), support, beta=0.0, add_tail_bucket=True)
    exact_loss.backward()
    # dz exactly, then the head's gradients from dz rounded once (an fp32 tile's) or from unshifted bf16 logits
    logits = dense_logits(*ref).detach().requires_grad_()
    (dz,) = torch.autograd.grad(_divergence_of_logits(logits, support, beta=0.0, add_tail_bucket=True)[0], logits)
    h64, w64 = (t.detach() for t in ref[:2])

    def grads_from(dz_rounded):  # rounded to bf16 as the leaves' gradients are
        return (dz_rounded @ w64).bfloat16(), (dz_rounded.t() @ h64).bfloat16()

    once = grads_from(dz.to(torch.bfloat16).double())
    with torch.no_grad():
        z = logits.detach()
        zb = z.float().to(torch.bfloat16).double()
        lse = torch.logsumexp(z, -1, keepdim=True)
        ids = support["support_ids"].clamp_min(0)
        cand = torch.zeros_like(z, dtype=torch.bool).scatter_(1, ids, support["support_mask"])
        unshifted = torch.where(cand, dz, dz / (z - lse).exp() * (zb - lse).exp())
    coarse = grads_from(unshifted.to(torch.bfloat16).double())
    for name, ours, a, c, exact in zip(("hidden", "weight"), leaves, once, coarse, ref):
        err, bound = rel_err(ours.grad, exact.grad), 1.25 * rel_err(a, exact.grad)
        assert err <= bound, f"d{name}: {err:.2e} > 1.25x an fp32 tile's {bound / 1.25:.2e}"
        assert rel_err(c, exact.grad) > bound, f"d{name}: the unshifted tile's error is within the bound"


# -- the real kernels -------------------------------------------------------------------------------------------


def _gpu_problem(n, h, v, k, seed=0):
    """A bf16 student whose logits have standard deviation ~4 (a trained head's entropy) and a correlated teacher's
    top-``k`` log-probs, on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hs = torch.randn(n, h, generator=g, device="cuda")
    ws = torch.randn(v, h, generator=g, device="cuda") * (4.0 / h**0.5)
    wt = ws + 0.5 * torch.randn(v, h, generator=g, device="cuda") / h**0.5
    with torch.no_grad():
        top = torch.topk((hs @ wt.t()).log_softmax(-1), k, dim=-1)
    ids, teacher = top.indices, top.values
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[::7, k // 2:] = False
    mask = torch.rand(n, generator=g, device="cuda") > 0.1
    leaves = [hs.bfloat16().requires_grad_(), ws.bfloat16().requires_grad_()]
    return leaves, dict(support_ids=torch.where(valid, ids, -1), teacher_logprobs=teacher, support_mask=valid,
                        mask=mask)


def _upcast_divergence(hidden, weight, support, *, beta, add_tail_bucket):
    """TRL's ``_jsd_loss_chunk`` way: fp32 copies of both operands (float64 ones give the exact reference), fp32
    logits, the support divergence by autograd; mean over the counted tokens, and the per-token divergence."""
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return _divergence_of_logits(F.linear(hidden.to(dtype), weight.to(dtype)), support, beta=beta,
                                 add_tail_bucket=add_tail_bucket)


def _divergence_of_logits(logits, support, *, beta, add_tail_bucket):
    """The support divergence of ``logits [N, V]`` in their dtype: the mean over the counted tokens, and per token."""
    dtype = logits.dtype
    logp = logits.log_softmax(-1)
    valid = support["support_mask"]
    s = logp.gather(-1, support["support_ids"].clamp_min(0))
    student, svalid = support_distribution(s, valid, add_tail_bucket)
    teacher, _ = support_distribution(support["teacher_logprobs"].to(dtype), valid, add_tail_bucket)
    div = torch.where(support["mask"], support_divergence(student, teacher, svalid, beta).sum(-1), 0.0)
    return div.sum() / support["mask"].sum(), div


#: bf16's unit roundoff: the op rounds ``dz`` once to bf16 for its two gradient matmuls (round to nearest on the GPU).
BF16_UNIT = 2.0**-8


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_gpu_bf16_logits_are_fp32_faithful(beta, k):
    """The whole op on CUDA in bf16 (the GPU backend's pass, chosen by default: the fused matmul's statistics and
    the candidates' gathered fp32 logits on a Hopper GPU; cuBLAS's fp32 chunks elsewhere): the loss within ``RTOL``
    of float64 on the same bf16 values (no logit rounded to bf16), the per-token divergence as close to float64 as
    float64 math on cuBLAS's fp32 logits (plus ``RTOL``), and each gradient no further from float64 than TRL's way
    (fp32 copies of the operands, fp32 autograd, the gradient rounded once to bf16) plus one bf16 rounding of
    ``dz``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    leaves, support = _gpu_problem(4096, 1024, 32000, k, seed=k)
    out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                   support_mask=support["support_mask"], mask=support["mask"], beta=beta)
    out.loss.backward()
    ours = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    upcast_loss, _ = _upcast_divergence(*leaves, support, beta=beta, add_tail_bucket=True)
    upcast_loss.backward()
    upcast = [t.grad.clone() for t in leaves]
    ref = [leaf64(t) for t in leaves]
    exact_loss, exact_div = _upcast_divergence(*ref, support, beta=beta, add_tail_bucket=True)
    exact_loss.backward()
    assert rel_err(out.loss, exact_loss) <= RTOL
    # Per token, a divergence carries its logits' own rounding (the fp32 accumulation of bf16 products), which a tail
    # bucket amplifies by 1 / (1 − Σ_k p_k) on a confident token (K = 1: 1.3e-5 from cuBLAS's fp32 logits on an
    # H200): the pass's may differ from exact math on cuBLAS's fp32 logits by RTOL beyond that logits' own error.
    from hf_fused.ops.backends.triton_cublas.matmul import mm_f32_

    with torch.no_grad():
        z32 = torch.empty((leaves[0].shape[0], leaves[1].shape[0]), dtype=torch.float32, device="cuda")
        mm_f32_(z32, leaves[0].detach(), leaves[1].detach().t())
        _, cublas_div = _divergence_of_logits(z32.double(), support, beta=beta, add_tail_bucket=True)
    err, cublas_err = rel_err(out.divergence, exact_div.detach()), rel_err(cublas_div, exact_div.detach())
    assert err <= cublas_err + RTOL, f"per-token divergence {err:.2e} > cuBLAS's fp32 logits' {cublas_err:.2e} + RTOL"
    for name, a, e, x in zip(("hidden", "weight"), ours, upcast, ref):
        err, upcast_err = rel_err(a, x.grad), rel_err(e, x.grad)
        assert err <= upcast_err + BF16_UNIT, f"d{name}: {err:.2e} > TRL's way {upcast_err:.2e} + 2^-8"


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_gpu_fp32_matches_float64(reduction):
    """The real kernels on fp32 operands (fp32 tiles, cuBLAS fp32 products): the generic loss with the entropy,
    duplicate and invalid ids, bias, scale, soft-cap and temperature, uneven tiles, against float64 at ``RTOL``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tkw = TRANSFORMS["scaled_and_capped"]
    v = 5003
    leaves, support = _head(n=300, k=9, seed=8, v=v, h=64, device="cuda")
    ids, valid, mask = support["support_ids"], support["support_mask"], support["mask"]
    g = torch.Generator().manual_seed(9)
    weights = torch.rand(ids.shape, generator=g).cuda()
    alpha = (torch.randn(ids.shape[:-1], generator=g) * 0.1).cuda()
    with _one_pass(64):
        out = linear_support_loss(leaves[0], leaves[1], ids, _weighted_loss, leaves[2], support_mask=valid,
                                  mask=mask, per_token={"weights": weights, "alpha": alpha}, need_entropy=True,
                                  reduction=reduction, **tkw)
        up = torch.randn(mask.shape, generator=g).cuda() if reduction == "none" else torch.tensor(1.6).cuda()
        (out.loss * up).sum().backward()
    ref = [leaf64(t) for t in leaves]
    logp = dense_logits(*ref, **tkw).log_softmax(-1)
    s = torch.where(valid, logp.gather(-1, ids.clamp(0, v - 1)), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    per_token = torch.where(mask, -(weights.double() * s).sum(-1) - alpha.double() * entropy, 0.0)
    expected = per_token.sum() if reduction == "sum" else per_token
    (expected * up.double()).sum().backward()
    assert rel_err(out.loss, expected) <= RTOL and rel_err(out.token_losses, per_token) <= RTOL
    assert rel_err(out.entropy, torch.where(mask, entropy, 0.0)) <= RTOL
    _assert_grads(leaves, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8, 256])
def test_gpu_pass_peak_below_one_logits_tensor(k):
    """The op's peak above its inputs and gradients stays below one bf16 ``[N, V]`` logits tensor (the eager path
    holds several), at 16,384 tokens of a 151,936-token head."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = 16384, 2048, 151936
    leaves, support = _gpu_problem(n, h, v, k)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                   support_mask=support["support_mask"], mask=support["mask"])
    out.loss.backward()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert torch.isfinite(out.loss) and extra < n * v * 2, f"{extra / 2**30:.2f} GiB above inputs and gradients"


def _peak_above_inputs_and_grads(run, leaves) -> int:
    """Bytes ``run()`` (forward and backward) held above the memory allocated before it and the leaves' gradients."""
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    return torch.cuda.max_memory_allocated() - base - grads


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 64])
def test_gpu_pass_memory_within_a_tenth_of_the_cross_entropys(k):
    """At K ≤ 64 the op holds at most 1.1× what hf_fused's fused cross-entropy holds on the same hidden states and
    head (issue 38's target): the cross-entropy's bf16 tile and rows, plus an fp32 scratch of one vocabulary chunk
    (about a tenth of the tile)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = 16384, 2048, 151936
    leaves, support = _gpu_problem(n, h, v, k)
    labels = support["support_ids"][:, 0]
    labels = labels.masked_fill(~support["mask"] | (labels < 0), -100)

    def cross_entropy():
        linear_cross_entropy(leaves[0], leaves[1], labels).backward()

    def sparse():
        sparse_distillation_loss(leaves[0], leaves[1], support["support_ids"], support["teacher_logprobs"],
                                 support_mask=support["support_mask"], mask=support["mask"]).loss.backward()

    ce, ours = (_peak_above_inputs_and_grads(run, leaves) for run in (cross_entropy, sparse))
    assert ours <= 1.1 * ce, f"{ours / 2**30:.2f} GiB against the cross-entropy's {ce / 2**30:.2f} GiB"


# Compiles the pass's kernels for an H100 (sm_90) in a process without TRITON_INTERPRET (the interpreter accepts code
# the compiler rejects) at the launch shapes the op uses, and prints each one's registers and spilled stack bytes.
_COMPILE_FOR_SM90 = r"""
from hf_fused.ops.backends.triton_cublas import shifted_tile as T, support_kernels as S

scalars = {"logit_scale": "fp32", "softcap": "fp32", "inv_temperature": "fp32"}
kernels = {
    "chunk": (T._logits_chunk_kernel, dict(scalars, X="*fp32", T="*bf16", Off="*fp32", Bias="*bf16", M="*fp32",
                                           S="*fp32", ZP="*fp32", Ids="*i64", RAW="*fp32")),
    "logprobs": (S._support_logprobs_kernel, dict(scalars, RAW="*fp32", Valid="*u8", RunMax="*fp32",
                                                  RunSum="*fp32", S="*fp32")),
    "scatter": (S._scatter_support_grad_kernel, dict(scalars, DZ="*bf16", Ids="*i64", Valid="*u8", RAW="*fp32",
                                                     G="*fp32", LSE="*fp32", ENT="*fp32", G_ENT="*fp32")),
}
launches = [("gradient", T._shifted_grad_kernel, dict(scalars, T="*bf16", Off="*fp32", LSE="*fp32", ENT="*fp32",
                                                      G_LP="*fp32", G_ENT="*fp32", Labels="*i64", ZY="*fp32"),
             dict(SOFTCAP=True, SCALED=True, HAS_G_ENT=True, LABEL=False, ROUND=0, BLOCK_V=T.GRAD_BLOCK_V,
                  OFF_BLOCK=T.BLOCK_V),
             T.GRAD_WARPS, 0),
            ("gather", S._candidate_logits_kernel, dict(H="*bf16", W="*bf16", Ids="*i64", Valid="*u8",
                                                        Bias="*bf16", RAW="*fp32"),
             dict(HAS_BIAS=True, WIDEN_DOT=False, COPIES=64, BLOCK_K=S.GATHER_BLOCK_K, BLOCK_H=S.GATHER_BLOCK_H,
                  STAGES=S.GATHER_STAGES), 4, 0)]
for k in (1, 64, 256, 1024):
    block = S.candidate_block(k)
    for name, (fn, types) in kernels.items():
        flags = dict(SOFTCAP=True, SCALED=True)
        warps = 4
        if name == "chunk":
            flags.update(HAS_BIAS=True, ENTROPY=True, ROUND=0, BLOCK=T.BLOCK_V, BLOCK_K=block)
            warps = T.CHUNK_WARPS
        elif name == "logprobs":
            flags["BLOCK_K"] = block
        else:
            dup, warps = S._scatter_launch(block)
            flags.update(HAS_G_ENT=True, ROUND=0, BLOCK_K=block, DUP=dup)
        launches.append((name, fn, types, flags, warps, k))
for name, fn, types, flags, warps, k in launches:
    sig = {n: "constexpr" if n in flags else types.get(n, "i32") for n in fn.arg_names}
    print(name, k, *registers_and_stack(fn, sig, flags, warps), flush=True)
"""


def test_kernels_compile_for_h100_without_spills():
    """Every kernel of the pass (the chunk, log-probs and gradient-columns kernels at K = 1, 64, 256, 1024, the tile's
    gradient kernel, the candidates' gathered dot products) compiles for sm_90 with at most 255 registers and no
    spilled stack."""
    rows = [line.split() for line in compile_for_sm90(_COMPILE_FOR_SM90)]
    assert len(rows) == 14
    for name, k, regs, stack in rows:
        assert int(stack) == 0 and int(regs) <= 255, (name, k, regs, stack)
