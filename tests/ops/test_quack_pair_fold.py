"""The compensated pair's fold in QuACK's matmul epilogue
(hf_fused.ops.backends.triton_cublas.quack_bridge.pair_addmm_): which folds take it (the one pass's ``"pair"`` weight
gradient; the two passes' hidden-state gradient, compact where rows are ignored and moved at the end), that they give
the Triton fold's results (CPU: a stand-in with the Triton fold's own arithmetic in PyTorch, under Triton's
interpreter), a launch that fails, and the real kernel on a Hopper GPU with QuACK: the Triton fold's bits where the
product is exact in any order, and the fold's arithmetic, bit for bit, on QuACK's own fp32 product."""

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy  # noqa: E402
from hf_fused.ops.backends.triton_cublas import quack_bridge  # noqa: E402
from hf_fused.ops.backends.triton_cublas.compensated import RESIDUAL_DTYPE, compensated_addmm_  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402
from hf_fused.ops.backends.triton_cublas.plan import forced_plans  # noqa: E402
from hf_fused.ops.backends.triton_cublas.two_passes import move_compact_rows_  # noqa: E402
from hf_fused.ops.backends.triton_cublas.two_pass_rule import LeanPlan  # noqa: E402
from quack_stand_in import StandIn, assert_turned_off_once, trained_head_inputs, without_quack  # noqa: E402


