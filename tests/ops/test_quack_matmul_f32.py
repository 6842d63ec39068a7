"""QuACK's fp32-output matmul (hf_fused.ops.backends.triton_cublas.quack_bridge.matmul_f32_) for the GPU backend's
fp32 accumulations of bf16 products: the one pass's weight gradient over its tiles, the two passes' weight-gradient
chunks and hidden-state gradient. Which products take it; that the results are those of the cuBLAS calls it
replaces (CPU: a stand-in with the fallback's own operations under Triton's interpreter, bit for bit); a launch that
fails; and the real kernel on a Hopper GPU with QuACK against cuBLAS and float64."""

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402
from hf_fused.ops.backends.triton_cublas import fp32_logits_rule, quack_bridge  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402
from hf_fused.ops.backends.triton_cublas.plan import forced_plans  # noqa: E402
from hf_fused.ops.backends.triton_cublas.two_pass_rule import LeanPlan  # noqa: E402
from quack_stand_in import (  # noqa: E402
    StandIn, assert_turned_off_once, trained_head_inputs, without_quack as _without_quack,
)


def _inputs(seed=0, n=40, h=64, v=2176):
    """On CPU: 33 kept rows (several row blocks of 16 or 32) and 2176 columns (1024-column chunks, then the halving's
    "gradient" and "tile" ones), small enough for Triton's interpreter; the checks compare bits with bits."""
    return trained_head_inputs(seed, n, h, v, requires_grad=False)


def _cross_entropy(hidden, weight, labels, budget):
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    loss = linear_cross_entropy(h, w, labels, backend="triton", tile_budget_bytes=budget)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _logprobs(hidden, weight, labels, budget):
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    lp, _ = linear_logprobs(h, w, labels, backend="triton", tile_budget_bytes=budget)
    return (lp.detach(), *torch.autograd.grad(lp.sum(), (h, w)))


@pytest.fixture
def quack(monkeypatch):
    """The stand-in as the loaded QuACK, its fp32-output matmul taking CPU operands."""
    stand_in = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": stand_in})
    monkeypatch.setattr(quack_bridge, "runs_matmul_f32", lambda out, a, b: a.dtype == torch.bfloat16)
    return stand_in


@pytest.mark.parametrize("case", ["one_pass", "two_passes", "two_passes_logprobs"])
def test_fp32_accumulations_take_quacks_matmul_bit_for_bit(quack, monkeypatch, case):
    """The one pass's weight gradient (16-row tiles: the first written, the others added), the two passes' weight
    chunks over several row blocks (an explicit budget) and the default two passes' fp32 hidden gradient over the
    vocabulary chunks go to QuACK's matmul; the results are the cuBLAS path's bit for bit (the stand-in does what
    the fallback does)."""
    hidden, weight, labels = _inputs()
    plans = {"one_pass": dict(one_pass=OnePassPlan(16, "fp32", 0)),
             "two_passes": dict(one_pass=False, two_pass=LeanPlan(16, 1024, False, 0)),
             "two_passes_logprobs": dict(one_pass=False, two_pass=LeanPlan(32, 1024, False, 0))}[case]

    def run():
        with forced_plans(**plans):
            if case == "two_passes_logprobs":
                return _logprobs(hidden, weight, labels, None)
            return _cross_entropy(hidden, weight, labels, 2**17 if case == "two_passes" else None)

    got = run()
    assert "matmul_f32" in quack.calls and "matmul_f32+" in quack.calls, quack.calls
    plain = _without_quack(monkeypatch, run)
    for mine, theirs in zip(got, plain):
        assert torch.equal(mine, theirs)


def test_it_is_turned_off_by_its_switch(quack, monkeypatch):
    """``quack_bridge.MATMUL_F32 = False``: cuBLAS for every fp32 accumulation."""
    monkeypatch.setattr(quack_bridge, "MATMUL_F32", False)
    hidden, weight, labels = _inputs(1)
    _cross_entropy(hidden, weight, labels, 2**30)
    assert not any(call.startswith("matmul_f32") for call in quack.calls)


def test_which_operands_it_takes():
    """bf16 operands its TMA reads (``a`` row- or column-major, ``b`` row-major with 16-byte rows), an fp32
    contiguous ``out``, on a GPU of compute capability 9.x: never CPU tensors."""
    a, b, out = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16), torch.zeros(16, 32)
    assert not quack_bridge.runs_matmul_f32(out, a, b)  # CPU


