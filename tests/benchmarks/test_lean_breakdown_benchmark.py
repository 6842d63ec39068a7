"""Smoke test of ``python -m benchmarks.lean_breakdown`` on CPU (the GPU backend's kernels under Triton's
interpreter): the folds a lean step makes are recorded with their shapes, each plan the rule weighs is forced in
turn (the step then runs that plan) and the rule's own choice is marked."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from benchmarks import lean_breakdown  # noqa: E402
from benchmarks.lean_breakdown import forced_plan, main, recorded_folds  # noqa: E402
from hf_fused.ops import linear_cross_entropy  # noqa: E402
from hf_fused.ops.backends.triton_cublas import two_pass_rule  # noqa: E402

SHAPE, BUDGET = (48, 32, 1000), 96 * 1024  # under the default tile: the lean rule runs


def _step(hidden, weight, labels):
    linear_cross_entropy(hidden, weight, labels, backend="triton", tile_budget_bytes=BUDGET).backward()


def test_each_plan_is_forced_and_the_folds_recorded(capsys, monkeypatch):
    from benchmarks.fp32_logits import inputs

    hidden, weight, labels = inputs(torch.device("cpu"), *SHAPE)
    hidden.requires_grad_()
    seen = []
    with recorded_folds() as folds, forced_plan(None, seen):
        _step(hidden, weight, labels)
    options, choice = seen[-1]
    assert len({(p.block_rows, p.cols, p.gather_rows) for _, _, p in options}) > 1, options
    assert folds and all(k[2] == SHAPE[1] and calls > 0 for k, calls in folds.items())
    other = next(p for _, _, p in options if p != choice)
    taken = []
    real = two_pass_rule.lean_two_pass_plan
    with forced_plan((other.block_rows, other.cols, other.gather_rows), []):
        forced = two_pass_rule.lean_two_pass_plan
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(two_pass_rule, "lean_two_pass_plan", lambda *a, **k: taken.append(forced(*a, **k))
                                or taken[-1])
            _step(hidden, weight, labels)
    assert two_pass_rule.lean_two_pass_plan is real
    key = lambda plan: (plan.block_rows, plan.cols, plan.gather_rows)  # noqa: E731
    assert taken and all(key(plan) == key(other) for plan in taken)  # both passes' (their bytes differ)

    # the row the CLI measures and prints, read on its way (a second measure() of the same shape would run every
    # plan's steps again under the interpreter)
    rows, real = [], lean_breakdown.measure
    monkeypatch.setattr(lean_breakdown, "measure", lambda *a: rows.append((a, real(*a))) or rows[-1][1])
    assert main(["--device", "cpu", "--shapes", "48x32x1000", "--budget-mib", str(BUDGET / 2**20),
                 "--repeats", "1"]) == 0
    [(args, row)] = rows
    assert args == (torch.device("cpu"), SHAPE, BUDGET, 1)
    assert row["folds"] and all(fold > 0 and mm > 0 for *_, fold, mm in row["folds"])
    assert sum(chosen for *_, chosen in row["plans"]) == 1 and len(row["plans"]) > 1
    printed = capsys.readouterr().out
    assert "fold / mm" in printed and "every plan the lean rule weighs" in printed
