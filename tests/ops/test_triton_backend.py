"""The GPU backend (cuBLAS tiles + Triton epilogues) against a float64 dense reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in conftest), so CI checks the kernels'
math; the `gpu` tests check the real kernels in bf16 on a CUDA device.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import one_pass_accumulators, one_pass_plan  # noqa: E402

from references import KERNEL_TRANSFORMS as TRANSFORMS  # noqa: E402
from references import apply_transform as _transform, check_triton_matches_float64 as _check  # noqa: E402
from references import dense_logits as _dense_logits, kernel_head_inputs as _inputs, rel_err as _rel  # noqa: E402


@pytest.mark.parametrize("kw", TRANSFORMS)
@pytest.mark.parametrize(
    "v, budget",
    [(300, None), (300, 300 * 4 * 10), (5000, 2048 * 4 * 8)],
    ids=["one-tile", "row-blocks", "vocab-chunks-and-row-blocks"],
)
def test_triton_backend_matches_float64_in_fp32(kw, v, budget):
    _check("cpu", torch.float32, n=29, h=16, v=v, kw=kw, bias=True, budget=budget, tol=1e-5)


def test_triton_backend_all_ignored_gives_zero_loss_and_grads():
    hid, w, _, y = _inputs(6, 8, 130, "cpu", torch.float32, bias=False)
    loss = linear_cross_entropy(hid, w, torch.full_like(y, -100), backend="triton")
    loss.backward()
    assert loss.item() == 0.0 and hid.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


@pytest.mark.parametrize("labels", ["some_ignored", "all_ignored"])
@pytest.mark.parametrize("path", ["one_pass", "two_passes", "two_passes_pair"])
def test_no_buffer_is_read_before_it_is_written(monkeypatch, labels, path):
    """Every ``torch.empty`` of the op filled with NaN (integers with 77): the same loss and gradients, bit for bit,
    as with plain ``torch.empty`` — no uninitialized buffer reaches a result, also when no row is kept (the
    weight-gradient buffers that the first tile or each chunk writes instead of a zero fill)."""
    hid, w, _, y = _inputs(24, 16, 300, "cpu", torch.bfloat16, bias=False)
    if labels == "all_ignored":
        y = torch.full_like(y, -100)
    else:
        y[::3] = -100

    def run():
        hidden, weight = hid.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        if path == "one_pass":
            loss = linear_cross_entropy(hidden, weight, y, backend="triton")
        else:  # log-probs without a hint: statistics, then the gradient pass (fp32 or compensated dX)
            lp, _ = linear_logprobs(hidden, weight, y, backend="triton", return_entropy=True,
                                    tile_budget_bytes=2**30 if path == "two_passes_pair" else None)
            loss = (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum()
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad

    plain = run()
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    poisoned = run()
    for got, want in zip(poisoned, plain):
        assert torch.equal(got, want)


def _eager_bf16(hid, w, b, kw):
    """What transformers does in bf16: logits rounded to bf16 by the matmul, then fp32 from there."""
    z = hid @ w.T
    if b is not None:
        z = z + b
    return _transform(z.float(), kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", TRANSFORMS)
@pytest.mark.parametrize("budget", [None, 8 * 2**20])  # one-pass CE / vocabulary-outer with row blocks
def test_triton_backend_bf16_on_gpu_no_worse_than_eager(monkeypatch, kw, budget):
    # The backend rounds each logits tile to bf16 exactly as eager transformers (and TRL's chunked
    # head) round the logits, then works in fp32. So its error against float64 is pinned to eager
    # bf16's own error on the same inputs: at most 10% above it (summation order), never a bias.
    # (The stored tiles' path: the two passes' default statistics from the fp32 accumulator are
    # closer to float64 than eager's, tests/ops/test_fused_matmul.py.)
    monkeypatch.setenv("HF_FUSED_FP32_LOGITS", "0")
    n, h, v = 4096, 1024, 32000
    hid, w, _, y = _inputs(n, h, v, "cuda", torch.bfloat16, bias=False)
    ref_params = [t.detach().double().requires_grad_() for t in (hid, w)]
    z64 = _dense_logits(ref_params[0], ref_params[1], None, kw)
    eager_params = [t.detach().clone().requires_grad_() for t in (hid, w)]
    z_eager = _eager_bf16(eager_params[0], eager_params[1], None, kw)
    mask = y != -100
    gen = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(n, generator=gen).cuda(), torch.randn(n, generator=gen).cuda()

    def objectives(z):
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(1, y.clamp_min(0)[:, None])[:, 0] * mask
        ent = -(logp.exp() * logp).sum(-1) * mask
        return F.cross_entropy(z, y, ignore_index=-100), (lp * w1.to(z.dtype)).sum() + (ent * w2.to(z.dtype)).sum()

    ce64, rl64 = objectives(z64)
    ce_e, rl_e = objectives(z_eager)
    ce = linear_cross_entropy(hid, w, y, backend="triton", tile_budget_bytes=budget, **kw)
    lp, ent = linear_logprobs(hid, w, y, backend="triton", tile_budget_bytes=budget, return_entropy=True, **kw)
    rl = (lp * w1).sum() + (ent * w2).sum()
    for ours, eager, ref in ((ce, ce_e, ce64), (rl, rl_e, rl64)):
        g_ref = torch.autograd.grad(ref, ref_params, retain_graph=True)
        g_eager = torch.autograd.grad(eager, eager_params, retain_graph=True)
        g_ours = torch.autograd.grad(ours, (hid, w), retain_graph=True)
        for g, ge, gr in zip(g_ours, g_eager, g_ref):
            assert _rel(g, gr) <= 1.1 * _rel(ge, gr) + 1e-6, (_rel(g, gr), _rel(ge, gr), g.shape)
        # The objective's value: eager's own bf16 rounding of the logits moves a summed objective far from
        # float64 (measured 1.2% for the entropy-weighted sum), so the value is pinned to eager's, which
        # it must reproduce up to fp32 summation order.
        assert abs(ours.item() - eager.item()) <= 1e-4 * abs(ref.item()), (ours.item(), eager.item(), ref.item())


@pytest.mark.gpu
def test_triton_backend_fp32_on_gpu_matches_float64():
    torch.backends.cuda.matmul.allow_tf32 = False
    _check("cuda", torch.float32, n=1000, h=256, v=5000, kw={"softcap": 3.0}, bias=True, budget=None, tol=1e-5)


def test_cross_entropy_path_choice_follows_the_budget():
    # The tests above cover both paths: the default budget holds the fp32 [V, H] accumulator of their
    # small heads (one pass), the small budgets do not (vocabulary-outer two passes).
    def plan(w, need_weight, budget):
        accumulators = one_pass_accumulators(need_weight, w.dtype, w.dtype)
        return one_pass_plan(*w.shape, w.element_size(), accumulators, budget, w.device)

    w = torch.empty(300, 16)
    assert plan(w, True, None).rows >= 512
    assert plan(w, True, 300 * 4 * 10) is None
    big = torch.empty(151936, 2048, dtype=torch.bfloat16)  # Qwen head: 1.16 GiB fp32 accumulator
    assert plan(big, True, None) is None  # off CUDA the default is the 256 MiB budget: not even the pair fits
    assert plan(big, True, 2 * 2**30).accumulator == "fp32" and plan(big, True, 2 * 2**30).rows >= 512
    assert plan(big, True, 2**30).accumulator == "pair"  # 0.29 GiB residual: the one pass still fits 1 GiB
    assert plan(big, False, None).rows >= 512  # frozen head: no accumulator


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 8 * 2**20])  # one pass / vocabulary-outer with row blocks
def test_triton_token_weights_on_gpu_match_float64(budget):
    """Token-weighted cross-entropy (GRPO's on-policy gradient) on the GPU, fp32, against float64."""
    torch.backends.cuda.matmul.allow_tf32 = False
    n, h, v = 1000, 256, 5000
    hid, w, b, y = _inputs(n, h, v, "cuda", torch.float32, bias=True)
    tw = torch.randn(n, generator=torch.Generator().manual_seed(3)).cuda()
    tw[::7] = 0.0
    params = [hid, w, b]
    ref_params = [t.detach().double().requires_grad_() for t in params]
    z = _dense_logits(*ref_params, {"softcap": 3.0})
    weighted = F.cross_entropy(z, y, ignore_index=-100, reduction="none") * tw.double()
    ref = weighted.sum() / 123
    loss = linear_cross_entropy(hid, w, y, b, backend="triton", tile_budget_bytes=budget, softcap=3.0,
                                token_weights=tw, reduction="sum", num_items_in_batch=123)
    # Signed weights cancel in the sum (here |Σ| ≈ 1/700 of Σ|·|), so fp32 rounding is bounded relative
    # to Σ|w·loss|, the scale the terms are summed at, not to the cancelled result.
    assert abs(loss.item() - ref.item()) <= 1e-5 * weighted.abs().sum().item() / 123
    for g, rg in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, ref_params)):
        assert _rel(g, rg) <= 1e-5


