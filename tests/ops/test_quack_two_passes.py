"""QuACK's epilogues in the GPU backend's two passes (the memory-lean path), where the statistics come from the fp32
accumulator: the statistics pass as QuACK's scaled-exp matmul with nothing stored
(hf_fused.ops.backends.triton_cublas.quack_bridge.scaled_exp_row_stats_) and each ``dz`` tile as
``scale·exp(z − lse)`` of the accumulator (quack_bridge.softmax_grad with ``round_logits=False``). Which calls take
them; that the passes turn their outputs into an fp32 head's loss, log-probs, entropy and gradients (CPU: the
PyTorch stand-in under Triton's interpreter, against float64 and against the fused Triton matmul that runs in their
place without QuACK); the row blocks; what happens when a launch fails; and the real kernels on a Hopper GPU with QuACK."""

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402
from hf_fused.ops.backends.triton_cublas import fp32_logits_rule, logits_epilogues, plan, quack_bridge  # noqa: E402
from quack_stand_in import (  # noqa: E402
    assert_turned_off_once, quack_fixture, trained_head_inputs, without_quack as _without_quack,
)

quack = quack_fixture  # the shared fixture "quack", in this module for pytest to find

#: An explicit budget small enough for the two passes at these sizes (several row blocks and vocabulary chunks).
LEAN = 2**17


def _inputs(seed=0, n=72, h=64, v=4352):
    return trained_head_inputs(seed, n, h, v)


def _small_inputs(seed):
    """Fewer rows and half the vocabulary of :func:`_inputs`, still two passes of two gradient tiles under ``LEAN``: for
    the tests that compare which launches ran, or bits with bits, where the size of the sums does not matter (the
    interpreter's time grows with it)."""
    return _inputs(seed, n=40, v=2176)


def _float64(hidden, weight, labels, upstream, entropy_weight=0.0, temperature=1.0):
    """``Σ upstream·logp + entropy_weight·Σ entropy`` over the kept rows in float64 from the bf16 operands (the
    logits divided by ``temperature``): ``(logp, entropy, dX, dW)``."""
    h, w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logp_all = torch.log_softmax(h @ w.T / temperature, -1)
    kept = labels != -100
    logp = logp_all.gather(1, labels.clamp_min(0)[:, None])[:, 0] * kept
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    value = (upstream.double() * logp).sum() + entropy_weight * (entropy * kept).sum()
    return (logp.detach(), entropy.detach(), *torch.autograd.grad(value, (h, w)))


def _error(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def _logprobs_pass(hidden, weight, labels, upstream, entropy_weight=0.0, budget=LEAN, temperature=1.0):
    """Log-probs with the entropy, no hint, under an explicit budget (the two passes); the gradient of
    ``Σ upstream·logp (+ entropy_weight·Σ entropy)``: ``(logp, entropy, dX, dW)``."""
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    lp, ent = linear_logprobs(h, w, labels, return_entropy=True, backend="triton", tile_budget_bytes=budget,
                              temperature=temperature)
    loss = (lp * upstream).sum()
    if entropy_weight:
        loss = loss + entropy_weight * (ent * (labels != -100)).sum()
    return (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (h, w)))


def test_the_statistics_pass_is_asked_for_by_default_on_cuda_only(monkeypatch):
    """``"two_passes_quack"``: on by default on a CUDA device, off on CPU and under ``HF_FUSED_FP32_LOGITS=0``."""
    monkeypatch.delenv(fp32_logits_rule.ENV, raising=False)
    assert fp32_logits_rule.enabled("two_passes_quack", torch.device("cuda"))
    assert not fp32_logits_rule.enabled("two_passes_quack", torch.device("cpu"))
    monkeypatch.setenv(fp32_logits_rule.ENV, "0")
    assert not fp32_logits_rule.enabled("two_passes_quack", torch.device("cuda"))


