"""The GPU backend's distillation pass: its Triton tile epilogue (``distillation_kernels.py``) against float64
:mod:`hf_fused.ops.distillation_math`-equivalent references on one tile, and the whole op through that pass
(``backend="triton"``) against float64.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest) on small tiles; the vocabulary sizes are not
multiples of the kernels' column blocks (1024 and 2048), so each kernel's last, masked block is exercised, and the
statistics kernel's unmasked full blocks too. Tolerance ``RTOL = 1e-5`` as for the plain-PyTorch pass
(tests/ops/test_distillation.py): the kernels compute in fp32 from fp32 logits, their online sums rescaled per
block (measured at most 3e-6 against float64 on these tiles); launches in column chunks and row groups too. The
kernels also compile for sm_90 here (Triton's bundled toolchain, no GPU): the interpreter runs code the compiler
refuses. The ``gpu`` tests run the compiled kernels on one tile and the whole op in bf16 on CUDA through the new
pass against float64 and against the plain-PyTorch pass.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from references import apply_transform, dense_logits, leaf64, rel_err
from sm90 import compile_for_sm90

RTOL = 1e-5
BETAS = [0.0, 0.5, 1.0, 0.1]
TEMPERATURES = [1.0, 0.7, 2.0]
#: (student scale, soft-cap, teacher scale, soft-cap, biases): each model's own transform.
SCALED_CAPPED = (0.5, 5.0, 2.0, 8.0)

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it when there is no GPU)")


def _transform(scale=1.0, softcap=None, temperature=1.0):
    from hf_fused.ops.logit_transform import LogitTransform

    return LogitTransform(logit_scale=scale, softcap=softcap, temperature=temperature)


def _divergence64(zs, zt, beta):
    """Float64 per-row divergence and student entropy of tempered logits (TRL's conventions)."""
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    if beta == 0:
        div = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        div = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        div = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    return div, -(s.exp() * s).sum(-1)


def _tile(rows, vocab, *, seed, biases):
    """Raw fp32 logits of a correlated pair (spread ~3) and optional fp32 biases."""
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(rows, vocab, generator=g) * 3
    zt = 0.9 * zs + torch.randn(rows, vocab, generator=g) * 1.3
    bs = torch.randn(vocab, generator=g) * 0.5 if biases else None
    bt = torch.randn(vocab, generator=g) * 0.5 if biases else None
    return zs, zt, bs, bt


def _check_tile(beta, s_tf, t_tf, *, biases, rows=3, vocab=1100, seed=0, launch=None):
    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile

    zs, zt, bs, bt = _tile(rows, vocab, seed=seed, biases=biases)
    g = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    dz = torch.empty(rows, vocab)
    out = distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=dz, row_grads=g,
                            launch=launch)
    _assert_float64s(out, dz, zs, zt, bs, bt, g, beta, s_tf, t_tf)
    return zs, zt, bs, bt, g, out, dz


def _assert_float64s(out, dz, zs, zt, bs, bt, g, beta, s_tf, t_tf):
    """The tile's divergence, entropy and ``dz`` (of the loss ``Σ g·D``) within ``RTOL`` of float64's."""

    def tempered(z, b, tf):
        z = z if b is None else z + b.double()
        return apply_transform(z, dict(logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature))

    raw64 = zs.double().requires_grad_()
    div64, ent64 = _divergence64(tempered(raw64, bs, s_tf), tempered(zt.double(), bt, t_tf), beta)
    (div64 * g.double()).sum().backward()
    assert rel_err(out.divergence, div64) <= RTOL, "divergence"
    assert rel_err(out.entropy, ent64.detach()) <= RTOL, "entropy"
    assert rel_err(dz, raw64.grad) <= RTOL, "dz"


@interpreted
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_tile_epilogue_matches_float64(beta, temperature):
    _check_tile(beta, _transform(temperature=temperature), _transform(temperature=temperature), biases=False)


