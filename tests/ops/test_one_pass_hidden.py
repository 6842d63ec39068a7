"""The one pass's hidden-state gradient (:mod:`hf_fused.ops.backends.triton_cublas.one_pass_hidden`): held from the
forward as hidden's own gradient (bf16: plus an int8 residual, the compensated pair; fp32: the gradient itself)
instead of an fp32 ``[M, H]`` buffer of the kept rows that backward scaled, rounded and scattered.

Checked under Triton's interpreter against the fp32-buffer path (``"rows"``, forced) on the same tiles: at an
upstream factor of 1 the same bits; at other factors the pair's value times the factor, rounded once, so within
one bf16 step of the buffer's result and mostly equal; the fp32 gradient the same bits at every factor; every
other output the same bits. Through the public ops, with ignored tokens (rows gathered) and without, with a grad
hint (whose backward scales by a device tensor) and the row-scaled tiles' path.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from references import INTERPRETER_AND_GPU as DEVICES, make_head_inputs  # noqa: E402
from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402
from hf_fused.ops.grads import HeadGrads  # noqa: E402
from hf_fused.ops.head_inputs import HeadInputs  # noqa: E402
from hf_fused.ops.logit_transform import LogitTransform  # noqa: E402
from hf_fused.ops.backends.triton_cublas import one_pass_hidden, one_pass_rule  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402
from hf_fused.ops.backends.triton_cublas.plan import forced_plans  # noqa: E402


# 200 tokens: 4 tiles of 64 rows (3 with a third of the labels ignored), small enough for the interpreter
N, H, V, ROWS = 200, 64, 256, 64


def _cross_entropy(hidden, weight, labels, factor):
    return linear_cross_entropy(hidden, weight, labels, backend="triton", reduction="sum") * factor


def _hinted_logprobs(hidden, weight, labels, factor):
    g = torch.linspace(-2.0, 1.0, labels.numel(), device=labels.device) * (labels != -100)
    logprobs, _ = linear_logprobs(hidden, weight, labels, backend="triton", grad_hint=g)
    return (logprobs * g).sum() * factor  # the hint up to the factor: backward scales by a device tensor


OPS = {"cross_entropy": _cross_entropy, "hinted_logprobs": _hinted_logprobs}


def _run(monkeypatch, op, kind, dtype, ignore, factor, device):
    """``(loss, hidden.grad, weight.grad, the kinds the passes took)`` with the hidden gradient's kind forced."""
    kinds = []
    real = one_pass_hidden.hidden_gradient_kind

    def forced_kind(hidden_dtype):
        kinds.append(real(hidden_dtype) if kind is None else kind)
        return kinds[-1]

    monkeypatch.setattr(one_pass_hidden, "hidden_gradient_kind", forced_kind)
    hidden, weight, _, labels = make_head_inputs((N,), H, V, bias=False, ignore=ignore, dtype=dtype, weight_std=4.0,
                                                 seed=7)
    hidden, weight = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
    with forced_plans(one_pass=OnePassPlan(ROWS, "fp32", 0)):
        loss = OPS[op](hidden, weight, labels.to(device), factor)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, kinds


@pytest.mark.parametrize("device", DEVICES)
# each op at each factor once, rows gathered (some ignored) or every row kept (the interpreter is slow)
@pytest.mark.parametrize("op, factor, ignore", [("cross_entropy", 1.0, "some"), ("cross_entropy", 0.37, "none"),
                                                ("hinted_logprobs", 0.37, "some"), ("hinted_logprobs", 1.0, "none")])