def _dense_statistics(z, y):
    """Float64 statistics of the dense logits ``z`` (hf_fused.ops.token_statistics), 0 / False where ignored."""
    mask = y != -100
    return {
        "mean_logits": z.mean(-1) * mask,
        "is_top1": (z.argmax(-1) == y) & mask,
        "log_sum_sq_probs": torch.log((z.softmax(-1) ** 2).sum(-1)) * mask,
    }


STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")
# Soft-caps that leave the top logits apart: a cap of 2-3 on logits of standard deviation 4 saturates tanh, and the
# top logits of most rows then tie in fp32 (for TRL's kernel too), where float64 still tells them apart.
STATISTICS_TRANSFORMS = [{}, {"softcap": 30.0, "temperature": 0.7}, {"logit_scale": 0.5, "temperature": 0.7}]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", STATISTICS_TRANSFORMS)
@pytest.mark.parametrize("path", ["statistics_pass", "one_pass"])
def test_triton_token_statistics_on_gpu_fp32_match_float64(path, kw):
    """The statistics kernel's token statistics on CUDA in fp32, on the statistics pass (8 MiB budget: two
    vocabulary chunks) and the one pass (a grad_hint), with the log-probs and gradients of the call."""
    torch.backends.cuda.matmul.allow_tf32 = False
    n, h, v = 1000, 256, 5000
    hid, w, b, y = _inputs(n, h, v, "cuda", torch.float32, bias=True)
    params = [hid, w, b]
    ref_params = [t.detach().double().requires_grad_() for t in params]
    z = _dense_logits(*ref_params, kw)
    y = torch.where((y != -100) & (torch.arange(n, device="cuda") % 2 == 0), z.argmax(-1), y)  # hits and misses
    hint = torch.randn(n, generator=torch.Generator().manual_seed(2)).cuda() if path == "one_pass" else None
    budget = 8 * 2**20 if path == "statistics_pass" else None
    lp, _, stats = linear_logprobs(hid, w, y, b, backend="triton", tile_budget_bytes=budget, grad_hint=hint,
                                   statistics=STATISTICS, **kw)
    ref = _dense_statistics(z.detach(), y)
    # A row whose two largest logits are closer than fp32 can resolve may legitimately pick either: compare is_top1
    # where float64's top-2 gap exceeds 1e-4 (fp32 logits of this size are accurate to ~1e-5), all rows but a few.
    top2 = z.detach().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert clear.float().mean() > 0.99
    assert torch.equal(stats["is_top1"][clear], ref["is_top1"][clear]) and stats["is_top1"].any()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert _rel(stats[name], ref[name]) <= 1e-5, name
    ref_lp = torch.log_softmax(z, -1).gather(1, y.clamp_min(0)[:, None])[:, 0] * (y != -100)
    assert _rel(lp, ref_lp) <= 1e-5
    upstream = hint if hint is not None else torch.randn(n, generator=torch.Generator().manual_seed(3)).cuda()
    grads = torch.autograd.grad((lp * upstream).sum(), params)
    ref_grads = torch.autograd.grad((ref_lp * upstream.double()).sum(), ref_params)
    for g, rg in zip(grads, ref_grads):
        assert _rel(g, rg) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 8 * 2**20])
