"""What the ops accept and what they allocate: clear errors for bad inputs, backend selection, and the
tile planner's memory bound (no ``[N, V]`` tensor ever exists; each tile stays inside its budget)."""

from __future__ import annotations

import weakref
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from references import dense_cross_entropy, make_head_inputs
from hf_fused.ops import (
    DEFAULT_TILE_BUDGET_BYTES,
    available_backends,
    linear_cross_entropy,
    linear_logprobs,
    rows_per_tile,
)
from hf_fused.ops import backends as backends_module
from hf_fused.ops.backends import TorchReferenceBackend
from hf_fused.ops.tiling import TILE_BUFFERS

H, V = 8, 50


def inputs(batch_shape=(2, 3), **kwargs):
    return make_head_inputs(batch_shape, H, V, **kwargs)


def ce(hidden, weight, labels, bias=None, **kwargs):
    return linear_cross_entropy(hidden, weight, labels, bias, **kwargs)


def lp(hidden, weight, labels, bias=None, **kwargs):
    return linear_logprobs(hidden, weight, labels, bias, return_entropy=True, **kwargs)


def ce_none(hidden, weight, labels, bias=None, **kwargs):
    return linear_cross_entropy(hidden, weight, labels, bias, reduction="none", **kwargs)


OPS = {"cross_entropy": ce, "cross_entropy_none": ce_none, "logprobs": lp}
op_param = pytest.mark.parametrize("op", list(OPS.values()), ids=list(OPS))


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["avg", "MEAN", None, "batchmean"])
def test_unknown_reduction_is_a_value_error_naming_the_choices(reduction):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match=r"reduction must be one of .*'mean'.*'sum'.*'none'"):
        linear_cross_entropy(hidden, weight, labels, bias, reduction=reduction)


@op_param
def test_hidden_size_mismatch_is_a_value_error(op):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match=r"hidden must be \[\.\.\., H\] with H = weight.shape\[1\] = 9"):
        op(hidden, torch.randn(V, H + 1), labels)


@op_param
def test_labels_shape_mismatch_is_a_value_error(op):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match=r"labels must have hidden's leading shape \(2, 3\), got \(6,\)"):
        op(hidden, weight, labels.view(-1))
    with pytest.raises(ValueError, match="leading shape"):
        op(hidden, weight, labels[:, :2])


@op_param
@pytest.mark.parametrize("weight_shape", [(V,), (1, V, H)], ids=["1d", "3d"])
def test_weight_that_is_not_2d_is_a_value_error(op, weight_shape):
    hidden, _, _, labels = inputs()
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        op(hidden, torch.randn(weight_shape), labels)


@op_param
@pytest.mark.parametrize("bias_shape", [(V + 1,), (1, V), (H,)])
def test_bias_shape_mismatch_is_a_value_error(op, bias_shape):
    hidden, weight, _, labels = inputs()
    with pytest.raises(ValueError, match=rf"bias must be a \[V\] = \[{V}\] tensor"):
        op(hidden, weight, labels, torch.zeros(bias_shape))


@op_param
def test_zero_dim_hidden_is_a_value_error(op):
    _, weight, _, _ = inputs()
    with pytest.raises(ValueError, match="hidden must be"):
        op(torch.tensor(1.0), weight, torch.tensor(0))


@op_param
def test_tensors_on_different_devices_are_a_value_error(op):
    hidden, weight, _, labels = inputs()
    with pytest.raises(ValueError, match="one device"):
        op(hidden, weight, labels.to("meta"))
    with pytest.raises(ValueError, match="one device"):
        op(hidden.detach().to("meta"), weight, labels)


@op_param
@pytest.mark.parametrize("bad_label", [V, V + 7, -5, -100], ids=["V", "above_V", "negative", "default_index"])
def test_labels_out_of_range_are_a_value_error_naming_the_label(op, bad_label):
    """-100 is out of range once ignore_index is something else."""
    hidden, weight, _, labels = inputs()
    labels[1, 2] = bad_label
    with pytest.raises(ValueError, match=rf"labels contain {bad_label}, outside \[0, {V}\) and not ignore_index=-1"):
        op(hidden, weight, labels, ignore_index=-1)


