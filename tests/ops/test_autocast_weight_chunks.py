"""fp32 master weights under bf16 autocast (``Trainer(bf16=True)`` on a float32 model, TRL's GRPOTrainer default):
the GPU backend's two passes cast the weight one vocabulary chunk at a time instead of holding a whole bf16 copy,
the planner counts those buffers (and, for the one pass, the whole copies it makes), and the results are the
ones the whole cast gives, bit for bit.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (conftest); the casts are torch's on either device.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hf_fused.ops import LogitTransform, linear_cross_entropy  # noqa: E402
from hf_fused.ops.backends.triton_cublas import TritonCublasBackend, one_pass_rule, two_pass_rule  # noqa: E402
from hf_fused.ops.backends.triton_cublas import plan as planning  # noqa: E402
from hf_fused.ops.head_inputs import HeadInputs, NeededGrads  # noqa: E402

N, H, V = 40, 32, 1000
ALL = NeededGrads(True, True, False)


def _head(budget=None, bias=False, seed=0, n=N, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(v, H, generator=g) / H**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    rows = torch.arange(n)[torch.arange(n) % 5 != 0]  # some rows ignored: the kept rows are gathered or copied
    b = torch.randn(v, generator=g) if bias else None
    return HeadInputs(hidden, weight, b, labels, rows, LogitTransform(), budget, compute_dtype=torch.bfloat16)


class _BigAllocations(TorchDispatchMode):
    """The dtypes of every tensor an op returns with at least ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append((str(func), t.dtype))
        return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plan", [two_pass_rule.LeanPlan(13, 256, False, 0), two_pass_rule.LeanPlan(8, 384, True, 0)],
                         ids=["compact-rows", "gathered-rows"])
