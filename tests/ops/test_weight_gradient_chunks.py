"""The two passes' weight-gradient chunks: an fp32 accumulator with no memory of its own.

When several row blocks add into one vocabulary chunk's weight gradient, its fp32 accumulator lives in the bf16
gradient's rows not written yet, or near the vocabulary's end in the tile buffer
(:func:`hf_fused.ops.backends.triton_cublas.weight_chunks.weight_gradient_chunks`). These tests check the
schedule's invariants and that each place gives, bit for bit, what an fp32 buffer of its own gives (the same
matmuls into the same fp32 values, rounded once), through the public ops on the triton backend (Triton's
interpreter on CPU).
"""

import random

import pytest
import torch

pytest.importorskip("triton")  # the GPU backend's package (its planning included) imports Triton

from hf_fused.ops.backends.triton_cublas import two_pass_rule, two_passes, weight_chunks  # noqa: E402
from hf_fused.ops.backends.triton_cublas.plan import forced_plans  # noqa: E402
from hf_fused.ops.backends.triton_cublas.two_pass_rule import LeanPlan  # noqa: E402
from hf_fused.ops.backends.triton_cublas.weight_chunks import (  # noqa: E402
    WeightChunk, tile_accumulator_offset, weight_gradient_chunks,
)


def _check_schedule(vocab_size, hidden_size, plan, n_rows, elem=2, grad_elem=2):
    chunks = weight_gradient_chunks(vocab_size, hidden_size, plan, n_rows, elem, grad_elem)
    assert chunks[0].v0 == 0 and chunks[-1].v1 == vocab_size
    assert all(a.v1 == b.v0 for a, b in zip(chunks, chunks[1:])) and all(c.v1 > c.v0 for c in chunks)
    for c in chunks:
        width = c.v1 - c.v0
        assert width <= plan.cols  # the chunk's dz is a view of the [block_rows, cols] tile
        if c.accumulator == "gradient":  # twice the chunk's rows, none of them written by an earlier chunk
            assert c.v0 + 2 * width <= vocab_size
        elif c.accumulator == "tile":  # the packed dz, then the fp32 accumulator, inside the tile buffer
            assert tile_accumulator_offset(plan.block_rows, width, elem) + 4 * width * hidden_size <= (
                plan.block_rows * plan.cols * elem)
    buffers = [c for c in chunks if c.accumulator == "buffer"]
    if buffers:  # only the last sliver that neither holds (several chunks where the tile is narrower than it)
        assert buffers == chunks[-len(buffers):]
        assert vocab_size - buffers[0].v0 < 2 * weight_chunks.TILE_ACCUMULATOR_ALIGN
    return chunks


def test_schedule_invariants_over_random_shapes():
    rng = random.Random(0)
    for _ in range(3000):
        vocab, hidden = rng.randint(1, 6000), rng.choice([8, 16, 64, 2048, 4096])
        block_rows = rng.randint(1, 400)
        plan = LeanPlan(block_rows, rng.randint(1, vocab), False, 0)
        _check_schedule(vocab, hidden, plan, block_rows + rng.randint(1, 1000))


def test_one_row_block_or_an_fp32_gradient_writes_in_place_in_even_chunks():
    plan = LeanPlan(100, 2048, False, 0)
    for n_rows, grad_elem in ((100, 2), (90, 2), (1000, 4)):
        chunks = weight_gradient_chunks(5000, 64, plan, n_rows, 2, grad_elem)
        assert [(c.v0, c.v1, c.accumulator) for c in chunks] == [
            (0, 2048, "direct"), (2048, 4096, "direct"), (4096, 5000, "direct")]


