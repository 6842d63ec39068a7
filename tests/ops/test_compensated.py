"""``compensated_addmm_`` (``hi + lo·ulp(hi)/254 += a @ b``) against float64: accumulating k vocabulary chunks
into a bf16 ``hi`` with an int8 residual ``lo`` is as accurate as eager's one fp32-accumulated matmul rounded
once, and measurably more accurate than accumulating into a bf16 tensor; the residual means what
docs/design/numerics.md says, element by element, across bf16's range.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest) with small shapes; the ``gpu`` tests run
the compiled kernel at larger shapes and through every benchmarked launch configuration. The Hopper (TMA)
kernel runs under the interpreter too when asked for (``GemmConfig(tma=True)``) and is checked against the
pointer kernel bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops.backends.triton_cublas.compensated import (  # noqa: E402
    RESIDUAL_DTYPE, compensated_addmm_,
)
from hf_fused.ops.backends.triton_cublas.compensated_pair import compensated_scale_, compensated_store_  # noqa: E402
from hf_fused.ops.backends.triton_cublas.matmul import SWEEP_CONFIGS, GemmConfig  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402

# The CPU tests launch the kernel on CPU tensors: only Triton's interpreter can (conftest sets it without CUDA).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it when there is no GPU)")

# Precision p (significand bits, implicit one included) and the smallest normal exponent of each format.
FORMATS = {torch.bfloat16: (8, -126)}
# Gradient scale: bf16 has fp32's exponent range, so a realistic 1/num_items_in_batch.
SCALES = {torch.bfloat16: 1 / 4096}


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 spacing of ``dtype`` values at ``|v|`` (the gap above ``|v|``; subnormal spacing near 0)."""
    p, emin = FORMATS[dtype]
    _, e = torch.frexp(v.double().abs())  # |v| = f·2^e, f ∈ [0.5, 1): floor(log2|v|) = e − 1
    e = torch.where(v == 0, emin + 1, e)  # frexp(0) gives e = 0; 0's gap is the subnormal spacing
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), (e - 1).clamp_min(emin) - p + 1)


def _lean_path_operands(m, n, chunk, k, dtype, device="cpu", seed=0):
    """The products the lean gradient loop accumulates: ``dz = g·(softmax(z) − onehot(y))`` over ``k·chunk``
    vocabulary columns (z ~ N(0, 4²): about 4 nats of entropy, like a trained head) and a weight ~ N(0, 0.02²)."""
    g = torch.Generator().manual_seed(seed)
    vocab = chunk * k
    z = torch.randn(m, vocab, generator=g) * 4
    y = torch.randint(0, vocab, (m,), generator=g)
    dz = torch.softmax(z, dim=-1)
    dz[torch.arange(m), y] -= 1
    w = torch.randn(vocab, n, generator=g) * 0.02
    return (dz * SCALES[dtype]).to(device, dtype), w.to(device, dtype)


def _accumulate(a, w, chunk, config=None, transpose_a=False):
    """``(hi, lo)`` after one ``compensated_addmm_`` per vocabulary chunk, and the plain half-precision sum."""
    m, n = a.shape[0], w.shape[1]
    hi = torch.zeros(m, n, dtype=a.dtype, device=a.device)
    lo = torch.zeros(m, n, dtype=RESIDUAL_DTYPE, device=a.device)
    plain = torch.zeros_like(hi)
    if transpose_a:  # same values, [K, M] storage read through a transposed view
        a = a.t().contiguous().t()
    for v0 in range(0, w.shape[0], chunk):
        a_i, w_i = a[:, v0:v0 + chunk], w[v0:v0 + chunk]
        compensated_addmm_(hi, lo, a_i, w_i, config=config)
        torch.addmm(plain, a_i, w_i, out=plain)  # rounds to a.dtype once per chunk
    return hi, lo, plain


def _bound(a, w, chunk, hi, dtype):
    """Per-element bound on ``|hi − exact|`` of the former bf16 pair (docs/design/numerics.md): the
    last rounding ``½ulp(hi)``, plus per fold at most ``u·½ulp = ulp/512`` of the largest partial sum (at least
    half the subnormal spacing), plus the fp32 accumulation error ``(K + 2k)·2⁻²⁴·Σ|a||w|`` (Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed., §3.1; the 2k are the two fp32 roundings of each fold; the
    int8 residual's decoding, ≤ 2⁻²⁴·ulp ≈ 2⁻³¹·|hi| per fold, fits in the slack of K against a dot's K − 1).
    The int8 residual guarantees ``ulp/508`` per fold, 0.8 % more; its tests keep this tighter bound, which
    the realised errors meet (see test_sixty_four_chunks_within_the_bf16_pairs_bound)."""
    p, emin = FORMATS[dtype]
    u = 2.0**-p
    partial = torch.stack([a[:, v0:v0 + chunk].double() @ w[v0:v0 + chunk].double()
                           for v0 in range(0, w.shape[0], chunk)]).cumsum(0).abs().amax(0)
    k = w.shape[0] // chunk
    fold = (u * _ulp(partial, dtype) / 2).clamp_min(2.0 ** (emin - p) / 2)
    fp32 = (w.shape[0] + 2 * k) * 2.0**-24 * (a.double().abs() @ w.double().abs())
    return _ulp(hi, dtype) / 2 + k * fold + fp32


def _errors(result, exact):
    err = (result.double() - exact).abs()
    return err.mean().item(), err.max().item()