def test_two_passes_cast_chunk_by_chunk_with_the_whole_casts_bits(plan, bias):
    """Statistics and every gradient of the two passes from the fp32 head equal those from its whole-cast twin
    (:meth:`HeadInputs.computed`, what the op passed before) bit for bit, and no ``[V, H]`` bf16 tensor is ever
    made: the only weight-sized tensors are the fp32 inputs and gradient."""
    # 16 kept rows of 20 (blocks of 13 and 3, or two of 8) and a vocabulary of 400 (two chunks, the last ragged, in
    # either plan): every kernel of the two passes runs per row and chunk under Triton's interpreter
    v = 400
    backend, head = TritonCublasBackend(), _head(bias=bias, n=20, v=v)
    g = torch.Generator().manual_seed(1)
    m = head.rows.numel()
    g_lp, g_ent = torch.randn(m, generator=g), torch.randn(m, generator=g)
    outs = {}
    for name, h in (("chunks", head), ("whole", head.computed())):
        with planning.forced_plans(one_pass=False, two_pass=plan), _BigAllocations(v * H) as seen:
            fwd = backend.logprobs_forward(h, return_entropy=True)
            grads = backend.logprobs_backward(h, fwd.lse, fwd.entropy, g_lp, g_ent, need=ALL)
        outs[name] = (fwd, grads, seen.seen)
    (fwd, grads, seen), (ref_fwd, ref_grads, ref_seen) = outs["chunks"], outs["whole"]
    for a, b in ((fwd.logprobs, ref_fwd.logprobs), (fwd.entropy, ref_fwd.entropy), (fwd.lse, ref_fwd.lse),
                 (grads.hidden, ref_grads.hidden), (grads.weight, ref_grads.weight)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert grads.weight.dtype == torch.float32  # the fp32 weight's gradient, never rounded to bf16 on the way
    # the fp32 gradient is the one weight-sized tensor either way (the twin's bf16 copy was made before, by
    # computed(), as the op used to)
    assert [dtype for _, dtype in seen] == [dtype for _, dtype in ref_seen] == [torch.float32], (seen, ref_seen)


def test_the_lean_plan_counts_the_cast_chunk_within_the_budget():
    m, h, v, bf16 = 29_491, 2048, 151_936, 2
    for budget in (256 * 2**20, 64 * 2**20):
        rows = dict(copy_bytes=m * h * bf16, gather_row_bytes=h * bf16)
        plain = two_pass_rule.lean_two_pass_plan(m, h, v, bf16, budget, **rows)
        cast = two_pass_rule.lean_two_pass_plan(m, h, v, bf16, budget, **rows, col_bytes=h * bf16)
        assert cast.bytes <= budget and plain.bytes <= budget
        assert cast.cols < plain.cols  # the [cols, H] buffer takes its share of the budget
        tile_and_rows = cast.block_rows * (cast.cols * bf16 + (h * bf16 if cast.gather_rows else 0))
        assert cast.cols * h * bf16 <= cast.bytes - tile_and_rows


def test_the_backend_plans_the_cast_buffer_only_for_a_weight_in_another_dtype():
    wide = _head(budget=2**20)  # room for the whole vocabulary either way: the buffer is counted beside the tile
    casting, same = planning.plan_two_passes(wide), planning.plan_two_passes(wide.computed())
    assert (casting.block_rows, casting.cols) == (same.block_rows, same.cols) == (32, V)
    assert casting.bytes == same.bytes + V * H * 2 <= 2**20
    tight = _head(budget=100_000)  # the buffer takes room from the tile (here: half the rows per block)
    casting, same = planning.plan_two_passes(tight), planning.plan_two_passes(tight.computed())
    assert casting.block_rows * casting.cols < same.block_rows * same.cols
    assert casting.bytes <= 100_000 and same.bytes <= 100_000


def test_the_one_pass_counts_the_whole_casts_it_makes():
    """The one pass reads the whole weight per tile, so it casts it whole (and hidden): its plan counts both copies,
    and an explicit budget that only leaves room for the tile without them takes the two passes."""
    head = _head()
    view, casts = head.computed(meta=True), head.cast_bytes()
    assert casts == (V * H + N * H) * 2 and view.weight.dtype == torch.bfloat16 and view.weight.is_meta
    assert view.weight_grad_dtype == torch.float32 and view.compute_dtype is None
    assert head.computed().cast_bytes() == 0
    assert _head(bias=True).cast_bytes() == (V * H + N * H + V) * 2  # the bias's copy too
    gradient = N * H * 4  # fp32 hidden states: their whole gradient, written from the forward
    tile_rows = one_pass_rule.MIN_ONE_PASS_ROWS
    # per tile row: the gathered row in bf16, and the fp32 row its product passes through into the gradient
    without_casts = one_pass_rule.one_pass_working_set(V, H, 2, "none", tile_rows, gradient, H * 2 + H * 4)
    assert planning.plan_one_pass(replace(head, tile_budget_bytes=without_casts), ALL) is None
    with_casts = replace(head, tile_budget_bytes=without_casts + casts)
    plan = planning.plan_one_pass(with_casts, ALL)
    assert plan is not None and plan.accumulator == "none" and plan.bytes <= without_casts + casts


@pytest.mark.parametrize("budget", [None, 2**20])
def test_cross_entropy_under_autocast_with_fp32_weights_matches_float64(budget):
    """Through the public op: an fp32 model's head under CPU bf16 autocast, the Triton backend, default rule and an
    explicit budget (the two passes with chunk casts): loss and fp32 gradients against float64 within bf16's
    operand rounding (2⁻⁸ relative per operand; eager's error under the same autocast is of that size)."""
    head = _head()
    hidden = head.hidden.clone().requires_grad_()
    weight = head.weight.clone().requires_grad_()
    labels = head.labels.clone()
    labels[torch.arange(N) % 5 == 0] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, labels, backend="triton", tile_budget_bytes=budget)
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, ignore_index=-100)
    ref.backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    assert rel(hidden.grad, h64.grad) < 2e-2 and rel(weight.grad, w64.grad) < 2e-2