def test_benchmark_shapes_keep_the_plan_width_until_the_last_two_chunks():
    """32768 tokens, 10 % ignored, 256 MiB (the lean plan of the benchmark's cross-entropy at H = 2048, and of its
    GRPO problem at H = 4096): every chunk but the last few is the plan's width, and those hold the accumulator in
    the gradient; the last go to the tile."""
    for m, hidden in ((29_491, 2048), (29_360, 4096)):
        plan = two_pass_rule.lean_two_pass_plan(
            m, hidden, 151_936, 2, 256 * 2**20, reserved_bytes=m * hidden, copy_bytes=m * hidden * 2,
            gather_row_bytes=hidden * 2, accumulator_row_bytes=6 * hidden, weight_chunk=True, row_quantum=4224)
        chunks = _check_schedule(151_936, hidden, plan, m)
        kinds = [c.accumulator for c in chunks]
        assert kinds[-2:] == ["tile", "tile"] and set(kinds[:-2]) == {"gradient"}, kinds
        assert sum(c.v1 - c.v0 == plan.cols for c in chunks) >= len(chunks) - 4


def test_tiny_tile_leaves_a_sliver_to_a_buffer():
    # H = 4096 beside a 10×2048 tile: no fp32 row fits in the tile, so the halving ends in a buffer of < 16 columns
    chunks = _check_schedule(4300, 4096, LeanPlan(10, 2048, False, 0), 25)
    assert chunks[-1].accumulator == "buffer" and "tile" not in {c.accumulator for c in chunks}


def test_a_tile_narrower_than_the_sliver_splits_it():
    """A forced 8-column tile (fewer than ``2·TILE_ACCUMULATOR_ALIGN``) over several row blocks of a 2-byte gradient:
    the last 13 columns, for which neither the gradient nor the tile holds an accumulator, go to buffers in chunks no
    wider than the tile (one chunk of 13 wrote its dz past the tile)."""
    chunks = _check_schedule(29, 16, LeanPlan(4, 8, False, 0), 10)
    assert [(c.v0, c.v1, c.accumulator) for c in chunks] == [
        (0, 8, "gradient"), (8, 16, "gradient"), (16, 24, "buffer"), (24, 29, "buffer")]


# -- through the public ops on the triton backend ------------------------------------------------------------

from hf_fused.ops import linear_cross_entropy, linear_logprobs  # noqa: E402


def _run(hidden, weight, labels, plan, seed_weights):
    """Cross-entropy and log-probs + entropy through the two passes under ``plan``: their loss and gradients."""
    out = []
    with forced_plans(one_pass=False, two_pass=plan):
        for op in ("ce", "lp"):
            h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
            if op == "ce":
                loss = linear_cross_entropy(h, w, labels, reduction="sum", backend="triton", tile_budget_bytes=2**20)
            else:
                lp, ent = linear_logprobs(h, w, labels, return_entropy=True, backend="triton", tile_budget_bytes=2**20)
                loss = (lp * seed_weights[0]).sum() + (ent * seed_weights[1]).sum()
            loss.backward()
            out += [loss.detach(), h.grad, w.grad]
    return out


def _spy(monkeypatch, force=None):
    """Record the chunk kinds the backend used; with ``force``, replace every chunk's accumulator by it."""
    seen = []
    original = two_passes.weight_gradient_chunks

    def chunks(*args):
        result = original(*args)
        if force is not None:
            result = [WeightChunk(c.v0, c.v1, force if c.accumulator != "direct" else "direct") for c in result]
        seen.extend(c.accumulator for c in result)
        return result

    monkeypatch.setattr(two_passes, "weight_gradient_chunks", chunks)
    return seen