def test_triton_token_statistics_on_gpu_bf16_match_stock_trl(monkeypatch, budget):
    """bf16: the logits tile is bf16 (rounded by cuBLAS as TRL's tiles and eager transformers' logits are), so the
    statistics are TRL's up to how cuBLAS rounds a logit in another tile shape: values no
    further from float64 than TRL's (1.1×, summation order), is_top1 equal to TRL's except where such a rounding
    decides a near-tie at the top (at most 0.2% of rows). The stored tiles' path (the fp32 statistics off; with them,
    tests/ops/test_fused_matmul.py)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    monkeypatch.setenv("HF_FUSED_FP32_LOGITS", "0")

    n, h, v = 4096, 1024, 32000
    hid, w, _, y = _inputs(n, h, v, "cuda", torch.bfloat16, bias=False)
    z64 = _dense_logits(hid.detach().double(), w.detach().double(), None, {})
    y = torch.where((y != -100) & (torch.arange(n, device="cuda") % 2 == 0), z64.argmax(-1), y)
    mask = y != -100
    _, _, log_sum_sq, mean, top1 = ChunkedLogProbFunction.apply(
        hid.detach(), w.detach(), None, y, 1.0, 4096, None, 1.0, STATISTICS)
    trl = {"mean_logits": mean * mask, "is_top1": top1 & mask, "log_sum_sq_probs": log_sum_sq * mask}
    with torch.no_grad():
        _, _, ours = linear_logprobs(hid, w, y, backend="triton", tile_budget_bytes=budget, statistics=STATISTICS)
    ref = _dense_statistics(z64, y)
    assert (ours["is_top1"] != trl["is_top1"]).float().mean() <= 0.002 and ours["is_top1"].any()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert _rel(ours[name], ref[name]) <= 1.1 * _rel(trl[name], ref[name]) + 1e-6, name
