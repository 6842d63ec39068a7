"""``linear_token_statistics`` (the gradient-free fields of TRL's fused head: mean logit, arg-max hit,
``log Σ p²``) against float64 statistics of the dense logits, across tile layouts, ignore patterns, logit
transforms and autocast."""

from __future__ import annotations

import pytest
import torch

from dense_reference import dense_logits, make_head_inputs, rel_err
from dense_reference import single_threaded_torch  # noqa: F401  (autouse fixture)
from dense_reference import H, RTOL, TRANSFORMS, budget_for
from hf_fused.ops import token_statistics
from hf_fused.ops.token_statistics import TOKEN_STATISTICS, linear_token_statistics

V = 37


def dense_statistics(hidden, weight, bias, labels, **transform):
    """Float64 reference, computed the way TRL's docstring defines the fields; 0 / False where ignored."""
    z = dense_logits(hidden.double(), weight.double(), None if bias is None else bias.double(), **transform)
    mask = labels != -100
    first_max = z.argmax(-1)
    return {
        "mean_logits": z.mean(-1) * mask,
        "is_top1": (first_max == labels) & mask,
        "log_sum_sq_probs": torch.log((z.softmax(-1) ** 2).sum(-1)) * mask,
    }


@pytest.fixture(params=[None, 8], ids=["one-vocab-chunk", "vocab-chunks-of-8"])
def vocab_chunk(request, monkeypatch):
    """The whole vocabulary in one matmul, or chunks of 8 columns (37 = 4·8 + 5: online reductions across chunks)."""
    if request.param is not None:
        monkeypatch.setattr(token_statistics, "VOCAB_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("tile_rows", [1, 5, 64])
def test_statistics_match_float64(transform, ignore, tile_rows, vocab_chunk):
    hidden, weight, bias, labels = make_head_inputs((3, 7), H, V, ignore=ignore, seed=tile_rows)
    # Labels on the arg-max for half the rows, so is_top1 is True somewhere and the comparison means something.
    with torch.no_grad():
        z = dense_logits(hidden.double(), weight.double(), bias.double(), **TRANSFORMS[transform])
        labels = torch.where((labels != -100) & (torch.arange(7) % 2 == 0), z.argmax(-1), labels)
    got = linear_token_statistics(hidden, weight, labels, bias, tile_budget_bytes=budget_for(tile_rows, V),
                                  **TRANSFORMS[transform])
    ref = dense_statistics(hidden, weight, bias, labels, **TRANSFORMS[transform])
    assert set(got) == set(TOKEN_STATISTICS)
    assert torch.equal(got["is_top1"], ref["is_top1"])
    if ignore != "all":
        assert got["is_top1"].any() and not got["is_top1"].all()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert got[name].dtype == torch.float32 and got[name].shape == labels.shape
        assert rel_err(got[name], ref[name]) <= RTOL, name
    for value in got.values():
        assert not value.requires_grad


@pytest.mark.parametrize("tied", [(1, 2), (1, 9), (9, 17)])
def test_first_maximum_wins_a_tie(tied, vocab_chunk):
    """TRL counts a label as top-1 only if no earlier token has the same logit (argmax returns the first), also when
    the tied tokens fall in different vocabulary chunks."""
    weight = torch.zeros(20, 2)
    weight[list(tied), 0] = 1.0
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    labels = torch.tensor(list(tied))
    got = linear_token_statistics(hidden, weight, labels, statistics=("is_top1",))
    assert got["is_top1"].tolist() == [True, False]


def test_only_requested_statistics():
    hidden, weight, bias, labels = make_head_inputs((4,), H, V)
    assert set(linear_token_statistics(hidden, weight, labels, bias, statistics=("mean_logits",))) == {"mean_logits"}
    with pytest.raises(ValueError, match="unknown token statistics"):
        linear_token_statistics(hidden, weight, labels, bias, statistics=("entropy",))


def test_autocast_reads_the_bf16_operands(vocab_chunk):
    """Under autocast the operands are rounded to bf16 as F.linear's would be; the statistics then match the
    float64 ones of those rounded operands (the only rounding left is fp32 accumulation)."""
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_token_statistics(hidden, weight, labels, bias)
    rounded = [t.detach().bfloat16().float() for t in (hidden, weight, bias)]
    ref = dense_statistics(*rounded, labels)
    assert torch.equal(got["is_top1"], ref["is_top1"])
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert rel_err(got[name], ref[name]) <= RTOL, name