def test_a_launch_that_fails_falls_back_with_one_warning(monkeypatch):
    """A launch that raises turns QuACK off for the process (one warning); the call goes on with cuBLAS, bit for bit
    a process without QuACK."""
    monkeypatch.setattr(quack_bridge, "runs_matmul_f32", lambda out, a, b: a.dtype == torch.bfloat16)
    hidden, weight, labels = _inputs(2)
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    plain = _cross_entropy(hidden, weight, labels, 2**30)
    assert_turned_off_once(monkeypatch, "matmul_f32", lambda: _cross_entropy(hidden, weight, labels, 2**30), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(1000, 1024), (2048, 4096), (3000, 1024), (3000, 4096)])
def test_each_tile_configuration_on_gpu_adds_an_fp32_matmul(k, n):
    """:func:`~hf_fused.ops.backends.triton_cublas.quack_epilogues.matmul_f32` under each of its configurations (the
    ping-pong kernel for a short ``K``, ``192`` or ``128`` rows per tile by ``N``; the cooperative one beyond): written,
    then added to, on a transposed ``a`` as the one pass passes ``dzᵀ``, it is as close to float64's ``2·(a @ b)`` as
    cuBLAS's fp32-output matmul and addmm of the same operands (the same fp32 sums in another order; the tensor
    cores' fp32 accumulation, not IEEE's, sets both errors)."""
    pytest.importorskip("quack")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("QuACK's SM90 matmul needs a GPU of compute capability 9.x")
    quack = quack_bridge.load()
    assert quack is not None, f"QuACK did not load: {quack_bridge.last_error()}"
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(k, 1152, device="cuda", generator=g).to(torch.bfloat16).t()
    b = torch.randn(k, n, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(1152, n, device="cuda")
    quack.matmul_f32(a, b, out, accumulate=False)
    quack.matmul_f32(a, b, out, accumulate=True)
    cublas = torch.mm(a, b, out_dtype=torch.float32)
    torch.addmm(cublas, a, b, out_dtype=torch.float32, out=cublas)
    exact = 2 * (a.double() @ b.double())
    err = lambda t: ((t.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(out) <= 1.5 * err(cublas), (err(out), err(cublas))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one_pass", "one_pass_h4096", "lean", "two_passes_logprobs"])
def test_quacks_matmul_on_gpu_matches_cublas(monkeypatch, case):
    """On a Hopper GPU with QuACK: the one pass's cross-entropy (H 1024 and 4096: both ping-pong tiles), the lean two
    passes' (64 MiB, several row blocks) and the default two passes' log-probs with QuACK's fp32 accumulations against the same calls on cuBLAS
    (``MATMUL_F32`` off): the same loss (its statistics do not depend on them), gradients within 2⁻⁸ of each other in
    norm (the same fp32 sums in another order, then one rounding to bf16) and no further from float64 (1 % of their
    distance)."""
    pytest.importorskip("quack")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("QuACK's SM90 matmul needs a GPU of compute capability 9.x")
    monkeypatch.delenv(fp32_logits_rule.ENV, raising=False)
    hidden, weight, labels = (t.cuda() for t in _inputs(3, n=4096, h=4096 if case == "one_pass_h4096" else 1024,
                                                          v=151936))
    # the lean case in 1024-row blocks of 8192 columns: each chunk's weight gradient added up over four blocks
    plans = dict(one_pass=False, two_pass=LeanPlan(1024, 8192, False, 0)) if case == "lean" else {}

    def run():
        with forced_plans(**plans):
            if case == "two_passes_logprobs":
                return _logprobs(hidden, weight, labels, None)
            return _cross_entropy(hidden, weight, labels, 64 * 2**20 if case == "lean" else None)

    quack = quack_bridge.load()
    assert quack is not None, f"QuACK was turned off in this process: {quack_bridge.last_error()}"
    calls = []
    spy = type("Spy", (), {name: staticmethod(
        (lambda name: lambda *a, **k: (calls.append(name) if name == "matmul_f32" else None) or getattr(quack, name)(
            *a, **k))(name)) for name in ("matmul_f32", "scaled_exp_logits", "softmax_grad", "logits_with_statistics",
                                        "pair_addmm")
    })()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": spy})
    got = run()
    assert calls
    monkeypatch.setattr(quack_bridge, "MATMUL_F32", False)
    plain = run()
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=0)
    h, w = (t.double().requires_grad_() for t in (hidden, weight))
    logp = torch.log_softmax(h @ w.T, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0] * (labels != -100)
    value = logp.sum() if case == "two_passes_logprobs" else -logp.sum() / (labels != -100).sum()
    for mine, theirs, exact in zip(got[1:], plain[1:], torch.autograd.grad(value, (h, w))):
        err = lambda t: ((t.double() - exact).norm() / exact.norm()).item()  # noqa: E731
        assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 2.0**-8
        assert err(mine) <= 1.01 * err(theirs), (err(mine), err(theirs))
