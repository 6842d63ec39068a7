"""The GPU backend's planning (:mod:`hf_fused.ops.backends.triton_cublas.plan` and its rules): which schedule a call
takes, and its shapes.

The default rule is what makes hf_fused fast without options: on a CUDA device the one pass whenever its
working set fits in a quarter of the free memory, else the lean two passes. Free memory is injected here, so
the rule is checked on CPU exactly as the GPU backend applies it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")  # the GPU backend's package (its planning included) imports Triton

from hf_fused.ops import DEFAULT_TILE_BUDGET_BYTES, LogitTransform, describe_plan  # noqa: E402
from hf_fused.ops.backends.triton_cublas import (  # noqa: E402
    matmul, one_pass, one_pass_rule, operands, two_pass_rule, two_passes,
)
from hf_fused.ops.backends.triton_cublas import plan as planning  # noqa: E402
from hf_fused.ops.backends.triton_cublas.backend import TritonCublasBackend  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import (  # noqa: E402
    MIN_ONE_PASS_ROWS, ONE_PASS_FREE_SHARE, ONE_PASS_TILE_ROWS, OnePassPlan, one_pass_accumulators, one_pass_plan,
    one_pass_rows, one_pass_working_set,
)
from hf_fused.ops.backends.triton_cublas.two_pass_rule import two_pass_plan  # noqa: E402
from hf_fused.ops.head_inputs import HeadInputs, NeededGrads  # noqa: E402

V, H, BF16 = 151_936, 2048, 2
#: Bytes per [V, H] element of the one pass's fp32 weight-gradient accumulator beyond a bf16 gradient: half its rows
#: live in the gradient's own bytes (hf_fused.ops.grads.split_accumulator).
FP32_ACC = 2
CUDA = torch.device("cuda")
NEEDED = one_pass_working_set(V, H, BF16, "fp32", ONE_PASS_TILE_ROWS)  # fp32 [V, H] beyond the gradient + tile


def _meta_head(n: int, tile_budget_bytes, **kwargs) -> HeadInputs:
    """A bf16 ``[n, H]`` × ``[V, H]`` head on the meta device, every row kept: what the planner sees, no data."""

    return HeadInputs(torch.empty(n, H, dtype=torch.bfloat16, device="meta"),
                      torch.empty(V, H, dtype=torch.bfloat16, device="meta"), None,
                      torch.empty(n, dtype=torch.long, device="meta"), torch.empty(n, dtype=torch.long, device="meta"),
                      LogitTransform(), tile_budget_bytes, **kwargs)


def _free(monkeypatch, free):
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: free if device.type == "cuda" else None)


def test_working_set_is_the_fp32_accumulator_plus_the_tile():
    assert NEEDED == V * H * FP32_ACC + ONE_PASS_TILE_ROWS * V * BF16
    assert one_pass_working_set(V, H, BF16, "none", 100) == 100 * V * BF16  # frozen head: no accumulator
    assert one_pass_working_set(V, H, BF16, "none", 100, 7) == 100 * V * BF16 + 7  # the call's rows' buffers


def test_one_pass_counts_the_kept_rows_buffers(monkeypatch):
    """The one pass also holds the hidden gradient (until backward: bf16 hidden states' whole gradient and the kept
    rows' int8 residual, the fp32 buffer each tile's product passes through) and, when rows are ignored, each
    tile's kept hidden rows gathered into a [rows, H] buffer (not a compact copy of them all): the backend passes
    them to the planner, and an explicit budget covers them."""

    n, kept = 32768, 29491
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta")
    hidden = torch.empty(n, H, dtype=torch.bfloat16, device="meta")
    head = HeadInputs(hidden, weight, None, torch.empty(n, dtype=torch.long, device="meta"),
                      torch.empty(kept, dtype=torch.long, device="meta"), LogitTransform(), None)
    seen = []
    monkeypatch.setattr(planning, "one_pass_plan", lambda *a: seen.append(a))
    planning.plan_one_pass(head, NeededGrads(True, True, False))
    # the hidden gradient and its residual; per tile row a gathered row and the product's fp32 row
    assert seen[-1][-2:] == (n * H * BF16 + kept * H, H * BF16 + H * 4)
    every_row = replace(head, kept_rows=head.rows.new_empty(n))
    planning.plan_one_pass(every_row, NeededGrads(True, True, False))
    assert seen[-1][-2:] == (n * H * (BF16 + 1), H * 4)  # every row kept: tiles slice hidden itself
    planning.plan_one_pass(replace(every_row, hidden=hidden.float()), NeededGrads(False, True, False))
    assert seen[-1][-2:] == (0, H * (BF16 + 4))  # fp32 hidden states: gathered through fp32, no hidden gradient
    budget = V * H * FP32_ACC + MIN_ONE_PASS_ROWS * V * BF16
    assert one_pass_rows(V, H, BF16, "fp32", budget, CUDA) == MIN_ONE_PASS_ROWS
    assert one_pass_rows(V, H, BF16, "fp32", budget, CUDA, 7) == 0
    assert one_pass_rows(V, H, BF16, "fp32", budget, CUDA, 0, H * BF16) == 0
    assert one_pass_rows(V, H, BF16, "fp32", budget + MIN_ONE_PASS_ROWS * H * BF16, CUDA, 0, H * BF16) == \
        MIN_ONE_PASS_ROWS
    assert one_pass_working_set(V, H, BF16, "fp32", 10, 7, 3) == V * H * FP32_ACC + 10 * (V * BF16 + 3) + 7


@pytest.mark.parametrize("share,expected", [(1.0, ONE_PASS_TILE_ROWS), (1.01, ONE_PASS_TILE_ROWS), (0.99, 0)])
def test_default_takes_the_one_pass_when_it_fits_a_quarter_of_free_memory(monkeypatch, share, expected):
    _free(monkeypatch, int(NEEDED / ONE_PASS_FREE_SHARE * share))
    assert one_pass_rows(V, H, BF16, "fp32", None, CUDA) == expected


def test_default_for_a_frozen_head_needs_only_the_tile(monkeypatch):
    _free(monkeypatch, int(ONE_PASS_TILE_ROWS * V * BF16 / ONE_PASS_FREE_SHARE) + 1)
    assert one_pass_rows(V, H, BF16, "none", None, CUDA) == ONE_PASS_TILE_ROWS
    assert one_pass_rows(V, H, BF16, "fp32", None, CUDA) == 0


@pytest.mark.parametrize("free", [2**40, 0])
def test_explicit_budget_is_a_hard_bound_whatever_is_free(monkeypatch, free):
    _free(monkeypatch, free)
    accumulator = V * H * FP32_ACC
    assert one_pass_rows(V, H, BF16, "fp32", accumulator + MIN_ONE_PASS_ROWS * V * BF16, CUDA) == MIN_ONE_PASS_ROWS
    assert one_pass_rows(V, H, BF16, "fp32", accumulator + (MIN_ONE_PASS_ROWS - 1) * V * BF16, CUDA) == 0
    assert one_pass_rows(V, H, BF16, "fp32", DEFAULT_TILE_BUDGET_BYTES, CUDA) == 0


def test_default_off_cuda_is_the_default_budget(monkeypatch):
    _free(monkeypatch, 2**40)
    cpu = torch.device("cpu")
    assert one_pass_rows(V, H, BF16, "fp32", None, cpu) == one_pass_rows(V, H, BF16, "fp32", DEFAULT_TILE_BUDGET_BYTES, cpu)
    small_v = 1000
    rows = (DEFAULT_TILE_BUDGET_BYTES - small_v * 64 * FP32_ACC) // (small_v * 4)  # 67076
    assert one_pass_rows(small_v, 64, 4, "fp32", None, cpu) == rows - rows % one_pass_rule.ONE_PASS_ROW_ALIGN == 67072


@pytest.mark.parametrize("extra_rows", range(9))
def test_one_pass_rows_are_whole_multiples_of_the_alignment(extra_rows):
    """Under an explicit budget the rows per tile are the most that fit, rounded down to ``ONE_PASS_ROW_ALIGN``
    (each tile's slice of the fp32 / int64 per-row vectors then starts 16-byte aligned, as QuACK's TMA needs)."""
    budget = V * H * FP32_ACC + (MIN_ONE_PASS_ROWS + 8 + extra_rows) * V * BF16
    rows = one_pass_rows(V, H, BF16, "fp32", budget, CUDA)
    assert rows == MIN_ONE_PASS_ROWS + (16 if extra_rows == 8 else 8)
    assert rows % one_pass_rule.ONE_PASS_ROW_ALIGN == 0 and (rows * 4) % 16 == 0 and (rows * 8) % 16 == 0


@pytest.mark.parametrize("n_rows,budget", [(32768, None), (8192, 2**20 * 32), (3, None), (100_000, 2**20)])
def test_two_pass_tile_fits_the_budget_and_keeps_chunks_wide(n_rows, budget):
    rows, cols = two_pass_plan(n_rows, V, BF16, budget)
    assert rows * cols * BF16 <= (budget or DEFAULT_TILE_BUDGET_BYTES) or cols == two_pass_rule.MIN_CHUNK_COLS
    assert 1 <= rows <= n_rows and cols >= min(V, two_pass_rule.MIN_CHUNK_COLS)
    assert cols == V or cols % two_pass_rule.CHUNK_COL_ALIGN == 0


def test_two_pass_rejects_a_bad_budget():
    with pytest.raises(ValueError, match="tile_budget_bytes"):
        two_pass_plan(10, V, BF16, 0)


def test_describe_plan_names_the_schedule(monkeypatch):
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: 2**40)
    assert describe_plan(weight, n_rows=8192, backend="triton").startswith("one pass")
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: 2**30)
    assert describe_plan(weight, n_rows=8192, backend="triton").startswith("two passes")


def test_describe_plan_describes_what_the_tensors_backend_runs():
    """A CPU weight gets the torch reference: its line names that backend's tile, not a GPU schedule; the GPU
    backend's line (here forced, its kernels under Triton's interpreter) is its plan's."""
    weight = torch.empty(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    assert describe_plan(weight, n_rows=100).startswith("torch reference, one pass per tile: 100 rows per tile")
    assert "fp32 weight gradient" not in describe_plan(weight, n_rows=100, need_weight=False)
    assert describe_plan(weight, n_rows=100, backend="triton").startswith("one pass (6·N·H·V)")
    with pytest.raises(ValueError, match="tile_budget_bytes"):
        describe_plan(weight, n_rows=100, tile_budget_bytes=0)
    with pytest.raises(ValueError, match="weight must be a \\[V, H\\] tensor"):
        describe_plan(weight[0], n_rows=100)
    with pytest.raises(ValueError, match="n_rows"):
        describe_plan(weight, n_rows=-1)


def test_describe_plan_reads_the_backends_plan(monkeypatch):
    """``describe_plan`` asks the GPU backend's own planner (the loops' plan functions), not a copy of it."""
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    heads = []
    monkeypatch.setattr(planning, "plan_one_pass", lambda head, need, **_: heads.append((head, need)) or OnePassPlan(
        1234, "pair", 0))
    assert describe_plan(weight, n_rows=100, n_tokens=130, backend="triton").startswith(
        "one pass (6·N·H·V): 1234 rows per tile")
    head, need = heads[0]
    assert head.weight is weight and head.hidden.shape == (130, H) and head.rows.numel() == 100
    assert need == NeededGrads(True, True, False)
    lean = two_pass_rule.LeanPlan(64, 4096, True, 123 * 2**20)
    monkeypatch.setattr(planning, "plan_one_pass", lambda head, need, **_: None)
    with planning.forced_plans(two_pass=lean):
        line = describe_plan(weight, n_rows=100, n_tokens=130, backend="triton", tile_budget_bytes=2**30)
    assert line.startswith("two passes (8·N·H·V): 64×4096 tile, 0.12 GiB") and line.endswith("gathered per block")


# -- the one pass's weight-gradient accumulator -----------------------------------------------------------

PAIRED = ("fp32", "pair")
PAIR_NEEDED = one_pass_working_set(V, H, BF16, "pair", ONE_PASS_TILE_ROWS)  # int8 [V, H] + a 2048-row bf16 tile


def test_accumulators_a_call_can_use():
    assert one_pass_accumulators(False, torch.bfloat16, torch.bfloat16) == ("none",)  # frozen lm_head
    assert one_pass_accumulators(True, torch.float32, torch.bfloat16) == ("none",)  # fp32 master weights
    assert one_pass_accumulators(True, torch.bfloat16, torch.bfloat16) == PAIRED
    assert one_pass_accumulators(True, torch.float16, torch.float16) == ("fp32",)  # the pair is bf16 only
    assert one_pass_accumulators(True, torch.float32, torch.float32) == ("none",)
    assert one_pass_working_set(V, H, BF16, "pair", 0) == V * H * one_pass_rule.PAIR_RESIDUAL_BYTES
    with pytest.raises(ValueError, match="accumulator must be one of"):
        one_pass_working_set(V, H, BF16, "bf16", 0)
    with pytest.raises(ValueError, match="at least one accumulator"):
        one_pass_plan(V, H, BF16, (), None, CUDA)


@pytest.mark.parametrize("free,expected", [
    (NEEDED / ONE_PASS_FREE_SHARE, "fp32"),  # the fp32 accumulator fits: the fastest one pass
    (NEEDED / ONE_PASS_FREE_SHARE - 1, "pair"),  # it does not: the pair's 1 byte per element does
    (PAIR_NEEDED / ONE_PASS_FREE_SHARE, "pair"),
    (PAIR_NEEDED / ONE_PASS_FREE_SHARE - 1, None),  # neither: two passes
])
def test_default_takes_the_pair_where_only_it_fits(monkeypatch, free, expected):
    _free(monkeypatch, int(free))
    plan = one_pass_plan(V, H, BF16, PAIRED, None, CUDA)
    assert (plan and plan.accumulator) == expected
    if plan:
        assert plan == OnePassPlan(ONE_PASS_TILE_ROWS, expected, NEEDED if expected == "fp32" else PAIR_NEEDED)
    # without the pair (fp16 gradients) the same memory gives the two passes
    assert (one_pass_plan(V, H, BF16, ("fp32",), None, CUDA) is None) == (expected != "fp32")


@pytest.mark.parametrize("fp32_rows", [ONE_PASS_TILE_ROWS, ONE_PASS_TILE_ROWS - 8, MIN_ONE_PASS_ROWS, 0])
def test_explicit_budget_keeps_fp32_for_full_tiles_else_the_most_rows(monkeypatch, fp32_rows):
    """Under a budget the fp32 accumulator wins while it leaves ONE_PASS_TILE_ROWS rows per tile; below that the
    pair (3 bytes less per [V, H] element: 3·V·H/(V·2) = 1.5·H more rows) leaves more rows and is taken."""
    _free(monkeypatch, 0)  # ignored under a budget
    extra = 1000 * H * 4
    budget = V * H * FP32_ACC + fp32_rows * V * BF16 + extra
    plan = one_pass_plan(V, H, BF16, PAIRED, budget, CUDA, extra)
    if fp32_rows == ONE_PASS_TILE_ROWS:
        assert plan.accumulator == "fp32" and plan.rows == ONE_PASS_TILE_ROWS
    else:
        pair_rows = (budget - V * H - extra) // (V * BF16)
        assert plan.accumulator == "pair" and plan.rows == pair_rows - pair_rows % one_pass_rule.ONE_PASS_ROW_ALIGN
    assert plan.bytes == one_pass_working_set(V, H, BF16, plan.accumulator, plan.rows, extra) <= budget
    assert one_pass_plan(V, H, BF16, PAIRED, V * H + (MIN_ONE_PASS_ROWS - 1) * V * BF16, CUDA) is None


def test_describe_plan_names_the_accumulator(monkeypatch):
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: 2**40)  # any device: the weight is on meta
    assert describe_plan(weight, n_rows=8192, backend="triton").endswith("accumulator 'fp32'")
    free = int((PAIR_NEEDED + 8192 * H * 4) / ONE_PASS_FREE_SHARE)
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: free)
    assert describe_plan(weight, n_rows=8192, backend="triton").endswith("accumulator 'pair'")
    # fp32 weight: no pair
    assert describe_plan(weight.float(), n_rows=8192, backend="triton").startswith("two passes")


