"""``compensated_addmm_`` (``hi + lo += a @ b``) against float64: accumulating k vocabulary chunks into a
bf16 pair is as accurate as eager's one fp32-accumulated matmul rounded once, and measurably more accurate
than accumulating into a bf16 tensor.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest) with small shapes; the ``gpu`` tests run
the compiled kernel at larger shapes and through every benchmarked launch configuration.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops.backends.compensated import SWEEP_CONFIGS, GemmConfig, compensated_addmm_  # noqa: E402

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
    lo = torch.zeros_like(hi)
    plain = torch.zeros_like(hi)
    if transpose_a:  # same values, [K, M] storage read through a transposed view
        a = a.t().contiguous().t()
    for v0 in range(0, w.shape[0], chunk):
        a_i, w_i = a[:, v0:v0 + chunk], w[v0:v0 + chunk]
        compensated_addmm_(hi, lo, a_i, w_i, config=config)
        torch.addmm(plain, a_i, w_i, out=plain)  # rounds to a.dtype once per chunk
    return hi, lo, plain


def _bound(a, w, chunk, hi, dtype):
    """Per-element bound on ``|hi − exact|`` (module docstring of ``compensated``): the last rounding
    ``½ulp(hi)``, plus per fold at most ``u·½ulp`` of the largest partial sum (at least half the subnormal
    spacing), plus the fp32 accumulation error ``(K + 2k)·2⁻²⁴·Σ|a||w|`` (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., §3.1; the 2k are the two fp32 roundings of each fold)."""
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
    # hi and eager round values within k·u·½ulp (≤ 8 % of a half-ulp at k = 20 in bf16, worst case) of the same
    # exact sum, so they differ only for sums that close to a rounding tie, where the error grows by at most
    # that distance: the expected growth of the mean is ~8·(k·u/2)² ≤ 1.3 %; 5 % is the margin. The largest
    # errors are half-ulps of the largest outputs for both; a fold moves them by at most k·u of that.
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
    lo_buf = torch.full((40, 80), -7.0, dtype=dtype)
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


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
def test_fold_rounds_to_nearest_even(dtype):
    # Sums known exactly in fp32 (three half-precision pieces · 1): hi must be torch's round-to-nearest-even
    # of the sum and lo that of the remainder, ties and binade edges included (Triton's interpreter truncates
    # a plain .to(bfloat16), which this would catch).
    g = torch.Generator().manual_seed(3)
    spread = 1e3
    ties = 1 + (2 * torch.arange(64) + 1) * 2.0 ** -FORMATS[dtype][0]  # halfway between neighbours at [1, 2)
    edges = 2.0 - 2.0 ** -torch.arange(9, 24, dtype=torch.float64)  # just below a power of two
    x = torch.cat([torch.randn(2000, generator=g).double() * spread, ties, -ties, edges, -edges]).float()
    pieces, rest = _pieces(x, dtype)
    pieces, x = pieces[rest == 0], x[rest == 0]
    assert len(x) > 1500
    hi = torch.zeros(len(x), 1, dtype=dtype)
    lo = torch.zeros_like(hi)
    compensated_addmm_(hi, lo, pieces, torch.ones(3, 1, dtype=dtype))
    assert torch.equal(hi[:, 0], x.to(dtype))
    assert torch.equal(lo[:, 0], (x - x.to(dtype).float()).to(dtype))


@interpreted
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # the interpreter's numpy
def test_non_finite_sums_match_eager():
    a = torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [3e38, 3e38], [-3e38, -3e38]]).bfloat16()
    b = torch.ones(2, 1, dtype=torch.bfloat16)
    hi = torch.zeros(4, 1, dtype=torch.bfloat16)
    lo = torch.zeros_like(hi)
    compensated_addmm_(hi, lo, a, b)
    eager = (a.float() @ b.float()).bfloat16()
    assert torch.equal(hi.isnan(), eager.isnan()) and torch.equal(hi[~hi.isnan()], eager[~eager.isnan()])


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16 is refused (test_bad_arguments_raise)
def test_final_fold_would_change_nothing(dtype):
    # Why compensated has no finalize step: round(hi + lo) differs from hi only where lo is exactly half an
    # ulp of hi (a tie, which round-half-to-even may resolve away from the pair's sum), never otherwise.
    a, w = _lean_path_operands(64, 96, 128, 20, dtype)
    hi, lo, _ = _accumulate(a, w, 128)
    folded = (hi.double() + lo.double()).to(dtype)
    tie = lo.double().abs() == _ulp(hi, dtype) / 2
    assert ((folded != hi) <= tie).all()


def test_bad_arguments_raise():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    b = torch.zeros(8, 6, dtype=torch.bfloat16)
    hi = torch.zeros(4, 6, dtype=torch.bfloat16)
    lo = torch.zeros_like(hi)
    with pytest.raises(ValueError, match="hi, lo"):
        compensated_addmm_(hi, lo, a, b[:7])
    with pytest.raises(TypeError, match="needs bf16"):
        compensated_addmm_(hi, lo, a.float(), b.float())
    with pytest.raises(TypeError, match="needs bf16"):
        compensated_addmm_(hi, lo.half(), a, b)
    with pytest.raises(TypeError, match="fp32 accumulator"):
        compensated_addmm_(hi.half(), lo.half(), a.half(), b.half())
    pair = torch.zeros(4, 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hi overlaps lo"):
        compensated_addmm_(pair[:, :6], pair[:, 3:9], a, b)
    with pytest.raises(ValueError, match="overlaps a"):
        compensated_addmm_(a[:, :6], lo, a, b)
    with pytest.raises(ValueError, match="epilogue_split"):
        compensated_addmm_(hi, lo, a, b, config=GemmConfig(32, 32, 16, epilogue_split=4))


def test_empty_k_leaves_the_pair_as_it_was():
    hi = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    lo = torch.tensor([[2.0**-9, 2.0**-8]], dtype=torch.bfloat16)  # lo = half an ulp of hi: a fold would move hi
    before = hi.clone(), lo.clone()
    compensated_addmm_(hi, lo, torch.zeros(1, 0, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.bfloat16))
    assert torch.equal(hi, before[0]) and torch.equal(lo, before[1])


@interpreted
def test_benchmark_runs_on_cpu(capsys):
    from benchmarks.compensated_gemm import main

    assert main(["--device", "cpu", "--quick", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    for label in ("cuBLAS addmm → fp32", "addmm → bf16", "compensated", "best per shape"):
        assert label in printed


# Compiles the kernel for an H100 (sm_90) in a process without TRITON_INTERPRET (the interpreter accepts code
# that the compiler rejects, such as returns of different types) and prints, per launch shape of the default
# table, the registers, spilled stack bytes and Hopper tensor-core (wgmma) instructions of the result (the
# benchmark's other sweep shapes compile on the GPU when it runs).
_COMPILE_FOR_SM90 = r"""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from hf_fused.ops.backends import compensated as C