@interpreted
@pytest.mark.parametrize("beta", BETAS)
def test_tile_epilogue_each_models_scale_softcap_and_bias(beta):
    s_scale, s_cap, t_scale, t_cap = SCALED_CAPPED
    _check_tile(beta, _transform(s_scale, s_cap, 0.7), _transform(t_scale, t_cap, 0.7), biases=True, seed=3)


@interpreted
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_tile_epilogue_bf16_dz_is_the_fp32_dz_rounded_once_and_in_place_dz_is_the_same(beta):
    """The bf16 ``dz`` of the gradient matmuls is the fp32 one rounded once (bit for bit); ``dz`` written over the
    student's logits, and the statistics without ``dz``, give the same bits. A vocabulary beyond the gradient
    kernel's first column block (2048): its unmasked full blocks too."""
    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile

    s_tf, t_tf = _transform(0.5, 5.0, 0.7), _transform(temperature=0.7)
    zs, zt, bs, bt, g, out, dz = _check_tile(beta, s_tf, t_tf, biases=True, seed=5, rows=2, vocab=2100)
    dz16 = torch.empty(zs.shape, dtype=torch.bfloat16)
    distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=dz16, row_grads=g)
    assert torch.equal(dz16, dz.bfloat16())
    stats = distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt)
    assert torch.equal(stats.divergence, out.divergence) and torch.equal(stats.entropy, out.entropy)
    in_place = zs.clone()
    distillation_tile(in_place, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=in_place, row_grads=g)
    assert torch.equal(in_place, dz)


def _chunked(stats, sums, grad, rows):
    """Launch shapes of ``(block_v, warps, chunks)`` per kernel and ``rows`` per launch group."""
    from hf_fused.ops.backends.triton_cublas.distillation_pass import EpilogueLaunch, KernelLaunch

    return EpilogueLaunch(KernelLaunch(*stats), KernelLaunch(*sums), KernelLaunch(*grad), rows=rows)


@interpreted
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_tile_epilogue_in_column_chunks_and_row_groups(beta):
    """Each kernel's rows split into column chunks whose records the next kernels combine (over 1100 columns:
    statistics 3 chunks of 384, 384 and 332 columns in blocks of 128, the JSD sums 768 and 332 in blocks of 256, the
    gradient 4 × 256 and 76 in blocks of 64), launched in groups of 2 of the 3 rows: float64's values at the same
    bound, and the bf16 ``dz`` the fp32 one rounded once."""
    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile

    launch = _chunked((128, 4, 3), (256, 4, 2), (64, 4, 5), rows=2)
    s_tf, t_tf = _transform(0.5, 5.0, 0.7), _transform(2.0, 8.0, 0.7)
    zs, zt, bs, bt, g, out, dz = _check_tile(beta, s_tf, t_tf, biases=True, seed=13, launch=launch)
    dz16 = torch.empty(zs.shape, dtype=torch.bfloat16)
    again = distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=dz16, row_grads=g,
                              launch=launch)
    assert torch.equal(dz16, dz.bfloat16())
    assert torch.equal(again.divergence, out.divergence) and torch.equal(again.entropy, out.entropy)


@interpreted
def test_tile_epilogue_scalar_row_gradient_and_no_rows():
    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile

    zs, zt, _, _ = _tile(2, 300, seed=7, biases=False)
    tf = _transform()
    per_row, scalar = torch.empty_like(zs), torch.empty_like(zs)
    distillation_tile(zs, zt, 1.0, tf, tf, dz=per_row, row_grads=torch.full((2,), 0.25))
    distillation_tile(zs, zt, 1.0, tf, tf, dz=scalar, row_grads=torch.tensor(0.25))
    assert torch.equal(per_row, scalar) and per_row.abs().sum() > 0
    empty = distillation_tile(zs[:0], zt[:0], 0.5, tf, tf, dz=per_row[:0], row_grads=1.0)
    assert empty.divergence.shape == (0,) and empty.entropy.shape == (0,)


# -- the whole op through the GPU backend's pass ------------------------------------------------------------------

#: The op tests' heads: one partial column block (the kernel tests above exercise the full ones).
V, H_S, H_T = 300, 16, 24