@pytest.mark.parametrize("entropy_gradient", [False, True])
def test_logprobs_two_passes_take_quacks_epilogues(quack, monkeypatch, entropy_gradient):
    """Log-probs with the entropy in the two passes: the statistics from the scaled-exp partials with nothing
    stored, ``dz`` from QuACK's epilogue of the accumulator where the gradient reaches the log-probs alone (an
    entropy gradient keeps the Triton epilogue). Log-probs and entropy within 1e-5 nats of float64, as close as the
    fused matmul's (the same fp32 accumulator, summed in another order); gradients no further from float64 than the
    fused matmul's."""
    hidden, weight, labels = _inputs()
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(labels.shape, generator=g) * (labels != -100)
    weight_ent = 0.5 if entropy_gradient else 0.0
    got = _logprobs_pass(hidden, weight, labels, upstream, weight_ent)
    assert set(quack.calls) == {"scaled+entropy stats"} | (set() if entropy_gradient else {"grad_fp32"})
    fused = _without_quack(monkeypatch, lambda: _logprobs_pass(hidden, weight, labels, upstream, weight_ent))
    logp, entropy, *grads = _float64(hidden, weight, labels, upstream, weight_ent)
    kept = labels != -100
    assert (got[0].double() - logp)[kept].abs().max() < 1e-5
    assert (got[1].double() - entropy)[kept].abs().max() < 1e-5
    for mine, theirs, exact in zip(got[:2], fused[:2], (logp, entropy)):  # fp32 sums over 4352 columns, either order
        rms = lambda t: (t.double() - exact)[kept].pow(2).mean().sqrt().item()  # noqa: E731
        assert rms(mine) <= 1.5 * rms(theirs), (rms(mine), rms(theirs))
    for mine, theirs, exact in zip(got[2:], fused[2:], grads):
        # The interpreter's fp32 → bf16 store truncates the Triton epilogue's dz where the stand-in rounds to nearest:
        # no worse than the kernel's (the GPU test below compares the real kernels).
        assert _error(mine, exact) <= 1.02 * _error(theirs, exact) + 1e-6, (_error(mine, exact), _error(theirs, exact))


def test_a_temperature_takes_the_scaled_epilogues(quack, monkeypatch):
    """A sampling temperature: the statistics pass on the scaled-exp matmul of ``acc / T`` and each ``dz`` from
    QuACK's epilogue of ``acc / T`` (the chain factor 1/T in its per-row factor); log-probs and entropy within 1e-5
    nats of float64 and as close as the fused matmul's, gradients no further."""
    hidden, weight, labels = _inputs(6)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(7)) * (labels != -100)
    got = _logprobs_pass(hidden, weight, labels, upstream, temperature=0.7)
    assert quack.calls[0] == "scaled+entropy stats" and set(quack.calls) == {"scaled+entropy stats", "grad_fp32"}
    fused = _without_quack(monkeypatch, lambda: _logprobs_pass(hidden, weight, labels, upstream, temperature=0.7))
    logp, entropy, *grads = _float64(hidden, weight, labels, upstream, temperature=0.7)
    kept = labels != -100
    for mine, theirs, exact in zip(got[:2], fused[:2], (logp, entropy)):
        rms = lambda t: (t.double() - exact)[kept].pow(2).mean().sqrt().item()  # noqa: E731
        assert (mine.double() - exact)[kept].abs().max() < 1e-5
        assert rms(mine) <= 1.5 * rms(theirs), (rms(mine), rms(theirs))
    for mine, theirs, exact in zip(got[2:], fused[2:], grads):
        assert _error(mine, exact) <= 1.02 * _error(theirs, exact) + 1e-6, (_error(mine, exact), _error(theirs, exact))


def test_cross_entropy_two_passes_take_quacks_epilogues(quack, monkeypatch):
    """The cross-entropy under an explicit budget (the two passes): the statistics from the scaled-exp partials
    (no entropy asked), ``dz`` from QuACK's epilogue of the accumulator; the loss float64's to fp32 rounding,
    gradients no further from float64 than the fused matmul's."""
    hidden, weight, labels = _inputs(2)

    def run():
        h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
        loss = linear_cross_entropy(h, w, labels, backend="triton", tile_budget_bytes=LEAN)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

    got = run()
    assert "scaled stats" in quack.calls and "grad_fp32" in quack.calls
    assert set(quack.calls) == {"scaled stats", "grad_fp32"}
    fused = _without_quack(monkeypatch, run)
    kept = labels != -100
    logp, _, *grads = _float64(hidden, weight, labels, -kept.double() / kept.sum())
    exact_loss = -logp.sum() / kept.sum()
    assert abs(got[0].double() - exact_loss).item() / exact_loss.item() < 1e-6
    for mine, theirs, exact in zip(got[1:], fused[1:], grads):
        assert _error(mine, exact) <= 1.02 * _error(theirs, exact) + 1e-6, (_error(mine, exact), _error(theirs, exact))