def reference_fold(hi: torch.Tensor, lo: torch.Tensor, acc: torch.Tensor) -> None:
    """The fold of ``compensated._fold`` in PyTorch's fp32 operations, in place: ``t = (h + lo·step·binade(h)) +
    acc``, ``hi ← bf16(t)``, ``lo ← rint((t − hi)·16256·2^(128 − E))`` clamped to ±127, 0 where ``hi`` is not finite
    (``E``: hi's biased exponent clamped to [1, 254]; ``binade = 2^(E − 127)``)."""

    def binade(x):
        return (x.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(2.0**-126, 2.0**127)

    h = hi.float()
    low = (lo.float() * torch.tensor(2.0**-7 / 254, dtype=torch.float32, device=hi.device)) * binade(h)
    t = (h + low) + acc
    hi.copy_(t.bfloat16())
    h = hi.float()
    scale = (0x7F800000 - binade(h).view(torch.int32)).view(torch.float32)
    q = torch.round((t - h) * scale * 16256.0).clamp(-127, 127)
    lo.copy_(torch.where(h.isfinite(), q, 0.0).to(RESIDUAL_DTYPE))


class PairStandIn(StandIn):
    """The stand-in with the fold: the product in fp32 (a @ b of the fp32 operands), then :func:`reference_fold`."""

    def pair_addmm(self, a, b, hi, lo):
        self.calls.append("pair_addmm")
        reference_fold(hi, lo, a.float() @ b.float())


@pytest.fixture
def quack(monkeypatch):
    stand_in = PairStandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": stand_in})
    monkeypatch.setattr(quack_bridge, "runs_pair_fold", lambda hi, lo, a, b: a.dtype == torch.bfloat16)
    monkeypatch.setattr(quack_bridge, "folds_pairs", lambda device: True)
    monkeypatch.setattr(quack_bridge, "runs_matmul_f32", lambda out, a, b: False)
    return stand_in


def _cross_entropy(hidden, weight, labels, budget=None):
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    loss = linear_cross_entropy(h, w, labels, backend="triton", tile_budget_bytes=budget)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _ulps_apart(x: torch.Tensor, y: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place (same-sign values)."""
    return int((x.view(torch.int16).int() - y.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("case", ["one_pass", "two_passes"])
def test_pair_folds_take_quacks_matmul(quack, monkeypatch, case):
    """The one pass's ``"pair"`` weight gradient over its 16-row tiles, and the two passes' hidden-state gradient over
    the vocabulary chunks where every label is kept, fold through QuACK's matmul; the gradients are the Triton fold's
    (a process without QuACK) to within one bf16 step where the fp32 products' order differs (the interpreter's dot
    and PyTorch's matmul sum in different orders), the loss the same."""
    hidden, weight, labels = trained_head_inputs(3, 40, 64, 2176 if case == "two_passes" else 256,
                                                 requires_grad=False)
    if case == "two_passes":
        labels = labels.clamp_min(0)  # every row kept: hi is the whole gradient, no gathered rows
    plans = {"one_pass": dict(one_pass=OnePassPlan(16, "pair", 0)),
             "two_passes": dict(one_pass=False, two_pass=LeanPlan(16, 1024, False, 0))}[case]

    def run():
        with forced_plans(**plans):
            return _cross_entropy(hidden, weight, labels, 2**17 if case == "two_passes" else None)

    got = run()
    assert quack.calls.count("pair_addmm") >= 3, quack.calls
    plain = without_quack(monkeypatch, run)
    assert torch.equal(got[0], plain[0])
    grad = {"one_pass": 2, "two_passes": 1}[case]  # the pair's gradient: the weight's, or the hidden states'
    assert _ulps_apart(got[grad], plain[grad]) <= 1
    assert (got[grad] != plain[grad]).float().mean() < 0.02


def test_gathered_rows_fold_compact_and_move_at_the_end(quack, monkeypatch):
    """The two passes' pair over the kept rows of a gradient with ignored rows: QuACK's tile loads cannot gather rows,
    so the kept rows' sums fold compact in hi's first rows and move where they belong at the end; the gradient is the
    gathering Triton fold's (a process without QuACK) to within one bf16 step, the ignored rows 0."""
    hidden, weight, labels = trained_head_inputs(4, 40, 64, 2176, requires_grad=False)
    assert (labels < 0).any()

    def run():
        with forced_plans(one_pass=False, two_pass=LeanPlan(16, 1024, False, 0)):
            return _cross_entropy(hidden, weight, labels, 2**17)

    got = run()
    assert quack.calls.count("pair_addmm") >= 3, quack.calls
    plain = without_quack(monkeypatch, run)
    assert torch.equal(got[0], plain[0])
    assert (got[1][labels < 0] == 0).all()
    assert _ulps_apart(got[1], plain[1]) <= 1 and (got[1] != plain[1]).float().mean() < 0.02


@pytest.mark.parametrize("n, m", [(50, 37), (64, 63), (9, 0), (100, 3), (10, 1), (8, 8)])
def test_compact_rows_move_where_they_belong(n, m):
    """:func:`~hf_fused.ops.backends.triton_cublas.two_passes.move_compact_rows_`: row i to row ``rows[i]`` in
    place, the other rows zeroed, bit for bit a scatter into zeros, through blocks of the residual's bytes (one
    allocated row where they hold none)."""
    g = torch.Generator().manual_seed(n + m)
    rows = torch.randperm(n, generator=g)[:m].sort().values
    out = torch.randn(n, 16, generator=g).bfloat16()
    expected = torch.zeros_like(out).index_copy_(0, rows, out[:m].clone())
    move_compact_rows_(out, rows, torch.zeros(m, 16, dtype=RESIDUAL_DTYPE))
    assert torch.equal(out, expected)


def test_it_is_turned_off_by_its_switch(quack, monkeypatch):
    """``quack_bridge.PAIR_FOLD = False``: the Triton fold for every pair."""
    monkeypatch.setattr(quack_bridge, "PAIR_FOLD", False)
    hidden, weight, labels = trained_head_inputs(5, 40, 32, 256, requires_grad=False)
    with forced_plans(one_pass=OnePassPlan(16, "pair", 0)):
        _cross_entropy(hidden, weight, labels)
    assert "pair_addmm" not in quack.calls


def test_which_operands_it_takes():
    """A contiguous bf16 ``hi`` and int8 ``lo`` of the product's shape, bf16 operands its TMA reads, on a GPU of
    compute capability 9.x: never CPU tensors."""
    a, b = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    hi, lo = torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=RESIDUAL_DTYPE)
    assert not quack_bridge.runs_pair_fold(hi, lo, a, b)  # CPU


def test_a_launch_that_fails_falls_back_with_one_warning(monkeypatch):
    """A fold that raises turns QuACK off for the process (one warning); the call goes on with the Triton fold, bit
    for bit a process without QuACK."""
    monkeypatch.setattr(quack_bridge, "runs_pair_fold", lambda hi, lo, a, b: a.dtype == torch.bfloat16)
    monkeypatch.setattr(quack_bridge, "runs_matmul_f32", lambda out, a, b: False)
    hidden, weight, labels = trained_head_inputs(6, 40, 32, 256, requires_grad=False)

    def run():
        with forced_plans(one_pass=OnePassPlan(16, "pair", 0)):
            return _cross_entropy(hidden, weight, labels)

    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    plain = run()
    assert_turned_off_once(monkeypatch, "pair_addmm", run, plain)


# -- the kernel on a Hopper GPU ---------------------------------------------------------------------------------


def _quack_on_gpu():
    pytest.importorskip("quack")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("QuACK's SM90 matmul needs a GPU of compute capability 9.x")
    module = quack_bridge.load()
    assert module is not None, f"QuACK did not load: {quack_bridge.last_error()}"
    return module


def _exact_products(x: torch.Tensor, n: int = 16):
    """``a [len(x), 8]`` and ``b [8, n]`` bf16 whose product's column 0 is the fp32 ``x`` exactly in any summation
    order (three truncated bf16 pieces of x against weights 1, zero columns), its other columns 0."""
    pieces, rest = [], x.clone()
    for _ in range(3):
        pieces.append((rest.view(torch.int32) & -65536).view(torch.float32))
        rest = rest - pieces[-1]
    a = torch.zeros(len(x), 8, dtype=torch.bfloat16, device=x.device)
    a[:, :3] = torch.stack(pieces, dim=1).bfloat16()
    b = torch.zeros(8, n, dtype=torch.bfloat16, device=x.device)
    b[:3, 0] = 1
    return a, b


@pytest.mark.gpu
def test_fold_on_gpu_is_the_triton_folds_bit_for_bit():
    """Sums across bf16's range (random significands in the binades from 2⁻¹⁰⁰, whose bf16 pieces are all normal;
    bf16 ties, residual ties at ±¼ ulp, values rounding to bf16's largest and past it to inf), folded into a zero
    pair and then twice more into the pair they left (residuals decoded): QuACK's fold and the Triton fold give the same ``hi`` and ``lo`` bits, NaN and inf
    included (the products are exact, so both folds see the same fp32 sums)."""
    quack = _quack_on_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    m = 8192
    sig = 1 + torch.rand(m, generator=g, device="cuda", dtype=torch.float64)
    x = torch.ldexp(sig, torch.randint(-100, 127, (m,), generator=g, device="cuda"))
    ulp = torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)
    x[:512] = x[:512].bfloat16().double() + ulp[:512] / 2  # bf16 ties
    x[512:1024] = x[512:1024].bfloat16().double() + ulp[512:1024] / 4  # residual ties
    top = (2 - 2.0**-7) * 2.0**127
    x[1024:1032] = torch.tensor([top, top + 2.0**119, 3.4e38, -3.4e38, 0.0, -0.0, 1.0, -1.0], dtype=torch.float64)
    x = (x * torch.where(torch.rand(m, generator=g, device="cuda") < 0.5, -1.0, 1.0)).float()
    a, b = _exact_products(x)
    pairs = []
    for fold in (lambda hi, lo: quack.pair_addmm(a, b, hi, lo), lambda hi, lo: compensated_addmm_(hi, lo, a, b)):
        hi = torch.zeros(m, b.shape[1], dtype=torch.bfloat16, device="cuda")
        lo = torch.zeros(m, b.shape[1], dtype=RESIDUAL_DTYPE, device="cuda")
        for _ in range(3):  # the second and third from the stored pair: its residual decoded
            fold(hi, lo)
        pairs.append((hi, lo))
    (hi_q, lo_q), (hi_t, lo_t) = pairs
    assert torch.equal(hi_q.view(torch.int16), hi_t.view(torch.int16))
    assert torch.equal(lo_q, lo_t)
    assert hi_t[:, 0].isinf().any() and (lo_t[:, 0] != 0).float().mean() > 0.5  # the spectrum reached both


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, transposed", [(19200, 2048, 2048, True), (8448, 10112, 2048, False),
                                                 (4096, 2048, 4096, True)])
