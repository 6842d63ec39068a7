"""The gradient pass's logits matmul with ``dz`` in its epilogue (``backends/triton_cublas/logits_epilogues.py``).

On CPU the kernel runs under Triton's interpreter inside ``logits_epilogues.forced(True)`` (it is a Hopper
kernel: by default it runs only on sm_90+ GPUs); the ``gpu`` test compares it with cuBLAS's tiles on the GPU.
"""

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402
from hf_fused.ops.backends.triton_cublas import logits_epilogues as L  # noqa: E402
from hf_fused.ops.backends.triton_cublas import triton_kernels as TK  # noqa: E402
from hf_fused.ops.backends.triton_cublas.tiles import kernel_scalars  # noqa: E402
from hf_fused.ops.logit_transform import LogitTransform  # noqa: E402

from references import KERNEL_TRANSFORMS as TRANSFORMS  # noqa: E402
from references import apply_transform as _transform, check_triton_matches_float64 as _check  # noqa: E402


def _counted(monkeypatch):
    calls = []
    original = L.logits_grad_
    monkeypatch.setattr(L, "logits_grad_", lambda *a, **k: (calls.append(a[0].shape), original(*a, **k))[1])
    return calls


@pytest.mark.parametrize("kw", [TRANSFORMS[0], TRANSFORMS[3]], ids=["plain", "softcap-temperature"])
@pytest.mark.parametrize("budget", [300 * 4 * 10, 2048 * 4 * 8], ids=["row-blocks", "vocab-chunks-and-row-blocks"])
def test_two_passes_with_the_fused_gradient_match_float64(monkeypatch, kw, budget):
    """The two passes with ``dz`` from the matmul's epilogue: cross-entropy and log-probs + entropy, their loss and
    every gradient (hidden, weight, bias) against float64, at the tolerance of the cuBLAS-tile path's test."""
    calls = _counted(monkeypatch)
    v = 300 if budget == 300 * 4 * 10 else 3500  # 3500: two vocabulary chunks (2560 and 940 columns) of 5-6 rows
    with L.forced(True):
        _check("cpu", torch.float32, n=29, h=16, v=v, kw=kw, bias=True, budget=budget, tol=1e-5)
    assert calls, "the fused gradient kernel did not run"


@pytest.mark.parametrize("kw", TRANSFORMS, ids=["plain", "softcap", "scale-temperature", "softcap-temperature"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("grads", ["logprobs", "logprobs+entropy"])
def test_dz_equals_the_gradient_kernel_on_a_stored_tile_bit_for_bit(kw, bias, grads):
    """With integer-valued bf16 operands every fp32 sum is exact in any order, so torch's bf16 tile (the fp32 sum
    rounded once) and the kernel's rounded accumulator hold the same logits — many of them above 256, where bf16
    rounds integers, so the epilogue's rounding is exercised: ``dz`` must then equal ``grad_kernel``'s bit for bit,
    ragged rows and columns (70 × 600 against 128 × 256 tiles) and a column offset included."""
    gen = torch.Generator().manual_seed(0)
    m, n, k, v0 = 70, 600, 128, 1000
    h = torch.randint(-7, 8, (m, k), generator=gen).to(torch.bfloat16)
    w = torch.randint(-7, 8, (n, k), generator=gen).to(torch.bfloat16)
    b = torch.randn(v0 + n, generator=gen).to(torch.bfloat16) if bias else None
    labels = torch.randint(v0 - 50, v0 + n + 50, (m,), generator=gen)  # some outside these columns
    tile = torch.mm(h, w.t())
    assert (tile.float().abs() > 256).float().mean() > 0.2
    z = _transform(tile.float() + (b[v0:].float() if bias else 0), kw)
    lse = torch.logsumexp(z, dim=1) + torch.rand(m, generator=gen)  # p up to ~1 at each row's largest logits
    ent = torch.rand(m, generator=gen) * 5
    g_lp, g_ent = torch.randn(m, generator=gen), torch.randn(m, generator=gen)
    has_g_ent = grads == "logprobs+entropy"
    if not has_g_ent:
        g_ent = torch.zeros(m)
    transform = LogitTransform(**kw)
    scalars = kernel_scalars(transform, b)
    TK.grad_kernel[(m,)](tile, tile.stride(0), tile, tile.stride(0), n, v0, b if bias else lse, labels, lse, ent, g_lp,
                         g_ent, lse, HAS_G_LP=True, HAS_G_ENT=has_g_ent, SUM_PZ=False, BLOCK_V=256, num_warps=4,
                         **scalars)
    dz = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    with L.forced(True):
        assert L.applies(h, w, dz)
        L.logits_grad_(h, w, dz, labels, lse, ent, g_lp, g_ent, has_g_lp=True, has_g_ent=has_g_ent, col_offset=v0,
                       bias=b, scalars=scalars)
    assert torch.equal(dz.view(torch.int16), tile.view(torch.int16))


def test_applies_only_where_it_can_run():
    h, w = torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(300, 16, dtype=torch.bfloat16)
    tile = torch.empty(64, 300, dtype=torch.bfloat16)
    assert not L.applies(h, w, tile)  # a CPU tensor outside a forced block: the cuBLAS path
    with L.forced(True):
        assert L.applies(h, w, tile)
        assert L.applies(h.float(), w.float(), tile.float())  # fp32 under the interpreter (tests)
        assert not L.applies(h.half(), w.half(), tile.half())
        assert not L.applies(h.float(), w, tile)  # mixed dtypes
        assert not L.applies(h.t().contiguous().t(), w, tile)  # column-major hidden rows
        assert not L.applies(torch.zeros(64, 15, dtype=torch.bfloat16), torch.zeros(300, 15, dtype=torch.bfloat16),
                             tile)  # 30-byte rows: no TMA descriptor
    with L.forced(False):
        assert not L.applies(h, w, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [256 * 2**20, 64 * 2**20])
def test_fused_gradient_on_gpu_matches_cublas_tiles(monkeypatch, budget):
    """bf16 on the GPU, the lean two passes with the fused gradient (on sm_90 with the stored tiles' statistics) against
    cuBLAS's tiles and the gradient kernel: the same loss (the statistics pass is shared) and gradients within a bf16
    step of each other (a logit can round one step apart where the two matmuls' fp32 sums fall on either side of a
    rounding boundary; the gradients' fp32 sums then differ in their last bits). The fp32 statistics (the default on
    sm_90, whose dz is the unrounded accumulator's) are off here: tests/ops/test_fused_matmul.py covers them."""
    monkeypatch.setenv("HF_FUSED_FP32_LOGITS", "0")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fused gradient runs on sm_90 and later")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h_size, v = 4096, 1024, 32000
    hid = torch.randn(n, h_size, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h_size, device="cuda", generator=gen) * 4 / h_size**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    y[::7] = -100
    results = []
    for enabled in (True, False):
        with L.forced(enabled):
            loss = linear_cross_entropy(hid, w, y, tile_budget_bytes=budget)
            lp, ent = linear_logprobs(hid, w, y, return_entropy=True, tile_budget_bytes=budget)
            grads = torch.autograd.grad(loss + (lp * 0.3).sum() + (ent * 0.1).sum(), (hid, w))
        results.append((loss.detach(), grads))
    (loss_f, grads_f), (loss_c, grads_c) = results
    assert torch.equal(loss_f, loss_c)
    for gf, gc in zip(grads_f, grads_c):
        rel = ((gf.double() - gc.double()).norm() / gc.double().norm()).item()
        assert rel <= 2**-8, rel  # bf16's unit roundoff: a few elements one step apart, nowhere a larger error