def test_gpu_backend_asks_the_planner(monkeypatch):

    seen = []
    monkeypatch.setattr(planning, "one_pass_plan", lambda *a: seen.append(a))
    n = 64
    head = _meta_head(n, 12345)
    assert planning.plan_one_pass(head, NeededGrads(True, True, False)) is None
    assert seen == [(V, H, BF16, ("fp32", "pair"), 12345, head.weight.device, n * H * 3, H * 4)]


# -- the two passes' hidden-gradient accumulator ---------------------------------------------------------


def test_hidden_accumulator_pair_only_under_an_explicit_budget():
    # default rule: the fastest two passes (fp32 buffer, cuBLAS); an explicit budget: the bf16 pair's residual
    assert two_pass_rule.hidden_accumulator(1000, H, torch.bfloat16, None) == ("fp32", 1000 * H * 4)
    assert two_pass_rule.hidden_accumulator(1000, H, torch.bfloat16, 2**28) == ("pair", 1000 * H * 1)  # int8 residual
    assert two_pass_rule.hidden_accumulator(1000, H, torch.float16, 2**28) == ("fp32", 1000 * H * 4)
    assert two_pass_rule.hidden_accumulator(1000, H, torch.float32, 2**28) == ("none", 0)
    # what each reads and writes per row and chunk: bf16 hi + int8 lo, or an fp32 buffer
    assert two_pass_rule.accumulation_row_bytes("pair", H, BF16) == 2 * H * 3
    assert two_pass_rule.accumulation_row_bytes("fp32", H, BF16) == 8 * H
    assert two_pass_rule.accumulation_row_bytes("none", H, 4) == 8 * H