def test_fold_on_gpu_is_its_arithmetic_on_quacks_product(m, k, n, transposed):
    """At the one pass's ``dW`` shapes (``a = dzᵀ``, ping-pong) and the two passes' ``dh`` (cooperative), folded twice
    into a pair: bit for bit :func:`reference_fold` of QuACK's own fp32 product (``matmul_f32``, launched alike: the
    same sums in the same order), and within the pair's bound of float64's sum."""
    quack = _quack_on_gpu()
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(k, m, device="cuda", generator=g).bfloat16().t() if transposed else \
        torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(k, n, device="cuda", generator=g) * 1e-3).bfloat16()
    hi = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    lo = torch.zeros(m, n, dtype=RESIDUAL_DTYPE, device="cuda")
    hi_ref, lo_ref = hi.clone(), lo.clone()
    acc = torch.empty(m, n, device="cuda")
    quack.matmul_f32(a, b, acc, accumulate=False)
    for _ in range(2):
        quack.pair_addmm(a, b, hi, lo)
        reference_fold(hi_ref, lo_ref, acc)
    assert torch.equal(hi.view(torch.int16), hi_ref.view(torch.int16))
    assert torch.equal(lo, lo_ref)
    exact = 2 * (a.double() @ b.double())
    value = hi.double() + lo.double() * torch.ldexp(torch.ones_like(exact), torch.frexp(hi.double())[1] - 8) / 254
    err = ((value - exact).norm() / exact.norm()).item()
    eager = ((torch.mm(a, b, out_dtype=torch.float32) * 2).bfloat16().double() - exact).norm() / exact.norm()
    assert err < eager.item()
