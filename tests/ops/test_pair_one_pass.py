"""The GPU one pass with the compensated pair as its weight-gradient accumulator (``accumulator="pair"``).

Where the fp32 ``[V, H]`` accumulator does not fit, a bf16 weight gradient can still take the one pass: the
gradient itself plus an int8 residual (:mod:`hf_fused.ops.backends.triton_cublas.compensated`), folded after every
tile and scaled by the upstream gradient in backward with one rounding. Checked here under Triton's interpreter
against the same one pass with the fp32 accumulator (same tiles, same logits: everything but the weight gradient
bit for bit, the weight gradient within one rounding) and against float64 (no further from it than the fp32
accumulator's result), for every op that takes the one pass, under upstream factors other than 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from references import INTERPRETER_AND_GPU as DEVICES, bf16_cuda_head, make_head_inputs, rel_err  # noqa: E402
from hf_fused.ops import linear_cross_entropy, linear_logprobs, linear_token_loss  # noqa: E402
from hf_fused.ops.backends.triton_cublas import one_pass, one_pass_rule  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402


# 200 tokens, a third ignored: 2 tiles of 64 kept rows, 3 folds into the pair with the last partial tile (small
# enough for Triton's interpreter)
N, H, V, ROWS = 200, 64, 256, 64


def _forced(monkeypatch, accumulator):
    """Every one pass of the GPU backend with ``ROWS`` rows per tile and this accumulator. Returns the plans made,
    the tiles folded into the pair, and ``Σ_tiles |dz|ᵀ·|h|`` in float64 (``[V, H]``: what bounds the fp32
    rounding of the weight gradient's sum in any order), gathered from whichever accumulation runs."""
    plans, folds, abs_sum = [], [], []

    def plan(vocab_size, hidden_size, elem_bytes, accumulators, *rest):
        assert accumulators == ("fp32", "pair")  # a bf16 gradient of bf16 operands may take either
        plans.append(OnePassPlan(ROWS, accumulator, 0))
        return plans[-1]

    halves = []  # the fp32 accumulator's dW comes in two matmuls per tile: rows [0, V // 2), then the rest

    def spy(real, fold):
        def accumulate(out, *args, **kwargs):
            a, b = args[-2:] if fold else args
            folds.extend([a.shape] if fold else [])
            terms = torch.stack([a.double() @ b.double(), a.double().abs() @ b.double().abs()])
            if a.shape[0] != V:  # one half of the split accumulator's product
                offset = 0 if len(halves) % 2 == 0 else V // 2
                halves.append(offset)
                terms = torch.nn.functional.pad(terms, (0, 0, offset, V - offset - a.shape[0]))
            abs_sum.append(terms + abs_sum.pop() if abs_sum else terms)
            return real(out, *args, **kwargs)
        return accumulate

    monkeypatch.setattr("hf_fused.ops.backends.triton_cublas.plan.one_pass_plan", plan)
    # dW's products: folded into the pair (quack_bridge.pair_addmm_: QuACK's fold where it runs, else the Triton
    # one), or added into the fp32 accumulator (quack_bridge.matmul_f32_, which the one pass alone calls here: the
    # hidden gradient's dz @ W is written whole by mm_f32_)
    monkeypatch.setattr(one_pass.quack_bridge, "pair_addmm_", spy(one_pass.quack_bridge.pair_addmm_, True))
    monkeypatch.setattr(one_pass.quack_bridge, "matmul_f32_", spy(one_pass.quack_bridge.matmul_f32_, False))
    return plans, folds, abs_sum


def _cross_entropy(hidden, weight, bias, labels):
    return linear_cross_entropy(hidden, weight, labels, bias, backend="triton", reduction="sum") * 0.37


def _token_loss(hidden, weight, bias, labels):
    advantages = torch.linspace(-1.5, 2.0, labels.numel(), device=labels.device).view(labels.shape)

    def loss(logprobs, entropy, advantages):  # a DAPO-like term and an entropy bonus
        return -advantages * torch.exp(logprobs - logprobs.detach()) - 0.01 * entropy

    total, _, _ = linear_token_loss(hidden, weight, labels, loss, bias, per_token={"advantages": advantages},
                                    need_entropy=True, backend="triton")
    return total * -3.0


def _hinted_logprobs(hidden, weight, bias, labels):
    g = torch.linspace(-2.0, 1.0, labels.numel(), device=labels.device).view(labels.shape) * (labels != -100)
    logprobs, _ = linear_logprobs(hidden, weight, labels, bias, backend="triton", grad_hint=g)
    return (logprobs * g).sum() * 0.5  # the hint up to the factor 0.5


OPS = {"cross_entropy": _cross_entropy, "token_loss": _token_loss, "hinted_logprobs": _hinted_logprobs}


#: The upstream factor each op's loss puts on the head's gradients.
FACTORS = {"cross_entropy": 0.37, "token_loss": -3.0, "hinted_logprobs": 0.5}


def _inputs(device, bias, seed=5):
    hidden, weight, b, labels = make_head_inputs((N,), H, V, bias=bias, ignore="some", dtype=torch.bfloat16,
                                                 weight_std=4.0, seed=seed)
    leaves = [None if t is None else t.detach().to(device).requires_grad_() for t in (hidden, weight, b)]
    return (*leaves, labels.to(device))


def _run(monkeypatch, op, accumulator, bias, device="cpu", autocast=False):
    plans, folds, abs_sum = _forced(monkeypatch, accumulator)
    hidden, weight, b, labels = _inputs(device, bias)
    # bf16=True in Trainer / TRL's configs: autocast around the forward (backward outside it, as Trainer runs it)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = OPS[op](hidden, weight, b, labels)
    loss.backward()
    assert plans and all(p.accumulator == accumulator for p in plans)
    kept = int((labels != -100).sum())
    assert len(folds) == (-(-kept // ROWS) if accumulator == "pair" else 0)
    grads = [t.grad for t in (hidden, weight, b) if t is not None]
    return loss.detach(), grads, (hidden, weight, b, labels), abs_sum[0] * FACTORS[op]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", sorted(OPS))
def test_pair_one_pass_matches_the_fp32_accumulator(monkeypatch, op, bias, device):
    loss32, grads32, inputs, sums = _run(monkeypatch, op, "fp32", bias, device)
    loss_pair, grads_pair, _, _ = _run(monkeypatch, op, "pair", bias, device)
    # the same tiles and logits: the loss and every gradient but the weight's are the same bits
    assert torch.equal(loss_pair, loss32)
    for name, ours, theirs in zip(("hidden", "weight", "bias"), grads_pair, grads32):
        assert ours.dtype == theirs.dtype == torch.bfloat16
        if name != "weight":
            assert torch.equal(ours, theirs), name
    # The weight's, against float64: the exact sum of the same products (the bf16 logits-gradient tiles dz times
    # the hidden rows) times the upstream factor. Each path sums them in fp32 in its own order (a Triton dot, or
    # QuACK's matmul where it runs, per tile folded into the pair; a torch mm per tile added to an fp32 buffer): off
    # by at most kept·2⁻²⁴·Σ|dz|·|h| in any order; the pair's int8 quantisation adds ulp(hi)/508 per fold
    # (compensated's docstring; hi is at most Σ|dz|·|h| before the factor); then one rounding to bf16, ½ulp. Both
    # stay within that, and mostly agree bit for bit (they differ only where the two orders round to different sides).
    exact, scale = sums[0], sums[1].abs()
    kept = int((inputs[3] != -100).sum())
    folds = -(-kept // ROWS)
    for dw in (grads_pair[1], grads32[1]):
        half_ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(dw.double())[1] - 9).clamp_min(2.0**-134)
        fold_ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(scale)[1] - 7)  # ≥ 2·ulp(hi)·|factor|
        assert ((dw.double() - exact).abs() <= half_ulp + folds * fold_ulp / 508 + kept * 2.0**-24 * scale).all()
    assert (grads_pair[1] != grads32[1]).double().mean() <= 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_pair_under_autocast_is_the_pair_without_it(monkeypatch, device):
    """What bf16=True does to a bf16 model (TRL's default): autocast around the forward. The ops cast nothing for
    bf16 operands, so the pair's one pass under autocast is the one without it, bit for bit."""
    loss, grads, _, _ = _run(monkeypatch, "token_loss", "pair", True, device, autocast=True)
    plain_loss, plain_grads, _, _ = _run(monkeypatch, "token_loss", "pair", True, device)
    assert torch.equal(loss, plain_loss)
    for ours, plain in zip(grads, plain_grads):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_default_rule_takes_the_pair_when_only_it_fits(monkeypatch, device):
    """Through the public op, nothing forced: a budget that holds the residual but not the fp32 buffer gives the
    pair's one pass, the very computation checked above (same bits as the forced plan)."""
    monkeypatch.setattr(one_pass_rule, "MIN_ONE_PASS_ROWS", ROWS)  # this test's tiles are smaller than the rule's
    hidden, weight, b, labels = _inputs(device, True)
    kept = int((labels != -100).sum())
    # hidden's bf16 gradient and the kept rows' residual; each tile row's gathered hidden row and fp32 product row
    extra, gather = N * H * 2 + kept * H, H * 2 + H * 4
    budget = V * H * 1 + ROWS * (V * 2 + gather) + extra  # fp32 would need 3·V·H more: fewer rows than the pair's
    assert one_pass_rule.one_pass_plan(V, H, 2, ("fp32", "pair"), budget, hidden.device, extra, gather) == \
        OnePassPlan(ROWS, "pair", budget)
    folds = []
    real_fold = one_pass.quack_bridge.pair_addmm_
    monkeypatch.setattr(one_pass.quack_bridge, "pair_addmm_", lambda *a, **k: folds.append(1) or real_fold(*a, **k))
    loss = linear_cross_entropy(hidden, weight, labels, b, backend="triton", tile_budget_bytes=budget,
                                reduction="sum") * 0.37
    assert len(folds) == -(-kept // ROWS)  # gradients in the forward: the one pass
    loss.backward()
    forced_loss, forced_grads, _, _ = _run(monkeypatch, "cross_entropy", "pair", True, device)
    assert torch.equal(loss.detach(), forced_loss)
    for ours, forced in zip((hidden.grad, weight.grad, b.grad), forced_grads):
        assert torch.equal(ours, forced)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_pair_one_pass_error_is_eagers_on_gpu(monkeypatch, softcap):
    """bf16 on the GPU, a head of realistic width, every token's loss: the pair's one pass is as close to float64
    as eager transformers (a bf16 lm_head, fp32 logits, cross-entropy) on the loss and every gradient, within the
    1.25× of eager's error that tests/ops/test_mixed_precision.py allows every fused path (its rounding of the
    bf16 logits tile and of each gradient is eager's; only the order of the fp32 sums differs)."""
    import torch.nn.functional as F

    n, h, v = 4096, 1024, 32000
    hidden, weight, labels = bf16_cuda_head(n, h, v, seed=11, ignore_every=10)
    budget = v * h + 1024 * (v + h) * 2 + n * h * 4  # the pair and 1024 rows; not the fp32 accumulator (3·V·H more)
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: 0)  # budget only
    kw = {} if softcap is None else {"softcap": softcap}
    loss = linear_cross_entropy(hidden, weight, labels, tile_budget_bytes=budget, **kw)
    grads = torch.autograd.grad(loss * 0.3, (hidden, weight))
    from hf_fused.ops import describe_plan

    assert "'pair'" in describe_plan(weight, n_rows=int((labels != -100).sum()), n_tokens=n,
                                     tile_budget_bytes=budget)

    def dense(hd, w):
        z = F.linear(hd, w).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return F.cross_entropy(z, labels, ignore_index=-100)

    eager = dense(hidden, weight)
    eager_grads = torch.autograd.grad(eager * 0.3, (hidden, weight))
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    exact = dense(*leaves)
    exact_grads = torch.autograd.grad(exact * 0.3, leaves)
    assert rel_err(loss, exact) <= 1.25 * rel_err(eager, exact) + 2.0**-24
    for ours, theirs, ref in zip(grads, eager_grads, exact_grads):
        assert ours.dtype == torch.bfloat16
        assert rel_err(ours, ref) <= 1.25 * rel_err(theirs, ref), (rel_err(ours, ref), rel_err(theirs, ref))