@pytest.mark.parametrize("n_rows", [32768, 8192, 100_000])
def test_two_pass_tile_and_accumulator_share_the_budget(n_rows):
    budget = DEFAULT_TILE_BUDGET_BYTES
    _, reserved = two_pass_rule.hidden_accumulator(n_rows, H, torch.bfloat16, budget)
    rows, cols = two_pass_plan(n_rows, V, BF16, budget, reserved)
    tile = rows * cols * BF16
    if reserved + two_pass_rule.MIN_TWO_PASS_TILE_BYTES <= budget:
        assert tile + reserved <= budget  # 32768 tokens: the whole lean working set within 256 MiB
    else:  # the accumulator alone nearly fills the budget: the tile keeps its floor
        assert tile <= two_pass_rule.MIN_TWO_PASS_TILE_BYTES and tile >= two_pass_rule.MIN_TWO_PASS_TILE_BYTES // 2
    assert cols >= two_pass_rule.MIN_CHUNK_COLS and (cols == V or cols % two_pass_rule.CHUNK_COL_ALIGN == 0)


def test_gpu_two_pass_accumulates_a_bf16_hidden_gradient_as_a_compensated_pair():
    """The triton backend's gradient pass (on CPU under Triton's interpreter) with bf16 hidden states against the
    same pass accumulating in fp32 (fp32 hidden states: the same bf16 operands after the backend's cast, so the
    same logits gradient): the pair's gradient is the fp32 sum rounded once, but for sums within the pair's
    error of a rounding tie (measured: none or a handful of elements; at most one ulp apart there)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 48, 64, 4500  # a 2048-column chunk floor: three vocabulary chunks (the last ragged)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    rows = torch.arange(n)[torch.arange(n) % 5 != 0]  # ignored tokens: the pair writes hidden's whole gradient
    backend, transform = TritonCublasBackend(), LogitTransform()
    m = rows.numel()
    # all rows × 2048 columns + the residual + the compact copy of the kept rows
    budget = (m * (2048 * 2 + h * 2 + two_pass_rule.ROW_VECTOR_BYTES)
              + two_pass_rule.hidden_accumulator(m, h, torch.bfloat16, 1)[1])
    head = HeadInputs(hidden, weight, None, labels, rows, transform, budget)
    lse = backend.logprobs_forward(head).lse
    g_lp = torch.randn(m, generator=g)
    only_hidden = NeededGrads(hidden=True, weight=False, bias=False)
    calls = []
    original = two_passes.compensated_addmm_

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    two_passes.compensated_addmm_, saved = spy, two_passes.compensated_addmm_
    try:
        pair = backend.logprobs_backward(head, lse, None, g_lp, None, need=only_hidden).hidden
        # The default rule (no budget) keeps the fastest two passes: cuBLAS into an fp32 buffer, no pair.
        default = backend.logprobs_backward(replace(head, tile_budget_bytes=None), lse, None, g_lp, None,
                                            need=only_hidden).hidden
    finally:
        two_passes.compensated_addmm_ = saved
    fp32 = backend.logprobs_backward(replace(head, hidden=hidden.float()), lse, None, g_lp, None,
                                     need=only_hidden).hidden
    assert len(calls) == 3 and pair.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert default.dtype == torch.float32 and default.shape == (m, h)
    fp32_default = backend.logprobs_backward(replace(head, hidden=hidden.float(), tile_budget_bytes=None), lse, None,
                                             g_lp, None, need=only_hidden).hidden
    assert torch.equal(default, fp32_default)  # the same plan and the same fp32 accumulation
    assert pair.shape == (n, h) and fp32.shape == (m, h)
    ignored = torch.ones(n, dtype=torch.bool)
    ignored[rows] = False
    assert (pair[ignored] == 0).all()
    pair = pair[rows]
    rounded = fp32.bfloat16()
    differs = pair != rounded
    assert differs.float().mean() <= 0.01, differs.float().mean()
    ulp = (rounded.float().abs() * 2.0**-7).clamp(min=2.0**-126)
    assert ((pair.float() - rounded.float()).abs()[differs] <= ulp[differs]).all()


# -- an explicit budget bounds the lean two passes' whole working set --------------------------------------

LEAN_M = 29_491  # 32768 tokens, 10% ignored: the benchmark's cross-entropy shape


def _lean(budget, residual=1, copy=True, weight_chunk=True):
    return two_pass_rule.lean_two_pass_plan(
        LEAN_M, H, V, BF16, budget, reserved_bytes=LEAN_M * H * residual, copy_bytes=LEAN_M * H * BF16 if copy else 0,
        gather_row_bytes=H * BF16, accumulator_row_bytes=H * (2 * BF16 + 2 * residual), weight_chunk=weight_chunk)


@pytest.mark.parametrize("budget_mib", [256, 384, 1024])
@pytest.mark.parametrize("residual", [1, 2])
def test_lean_plan_holds_the_whole_working_set_within_the_budget(budget_mib, residual):
    budget = budget_mib * 2**20
    plan = _lean(budget, residual)
    # counted independently: residual, the kept rows (a compact copy or one gathered block) and the tile; the fp32
    # weight-gradient chunk, when several row blocks add into it, lives in the gradient or the tile (no budget)
    rows = plan.block_rows * H * BF16 if plan.gather_rows else LEAN_M * H * BF16
    vectors = LEAN_M * two_pass_rule.ROW_VECTOR_BYTES  # row indices, labels, log-sum-exp, upstream gradients
    assert LEAN_M * H * residual + rows + plan.block_rows * plan.cols * BF16 + vectors == plan.bytes <= budget
    assert plan.cols >= two_pass_rule.MIN_CHUNK_COLS and plan.cols % two_pass_rule.CHUNK_COL_ALIGN == 0


def test_lean_plan_gathers_rows_only_when_a_compact_copy_leaves_too_little():
    # 256 MiB: residual 115 + copy 115 MiB would leave 26 MiB for tile and weight chunk: gather row blocks
    assert _lean(256 * 2**20).gather_rows
    # 1 GiB: the copy fits beside a tile of every kept row: no per-chunk gather, one row block
    plan = _lean(2**30)
    assert not plan.gather_rows and plan.block_rows == LEAN_M


def test_lean_plan_without_ignored_rows_reads_hidden_in_place():
    plan = _lean(256 * 2**20, copy=False)  # every row kept: nothing to copy or gather
    assert not plan.gather_rows
    assert plan.bytes == LEAN_M * (H * 1 + two_pass_rule.ROW_VECTOR_BYTES) + plan.block_rows * plan.cols * BF16


def test_lean_plan_moves_fewer_bytes_with_wider_chunks():
    # With a gather, every chunk re-reads the kept rows and the pair: the plan takes fewer, wider chunks over
    # more row blocks (here 4 blocks × 5120 columns) rather than the narrowest chunks under all rows.
    plan = _lean(256 * 2**20)
    assert plan.block_rows < LEAN_M and plan.cols > 2 * two_pass_rule.MIN_CHUNK_COLS


def test_lean_plan_keeps_the_tile_floor_when_nothing_fits():
    budget = 48 * 2**20  # below the residual alone (58 MiB)
    plan = _lean(budget)
    assert plan.bytes > budget and not plan.gather_rows
    assert plan.block_rows * plan.cols * BF16 <= two_pass_rule.MIN_TWO_PASS_TILE_BYTES


def test_gpu_two_pass_gathered_row_blocks_match_the_compact_copy(monkeypatch):
    """The triton backend's two passes (CPU, Triton's interpreter) with the same tile, once from one compact copy
    of the kept rows and once gathering each row block per chunk: bit-identical statistics and gradients (the
    same operands reach the same matmuls), for bf16 hidden states and for fp32 ones cast to a bf16 weight."""

    g = torch.Generator().manual_seed(1)
    # Small for Triton's interpreter (its time goes with rows × chunks): 13 kept rows in blocks of 5, 5 and 3; 128-column
    # tiles of a vocabulary of 200, 2 statistics chunks and 6 gradient chunks whose accumulators live in the gradient,
    # then the tile
    n, h, v, cols = 20, 32, 200, 128
    weight = (torch.randn(v, h, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    rows = torch.arange(n)[torch.arange(n) % 3 != 1]
    m = rows.numel()
    g_lp, g_ent = torch.randn(m, generator=g), torch.randn(m, generator=g)
    need = NeededGrads(hidden=True, weight=True, bias=False)
    backend = TritonCublasBackend()
    for hidden in (torch.randn(n, h, generator=g).bfloat16(), torch.randn(n, h, generator=g)):
        head = HeadInputs(hidden, weight, None, labels, rows, LogitTransform(), 2**20)
        results = []
        for gather in (False, True):
            forced = two_pass_rule.LeanPlan(block_rows=5, cols=cols, gather_rows=gather, bytes=0)
            monkeypatch.setattr(planning, "plan_two_passes", lambda *a, **k: forced)
            fwd = backend.logprobs_forward(head, return_entropy=True)
            grads = backend.logprobs_backward(head, fwd.lse, fwd.entropy, g_lp, g_ent, need=need)
            results.append((fwd.logprobs, fwd.entropy, fwd.lse, grads.hidden, grads.weight))
        for compact, gathered in zip(*results):
            assert torch.equal(compact, gathered)
        assert results[0][3].dtype == (torch.bfloat16 if hidden.dtype == torch.bfloat16 else torch.float32)


def test_gpu_two_pass_plans_within_an_explicit_budget():
    """The backend hands the planner everything it will hold: with a quarter of the rows ignored and a budget too
    small for their compact copy, the plan gathers row blocks and counts the gather buffer (the weight-gradient
    chunk's accumulator takes no budget: weight_chunks.weight_gradient_chunks)."""

    n, h, v = 4000, 64, 4300
    hidden = torch.zeros(n, h, dtype=torch.bfloat16)
    weight = torch.zeros(v, h, dtype=torch.bfloat16)
    rows = torch.arange(n)[torch.arange(n) % 4 != 0]
    m = rows.numel()
    kind, residual = two_pass_rule.hidden_accumulator(m, h, torch.bfloat16, 1)
    # room for 64 gathered rows of a 2048-column tile, not for the compact copy beside a 2048-column row
    budget = residual + m * two_pass_rule.ROW_VECTOR_BYTES + 64 * (2048 * BF16 + h * BF16)
    assert budget - residual - m * two_pass_rule.ROW_VECTOR_BYTES - m * h * BF16 < 2048 * BF16
    head = HeadInputs(hidden, weight, None, torch.zeros(n, dtype=torch.long), rows, LogitTransform(), budget)
    plan = planning.plan_two_passes(head, reserved_bytes=residual, accumulator_row_bytes=h * 6, weight_chunk=True)
    assert kind == "pair" and plan.gather_rows and plan.bytes <= budget
    assert plan.bytes == residual + m * two_pass_rule.ROW_VECTOR_BYTES + plan.block_rows * (plan.cols + h) * BF16


def test_gpu_two_pass_gathers_into_one_buffer_for_the_whole_pass():
    """Every gathered row block, in every vocabulary chunk, lives in the one buffer the plan counted (a block
    still referenced when the next chunk starts measured a second buffer at the H100's peak before this)."""

    n, h = 50, 16
    hidden = torch.randn(n, h).bfloat16()
    rows = torch.arange(0, n, 3)
    head = HeadInputs(hidden, torch.zeros(100, h, dtype=torch.bfloat16), None, torch.zeros(n, dtype=torch.long),
                      rows, LogitTransform(), 2**20)
    plan = two_pass_rule.LeanPlan(block_rows=6, cols=2048, gather_rows=True, bytes=0)
    compact, buf, labels = operands.rows_source(head, plan)
    assert compact is None and buf.shape == (6, h) and labels.shape == rows.shape
    for _chunk in range(2):
        for r0, r1, h_rows in operands.row_blocks(head, plan, compact, buf):
            assert h_rows.data_ptr() == buf.data_ptr() and torch.equal(h_rows, hidden[rows[r0:r1]])


def test_the_planner_counts_the_residual_the_kernel_stores():
    from hf_fused.ops.backends.triton_cublas.compensated import RESIDUAL_DTYPE

    assert one_pass_rule.PAIR_RESIDUAL_BYTES == RESIDUAL_DTYPE.itemsize


@pytest.mark.parametrize("m", [29_491, 3_000, 1_025])
def test_lean_plan_splits_rows_into_equal_blocks(m):
    # 29491 rows in blocks of 7372 would leave a 5th block of 3 rows: four more launches per chunk for nothing
    for budget in (256 * 2**20, 2**22, 2**24):
        plan = two_pass_rule.lean_two_pass_plan(m, H, V, BF16, budget, reserved_bytes=m * H, copy_bytes=m * H * BF16,
                                         gather_row_bytes=H * BF16, accumulator_row_bytes=H * 6, weight_chunk=True)
        blocks = -(-m // plan.block_rows)
        assert plan.block_rows == -(-m // blocks), (budget, plan)


@pytest.mark.parametrize("grad_dtype,accumulators", [(None, ("fp32", "pair")), (torch.bfloat16, ("fp32", "pair")),
                                                      (torch.float32, ("none",))])
def test_an_fp32_weight_gradient_is_not_planned_as_an_extra_accumulator(monkeypatch, grad_dtype, accumulators):
    """fp32 master weights under autocast: the one pass's fp32 [V, H] buffer becomes the weight's gradient itself,
    so the planner is asked about the tile alone (the default rule then takes the one pass with less free memory)."""

    seen = []
    monkeypatch.setattr(planning, "one_pass_plan", lambda *a: seen.append(a))
    head = _meta_head(64, None, weight_grad_dtype=grad_dtype)
    assert one_pass.run_one_pass(head, None, NeededGrads(True, True, False), False, ()) is None
    assert seen[0][3] == accumulators


# -- row blocks in whole waves of the pair's persistent matmul -----------------------------------------------


@pytest.mark.parametrize("quantum", [4224, 1056, 384])
@pytest.mark.parametrize("m", [29_491, 28_672, 9_000])
def test_lean_plan_blocks_are_whole_quanta(m, quantum):
    for budget in (256 * 2**20, 128 * 2**20, 2**30):
        plan = two_pass_rule.lean_two_pass_plan(m, H, V, BF16, budget, reserved_bytes=m * H, copy_bytes=m * H * BF16,
                                         gather_row_bytes=H * BF16, accumulator_row_bytes=H * 6, weight_chunk=True,
                                         row_quantum=quantum)
        if plan.bytes <= budget:  # a plan that fits; the floor plan when nothing does is the unquantized one
            assert plan.block_rows == m or plan.block_rows % quantum == 0, (budget, plan)


@pytest.mark.parametrize("m", [3_276, 5_000, 9_000])
def test_lean_plan_in_quanta_fits_wherever_equal_blocks_fit(m):
    """Fewer rows than a quantum, or a budget too small for a block of whole quanta: equal blocks, within the
    budget, rather than the over-budget floor plan (a 4224-row quantum left 3276 rows only one block, which did
    not fit 16 MiB)."""
    h, v = 1024, 32_000
    kw = dict(reserved_bytes=m * h, copy_bytes=m * h * BF16, gather_row_bytes=h * BF16, accumulator_row_bytes=h * 6,
              weight_chunk=True)
    for budget in range(8 * 2**20, 64 * 2**20, 2**21):
        if two_pass_rule.lean_two_pass_plan(m, h, v, BF16, budget, **kw).bytes <= budget:
            quantized = two_pass_rule.lean_two_pass_plan(m, h, v, BF16, budget, row_quantum=4224, **kw)
            assert quantized.bytes <= budget, budget


def test_lean_plan_in_waves_on_the_benchmark_shape():
    """32768 tokens, 10% ignored, 256 MiB, H100 (132 SMs, 128×256 tiles of a 2048-wide product: 4224 rows are two
    waves): three blocks of 8448 rows (four waves each) and one of 4147 (two), not four of 7373 (3.5 waves each,
    the last half empty); measured 3% faster per step (H100, 2026-11-25)."""
    plain = _lean(256 * 2**20)
    waves = two_pass_rule.lean_two_pass_plan(
        LEAN_M, H, V, BF16, 256 * 2**20, reserved_bytes=LEAN_M * H, copy_bytes=LEAN_M * H * BF16,
        gather_row_bytes=H * BF16, accumulator_row_bytes=H * 6, weight_chunk=True, row_quantum=4224)
    assert (plain.block_rows, waves.block_rows) == (7373, 8448)
    assert waves.bytes <= 256 * 2**20 and waves.cols >= two_pass_rule.MIN_CHUNK_COLS


@pytest.mark.parametrize("sms", [132, 114, 78, 1])
@pytest.mark.parametrize("n", [2048, 4096, 2560, 896, 5120])
def test_wave_rows_are_the_fewest_rows_of_whole_waves(monkeypatch, sms, n):

    monkeypatch.setattr(matmul, "multiprocessors", lambda device: sms)
    rows = matmul.wave_rows(n, torch.device("cuda"))  # no CUDA call: the SM count is patched
    block_m, block_n = matmul.LARGE.block_m, matmul.LARGE.block_n

    def tiles(r):
        return -(-r // block_m) * -(-n // block_n)

    assert rows % block_m == 0 and tiles(rows) % sms == 0
    assert all(tiles(r) % sms for r in range(block_m, rows, block_m))
    assert matmul.wave_rows(n, torch.device("cpu")) == 1


def test_gpu_two_pass_asks_for_row_blocks_in_waves_and_unequal_blocks_agree(monkeypatch):
    """The backward asks the planner for row blocks in whole waves of the pair's matmul, and blocks of unequal
    size (whole quanta, then the rest) give the equal blocks' gradients: the hidden gradient bit for bit (each
    row's fold sees the same products in the same order), the weight gradient to within one bf16 ulp (its fp32
    chunk adds the row blocks' products in another grouping, then rounds once to bf16)."""

    g = torch.Generator().manual_seed(3)
    # 128-column tiles of a vocabulary of 300 (small for Triton's interpreter): 6 gradient chunks, their
    # fp32 accumulators in the gradient then the tile, over both blockings
    n, h, v, cols = 45, 32, 300, 128
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    rows = torch.arange(n)[torch.arange(n) % 4 != 2]
    m = rows.numel()
    g_lp = torch.randn(m, generator=g)
    need = NeededGrads(hidden=True, weight=True, bias=False)
    head = HeadInputs(hidden, weight, None, labels, rows, LogitTransform(), 2**20)
    backend = TritonCublasBackend()
    fwd = backend.logprobs_forward(head)
    monkeypatch.setattr(planning, "wave_rows", lambda n_cols, device: 16)
    asked, results = [], []
    for block_rows in (17, 16):  # 34 rows: two equal blocks, then blocks of 16, 16 and 2
        forced = two_pass_rule.LeanPlan(block_rows=block_rows, cols=cols, gather_rows=False, bytes=0)
        monkeypatch.setattr(planning, "plan_two_passes",
                            lambda *a, **k: asked.append(k.get("row_quantum")) or forced)
        grads = backend.logprobs_backward(head, fwd.lse, None, g_lp, None, need=need)
        assert grads.hidden_scattered
        results.append((grads.hidden, grads.weight))
    assert asked == [16, 16] and m == 34
    (dh_equal, dw_equal), (dh_waves, dw_waves) = results
    assert torch.equal(dh_equal, dh_waves)
    ulp = (dw_equal.float().abs() * 2.0**-7).clamp(min=2.0**-133)
    assert ((dw_equal.float() - dw_waves.float()).abs() <= ulp).all()


# -- forced plans (tile sweeps) ----------------------------------------------------------------------------

def test_forced_plans_replace_the_rule_inside_the_block_only(monkeypatch):
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: 2**40)  # any device: the head is on meta
    head, need, frozen = _meta_head(64, None), NeededGrads(True, True, False), NeededGrads(True, False, False)
    forced = OnePassPlan(512, "pair", 0)
    rule = planning.plan_one_pass(head, need)
    assert rule.accumulator == "fp32"
    lean = two_pass_rule.LeanPlan(100, 4096, True, 0)
    with planning.forced_plans(one_pass=forced, two_pass=lean):
        assert planning.plan_one_pass(head, need) is forced
        # an accumulator the call cannot use gives way to the call's first: a frozen head needs none
        assert planning.plan_one_pass(head, frozen) == OnePassPlan(512, "none", 0)
        assert planning.forced_two_pass_plan() is lean and planning.plan_two_passes(head) is lean
        with planning.forced_plans(one_pass=False):  # nested: two passes, the outer two-pass tile kept
            assert planning.plan_one_pass(head, need) is None
            assert planning.forced_two_pass_plan() is lean
        assert planning.plan_one_pass(head, need) is forced
    assert planning.plan_one_pass(head, need) == rule and planning.forced_two_pass_plan() is None
    with pytest.raises(TypeError, match="one_pass must be"):
        with planning.forced_plans(one_pass=2048):
            pass
    with pytest.raises(TypeError, match="two_pass must be"):
        with planning.forced_plans(two_pass=(100, 4096)):
            pass


def test_gpu_backend_takes_forced_plans():
    head = _meta_head(64, 12345)
    lean = two_pass_rule.LeanPlan(32, 2048, False, 0)
    with planning.forced_plans(one_pass=OnePassPlan(16, "pair", 0), two_pass=lean):
        assert planning.plan_one_pass(head, NeededGrads(True, True, False)) == OnePassPlan(16, "pair", 0)
        assert planning.plan_two_passes(head) is lean


def test_two_pass_tile_plan_is_the_default_or_the_lean_plan():
    rows, cols = two_pass_plan(8192, V, BF16, None)
    assert two_pass_rule.two_pass_tile_plan(8192, H, V, BF16, None) == two_pass_rule.LeanPlan(rows, cols, False,
                                                                                            rows * cols * BF16)
    kw = dict(reserved_bytes=8192 * H, copy_bytes=8192 * H * BF16, gather_row_bytes=H * BF16,
              accumulator_row_bytes=6 * H, weight_chunk=True, row_quantum=128)
    assert two_pass_rule.two_pass_tile_plan(8192, H, V, BF16, 2**28, **kw) == \
        two_pass_rule.lean_two_pass_plan(8192, H, V, BF16, 2**28, **kw)
    with pytest.raises(ValueError, match="tile_budget_bytes"):
        two_pass_rule.two_pass_tile_plan(8192, H, V, BF16, 0)


def test_default_reads_free_memory_once_when_the_fp32_accumulator_fits(monkeypatch):
    """The pair is only asked about when the fp32 buffer falls short: one free-memory query per call otherwise."""
    calls = []
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: calls.append(device) or 2**40)
    assert one_pass_plan(V, H, BF16, PAIRED, None, CUDA).accumulator == "fp32" and len(calls) == 1
    monkeypatch.setattr(one_pass_rule, "free_device_bytes", lambda device: calls.append(device) or int(PAIR_NEEDED * 4))
    assert one_pass_plan(V, H, BF16, PAIRED, None, CUDA).accumulator == "pair" and len(calls) == 3


@pytest.mark.gpu
def test_free_device_bytes_reads_the_allocator_once():
    """The default rule's free memory (driver-free plus the allocator's reserved but unallocated bytes) from one
    read of the allocator's nested statistics equals ``memory_reserved() − memory_allocated()``'s."""
    device = torch.device("cuda")
    keep = torch.empty(3 * 2**20 + 5, dtype=torch.uint8, device=device)  # noqa: F841  (something allocated)
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    want = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert one_pass_rule.free_device_bytes(device) == want