def _op_inputs(n, *, seed, dtype=torch.float32, device="cpu", vocab=V, h_s=H_S, h_t=H_T):
    """A correlated student/teacher pair (logits of spread ~3), biases, and a mask with ignored tokens."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h_s, generator=g)
    ws = torch.randn(vocab, h_s, generator=g) * (3 / h_s**0.5)
    bs = torch.randn(vocab, generator=g) * 0.5
    ht = torch.cat([hs, torch.randn(n, h_t - h_s, generator=g)], -1)
    wt = torch.cat([ws + 0.5 * torch.randn(vocab, h_s, generator=g) / h_s**0.5,
                    torch.randn(vocab, h_t - h_s, generator=g) * (2 / h_s**0.5)], 1)
    bt = torch.randn(vocab, generator=g) * 0.5
    mask = (torch.rand(n, generator=g) > 0.3).long()
    mask[0] = 1
    student = [t.to(device, dtype).requires_grad_() for t in (hs, ws, bs)]
    teacher = [t.to(device, dtype) for t in (ht, wt, bt)]
    return student, teacher, mask.to(device)


def _dense64(student, teacher, mask, beta, kw):
    ref = [leaf64(t) for t in student]
    zs = dense_logits(*ref, logit_scale=kw["student_logit_scale"], softcap=kw["student_softcap"],
                      temperature=kw["temperature"])
    zt = dense_logits(*[None if t is None else t.double() for t in teacher], logit_scale=kw["teacher_logit_scale"],
                      softcap=kw["teacher_softcap"], temperature=kw["temperature"])
    div, ent = _divergence64(zs, zt, beta)
    kept = mask != 0
    return ref, torch.where(kept, div, 0.0), torch.where(kept, ent, 0.0).detach()


def _spy_on_pass(monkeypatch):
    """Count the GPU pass's tiles (so that a test knows the op went through it)."""
    from hf_fused.ops.backends.triton_cublas import distillation_pass as module

    calls = []
    original = module.distillation_tile

    def spy(zs, *args, **kwargs):
        calls.append(zs.shape[0])
        return original(zs, *args, **kwargs)

    monkeypatch.setattr(module, "distillation_tile", spy)
    return calls