@op_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_non_integer_labels_are_a_type_error(op, dtype):
    hidden, weight, _, labels = inputs()
    with pytest.raises(TypeError, match=r"labels must be an integer tensor of token ids, got torch\."):
        op(hidden, weight, labels.to(dtype))


@op_param
def test_non_tensor_and_non_float_inputs_are_type_errors(op):
    hidden, weight, _, labels = inputs()
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor, got list"):
        op(hidden.tolist(), weight, labels)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        op(hidden, weight, labels.tolist())
    with pytest.raises(TypeError, match="must be floating point"):
        op(hidden.detach().long(), weight, labels)


@pytest.mark.parametrize("labels_dtype", [torch.int32, torch.int16, torch.uint8], ids=str)
def test_any_integer_label_dtype_is_accepted(labels_dtype):
    hidden, weight, bias, labels = inputs()
    with torch.no_grad():
        expected = ce(hidden, weight, labels, bias)
        got = ce(hidden, weight, labels.to(labels_dtype), bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "num_items", [0, -3, 0.0, torch.tensor(0), torch.tensor(-1.5)], ids=["0", "-3", "0.0", "t0", "t-1.5"]
)
def test_non_positive_num_items_in_batch_is_a_value_error(reduction, num_items):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match="num_items_in_batch must be a finite number > 0"):
        ce(hidden, weight, labels, bias, reduction=reduction, num_items_in_batch=num_items)


@pytest.mark.parametrize("num_items", [4, torch.tensor(4)], ids=["int", "tensor"])
def test_num_items_in_batch_with_reduction_none_is_a_value_error(num_items):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match="num_items_in_batch applies to reduction='mean' or 'sum', not 'none'"):
        ce(hidden, weight, labels, bias, reduction="none", num_items_in_batch=num_items)


@op_param
@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")], ids=str)
def test_non_positive_or_non_finite_temperature_is_a_value_error(op, temperature):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got"):
        op(hidden, weight, labels, bias, temperature=temperature)


@op_param
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"softcap": 0.0}, "softcap must be None or a finite number > 0"),
        ({"softcap": -30.0}, "softcap must be None or a finite number > 0"),
        ({"logit_scale": 0.0}, "logit_scale must be a finite non-zero number"),
        ({"logit_scale": float("inf")}, "logit_scale must be a finite non-zero number"),
    ],
    ids=["softcap0", "softcap_negative", "logit_scale0", "logit_scale_inf"],
)
def test_invalid_softcap_or_logit_scale_is_a_value_error(op, kwargs, message):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match=message):
        op(hidden, weight, labels, bias, **kwargs)


@op_param
@pytest.mark.parametrize("budget", [0, -1, 1.5, "1024", True], ids=str)
def test_invalid_tile_budget_is_a_value_error(op, budget):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match="tile_budget_bytes must be a positive int"):
        op(hidden, weight, labels, bias, tile_budget_bytes=budget)


# -- backends -----------------------------------------------------------------------------------------


@op_param
def test_unknown_backend_name_is_a_value_error_listing_the_available_ones(op):
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match=r"unknown hf_fused backend 'no_such_backend'; available: \[.*'torch'"):
        op(hidden, weight, labels, bias, backend="no_such_backend")


@op_param
def test_unknown_backend_from_environment_is_a_value_error(op, monkeypatch):
    monkeypatch.setenv("HF_FUSED_BACKEND", "no_such_backend")
    hidden, weight, bias, labels = inputs()
    with pytest.raises(ValueError, match="HF_FUSED_BACKEND"):
        op(hidden, weight, labels, bias)


def test_torch_reference_is_available_and_the_cpu_default():
    assert "torch" in available_backends()
    hidden, weight, bias, labels = inputs()
    with torch.no_grad():
        default = ce(hidden, weight, labels, bias)
        forced = ce(hidden, weight, labels, bias, backend="torch")
    torch.testing.assert_close(default, forced, rtol=0, atol=0)


