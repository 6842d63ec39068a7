"""QuACK's epilogues (hf_fused.ops.backends.triton_cublas.quack_epilogues) in PyTorch, for the CPU tests of the calls
that take them (tests/ops/test_quack.py, tests/ops/test_quack_scaled_exp.py), and the check both make of a launch
that fails."""

import math
import warnings

import pytest
import torch

from hf_fused.ops.backends.triton_cublas import fp32_logits_rule, quack_bridge

LOG2E = 1.0 / math.log(2.0)
#: quack_epilogues.SHIFT_WINDOW (that module imports QuACK, which CPU machines lack)
SHIFT_WINDOW = 64


class StandIn:
    """Each epilogue as quack_epilogues defines it, recording its calls: ``"tile"`` (the bf16 tile and its statistics),
    ``"grad"`` / ``"grad_fp32"`` (the two passes' ``dz`` of the bf16 logits or of the fp32 accumulator), ``"scaled"``
    / ``"scaled+entropy"`` (the scaled-exp tile), with `` stats`` where nothing is stored (the statistics pass),
    ``"matmul_f32"`` / ``"matmul_f32+"`` (an fp32 product written / added)."""

    def __init__(self):
        self.calls = []

    def logits_with_statistics(self, h, w, y, out, *, lse, label_logit):
        self.calls.append("tile")
        torch.mm(h, w.t(), out=out)
        z = out.float()
        lse.copy_(torch.logsumexp(z, -1))
        label_logit.copy_(z.gather(1, y[:, None])[:, 0])

    def softmax_grad(self, h, w, y, lse, scale, out, label_logit, *, round_logits=True, logit_scale=1.0):
        """``scale·exp(z − lse)`` of the bf16 tile (or of the fp32 logits, times ``logit_scale``), the label logit
        where in range."""
        assert logit_scale == 1.0 or not round_logits
        self.calls.append("grad" if round_logits else "grad_fp32")
        z = (h.float() @ w.float().t()) * logit_scale  # fp32 accumulation, one rounding of the scaled value
        if round_logits:
            z = z.bfloat16().float()  # one rounding, as the GPU's
        inside = (y >= 0) & (y < z.shape[1])
        label_logit.copy_(torch.where(inside, z.gather(1, y.clamp(0, z.shape[1] - 1)[:, None])[:, 0], label_logit))
        out.copy_(scale[:, None] * torch.exp(z - lse[:, None]))

    def scaled_exp_logits(self, h, w, y, out, *, sum_exp, max_log2, label_logit, tile_n, sum_ez=None, scale=1.0):
        """quack/epilogue/scaled_exp.py's with the shifts' window: fp32 accumulation of the bf16 operands, ``k =
        rne(tile max·log2 e)`` less its clamp to ``±SHIFT_WINDOW`` (0 inside), the fp32 Σ of the values (and, for
        the entropy, of their products with the logits), the stored tile rounded to nearest bf16 once."""
        self.calls.append(("scaled" if sum_ez is None else "scaled+entropy") + (" stats" if out is None else ""))
        z = (h.float() @ w.float().t()) * scale  # one fp32 rounding of the scaled accumulator (none at 1)
        rows, v = z.shape
        tiles = z.view(rows, v // tile_n, tile_n)
        k = torch.round(tiles.amax(-1) * LOG2E)  # round half to even, as QuACK's roundeven
        k -= k.clamp(-SHIFT_WINDOW, SHIFT_WINDOW)  # quack_epilogues.WindowedMaxLog2
        e = torch.exp2(tiles * LOG2E - k[..., None])
        sum_exp.copy_(e.sum(-1))
        if sum_ez is not None:
            sum_ez.copy_((e * tiles).sum(-1))
        max_log2.copy_(k)
        if out is not None:
            out.copy_(e.view(rows, v))
        label_logit.copy_(z.gather(1, y[:, None])[:, 0])


    def matmul_f32(self, a, b, out, *, accumulate):
        """``out (+)= a @ b`` in fp32: the CPU fallback's own operations, so its bits."""
        self.calls.append("matmul_f32+" if accumulate else "matmul_f32")
        if accumulate:
            out.addmm_(a.float(), b.float())
        else:
            torch.mm(a.float(), b.float(), out=out)


def trained_head_inputs(seed=0, n=48, h=64, v=4352, requires_grad=True):
    """bf16 ``(hidden [n, h], weight [v, h], labels [n])`` whose logits have a trained head's spread (standard
    deviation ~4), every 6th label ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_(requires_grad)
    weight = (torch.randn(v, h, generator=g) * 4 / h**0.5).bfloat16().requires_grad_(requires_grad)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::6] = -100
    return hidden, weight, labels


@pytest.fixture(name="quack")
def quack_fixture(monkeypatch):
    """The stand-in as the loaded QuACK, its operands accepted on CPU, the fp32 statistics asked for (on a GPU they
    are by default; on CPU only when asked). A test module takes it with ``from quack_stand_in import
    quack_fixture``."""
    stand_in = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": stand_in})
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    with fp32_logits_rule.forced(True):
        yield stand_in


def without_quack(monkeypatch, run):
    """``run()`` with QuACK missing (what a process without it computes), then the loaded module back."""
    loaded = quack_bridge._QUACK["module"]
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    try:
        return run()
    finally:
        monkeypatch.setattr(quack_bridge, "_QUACK", {"module": loaded})


def assert_turned_off_once(monkeypatch, epilogue: str, run, plain) -> None:
    """A stand-in whose ``epilogue`` raises: the first ``run()`` warns once that QuACK is unavailable and returns
    ``plain`` (the results of a process without QuACK) bit for bit, QuACK is off for the process, a second run
    warns no more."""

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this DSL")

    module = StandIn()
    setattr(module, epilogue, broken)
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": module})
    with pytest.warns(UserWarning, match="unavailable .*no kernel for this DSL"):
        fallback = run()
    for got, want in zip(fallback, plain):
        assert torch.equal(got, want)
    assert quack_bridge._QUACK["module"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # off for the process: no second warning