def test_bf16_pair_is_the_fp32_buffer_rounded_once(monkeypatch, op, factor, ignore, device):
    loss, d_hidden, d_weight, kinds = _run(monkeypatch, op, None, torch.bfloat16, ignore, factor, device)
    assert kinds == ["pair"]
    ref_loss, ref_hidden, ref_weight, _ = _run(monkeypatch, op, "rows", torch.bfloat16, ignore, factor, device)
    assert torch.equal(loss, ref_loss) and torch.equal(d_weight, ref_weight)
    assert d_hidden.dtype == torch.bfloat16 and d_hidden.shape == ref_hidden.shape
    if factor == 1.0:
        assert torch.equal(d_hidden.view(torch.int16), ref_hidden.view(torch.int16))
        return
    # (hi + lo·ulp/254)·factor rounded once against (acc·factor) rounded once: the pair holds acc to ulp/508, so
    # the two round to different neighbours only where acc·factor lies within that of a midpoint
    ulp = torch.ldexp(torch.ones_like(ref_hidden, dtype=torch.float64), torch.frexp(ref_hidden.double())[1] - 8)
    diff = (d_hidden.double() - ref_hidden.double()).abs()
    assert bool((diff <= ulp).all())
    assert (diff > 0).double().mean() <= 0.02
    ignored = torch.nonzero(torch.all(ref_hidden == 0, dim=1)).squeeze(1)
    assert bool((d_hidden[ignored] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, ignore", [("cross_entropy", "none"), ("hinted_logprobs", "some")])
def test_fp32_hidden_is_its_own_gradient(monkeypatch, op, ignore, device):
    """fp32 hidden states (an fp32 model, or the vocabulary-parallel head's fp32 view): the gradient is written
    where it belongs and scaled in place, the same bits as the fp32 buffer scaled and scattered."""
    loss, d_hidden, d_weight, kinds = _run(monkeypatch, op, None, torch.float32, ignore, 0.37, device)
    assert kinds == ["scattered"]
    ref_loss, ref_hidden, ref_weight, _ = _run(monkeypatch, op, "rows", torch.float32, ignore, 0.37, device)
    assert torch.equal(loss, ref_loss) and torch.equal(d_weight, ref_weight)
    assert torch.equal(d_hidden, ref_hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_hidden_under_autocast_keeps_an_fp32_gradient(monkeypatch, device):
    """An fp32 model under bf16 autocast (TRL's default config): the matmuls read bf16 copies, but the hidden
    states' gradient is theirs, fp32, never rounded to bf16 on the way (as the weight's; head_inputs.HeadInputs):
    the same bits as the fp32 buffer's path, and finer than bf16."""
    def run(kind):
        kinds = []
        monkeypatch.setattr(one_pass_hidden, "hidden_gradient_kind",
                            lambda dtype: kinds.append(dtype) or ("rows" if kind == "rows" else real(dtype)))
        hidden, weight, _, labels = make_head_inputs((N,), H, V, bias=False, ignore="some", weight_std=4.0, seed=3)
        hidden, weight = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
        with forced_plans(one_pass=OnePassPlan(ROWS, "fp32", 0)), torch.autocast(device, dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, labels.to(device), backend="triton", reduction="sum")
        (loss * 0.37).backward()
        assert kinds == [torch.float32]
        return hidden.grad, weight.grad

    real = one_pass_rule.hidden_gradient_kind
    d_hidden, d_weight = run("scattered")
    ref_hidden, ref_weight = run("rows")
    assert d_hidden.dtype == torch.float32 and torch.equal(d_hidden, ref_hidden) and torch.equal(d_weight, ref_weight)
    assert bool((d_hidden != d_hidden.bfloat16().float()).any())


@pytest.mark.parametrize("device", DEVICES)
def test_row_scaled_tile_scales_before_the_rounding(monkeypatch, device):
    """A tile taken row-scaled (QuACK's exponential tile: ``dh = s·(E @ W)``) hands its row scale to the pair,
    which applies it in fp32 before its one rounding: the same bits as the fp32 buffer scaled in place."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(V, H, generator=g) * 0.5).bfloat16().to(device)
    rows = torch.tensor([0, 3, 4, 9, 10, 11], device=device)
    dz = torch.randn(len(rows), V, generator=g).bfloat16().to(device)
    scale = (torch.rand(len(rows), generator=g) + 0.5).to(device)
    hidden = torch.empty((12, H), dtype=torch.bfloat16, device=device)
    head = HeadInputs(hidden, weight, None, torch.zeros(12, dtype=torch.long, device=device), rows, LogitTransform(),
                      None)

    grads = {}
    for kind in ("pair", "rows"):
        monkeypatch.setattr(one_pass_hidden, "hidden_gradient_kind", lambda dtype, kind=kind: kind)
        gradient = one_pass_hidden.HiddenGradient(head)
        gradient.add(0, 4, dz[:4], weight, scale[:4])
        gradient.add(4, 6, dz[4:], weight, scale[4:])
        grads[kind] = HeadGrads()
        gradient.finish(grads[kind])
    pair = grads["pair"].input_grads(head.hidden, weight, None, rows, 1.0)[0]
    expected = grads["rows"].input_grads(head.hidden, weight, None, rows, 1.0)[0]
    assert torch.equal(pair.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(expected[rows].float(), ((dz.float() @ weight.float()) * scale[:, None]).bfloat16().float())


def test_planner_counts_the_gradient_it_holds():
    """The one pass's working set counts what the hidden gradient holds from the forward: hidden's whole gradient
    and the pair's residual (bf16), the gradient (fp32), an fp32 buffer of the kept rows (fp16), and per tile row
    the fp32 buffer a tile's product passes through on its way into the gradient."""
    tokens, kept, hidden_size = 1000, 700, 64
    assert one_pass_rule.hidden_gradient_kind(torch.bfloat16) == "pair"
    assert one_pass_rule.hidden_gradient_kind(torch.float32) == "scattered"
    assert one_pass_rule.hidden_gradient_kind(torch.float16) == "rows"
    assert one_pass_rule.hidden_gradient_bytes(torch.bfloat16, tokens, kept, hidden_size) == (2 * tokens + kept) * 64
    assert one_pass_rule.hidden_gradient_bytes(torch.float32, tokens, kept, hidden_size) == 4 * tokens * 64
    assert one_pass_rule.hidden_gradient_bytes(torch.float16, tokens, kept, hidden_size) == 4 * kept * 64
    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    assert [one_pass_rule.hidden_gradient_row_bytes(d, hidden_size) for d in dtypes] == \
        [256, 256, 0]