@op_param
def test_backend_argument_selects_a_registered_backend(op, monkeypatch):
    calls = []

    class Recording(TorchReferenceBackend):
        """Records the op's calls into the backend (not the reference's calls to itself)."""

        name = "recording"
        depth = 0

        def _record(self, name, method, *args, **kwargs):
            if not self.depth:
                calls.append(name)
            self.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1

        def logprobs_with_grads(self, *args, **kwargs):
            return self._record("logprobs_with_grads", super().logprobs_with_grads, *args, **kwargs)

        def logprobs_forward(self, *args, **kwargs):
            return self._record("logprobs_forward", super().logprobs_forward, *args, **kwargs)

    monkeypatch.setitem(backends_module._REGISTRY, "recording", Recording)
    monkeypatch.setitem(backends_module._INSTANCES, "recording", Recording())
    hidden, weight, bias, labels = inputs()
    op(hidden, weight, labels, bias, backend="recording")
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setenv("HF_FUSED_BACKEND", "recording")
    op(hidden, weight, labels, bias)
    assert len(calls) == 1


# -- tile planner -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [1, 50, 97, 151_936])
@pytest.mark.parametrize("budget", [1, 600, 12_345, 1 << 20, None], ids=str)
def test_rows_per_tile_is_the_most_rows_whose_working_set_fits_the_budget(vocab_size, budget):
    rows = rows_per_tile(vocab_size, budget)
    budget = DEFAULT_TILE_BUDGET_BYTES if budget is None else budget
    row_bytes = TILE_BUFFERS * 4 * vocab_size  # TILE_BUFFERS fp32 [rows, V] arrays
    assert isinstance(rows, int) and rows >= 1  # always progress, even if one row exceeds the budget
    if rows > 1:
        assert rows * row_bytes <= budget
    assert (rows + 1) * row_bytes > budget


def test_default_budget_allows_many_rows_for_a_large_vocabulary():
    assert rows_per_tile(151_936) == DEFAULT_TILE_BUDGET_BYTES // (TILE_BUFFERS * 4 * 151_936) >= 16


class ShapeRecorder(TorchDispatchMode):
    """Records ``(op, shape)`` of every tensor produced by an aten op while active."""

    def __init__(self):
        super().__init__()
        self.produced: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.produced.append((str(func), tuple(t.shape)))
        return out


def run_forward_backward(op_name: str, hidden, weight, bias, labels, **kwargs):
    g = torch.Generator().manual_seed(0)
    if op_name == "cross_entropy":
        loss = linear_cross_entropy(hidden, weight, labels, bias, **kwargs)
    elif op_name == "cross_entropy_none":
        loss = (linear_cross_entropy(hidden, weight, labels, bias, reduction="none", **kwargs)
                * torch.randn(labels.shape, generator=g)).sum()
    else:
        logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, **kwargs)
        g_lp, g_ent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
        loss = (logp * g_lp).sum() + (ent * g_ent).sum()
    loss.backward()


# N = 96 tokens, V = 160: a tile of 8 rows is 1,280 elements, N·V = 15,360, weight V·H = 1,280.
BIG_N_SHAPE, BIG_V, TILE_ROWS = (4, 24), 160, 8


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("transform", [{}, {"softcap": 3.0, "temperature": 0.7, "logit_scale": 1.5}],
                         ids=["identity", "combined"])
def test_no_tensor_of_n_by_v_elements_is_ever_allocated(op_name, transform):
    hidden, weight, bias, labels = make_head_inputs(BIG_N_SHAPE, H, BIG_V, ignore="some")
    n = labels.numel()
    budget = TILE_ROWS * TILE_BUFFERS * 4 * BIG_V
    assert rows_per_tile(BIG_V, budget) == TILE_ROWS
    with ShapeRecorder() as rec:
        run_forward_backward(op_name, hidden, weight, bias, labels, tile_budget_bytes=budget, **transform)
    assert rec.produced, "recorder saw no ops"
    biggest = max(rec.produced, key=lambda item: torch.Size(item[1]).numel())
    assert torch.Size(biggest[1]).numel() < n * BIG_V, f"{biggest} is as large as the [N, V] logits"
    # every tile-shaped tensor holds at most one tile of rows (H = 8 ≤ TILE_ROWS covers weight.T too)
    tile_like = [(f, s) for f, s in rec.produced if len(s) == 2 and s[1] == BIG_V]
    assert tile_like and max(s[0] for _, s in tile_like) <= TILE_ROWS
    assert any(s[0] == TILE_ROWS for _, s in tile_like)  # the tiles really were that size