def _check_no_worse_than_eager(a, w, chunk, dtype, config=None, transpose_a=False):
    exact = a.double() @ w.double()
    eager = (a.float() @ w.float()).to(dtype)  # one fp32-accumulated matmul over all of K, rounded once
    hi, lo, plain = _accumulate(a, w, chunk, config, transpose_a)
    k = w.shape[0] // chunk
    u = 2.0 ** -FORMATS[dtype][0]
    bound = _bound(a, w, chunk, hi, dtype)
    assert ((hi.double() - exact).abs() <= bound).all()
    # The bound is tight enough to fail: eager's one rounding satisfies it, k roundings into dtype do not.
    assert ((eager.double() - exact).abs() <= _bound(a, w, chunk, eager, dtype)).all()
    (e_mean, e_max), (c_mean, c_max), (p_mean, _) = _errors(eager, exact), _errors(hi, exact), _errors(plain, exact)
    # hi and eager round values within k·ulp/508 (≤ 8 % of a half-ulp at k = 20, worst case; the bf16 residual's
    # k·u·½ulp was 256/254 of that less) of the same exact sum, so they differ only for sums that close to a
    # rounding tie, where the error grows by at most that distance: the expected growth of the mean is
    # ~8·(k/508)² ≤ 1.3 %; 5 % is the margin. The largest errors are half-ulps of the largest outputs for both;
    # folds move them by at most k/254 of that (kept at the bf16 residual's k·u = k/256, which they meet).
    assert c_mean <= 1.05 * e_mean, (c_mean / e_mean, c_max / e_max)
    assert c_max <= (1 + k * u) * e_max, (c_mean / e_mean, c_max / e_max)
    if k >= 5:
        # Each of the k roundings adds up to half an ulp (~¼ on average): measured 1.6× eager's mean error at
        # k = 5 and 2.9–3.2× at k = 20; 1.3× is what this test requires to call it measurably worse.
        assert p_mean >= 1.3 * e_mean, p_mean / e_mean
        assert not ((plain.double() - exact).abs() <= _bound(a, w, chunk, plain, dtype)).all()
    return hi, lo, exact


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
@pytest.mark.parametrize("k", [1, 5, 20])
def test_chunk_accumulation_no_worse_than_eager(dtype, k):
    a, w = _lean_path_operands(64, 96, 128, k, dtype)
    _check_no_worse_than_eager(a, w, 128, dtype)


@interpreted
@pytest.mark.parametrize("dtype, transpose_a, epilogue_split", [
    (torch.bfloat16, False, 1), (torch.bfloat16, True, 4), (torch.bfloat16, False, 2), (torch.bfloat16, True, 1),
])
def test_ragged_tiles_and_transposed_a(dtype, transpose_a, epilogue_split):
    # 32×32×16 tiles over M = 70, N = 90, K = 50 per chunk: ragged in all three dimensions, 3 row-blocks in
    # groups of 2 (a short last group), K not a multiple of the block (the masked-K loads); the epilogue on
    # the whole tile or on column slices (the last slice of the last column-block partly past N).
    config = GemmConfig(32, 64, 16, group_m=2, num_warps=4, num_stages=2, epilogue_split=epilogue_split)
    a, w = _lean_path_operands(70, 90, 50, 5, dtype, seed=1)
    _check_no_worse_than_eager(a, w, 50, dtype, config, transpose_a)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
def test_strided_pair_leaves_neighbours_untouched(dtype):
    a, w = _lean_path_operands(40, 48, 64, 3, dtype, seed=2)
    # hi and lo are column blocks of wider buffers (row stride 80, not 48), as rows of a bigger gradient are.
    hi_buf = torch.full((40, 80), 7.0, dtype=dtype)
    lo_buf = torch.full((40, 80), -7, dtype=RESIDUAL_DTYPE)
    hi, lo = hi_buf[:, 16:64], lo_buf[:, 16:64]
    hi.zero_()
    lo.zero_()
    config = GemmConfig(32, 32, 16, group_m=2, num_warps=4, num_stages=2)
    for v0 in range(0, 192, 64):
        compensated_addmm_(hi, lo, a[:, v0:v0 + 64], w[v0:v0 + 64], config=config)
    ref_hi, ref_lo, _ = _accumulate(a, w, 64, config)
    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)
    assert (hi_buf[:, :16] == 7).all() and (hi_buf[:, 64:] == 7).all()
    assert (lo_buf[:, :16] == -7).all() and (lo_buf[:, 64:] == -7).all()


def _pieces(x: torch.Tensor, dtype: torch.dtype, n: int = 3):
    """``x`` (fp32) as ``n`` values of ``dtype`` summing to it exactly where the last residual is 0."""
    out, rest = [], x.double()
    for _ in range(n):
        out.append(rest.to(dtype))
        rest = rest - out[-1].double()
    return torch.stack(out, dim=1), rest