def test_row_blocks_keep_quacks_operands_aligned(quack, monkeypatch):
    """Several row blocks, each a multiple of 8 rows but the last (its label slice 16-byte aligned, as QuACK's TMA
    needs), every one through the scaled-exp matmul."""
    hidden, weight, labels = _inputs(3, n=100)
    monkeypatch.setattr(quack_bridge, "scaled_exp_row_bytes", lambda head: 1)  # as on a Hopper GPU with QuACK
    monkeypatch.setattr(quack_bridge, "statistics_row_bytes", lambda v, tile_n, entropy: LEAN // 21)  # 21 rows
    rows = []
    launch = quack.scaled_exp_logits
    monkeypatch.setattr(quack, "scaled_exp_logits", lambda h, *a, **k: rows.append(h.shape[0]) or launch(h, *a, **k))
    _logprobs_pass(hidden, weight, labels, torch.ones(labels.shape))
    kept = int((labels != -100).sum())
    assert len(rows) > 2 and sum(rows) == kept
    assert all(r % plan.STATISTICS_ROW_QUANTUM == 0 for r in rows[:-1])


def test_the_plan_counts_quacks_partials(monkeypatch):
    """Where QuACK may take the statistics pass and its partials hold more than the fused matmul's, the row blocks
    are planned at QuACK's bytes per row."""
    from hf_fused.ops.head_inputs import HeadInputs
    from hf_fused.ops.logit_transform import LogitTransform

    n, h, v = 4096, 64, 4352
    head = HeadInputs(torch.zeros(n, h, dtype=torch.bfloat16), torch.zeros(v, h, dtype=torch.bfloat16), None,
                      torch.zeros(n, dtype=torch.long), torch.arange(n), LogitTransform(), 2**20)
    plain = plan.plan_fp32_statistics_pass(head, 3, True)
    monkeypatch.setattr(quack_bridge, "scaled_exp_row_bytes", lambda head: 1)  # as on a Hopper GPU with QuACK
    monkeypatch.setattr(quack_bridge, "statistics_row_bytes", lambda v, tile_n, entropy: 10 * 2**10)
    with_quack = plan.plan_fp32_statistics_pass(head, 3, True)
    assert with_quack.block_rows == 2**20 // (10 * 2**10) // 8 * 8 < plain.block_rows
    assert with_quack.bytes <= 2**20


def test_the_plan_says_where_quack_takes_the_two_passes(quack, monkeypatch):
    """describe_plan's line for the two passes names QuACK's epilogues where a call would take them, the fused
    matmul's accumulator where the fp32 statistics are asked without QuACK, nothing with them off."""
    w = torch.zeros(4352, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(quack_bridge, "scaled_exp_row_bytes", lambda head: 16 * 17)  # as on a Hopper GPU
    line = plan.describe(w, n_rows=4096, tile_budget_bytes=LEAN)
    assert line.startswith("two passes") and line.endswith(
        "; log-prob statistics from the fp32 accumulator of QuACK's matmul epilogues")
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    assert plan.describe(w, n_rows=4096, tile_budget_bytes=LEAN).endswith(
        "; log-prob statistics from the matmul's fp32 accumulator")
    with fp32_logits_rule.forced(False):
        assert "statistics from" not in plan.describe(w, n_rows=4096, tile_budget_bytes=LEAN)


def test_a_statistics_launch_that_fails_falls_back_with_one_warning(quack, monkeypatch):
    """A scaled-exp launch that raises turns QuACK off for the process (one warning) and the pass goes on with the
    fused matmul: the results are those of a process without QuACK, bit for bit."""
    hidden, weight, labels = _small_inputs(4)
    upstream = torch.ones(labels.shape)
    plain = _without_quack(monkeypatch, lambda: _logprobs_pass(hidden, weight, labels, upstream))
    assert_turned_off_once(monkeypatch, "scaled_exp_logits",
                           lambda: _logprobs_pass(hidden, weight, labels, upstream), plain)


def test_without_fp32_statistics_nothing_changes(quack):
    """With the fp32 statistics off, the statistics pass reads cuBLAS's bf16 tiles as before (no scaled-exp launch;
    ``dz`` of the bf16 logits where QuACK takes it: raw logits only, a temperature keeps the Triton kernels)."""
    hidden, weight, labels = _small_inputs(5)
    with fp32_logits_rule.forced(False), logits_epilogues.forced(True):  # the bf16 dz epilogues as on a Hopper GPU
        _logprobs_pass(hidden, weight, labels, torch.ones(labels.shape))
        assert not any(call.endswith("stats") or call == "grad_fp32" for call in quack.calls)
        assert "grad" in quack.calls
        quack.calls.clear()
        _logprobs_pass(hidden, weight, labels, torch.ones(labels.shape), temperature=0.7)
    assert quack.calls == []


def _hopper(n, h, v, seed=0):
    pytest.importorskip("quack")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("QuACK's SM90 matmul needs a GPU of compute capability 9.x")
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).cuda().bfloat16()
    weight = (torch.randn(v, h, generator=g) * 4 / h**0.5).cuda().bfloat16()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::10] = -100
    return hidden, weight, labels, g


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["logprobs", "logprobs_entropy_gradient", "cross_entropy", "logprobs_temperature"])
def test_two_passes_on_gpu_match_the_fused_matmul(monkeypatch, case):
    """On a Hopper GPU with QuACK, at a 64 MiB budget: the two passes on QuACK's epilogues against the same passes
    on the fused Triton matmul (QuACK off): log-probs and entropy within 1e-4/T nats of float64 (a temperature T
    divides the logits and their accumulation error) and as close as the fused matmul's (fp32 summation order),
    gradients within 2⁻⁸ of each other in norm and as close to float64 (both round ``dz`` once from the accumulator;
    the accumulators differ in summation order)."""
    monkeypatch.delenv(fp32_logits_rule.ENV, raising=False)
    hidden, weight, labels, g = _hopper(4096, 1024, 151936)
    kept = labels != -100
    upstream = torch.randn(labels.shape, generator=g).cuda() * kept
    weight_ent = 0.5 if case == "logprobs_entropy_gradient" else 0.0
    temperature = 0.7 if case == "logprobs_temperature" else 1.0
    budget = 64 * 2**20

    def run():
        if case == "cross_entropy":
            h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
            loss = linear_cross_entropy(h, w, labels, backend="triton", tile_budget_bytes=budget)
            return (loss.detach(), *torch.autograd.grad(loss, (h, w)))
        return _logprobs_pass(hidden, weight, labels, upstream, weight_ent, budget, temperature)

    quack_module = quack_bridge.load()
    assert quack_module is not None, f"QuACK was turned off in this process: {quack_bridge.last_error()}"
    calls = []

    def spy(name):
        return staticmethod(lambda *a, **k: calls.append(name) or getattr(quack_module, name)(*a, **k))

    spying = type("Spy", (), {name: spy(name) for name in ("scaled_exp_logits", "softmax_grad", "matmul_f32",
                                                            "pair_addmm")})()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": spying})
    got = run()
    assert "scaled_exp_logits" in calls and ("softmax_grad" in calls) is (weight_ent == 0.0)
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    fused = run()
    if case == "cross_entropy":
        upstream = -kept.double() / kept.sum()
    logp, entropy, *grads = _float64(hidden, weight, labels, upstream, weight_ent, temperature)  # on the GPU
    if case == "cross_entropy":
        exact_loss = -logp.sum() / kept.sum()
        assert abs(got[0].double() - exact_loss) / exact_loss < 3e-6  # fp32 accumulation over H = 1024
    else:
        for mine, theirs, exact in zip(got[:2], fused[:2], (logp, entropy)):
            assert (mine.double() - exact)[kept].abs().max() < 1e-4 / temperature
            rms = lambda t: (t.double() - exact)[kept].pow(2).mean().sqrt().item()  # noqa: E731
            assert rms(mine) <= 1.5 * rms(theirs), (rms(mine), rms(theirs))
    n_out = 1 if case == "cross_entropy" else 2
    for mine, theirs, exact in zip(got[n_out:], fused[n_out:], grads):
        assert _error(mine, theirs.double()) <= 2.0**-8, _error(mine, theirs.double())
        assert _error(mine, exact) <= 1.05 * _error(theirs, exact), (_error(mine, exact), _error(theirs, exact))