# Widths small enough for Triton's interpreter, each still several "gradient" chunks before the last ones; the
# halving's 12-column end is packed with padding in the tile (H = 32) or left to a buffer (H = 80).
@pytest.mark.parametrize("hidden_size,v,cols,kinds", [(32, 300, 128, {"gradient", "tile"}),
                                                       (80, 300, 128, {"gradient", "buffer"})])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_accumulators_in_the_gradient_and_tile_equal_a_buffer_of_their_own(monkeypatch, hidden_size, v, cols, kinds,
                                                                           weight_dtype):
    """25 kept rows of 30 in blocks of 10 (three blocks add into each chunk): the schedule puts the fp32
    accumulators in the gradient's unwritten rows, then in the tile (H = 32 beside a 10×128 tile) or, where no fp32
    row fits beside the dz (H = 80 beside a 10×128 tile), a last sliver in a buffer; the losses and every gradient
    are bit-identical to the same run with every accumulator a buffer of its own. An fp32 weight (its gradient
    fp32, its own accumulator) runs every chunk "direct"."""
    g = torch.Generator().manual_seed(0)
    n = 30
    hidden = torch.randn(n, hidden_size, generator=g).to(weight_dtype)
    weight = (torch.randn(v, hidden_size, generator=g) / hidden_size**0.25).to(weight_dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::6] = -100
    seed_weights = (torch.randn(n, generator=g), torch.randn(n, generator=g))
    plan = LeanPlan(block_rows=10, cols=cols, gather_rows=True, bytes=0)

    seen = _spy(monkeypatch)
    placed = _run(hidden, weight, labels, plan, seed_weights)
    if weight_dtype == torch.float32:
        assert set(seen) == {"direct"}
    else:
        assert set(seen) == kinds, set(seen)
    _spy(monkeypatch, force="buffer")
    own = _run(hidden, weight, labels, plan, seed_weights)
    for got, want in zip(placed, own):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # and the schedule matters: the weight gradient is not that of a run with no gradient at all
    assert placed[2].abs().sum() > 0 and placed[5].abs().sum() > 0


@pytest.mark.filterwarnings("error")  # on CPU a matmul into a too small out= tile resizes it, with a UserWarning
def test_a_narrow_forced_tile_writes_every_chunk_within_it():
    """Cross-entropy and log-probs + entropy of bf16 operands through the two passes under a forced 8-column tile
    in blocks of 4 of 10 rows (a vocabulary of 29: chunks 8, 8, then the last 13 columns in buffers of 8 and 5):
    no matmul writes past the tile (a 13-column chunk made CUDA's addmm raise and CPU's resize the tile, warning),
    and the losses and gradients are within float64's distance of the same call under a 32-column tile, plus one
    bf16 rounding."""
    from references import RTOL, dense_cross_entropy, dense_logprobs, leaf64, rel_err

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 16, generator=g).bfloat16()
    weight = (torch.randn(29, 16, generator=g) / 2).bfloat16()
    labels = torch.randint(0, 29, (10,), generator=g)
    labels[3] = -100
    seed_weights = (torch.randn(10, generator=g), torch.randn(10, generator=g))
    narrow = _run(hidden, weight, labels, LeanPlan(4, 8, False, 0), seed_weights)
    wide = _run(hidden, weight, labels, LeanPlan(4, 32, False, 0), seed_weights)
    exact = []
    for op in ("ce", "lp"):
        h, w = leaf64(hidden, True), leaf64(weight, True)
        if op == "ce":
            loss = dense_cross_entropy(h, w, labels, reduction="sum")
        else:
            lp, ent = dense_logprobs(h, w, labels)
            loss = (lp * seed_weights[0].double()).sum() + (ent * seed_weights[1].double()).sum()
        loss.backward()
        exact += [loss.detach(), h.grad, w.grad]
    for i, (got, theirs, want) in enumerate(zip(narrow, wide, exact)):
        bound = 1.05 * rel_err(theirs, want) + 2.0**-8 + RTOL
        assert rel_err(got, want) <= bound, (i, rel_err(got, want), bound)