def _residual(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """What the int8 ``lo`` stands for, in float64: ``lo·ulp(hi)/254`` with the stored ``hi``'s ulp."""
    return lo.double() * _ulp(hi, torch.bfloat16) / 254


def _expected_residual(x: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``rint(254·(x − hi)/ulp(hi))`` (ties to even) for fp32 sums ``x`` and their bf16 roundings ``hi``, 0 where
    ``hi`` is not finite: exact in float64 (x − hi and the ·254 need at most 24 + 8 bits; ulp is a power of 2)."""
    q = torch.round((x.double() - hi.double()) * 254 / _ulp(hi, torch.bfloat16))
    return torch.where(hi.isfinite(), q, 0).to(RESIDUAL_DTYPE)


#: The launch shape of the one-column folds below: the default table's (LARGE, 128 × 256 tiles) computes 256 columns
#: per program for the one that is stored, 49 programs for the spectrum's 6167 sums (3-4 s under Triton's
#: interpreter, against 0.3); every element's fold is the same code (``_fold``) in any tile, here as in LARGE's, in
#: four column slices, the K loop masked.
_COLUMN = GemmConfig(2048, 64, 16, group_m=1, num_warps=4, num_stages=2, epilogue_split=4)

_TINY = 2.0**-70  # tiny sums are built as (pieces of x·2⁷⁰)·2⁻⁷⁰: bf16 pieces of x itself would drop its bits < 2⁻¹³³


def _fold_once(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """One ``compensated_addmm_`` of ``[n, 1]`` pairs whose product is the fp32 vector ``x`` exactly: ``a`` holds x's
    24 significand bits as three bf16 pieces of 8 (truncated, so that none rounds up to inf near fp32's max), in
    columns 0–2 against weights 1, or for |x| < 2⁻⁶⁰ those of x·2⁷⁰ in columns 3–5 against 2⁻⁷⁰. Every partial sum
    of the dot is a run of x's bits: exact in fp32, in any order."""
    tiny = x.abs() < 2.0**-60
    pieces, rest = [], torch.where(tiny, x / _TINY, x)  # exact: a power of two, no overflow
    for _ in range(3):
        pieces.append((rest.view(torch.int32) & -65536).view(torch.float32))  # the top 8 significand bits
        rest = rest - pieces[-1]  # exact (Sterbenz)
    assert (rest == 0).all()
    pieces = torch.stack(pieces, dim=1).bfloat16()
    zero = torch.zeros_like(pieces)
    a = torch.cat([torch.where(tiny[:, None], zero, pieces), torch.where(tiny[:, None], pieces, zero)], dim=1)
    b = torch.tensor([[1.0], [1.0], [1.0], [_TINY], [_TINY], [_TINY]], dtype=torch.bfloat16)
    compensated_addmm_(hi, lo, a, b, config=_COLUMN)


def _spectrum() -> torch.Tensor:
    """fp32 sums across bf16's range: random significands over every binade (fp32 subnormals included), both
    sides of powers of two, bf16 ties (½ulp: hi to even), the residual's own ties (r = ±¼ulp: ±63.5 steps,
    including the bf16 tie just below a power of two that rounds up to it), near-½ulp residuals, zeros,
    bf16 subnormals and the values around bf16's and fp32's largest (some round to inf)."""
    g = torch.Generator().manual_seed(7)
    f64 = dict(dtype=torch.float64)
    rand = torch.ldexp(1 + torch.rand(1500, generator=g, **f64), torch.randint(-149, 128, (1500,), generator=g))
    exponents = torch.tensor([-126, -125, -124, -110, -100, -20, -1, 0, 1, 60, 126, 127])
    powers = torch.ldexp(torch.ones(len(exponents), **f64), exponents)
    j = torch.arange(8, 25, **f64)[:, None]
    edges = torch.cat([powers * (1 - 2**-j), powers * (1 + 2**-j)]).flatten()
    hi = torch.ldexp(1 + torch.randint(0, 128, (200,), generator=g).double() / 128,
                     torch.randint(-125, 127, (200,), generator=g))  # bf16 values
    ulp = _ulp(hi, torch.bfloat16)
    ties = torch.cat([hi + ulp / 2, hi + ulp / 4, hi - ulp / 4, hi + ulp * 126.6 / 254, hi - ulp * 126.6 / 254,
                      powers - _ulp(powers, torch.bfloat16) / 4])
    sub = torch.cat([torch.randint(1, 2**23, (100,), generator=g).double() * 2.0**-149,  # fp32 subnormals
                     torch.randint(1, 2**7, (50,), generator=g).double() * 2.0**-133,  # bf16 subnormals exactly
                     torch.tensor([0.0, 2.0**-149, 2.0**-134, 3 * 2.0**-134, 2.0**-133, 2.0**-126 - 2.0**-149], **f64)])
    top = (2 - 2.0**-7) * 2.0**127  # bf16's largest; fp32's steps there are 2¹⁰⁴, bf16's midpoint above is 2¹¹⁹ on
    big = torch.tensor([top, top + 2.0**104, top + 2.0**119 - 2.0**104, top + 2.0**119, top + 2.0**119 + 2.0**104,
                        3.4028234663852886e38, top - 2.0**119 - 2.0**104], **f64)
    x = torch.cat([rand, edges, ties, sub, big]).float()
    signs = torch.where(torch.rand(len(x), generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([x * signs, -x * signs, torch.tensor([-0.0])])



@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
def test_fold_rounds_to_nearest_even(dtype):
    # Sums known exactly in fp32 (three half-precision pieces · 1): hi must be torch's round-to-nearest-even
    # of the sum and lo the remainder in steps of ulp(hi)/254 rounded to nearest even, ties and binade edges
    # included (Triton's interpreter truncates a plain .to(bfloat16), which this would catch).
    g = torch.Generator().manual_seed(3)
    spread = 1e3
    ties = 1 + (2 * torch.arange(64) + 1) * 2.0 ** -FORMATS[dtype][0]  # halfway between neighbours at [1, 2)
    edges = 2.0 - 2.0 ** -torch.arange(9, 24, dtype=torch.float64)  # just below a power of two
    x = torch.cat([torch.randn(2000, generator=g).double() * spread, ties, -ties, edges, -edges]).float()
    pieces, rest = _pieces(x, dtype)
    pieces, x = pieces[rest == 0], x[rest == 0]
    assert len(x) > 1500
    hi = torch.zeros(len(x), 1, dtype=dtype)
    lo = torch.zeros(len(x), 1, dtype=RESIDUAL_DTYPE)
    compensated_addmm_(hi, lo, pieces, torch.ones(3, 1, dtype=dtype), config=_COLUMN)
    assert torch.equal(hi[:, 0], x.to(dtype))
    assert torch.equal(lo[:, 0], _expected_residual(x, x.to(dtype)))


@interpreted
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # sums that overflow bf16
def test_residual_is_the_remainder_in_steps_of_ulp_over_254():
    # One fold from zero of an fp32 sum x known exactly: hi is the round-to-nearest-even of x (Triton's
    # interpreter truncates a plain .to(bfloat16), which this would catch) and lo the exact rint of the
    # remainder in steps of ulp(hi)/254, so that hi + lo·ulp/254 is within ulp/508 of x.
    x = _spectrum()
    hi = torch.zeros(len(x), 1, dtype=torch.bfloat16)
    lo = torch.zeros(len(x), 1, dtype=RESIDUAL_DTYPE)
    _fold_once(hi, lo, x)
    hi, lo = hi[:, 0], lo[:, 0]
    assert torch.equal(hi, x.bfloat16())
    assert torch.equal(lo, _expected_residual(x, hi))
    finite = hi.isfinite()
    err = (hi.double() + _residual(hi, lo) - x.double())[finite].abs()
    assert (err <= _ulp(hi, torch.bfloat16)[finite] / 508).all()
    assert lo.abs().max() == 127 and (lo == 64).any() and (lo == -64).any()  # the range and the ties were reached
    assert (hi.isinf() & x.isfinite()).any()  # and sums past bf16's largest went to ±inf, their lo to 0


@interpreted
def test_fold_decodes_the_stored_residual():
    # A fold from a pair (hi0, lo0) that already holds a residual: the new pair equals the exact sum
    # hi0 + lo0·ulp(hi0)/254 + x within ulp(hi')/508 (the residual's step) plus the fp32 stage's roundings:
    # (h + l) and (… + acc) 2⁻²⁴ each, decoding l 2⁻²³·|l|, and 2⁻¹⁵⁰ per rounding in fp32's subnormal range.
    # A wrong decoding scale in any binade would be off by a sizeable part of ulp(hi0).
    g = torch.Generator().manual_seed(8)
    hi0 = _spectrum().bfloat16()
    hi0 = hi0[hi0.double().abs() < 2.0**120]  # x below is at most 8·|hi0|: no overflow
    lo0 = torch.randint(-127, 128, hi0.shape, generator=g, dtype=RESIDUAL_DTYPE)
    lo0[:40] = 127
    lo0[40:80] = -127
    scale = torch.ldexp(1 + torch.rand(len(hi0), generator=g, dtype=torch.float64),
                        torch.randint(-12, 3, (len(hi0),), generator=g))
    x = (hi0.double() * scale * torch.where(torch.rand(len(hi0), generator=g) < 0.5, -1.0, 1.0)).float()
    x[-50:] = -hi0[-50:].float()  # cancellation: the new pair is the old residual alone
    hi, lo = hi0.clone()[:, None], lo0.clone()[:, None]
    _fold_once(hi, lo, x)
    hi, lo = hi[:, 0], lo[:, 0]
    old = hi0.double() + _residual(hi0, lo0)
    exact = old + x.double()
    bound = (_ulp(hi, torch.bfloat16) / 508 + 2.0**-24 * (old.abs() + exact.abs())
             + 2.0**-23 * _residual(hi0, lo0).abs() + 3 * 2.0**-150)
    assert ((hi.double() + _residual(hi, lo) - exact).abs() <= bound).all()
    assert (lo.abs() <= 127).all()


@interpreted
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # the interpreter's numpy
def test_non_finite_sums_match_eager():
    a = torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [3e38, 3e38], [-3e38, -3e38], [3.39e38, 0.0],
                      [float("-inf"), float("inf")]]).bfloat16()
    b = torch.ones(2, 1, dtype=torch.bfloat16)
    hi = torch.zeros(6, 1, dtype=torch.bfloat16)
    lo = torch.zeros(6, 1, dtype=RESIDUAL_DTYPE)
    lo[4] = 100  # a residual that the overflow must not turn into NaN
    compensated_addmm_(hi, lo, a, b)
    eager = (a.float() @ b.float()).bfloat16()
    assert torch.equal(hi.isnan(), eager.isnan()) and torch.equal(hi[~hi.isnan()], eager[~eager.isnan()])
    assert hi[:4].isinf().sum() == 3 and (lo[~hi.isfinite()] == 0).all()
    # A later finite chunk keeps ±inf ±inf and NaN NaN (the stored residual decodes to a finite 0 under inf).
    compensated_addmm_(hi, lo, torch.ones(6, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16))
    assert torch.equal(hi.isnan(), eager.isnan()) and torch.equal(hi[eager.isinf()], eager[eager.isinf()])
    assert (lo[~hi.isfinite()] == 0).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
def test_final_fold_would_change_nothing(dtype):
    # Why compensated has no finalize step: re-rounding hi + lo·ulp/254 differs from hi only where lo reaches
    # the midpoint to a neighbour: lo = ±127 (exactly ½ulp, a tie), or lo = ∓64 towards zero below a power of
    # two (the neighbour there is ½ulp away), which only a t exactly on that tie produces
    # (docs/design/numerics.md).
    a, w = _lean_path_operands(64, 96, 128, 20, dtype)
    hi, lo, _ = _accumulate(a, w, 128)
    # hi + residual is not a double rounding hazard: it lands on a bf16 midpoint only for lo = ±127.
    folded = (hi.double() + _residual(hi, lo)).float().to(dtype)
    power_of_two = (hi.view(torch.int16) & 0x7F == 0) & (hi.double().abs() >= 2.0**-125)
    towards_zero = lo.int() * hi.sign().int() == -64
    allowed = (lo.abs() == 127) | (power_of_two & towards_zero)
    assert ((folded != hi) <= allowed).all()


@interpreted
def test_sixty_four_chunks_within_the_bf16_pairs_bound():
    # Many folds: each adds at most ulp/508 (the int8 step's half) where the bf16 residual added at most
    # u·½ulp = ulp/512. The realised error of hi, and of the whole pair hi + lo·ulp/254, stays within the
    # bf16 pair's bound (_bound; for the pair without the last rounding's ½ulp(hi)), and hi stays as close
    # to float64 as eager's one rounding.
    a, w = _lean_path_operands(64, 96, 16, 64, torch.bfloat16, seed=9)
    hi, lo, exact = _check_no_worse_than_eager(a, w, 16, torch.bfloat16)
    pair_bound = _bound(a, w, 16, hi, torch.bfloat16) - _ulp(hi, torch.bfloat16) / 2
    assert ((hi.double() + _residual(hi, lo) - exact).abs() <= pair_bound).all()


def test_bad_arguments_raise():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    b = torch.zeros(8, 6, dtype=torch.bfloat16)
    hi = torch.zeros(4, 6, dtype=torch.bfloat16)
    lo = torch.zeros(4, 6, dtype=RESIDUAL_DTYPE)
    with pytest.raises(ValueError, match="hi, lo"):
        compensated_addmm_(hi, lo, a, b[:7])
    with pytest.raises(TypeError, match="needs bf16"):
        compensated_addmm_(hi, lo, a.float(), b.float())
    for residual in (hi, lo.half(), lo.to(torch.int16), lo.to(torch.uint8)):  # the former bf16 pair included
        with pytest.raises(TypeError, match="int8 residual lo: allocate it with .*RESIDUAL_DTYPE"):
            compensated_addmm_(hi, residual.clone(), a, b)
    with pytest.raises(TypeError, match="fp32 accumulator"):
        compensated_addmm_(hi.half(), lo, a.half(), b.half())
    pair = torch.zeros(4, 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hi overlaps lo"):
        compensated_addmm_(pair[:, :6], pair.view(RESIDUAL_DTYPE)[:, 6:12], a, b)  # lo on hi's bytes 3–5
    with pytest.raises(ValueError, match="overlaps a"):
        compensated_addmm_(a[:, :6], lo, a, b)
    with pytest.raises(ValueError, match="epilogue_split"):
        compensated_addmm_(hi, lo, a, b, config=GemmConfig(32, 32, 16, epilogue_split=4))


def test_empty_k_leaves_the_pair_as_it_was():
    hi = torch.tensor([[1.0 + 2.0**-7, 2.0]], dtype=torch.bfloat16)
    # A fold would move both: ½ulp on an odd hi is a tie to the even neighbour, and −64 steps below 2 pass the
    # midpoint to 2 − 2⁻⁷.
    lo = torch.tensor([[127, -64]], dtype=RESIDUAL_DTYPE)
    before = hi.clone(), lo.clone()
    compensated_addmm_(hi, lo, torch.zeros(1, 0, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.bfloat16))
    assert torch.equal(hi, before[0]) and torch.equal(lo, before[1])
    compensated_addmm_(hi, lo, torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.bfloat16))
    assert torch.equal(hi, torch.tensor([[1.0 + 2.0**-6, 2.0 - 2.0**-7]], dtype=torch.bfloat16))


# Compiles the kernels for an H100 (sm_90) in a process without TRITON_INTERPRET (the interpreter accepts code
# that the compiler rejects, such as returns of different types) and prints, per launch shape of the default
# table, the registers, spilled stack bytes, Hopper tensor-core (wgmma) instructions, TMA bulk-tensor loads
# (cp.async.bulk.tensor) and flush-to-zero (.ftz) instructions of the result: the pointer kernel, and the TMA
# kernel that runs the same table on sm_90 (the benchmark's other sweep shapes compile on the GPU when it runs;
# docs/design/numerics.md lists their counts).
_COMPILE_FOR_SM90 = r"""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from hf_fused.ops.backends.triton_cublas import compensated as C, matmul as M

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_and_print(fn, names, consts, types, cfg, label):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # What a launch specializes for the lean loop's tensors: 16-aligned pointers and strides, any row count M.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and n != "M" and not types.get(n, "").startswith("tensordesc")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ptx = kernel.asm["ptx"]
    wgmma = len(re.findall(r"wgmma.mma_async", ptx))
    tma = len(re.findall(r"cp.async.bulk.tensor", ptx))
    ftz = len(re.findall(r"\.ftz", ptx))
    print(cfg.name, label, regs, stack, wgmma, tma, ftz, flush=True)


ptrs = {"A": "*bf16", "B": "*bf16", "HI": "*bf16", "LO": "*i8", "HI_ROWS": "*i64"}
names = ["A", "B", "HI", "LO", "HI_ROWS", "M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
         "stride_hm", "stride_hn", "stride_lm", "stride_ln"]
for cfg in (M.LARGE, M.MEDIUM, M.SMALL):
    for layout in ("a row-major", "a transposed") if cfg == M.LARGE else ("a row-major",):
        unit = {"stride_ak": 1} if layout == "a row-major" else {"stride_am": 1}
        # The transposed layout also compiles the masked-K loop (EVEN_K off).
        consts = dict(unit, stride_bn=1, stride_hn=1, stride_ln=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=layout == "a row-major", WIDEN_DOT=False,
                      EPILOGUE_SPLIT=cfg.epilogue_split, GATHER_HI=False)
        compile_and_print(C._compensated_addmm_kernel, names, consts, ptrs, cfg, "pointer " + layout)

names = ["A_DESC", "B_DESC", "HI", "LO", "HI_ROWS", "M", "N", "K", "stride_hm", "stride_hn", "stride_lm", "stride_ln"]
for cfg in (M.LARGE, M.MEDIUM, M.SMALL):
    # The lean path's call (a row-major, hi rows gathered), and for LARGE also a plain one with a column-major a.
    for a_t, gather in ((False, True), (True, False)) if cfg == M.LARGE else ((False, True),):
        consts = dict(stride_hn=1, stride_ln=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, A_T=a_t, B_T=False, NUM_PROGRAMS=132, WIDEN_DOT=False,
                      EPILOGUE_SPLIT=cfg.epilogue_split, GATHER_HI=gather)
        a_box = (cfg.block_k, cfg.block_m) if a_t else (cfg.block_m, cfg.block_k)
        types = dict(ptrs, A_DESC=f"tensordesc<bf16[{a_box[0]}, {a_box[1]}]>",
                     B_DESC=f"tensordesc<bf16[{cfg.block_k}, {cfg.block_n}]>")
        label = "tma " + ("a transposed" if a_t else "a row-major") + (" gathered" if gather else "")
        compile_and_print(C._compensated_addmm_tma_kernel, names, consts, types, cfg, label)
"""


def test_kernel_compiles_for_h100_without_spills():
    rows = [line.rsplit(" ", 5) for line in compile_for_sm90(_COMPILE_FOR_SM90)]
    assert len(rows) == 8
    for name, regs, stack, wgmma, tma, ftz in rows:
        assert int(wgmma) > 0, name  # the product runs on Hopper tensor cores
        # The TMA kernel's loads are bulk tensor copies; the pointer kernel's are not.
        assert (int(tma) > 0) == (" tma " in f" {name} "), (name, tma)
        # No fp32 instruction flushes subnormals to zero: the fold's sums, the residual of a tiny hi and its
        # decoded value are fp32 subnormals where |hi| < 2⁻¹¹¹ (tests above check them under the interpreter).
        assert int(ftz) == 0, name
        # A spill moves registers through local memory on every epilogue; the table's epilogue_split is chosen
        # so that none happens (docs/design/numerics.md lists the measured counts).
        assert int(stack) == 0 and int(regs) <= 255, (name, regs, stack)


@pytest.fixture
def fp32_matmul():
    """Eager's reference on CUDA is a true fp32 accumulation (no TF32) for the duration of a test."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
@pytest.mark.parametrize("k", [1, 5, 20])
def test_chunk_accumulation_no_worse_than_eager_on_gpu(dtype, k, fp32_matmul):
    a, w = _lean_path_operands(1024, 2048, 4096 if k < 20 else 1024, k, dtype, device="cuda")
    _check_no_worse_than_eager(a, w, 4096 if k < 20 else 1024, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=lambda c: c.name)
def test_every_benchmarked_config_on_gpu(config, fp32_matmul):
    a, w = _lean_path_operands(1000, 2000, 1000, 5, torch.bfloat16, device="cuda", seed=4)  # ragged for every tile
    _check_no_worse_than_eager(a, w, 1000, torch.bfloat16, config)
    _check_no_worse_than_eager(a, w, 1000, torch.bfloat16, config, transpose_a=True)


@interpreted
def test_gathered_hi_rows_equal_the_compact_pair_scattered():
    # hi as the rows of a taller gradient (the kept tokens of [N_tokens, H]): the same sums as a compact pair,
    # landing in hi[hi_rows], the other rows untouched.
    a, w = _lean_path_operands(40, 48, 64, 3, torch.bfloat16, seed=5)
    config = GemmConfig(32, 64, 16, group_m=2, num_warps=4, num_stages=2, epilogue_split=2)
    hi_c, lo_c = torch.zeros(40, 48, dtype=torch.bfloat16), torch.zeros(40, 48, dtype=RESIDUAL_DTYPE)
    rows = torch.randperm(70, generator=torch.Generator().manual_seed(6))[:40].sort().values
    hi_g = torch.full((70, 48), 3.0, dtype=torch.bfloat16)
    hi_g[rows] = 0
    lo_g = torch.zeros(40, 48, dtype=RESIDUAL_DTYPE)
    for i in range(3):
        chunk = slice(64 * i, 64 * (i + 1))
        compensated_addmm_(hi_c, lo_c, a[:, chunk], w[chunk], config=config)
        compensated_addmm_(hi_g, lo_g, a[:, chunk], w[chunk], hi_rows=rows, config=config)
    assert torch.equal(hi_g[rows], hi_c) and torch.equal(lo_g, lo_c)
    others = torch.ones(70, dtype=torch.bool)
    others[rows] = False
    assert (hi_g[others] == 3.0).all()
    with pytest.raises(ValueError, match="hi_rows"):
        compensated_addmm_(hi_g, lo_g, a[:, :64], w[:64], hi_rows=rows.int())


def _nan_padded(x: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """``x`` as a view into a larger buffer whose rows are a multiple of 8 elements (the 16-byte strides TMA
    needs) and whose other elements are NaN: a load past the view that is not masked or zero-filled makes the
    sums NaN. ``transposed``: the buffer holds ``x.T`` (``x`` column-major)."""
    src = x.t() if transposed else x
    buf = torch.full((src.shape[0] + 8, (src.shape[1] + 7) // 8 * 8 + 8), float("nan"), dtype=x.dtype)
    buf[:src.shape[0], :src.shape[1]] = src
    view = buf[:src.shape[0], :src.shape[1]]
    return view.t() if transposed else view


def _tma_config(pointer: GemmConfig) -> GemmConfig:
    import dataclasses

    return dataclasses.replace(pointer, tma=True)


@interpreted
@pytest.mark.parametrize("a_t, b_t, epilogue_split, programs", [
    (False, False, 2, 1), (False, False, 4, 4), (True, False, 1, 4), (False, True, 2, 3), (True, True, 4, 1),
])
def test_tma_kernel_matches_pointer_kernel_and_float64(a_t, b_t, epilogue_split, programs, monkeypatch):
    # The TMA kernel under the interpreter: 32×64×16 tiles over M = 70, N = 90, K = 56 per chunk (ragged in all
    # three: TMA's zero fill past the descriptor's shape stands in for the masks; NaN beyond the views would
    # show any load that reads past it), a or b column-major (loaded as the transposed box), and 1, 3 or 4
    # persistent programs over the 6 tiles (uneven shares). Same per-tile fp32 sums in the same order as the
    # pointer kernel: bit-identical pairs, and within the float64 bounds of the pointer kernel's tests.
    from hf_fused.ops.backends.triton_cublas import compensated

    monkeypatch.setattr(compensated, "multiprocessors", lambda device: programs)
    a, w = _lean_path_operands(70, 90, 56, 5, torch.bfloat16, seed=10)
    a, w = _nan_padded(a, a_t), _nan_padded(w, b_t)
    assert (a.stride(0) == 1) == a_t and (w.stride(0) == 1) == b_t
    pointer = GemmConfig(32, 64, 16, group_m=2, num_warps=4, num_stages=2, epilogue_split=epilogue_split, tma=False)
    hi, lo, _ = _check_no_worse_than_eager(a, w, 56, torch.bfloat16, _tma_config(pointer))
    ref_hi, ref_lo, _ = _accumulate(a, w, 56, pointer)
    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)


@interpreted
def test_tma_kernel_gathers_hi_rows(monkeypatch):
    # Gathered hi rows (the lean path's call) on the TMA kernel: the pointer kernel's pair, bit for bit, in
    # hi[hi_rows], the other rows untouched; 2 programs over the 4 tiles.
    from hf_fused.ops.backends.triton_cublas import compensated

    monkeypatch.setattr(compensated, "multiprocessors", lambda device: 2)
    a, w = _lean_path_operands(40, 48, 72, 3, torch.bfloat16, seed=11)
    a, w = _nan_padded(a), _nan_padded(w)
    pointer = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2, epilogue_split=2, tma=False)
    rows = torch.randperm(70, generator=torch.Generator().manual_seed(12))[:40].sort().values
    pairs = []
    for config in (pointer, _tma_config(pointer)):
        hi = torch.full((70, 48), 3.0, dtype=torch.bfloat16)
        hi[rows] = 0
        lo = torch.zeros(40, 48, dtype=RESIDUAL_DTYPE)
        for i in range(3):
            chunk = slice(72 * i, 72 * (i + 1))
            compensated_addmm_(hi, lo, a[:, chunk], w[chunk], hi_rows=rows, config=config)
        pairs.append((hi, lo))
    (ref_hi, ref_lo), (hi, lo) = pairs
    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)
    others = torch.ones(70, dtype=torch.bool)
    others[rows] = False
    assert (hi[others] == 3.0).all() and hi[rows].abs().sum() > 0


@interpreted
def test_tma_refuses_operands_it_cannot_load():
    # tma=True where a descriptor cannot describe an operand raises, naming the reason; tma=None (the default
    # table's) runs the pointer kernel for them (on CPU always), and the same pair comes out.
    a = torch.randn(16, 50, generator=torch.Generator().manual_seed(13)).bfloat16()
    b = torch.randn(64, 24, generator=torch.Generator().manual_seed(14)).bfloat16()
    config = GemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=2)
    cases = [(a, b[:50], "strides \\(50, 1\\)"),  # a 100-byte row stride
             (a[:, ::2], b[:25], "strides \\(50, 2\\)"),  # no unit stride
             (a.new_zeros(16, 57)[:, 1:], b[:56], "16-byte aligned")]  # base 2 bytes past an aligned one
    for a_i, b_i, reason in cases:
        pairs = []
        for tma in (None, False):
            hi = torch.zeros(16, 24, dtype=torch.bfloat16)
            lo = torch.zeros(16, 24, dtype=RESIDUAL_DTYPE)
            compensated_addmm_(hi, lo, a_i, b_i, config=GemmConfig(16, 16, 16, group_m=1, num_warps=4, tma=tma))
            pairs.append((hi, lo))
        assert torch.equal(pairs[0][0], pairs[1][0]) and torch.equal(pairs[0][1], pairs[1][1])
        with pytest.raises(ValueError, match=f"TMA kernel, but a does not suit TMA: .*{reason}"):
            compensated_addmm_(hi, lo, a_i, b_i, config=_tma_config(config))


@interpreted
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("factor", [0.5, 1 / 3, -7.0, 3e-5])
def test_scale_rounds_the_pairs_value_times_the_factor_once(factor):
    # The one pass keeps its weight gradient as the pair until backward knows the upstream gradient: then
    # round(factor·(hi + lo)) must equal an fp32 accumulator's (t·factor).to(bf16) for the fp32 value t the pair
    # stands for (exactly, here: the pair's value needs at most 8 + 8 bits plus the decode's power of two, and
    # the product by the factor rounds once in fp32 in both), ±inf and NaN included.
    a, w = _lean_path_operands(48, 80, 64, 6, torch.bfloat16, seed=3)
    hi, lo, _ = _accumulate(a, w, 64)
    hi[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    lo[0, :4] = torch.tensor([0, 0, 0, 5], dtype=RESIDUAL_DTYPE)
    value = (hi.double() + _residual(hi, lo)).float()  # exact: hi's 8 bits and lo's 8 bits, 16 apart at most
    value[0, :3] = hi[0, :3].float()
    expected = (value * torch.tensor(factor, dtype=torch.float32)).to(torch.bfloat16)
    out = compensated_scale_(hi, lo, torch.tensor(factor))
    assert out is hi
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out[~out.isnan()], expected[~expected.isnan()])


@interpreted
def test_scale_by_one_leaves_hi_and_bad_arguments_raise():
    hi = torch.tensor([[1.0 + 2.0**-7, 2.0]], dtype=torch.bfloat16)
    lo = torch.tensor([[127, -64]], dtype=RESIDUAL_DTYPE)  # a fold would move both (test_empty_k_...)
    assert torch.equal(compensated_scale_(hi.clone(), lo, 1.0), hi)
    assert torch.equal(compensated_scale_(hi.clone(), lo, 2.0), torch.tensor([[2.0 + 2.0**-5, 4.0 - 2.0**-6]],
                                                                             dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous hi and lo of one shape"):
        compensated_scale_(hi, lo[:, :1], 2.0)
    with pytest.raises(ValueError, match="contiguous"):
        compensated_scale_(torch.zeros(2, 2, dtype=torch.bfloat16).t(), torch.zeros(2, 2, dtype=RESIDUAL_DTYPE), 2.0)
    with pytest.raises(TypeError, match="bf16 hi and an int8 lo"):
        compensated_scale_(hi.float(), lo, 2.0)


def test_one_pass_config_takes_three_stages_at_h_2048_only():
    from hf_fused.ops.backends.triton_cublas.compensated import one_pass_config
    from hf_fused.ops.backends.triton_cublas.matmul import LARGE, SMALL

    cpu = torch.device("cpu")
    assert one_pass_config(151936, 2048, cpu) == GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3,
                                                            epilogue_split=4)
    assert one_pass_config(151936, 4096, cpu) == LARGE
    assert one_pass_config(64, 96, cpu) == SMALL  # too few tiles for LARGE: the default's choice, unchanged


@interpreted
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("gather, scaled", [(False, False), (True, False), (False, True), (True, True)])
def test_store_is_the_fold_of_one_product_into_a_zero_pair(gather, scaled):
    """``compensated_store_`` of an fp32 block leaves the bits ``compensated_addmm_`` leaves in a zero pair after
    folding the same block in (here the block is ``a @ I``: the fold's fp32 product of bf16 values is exact), with
    the row scale applied in fp32 first; gathered rows land in ``hi``'s rows and nowhere else."""
    g = torch.Generator().manual_seed(3)
    m, n, tall = 24, 48, 40
    # values across bf16's range, ties and near-ties included: bf16 sums of three terms at different scales
    parts = [torch.randn(m, n, generator=g) * s for s in (1.0, 2.0**-8, 2.0**-17)]
    acc = (parts[0].bfloat16().float() + parts[1].bfloat16().float() + parts[2].bfloat16().float())
    acc[0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0**-130), 3e38])  # ties, a subnormal, huge
    row_scale = torch.rand(m, generator=g) * 3 + 0.25 if scaled else None
    if scaled:
        row_scale[0] = 1.0  # row 0's ties, subnormal and near-overflow as they are
    target = acc * row_scale[:, None] if scaled else acc
    rows = torch.randperm(tall, generator=g)[:m].sort().values if gather else None
    hi = torch.full((tall if gather else m, n), 7.0, dtype=torch.bfloat16)  # untouched rows keep their 7s
    lo = torch.empty((m, n), dtype=RESIDUAL_DTYPE)
    compensated_store_(hi, lo, acc.contiguous(), hi_rows=rows, row_scale=row_scale)

    # the reference: a zero pair folded with target's exact bf16 pieces (their sum is target in fp32)
    ref_hi, ref_lo = torch.zeros((m, n), dtype=torch.bfloat16), torch.zeros((m, n), dtype=RESIDUAL_DTYPE)
    pieces = [target.bfloat16()]
    rest = target - pieces[0].float()
    pieces += [rest.bfloat16(), (rest - rest.bfloat16().float()).bfloat16()]
    a = torch.cat(pieces, dim=1)  # [m, 3n] @ [3n, n] stacked identities: Σ pieces, accumulated in fp32
    eye = torch.cat([torch.eye(n, dtype=torch.bfloat16)] * 3, dim=0)
    assert torch.equal(sum(p.float() for p in pieces), target)  # the pieces are exact
    compensated_addmm_(ref_hi, ref_lo, a, eye)
    got_hi = hi[rows] if gather else hi
    assert torch.equal(got_hi.view(torch.int16), ref_hi.view(torch.int16))
    assert torch.equal(lo, ref_lo)
    assert torch.equal(got_hi, target.bfloat16())  # hi: the round-to-nearest of the fp32 value
    if gather:
        others = torch.ones(tall, dtype=torch.bool)
        others[rows] = False
        assert bool((hi[others] == 7.0).all())


@interpreted
@pytest.mark.parametrize("factor", [1.0, 0.5, 1 / 3, -7.0])
def test_scale_of_gathered_rows_equals_the_dense_scale(factor):
    """``compensated_scale_(hi, lo, factor, hi_rows=rows)`` scales the rows ``rows`` of a taller ``hi`` exactly as
    the dense call scales the compact pair, and leaves the other rows; a device tensor of 1.0 keeps ``hi``'s bits,
    as the Python 1.0 does (the deferred hint check scales by a device tensor)."""
    g = torch.Generator().manual_seed(5)
    m, n, tall = 16, 32, 30
    acc = torch.randn(m, n, generator=g) * 10
    acc[0, :2] = torch.tensor([1.0 + 2.0**-8 + 2.0**-16, 1.0 + 2.0**-8 - 2.0**-16])  # residuals near ±127
    rows = torch.randperm(tall, generator=g)[:m].sort().values
    compact_hi, compact_lo = torch.zeros((m, n), dtype=torch.bfloat16), torch.empty((m, n), dtype=RESIDUAL_DTYPE)
    compensated_store_(compact_hi, compact_lo, acc)
    tall_hi = torch.full((tall, n), -3.0, dtype=torch.bfloat16)
    tall_hi[rows] = compact_hi
    compensated_scale_(tall_hi, compact_lo, torch.tensor(factor), hi_rows=rows)
    expected = compensated_scale_(compact_hi.clone(), compact_lo, factor)
    assert torch.equal(tall_hi[rows].view(torch.int16), expected.view(torch.int16))
    others = torch.ones(tall, dtype=torch.bool)
    others[rows] = False
    assert bool((tall_hi[others] == -3.0).all())
    if factor == 1.0:
        assert torch.equal(expected, acc.bfloat16())
        assert int(compact_lo.abs().max()) >= 126  # the near-ties are there: a second rounding could move them
    else:  # the pair's value times the factor, rounded once: within half an ulp of the exact product, plus ulp/508
        exact = acc.double() * factor
        err = (expected.double() - exact).abs()
        assert bool((err <= _ulp(exact, torch.bfloat16) * (0.5 + 1 / 254)).all())


def test_store_and_scale_refuse_bad_arguments():
    hi, lo, acc = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=RESIDUAL_DTYPE), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="acc of lo's shape"):
        compensated_store_(hi, lo, acc[:, :4].contiguous())
    with pytest.raises(TypeError, match="fp32 acc"):
        compensated_store_(hi, lo, acc.double())
    with pytest.raises(ValueError, match="hi_rows needs"):
        compensated_store_(hi, lo, acc, hi_rows=torch.arange(3))
    with pytest.raises(ValueError, match="hi_rows needs"):
        compensated_scale_(hi, lo, 2.0, hi_rows=torch.arange(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="bf16 hi and an int8 lo"):
        compensated_store_(hi.half(), lo, acc)