@interpreted
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_op_through_the_triton_pass_matches_float64(monkeypatch, beta, reduction):
    """Loss, per-token divergence and entropy, and the student's hidden, weight and bias gradients, in uneven
    4-row tiles (the pass's budget rule: with fp32 products, 16 bytes per row and column, two fp32 logits and two
    tiles' fp32 ``dz`` for the gradient matmuls, which take two tiles at once), with each model's own transform."""
    from hf_fused.ops import linear_distillation_loss

    calls = _spy_on_pass(monkeypatch)
    s_scale, s_cap, t_scale, t_cap = SCALED_CAPPED
    kw = dict(student_logit_scale=s_scale, student_softcap=s_cap, teacher_logit_scale=t_scale, teacher_softcap=t_cap,
              temperature=0.7)
    student, teacher, mask = _op_inputs(15, seed=11)
    upstream = torch.rand(15, generator=torch.Generator().manual_seed(2)) + 0.5
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], student_bias=student[2],
                                   teacher_bias=teacher[2], mask=mask, beta=beta, reduction=reduction,
                                   tile_budget_bytes=4 * 16 * V, backend="triton", **kw)
    ref, div64, ent64 = _dense64(student, teacher, mask, beta, kw)
    if reduction == "mean":
        loss64 = div64.sum() / (mask != 0).sum()
        out.loss.backward()
        loss64.backward()
    else:
        loss64 = div64
        (out.loss * upstream).sum().backward()
        (div64 * upstream.double()).sum().backward()
    kept = int((mask != 0).sum())
    # the gradients' tiles hold 4 rows; "none"'s forward first computes the statistics alone, in tiles of 8 (no dz)
    grad_tiles = -(-kept // 4)
    assert len(calls) == grad_tiles + (-(-kept // 8) if reduction == "none" else 0)
    assert max(calls[-grad_tiles:]) == 4 and sum(calls[-grad_tiles:]) == kept and sum(calls) == kept * (
        2 if reduction == "none" else 1)
    assert rel_err(out.loss, loss64) <= RTOL
    assert rel_err(out.divergence, div64) <= RTOL and rel_err(out.entropy, ent64) <= RTOL
    for name, ours, exact in zip(("hidden", "weight", "bias"), student, ref):
        assert ours.grad.dtype == ours.dtype
        assert rel_err(ours.grad, exact.grad) <= RTOL, f"d{name}"


@interpreted
def test_op_through_the_triton_pass_bf16_leaves_no_bias_num_items(monkeypatch):
    """bf16 leaves on CPU (products from fp32 copies; the weight gradient's fp32 accumulator split over its bf16
    bytes), no bias, ``num_items_in_batch``: the gradients are float64's rounded once to bf16."""
    from hf_fused.ops import linear_distillation_loss

    calls = _spy_on_pass(monkeypatch)
    student, teacher, mask = _op_inputs(9, seed=12, dtype=torch.bfloat16)
    student[2], teacher[2] = None, None
    out = linear_distillation_loss(student[0], student[1], teacher[0], teacher[1], mask=mask, beta=0.1,
                                   num_items_in_batch=7, tile_budget_bytes=5 * 16 * V, backend="triton")
    out.loss.backward()
    kw = dict(student_logit_scale=1.0, student_softcap=None, teacher_logit_scale=1.0, teacher_softcap=None,
              temperature=1.0)
    ref, div64, _ = _dense64(student[:2] + [None], teacher[:2] + [None], mask, 0.1, kw)
    (div64.sum() / 7).backward()
    kept = int((mask != 0).sum())
    assert max(calls) <= 5 and len(calls) == -(-kept // 5) and sum(calls) == kept  # balanced tiles
    assert rel_err(out.divergence, div64) <= RTOL
    for name, ours, exact in zip(("hidden", "weight"), student, ref):
        assert ours.grad.dtype == torch.bfloat16
        assert rel_err(ours.grad, exact.grad) <= 2.0**-8, f"d{name}"


def test_tile_rows_rule_under_an_explicit_budget_counts_the_tile_arrays():
    from types import SimpleNamespace

    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile_rows
    from hf_fused.ops.head_inputs import NeededGrads
    from hf_fused.ops.tiling import DEFAULT_TILE_BUDGET_BYTES

    def head(budget, vocab=1000):
        return SimpleNamespace(head=SimpleNamespace(weight=torch.zeros(vocab, 4), tile_budget_bytes=budget,
                                                    weight_grad_dtype=None, rows=torch.arange(3)))

    need = NeededGrads(True, True, False)
    assert distillation_tile_rows(head(12 * 1000 * 7), need, 4) == 7  # bf16: two tiles of dz
    assert distillation_tile_rows(head(8 * 1000 * 7), need, 0) == 7
    assert distillation_tile_rows(head(100), need, 4) == 1  # at least one row
    assert distillation_tile_rows(head(None), need, 4) == DEFAULT_TILE_BUDGET_BYTES // (12 * 1000)  # off CUDA


# Compiles the epilogue's kernels for an H100/H200 (sm_90) in a process without TRITON_INTERPRET (the interpreter
# accepts code the compiler rejects, e.g. a name a loop rebinds to another type) at the default launch shapes, with
# every logit-transform flag set, and prints each one's registers and spilled stack bytes.
_COMPILE_FOR_SM90 = r"""
from hf_fused.ops.backends.triton_cublas import distillation_kernels as K
from hf_fused.ops.backends.triton_cublas.distillation_pass import EPILOGUE_LAUNCH as L, _chunking

floats = {"s_scale", "s_cap", "s_inv_t", "t_scale", "t_cap", "t_inv_t", "beta", "one_m_beta"}
flags = dict(HAS_BIAS_S=True, SOFTCAP_S=True, SCALED_S=True, HAS_BIAS_T=True, SOFTCAP_T=True, SCALED_T=True)
s_pow, j_pow = _chunking(151936, L.stats)[2], _chunking(151936, L.sums)[2]
launches = [("stats", K.stats_kernel, dict(flags, MODE=m, BLOCK_V=L.stats.block_v), L.stats.warps, "*fp32")
            for m in (0, 1, 2)]
launches.append(("sums", K.jsd_sums_kernel, dict(flags, COMPILED=True, STATS_CHUNKS=s_pow, BLOCK_V=L.sums.block_v),
                 L.sums.warps, "*fp32"))
launches += [("grad", K.grad_kernel, dict(flags, MODE=m, DZ_BF16=dz == "*bf16", COMPILED=True, STATS_CHUNKS=s_pow,
                                          SUMS_CHUNKS=j_pow, BLOCK_V=L.grad.block_v), L.grad.warps, dz)
             for m, dz in ((0, "*bf16"), (1, "*bf16"), (2, "*bf16"), (2, "*fp32"))]
launches.append(("finish", K.finish_kernel, dict(MODE=2, STATS_CHUNKS=s_pow, SUMS_CHUNKS=j_pow), 4, "*fp32"))
for name, fn, consts, warps, dz in launches:
    sig = {n: "constexpr" if n in consts else dz if n == "DZ" else "fp32" if n in floats
           else "*fp32" if n[0].isupper() else "i32" for n in fn.arg_names}
    print(name, consts.get("MODE", "-"), *registers_and_stack(fn, sig, consts, warps), flush=True)
"""


def test_kernels_compile_for_sm90_without_spills():
    """Every epilogue kernel (statistics for each mode, the JSD sums, the gradient for each mode with a bf16 and an
    fp32 ``dz``, the finish) compiles for sm_90 at the default launch shapes with at most 255 registers and no
    spilled stack."""
    rows = [line.split() for line in compile_for_sm90(_COMPILE_FOR_SM90)]
    assert len(rows) == 9
    for name, mode, regs, stack in rows:
        assert int(stack) == 0 and int(regs) <= 255, (name, mode, regs, stack)


# -- CUDA ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("transform", ["identity", "scaled_capped"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
def test_cuda_triton_pass_no_further_from_float64_than_the_plain_pass(monkeypatch, beta, transform):
    """bf16 heads on CUDA, a vocabulary that is no multiple of the column blocks, biases, a mask, tiles of at most
    96 rows (balanced over the ~700 kept tokens): the Triton pass (which the op takes) and the plain-PyTorch pass
    compute from the same fp32 logits and round ``dz`` once to bf16, so their errors against float64 agree."""
    from hf_fused.ops import linear_distillation_loss

    calls = _spy_on_pass(monkeypatch)
    kw = dict(temperature=0.7)
    if transform == "scaled_capped":
        s_scale, s_cap, t_scale, t_cap = SCALED_CAPPED
        kw.update(student_logit_scale=s_scale, student_softcap=s_cap, teacher_logit_scale=t_scale,
                  teacher_softcap=t_cap)
    full = dict(student_logit_scale=1.0, student_softcap=None, teacher_logit_scale=1.0, teacher_softcap=None)
    full.update(kw)
    vocab = 8192 + 1234
    student, teacher, mask = _op_inputs(1000, seed=21, dtype=torch.bfloat16, device="cuda", vocab=vocab, h_s=256,
                                        h_t=384)
    ref, div64, ent64 = _dense64(student, teacher, mask, beta, full)
    (div64.sum() / (mask != 0).sum()).backward()
    errors = {}
    for backend in ("triton", "torch"):
        params = [t.detach().clone().requires_grad_() for t in student]
        budget = 96 * (12 if backend == "triton" else 24) * vocab
        out = linear_distillation_loss(params[0], params[1], teacher[0], teacher[1], student_bias=params[2],
                                       teacher_bias=teacher[2], mask=mask, beta=beta, tile_budget_bytes=budget,
                                       backend=backend, **kw)
        out.loss.backward()
        errors[backend] = [rel_err(out.divergence, div64), rel_err(out.entropy, ent64)] + [
            rel_err(p.grad, r.grad) for p, r in zip(params, ref)]
    kept = int((mask != 0).sum())
    assert max(calls) <= 96 and len(calls) == -(-kept // 96) and sum(calls) == kept  # balanced tiles
    for i, what in enumerate(["divergence", "entropy", "d_hidden", "d_weight", "d_bias"]):
        ours, plain = errors["triton"][i], errors["torch"][i]
        # fp32 statistics: both at fp32 rounding, from products cuBLAS may sum in another order; the gradients: the
        # same bf16 rounding of the same fp32 dz dominates both
        slack = RTOL if i < 2 else 1e-6
        assert ours <= 1.1 * plain + slack, f"{what}: triton pass {ours:.3g} from float64, plain pass {plain:.3g}"
        assert ours <= (1e-4 if i < 2 else 2.0**-8), f"{what}: triton pass {ours:.3g} from float64"


@pytest.mark.gpu
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
def test_cuda_tile_epilogue_matches_float64_and_rounds_dz_once(beta, chunked):
    """The compiled kernels (fast hardware exponentials and logarithms) on a 64-row tile of 9426 columns, each
    model's transform and bias, the default launch shapes or column chunks in row groups: the divergence, entropy
    and fp32 ``dz`` at float64's RTOL, and the bf16 ``dz`` (the hardware's round to nearest even) the fp32 one
    rounded once by torch, bit for bit."""
    from hf_fused.ops.backends.triton_cublas.distillation_pass import distillation_tile

    launch = _chunked((1024, 4, 4), (1024, 4, 3), (2048, 8, 2), rows=24) if chunked else None
    s_tf, t_tf = _transform(0.5, 5.0, 0.7), _transform(2.0, 8.0, 0.7)
    zs, zt, bs, bt = (t.cuda() for t in _tile(64, 8192 + 1234, seed=17, biases=True))
    g = torch.rand(64, device="cuda") + 0.5
    dz, dz16 = torch.empty_like(zs), torch.empty(zs.shape, dtype=torch.bfloat16, device="cuda")
    out = distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=dz, row_grads=g,
                            launch=launch)
    again = distillation_tile(zs, zt, beta, s_tf, t_tf, student_bias=bs, teacher_bias=bt, dz=dz16, row_grads=g,
                              launch=launch)
    assert torch.equal(dz16, dz.bfloat16())
    assert torch.equal(again.divergence, out.divergence) and torch.equal(again.entropy, out.entropy)
    _assert_float64s(out, dz, zs, zt, bs, bt, g, beta, s_tf, t_tf)


@pytest.mark.gpu
def test_cuda_default_rule_tiles_and_memory_at_the_benchmark_shape_class(monkeypatch):
    """Under the default rule the pass takes ``DISTILLATION_TILE_ROWS``-row tiles; at V = 151,936, H_s 2048, H_t
    4096 and 4096 tokens its peak above the inputs stays under TRL's head at 16k tokens (2.53 GiB,
    docs/performance.md, H200, 2026-11-29): two fp32 and one bf16 [1024, V] tiles, the weight gradient's fp32
    accumulator split over its bf16 bytes, the hidden gradient."""
    from hf_fused.ops import linear_distillation_loss
    from hf_fused.ops.backends.triton_cublas import distillation_pass as module

    n, v, h_s, h_t = 4096, 151936, 2048, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
    ws = (torch.randn(v, h_s, device="cuda", generator=g) * (4 / h_s**0.5)).bfloat16().requires_grad_()
    ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) * (4 / h_t**0.5)).bfloat16()
    rows = _spy_on_pass(monkeypatch)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = linear_distillation_loss(hs, ws, ht, wt, beta=1.0)
    out.loss.backward()
    torch.cuda.synchronize()
    # as the benchmark counts: the peak above the inputs, less the gradients that become .grad
    peak = torch.cuda.max_memory_allocated() - base - sum(t.grad.numel() * 2 for t in (hs, ws))
    assert rows == [module.DISTILLATION_TILE_ROWS] * (n // module.DISTILLATION_TILE_ROWS)
    assert torch.isfinite(hs.grad).all() and torch.isfinite(ws.grad).all()
    assert peak < 2.53 * 2**30, f"peak {peak / 2**30:.2f} GiB above the inputs and gradients"