def test_rounding_a_gradient_chunk_in_place_in_small_blocks():
    """``round_chunk_into_`` of a "gradient" chunk with a temporary of fewer rows than the chunk (the tile buffer
    smaller than the chunk's [cols, H]): every ascending block is read before its writes land, so the result is
    the fp32 accumulator rounded once, row for row."""
    from hf_fused.ops.grads import fp32_view

    hidden_size, width, v0 = 8, 37, 16
    grad = torch.full((v0 + 2 * width + 5, hidden_size), float("nan"), dtype=torch.bfloat16)
    acc = fp32_view(grad[v0 : v0 + 2 * width].view(-1), width)
    values = torch.randn(width, hidden_size, generator=torch.Generator().manual_seed(3))
    acc.copy_(values)
    for temp_rows in (1, 3, 8, 40):
        grad_copy = grad.clone()
        acc_copy = fp32_view(grad_copy[v0 : v0 + 2 * width].view(-1), width)
        assert torch.equal(acc_copy, values)
        weight_chunks.round_chunk_into_(grad_copy, WeightChunk(v0, v0 + width, "gradient"), acc_copy,
                                        torch.empty(temp_rows, hidden_size, dtype=torch.bfloat16))
        assert torch.equal(grad_copy[v0 : v0 + width], values.bfloat16()), temp_rows
        assert grad_copy[:v0].isnan().all()  # nothing before the chunk touched


@pytest.mark.gpu
def test_accumulators_on_gpu_match_a_buffer_of_their_own(monkeypatch):
    """The same comparison on the GPU in bf16 (cuBLAS, and the Hopper kernels where they run), 8192 rows in blocks
    of 2048 and V = 32768 in 4096-column chunks (accumulators in the gradient, then in the tile): the loss equal and
    every gradient element within one bf16 step of the buffer run's — a "tile" chunk's dz is packed with another
    row stride, for which cuBLAS may sum the same fp32 products in another order, flipping a rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden_size, v = 8192, 1024, 32768
    hidden = torch.randn(n, hidden_size, generator=g, device="cuda").bfloat16()
    weight = (torch.randn(v, hidden_size, generator=g, device="cuda") * (4 / hidden_size**0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g, device="cuda")
    labels[::10] = -100
    seed_weights = (torch.randn(n, generator=g, device="cuda"), torch.randn(n, generator=g, device="cuda"))
    plan = LeanPlan(block_rows=2048, cols=4096, gather_rows=True, bytes=0)
    seen = _spy(monkeypatch)
    placed = _run(hidden, weight, labels, plan, seed_weights)
    assert {"gradient", "tile"} <= set(seen), set(seen)
    _spy(monkeypatch, force="buffer")
    own = _run(hidden, weight, labels, plan, seed_weights)
    for i, (got, want) in enumerate(zip(placed, own)):
        if i % 3 == 0:
            assert torch.equal(got, want)
        else:
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all(), i


# -- the one pass's fp32 [V, H] accumulator, half of it in the bf16 gradient's own bytes ------------------------


@pytest.mark.parametrize("vocab", [7, 64, 301])
@pytest.mark.parametrize("factor", [1.0, 0.37, "tensor"])
def test_split_accumulator_rounds_the_fp32_sums_once(vocab, factor):
    """``split_accumulator`` + ``HeadGrads.input_grads``: whatever fp32 values the head (the gradient's own bytes)
    and the tail hold, the gradient comes out as ``(values · factor)`` rounded once to bf16, row for row — the
    in-place rounding of the head (ascending blocks of V/16 rows) never reads a row it has overwritten."""
    from hf_fused.ops.grads import HeadGrads, split_accumulator

    hidden_size = 6
    grad = torch.full((vocab, hidden_size), float("nan"), dtype=torch.bfloat16)
    head, tail = split_accumulator(grad)
    assert head.shape == (vocab // 2, hidden_size) and tail.shape == (vocab - vocab // 2, hidden_size)
    assert head.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    values = torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(vocab)) * 1e3
    head.copy_(values[: vocab // 2])
    tail.copy_(values[vocab // 2 :])
    f = torch.tensor(-2.5) if factor == "tensor" else factor
    weight = torch.zeros(vocab, hidden_size, dtype=torch.bfloat16)
    _, d_weight, _ = HeadGrads(weight=grad, weight_tail=tail).input_grads(
        torch.zeros(1, hidden_size), weight, None, torch.arange(1), f)
    assert d_weight.data_ptr() == grad.data_ptr() and d_weight.dtype == torch.bfloat16
    assert torch.equal(d_weight, (values * f).bfloat16())