def test_shape_recorder_does_see_dense_logits():
    """Positive control for the test above: the dense reference does allocate [N, V]."""
    hidden, weight, bias, labels = make_head_inputs(BIG_N_SHAPE, H, BIG_V)
    with ShapeRecorder() as rec:
        dense_cross_entropy(hidden, weight, labels, bias).backward()
    assert any(torch.Size(s).numel() >= labels.numel() * BIG_V for _, s in rec.produced)


@pytest.mark.parametrize(
    "n_valid,tile_rows,expected",
    [(13, 4, [4, 4, 4, 1]), (12, 4, [4, 4, 4]), (1, 4, [1]), (5, 1, [1] * 5), (7, 64, [7])],
    ids=["partial_last", "exactly_full_last", "one_token", "one_row_each", "one_tile"],
)
def test_tiles_partition_the_non_ignored_rows(n_valid, tile_rows, expected):
    """The logits matmul of each tile covers ``tile_rows`` compacted rows; ignored rows never reach it."""
    n = n_valid + 3
    hidden, weight, bias, labels = make_head_inputs((n,), H, V)
    labels[[0, n // 2, n - 1]] = -100  # 3 ignored rows spread out; n_valid remain
    budget = tile_rows * TILE_BUFFERS * 4 * V
    with ShapeRecorder() as rec:
        linear_cross_entropy(hidden, weight, labels, bias, tile_budget_bytes=budget).backward()
    tile_rows_seen = [s[0] for f, s in rec.produced if f == "aten.mm.default" and s[1:] == (V,)]
    assert tile_rows_seen == expected


class TileMemoryMeter(TorchDispatchMode):
    """Peak bytes of live fp32 ``[rows ≤ max_rows, V]`` buffers (tile logits and their temporaries).

    Buffers are counted by storage while any tensor object produced by an aten op still refers to it.
    Temporaries internal to a single aten kernel (e.g. inside ``logsumexp``) are invisible here, so this
    is a lower bound of the real working set.
    """

    def __init__(self, vocab_size: int, max_rows: int):
        super().__init__()
        self.vocab_size, self.max_rows = vocab_size, max_rows
        self.refs: dict[int, int] = defaultdict(int)
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.float32
                and t.shape[1] == self.vocab_size and t.shape[0] <= self.max_rows
            ):
                key = t.untyped_storage().data_ptr()
                if self.refs[key] == 0:
                    self.sizes[key] = t.untyped_storage().nbytes()
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("transform", [{}, {"softcap": 3.0, "temperature": 0.7, "logit_scale": 1.5}],
                         ids=["identity", "combined"])
def test_tile_working_set_stays_within_tile_budget(op_name, transform):
    """``tile_budget_bytes`` is documented as the bound of one tile's fp32 working set (logits and the
    temporaries made from them), which the planner sizes as ``TILE_BUFFERS`` arrays of ``[rows, V]``.
    Measure the peak of live tile buffers over forward + backward (several tiles; H = 16 > rows so the
    transposed weight is not mistaken for a tile)."""
    hidden, weight, bias, labels = make_head_inputs((24,), 16, BIG_V)
    tile_rows = 4
    budget = tile_rows * TILE_BUFFERS * 4 * BIG_V
    with TileMemoryMeter(BIG_V, tile_rows) as meter:
        run_forward_backward(op_name, hidden, weight, bias, labels, tile_budget_bytes=budget, **transform)
    assert meter.peak > 0
    assert meter.peak <= budget, (
        f"peak live tile buffers {meter.peak} B = {meter.peak / (tile_rows * 4 * BIG_V):.0f} fp32 [rows, V] "
        f"arrays > tile_budget_bytes {budget} B ({TILE_BUFFERS} arrays)"
    )