names = ["A", "B", "HI", "LO", "HI_ROWS", "M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
         "stride_hm", "stride_hn", "stride_lm", "stride_ln"]
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for cfg in (C.LARGE, C.MEDIUM, C.SMALL):
    for layout in ("a row-major", "a transposed") if cfg == C.LARGE else ("a row-major",):
        dtype = "bf16"
        unit = {"stride_ak": 1} if layout == "a row-major" else {"stride_am": 1}
        # The transposed layout also compiles the masked-K loop (EVEN_K off).
        consts = dict(unit, stride_bn=1, stride_hn=1, stride_ln=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=layout == "a row-major", WIDEN_DOT=False,
                      EPILOGUE_SPLIT=cfg.epilogue_split, GATHER_HI=False)
        sig = {n: ("constexpr" if n in consts else ("*bf16" if i < 4 else "*i64" if n == "HI_ROWS" else "i32"))
               for i, n in enumerate(names)}
        sig.update({n: "constexpr" for n in consts})
        # What a launch specializes for the lean loop's tensors: 16-aligned pointers and strides, any row count M.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and n != "M"}
        src = triton.compiler.ASTSource(fn=C._compensated_addmm_kernel, signature=sig, constexprs=consts, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        wgmma = len(re.findall(r"wgmma.mma_async", kernel.asm["ptx"]))
        print(cfg.name, dtype, layout, regs, stack, wgmma, flush=True)
"""


def test_kernel_compiles_for_h100_without_spills():
    triton = pytest.importorskip("triton")
    import subprocess
    import sys

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled CUDA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns when unset)
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.rsplit(" ", 3) for line in out.stdout.splitlines()]
    assert len(rows) == 4
    for name, regs, stack, wgmma in rows:
        assert int(wgmma) > 0, name  # the product runs on Hopper tensor cores
        # A spill moves registers through local memory on every epilogue; the table's epilogue_split is chosen
        # so that none happens (module comment in compensated.py lists the measured counts).
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
    hi_c, lo_c = torch.zeros(40, 48, dtype=torch.bfloat16), torch.zeros(40, 48, dtype=torch.bfloat16)
    rows = torch.randperm(70, generator=torch.Generator().manual_seed(6))[:40].sort().values
    hi_g = torch.full((70, 48), 3.0, dtype=torch.bfloat16)
    hi_g[rows] = 0
    lo_g = torch.zeros(40, 48, dtype=torch.bfloat16)
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
