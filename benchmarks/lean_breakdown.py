"""Where the memory-lean path's time goes: ``python -m benchmarks.lean_breakdown [--device cuda]
[--shapes 8192x2048x151936,32768x2048x151936,16384x4096x128256] [--budget-mib 256] [--repeats 5]``.

Per ``N×H×V`` shape (bf16, logits of standard deviation ~4, 10% of labels ignored), ``linear_cross_entropy``
forward + backward under ``tile_budget_bytes``:

* **folds**: the hidden-gradient accumulations one step makes (QuACK's fold where it runs,
  :func:`hf_fused.ops.backends.triton_cublas.quack_bridge.pair_addmm_`, else
  :func:`hf_fused.ops.backends.triton_cublas.compensated.compensated_addmm_`; recorded: ``[M, K] @ [K, H]`` and how
  many), and for each distinct shape the fold's median milliseconds (as the step runs it) against cuBLAS's plain
  bf16 matmul of the same operands (``torch.mm``): what the fold's epilogue (the read and write of the bf16 gradient
  and its int8 residual) costs;
* **plans**: every tile the lean rule weighs
  (:func:`hf_fused.ops.backends.triton_cublas.two_pass_rule.lean_two_pass_options`), forced one at a time: rows per
  block, columns per chunk, whether the kept rows are gathered per block, the bytes the rule's cost model counts,
  and the step's median milliseconds; the rule's own choice marked ``*``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional
from unittest import mock

import torch

from hf_fused.ops import linear_cross_entropy
from hf_fused.ops.backends.triton_cublas import quack_bridge, two_pass_rule, two_passes

from .fp32_logits import SHAPES, inputs, parse_shape
from .measure import median_ms, text_table


@contextlib.contextmanager
def recorded_folds():
    """A dict ``{(M, K, H): calls}`` filled by the folds run inside the block (the calls still run)."""
    folds: dict[tuple[int, int, int], int] = {}

    def recording(real):
        def record(hi, lo, a, b, **kwargs):
            key = (a.shape[0], a.shape[1], b.shape[1])
            folds[key] = folds.get(key, 0) + 1
            return real(hi, lo, a, b, **kwargs)
        return record

    with mock.patch.object(two_passes, "compensated_addmm_", recording(two_passes.compensated_addmm_)), \
            mock.patch.object(quack_bridge, "pair_addmm_", recording(quack_bridge.pair_addmm_)):
        yield folds


@contextlib.contextmanager
def forced_plan(key: Optional[tuple[int, int, bool]], seen: list):
    """Inside the block, the lean rule returns the plan of ``(block_rows, cols, gather_rows)`` ``key`` wherever it
    weighs one (its own choice elsewhere, or everywhere with ``key`` None); ``seen`` gets each call's
    ``(options, choice)``."""
    real = two_pass_rule.lean_two_pass_plan

    def plan(*args, **kwargs):
        choice = real(*args, **kwargs)
        options = two_pass_rule.lean_two_pass_options(*args, **kwargs)
        seen.append((options, choice))
        for _, _, option in options:
            if (option.block_rows, option.cols, option.gather_rows) == key:
                return option
        return choice

    with mock.patch.object(two_pass_rule, "lean_two_pass_plan", plan):
        yield


def _fold_and_mm_ms(m: int, k: int, n: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median ms of one ``[m, k] @ [k, n]`` fold into a pair (``quack_bridge.pair_addmm_``: QuACK's where it runs)
    and of cuBLAS's bf16 product of the same operands (its buffers freed on return)."""
    a = (torch.randn(m, k, device=device) * 1e-3).to(torch.bfloat16)
    b = (torch.randn(k, n, device=device) * 0.03).to(torch.bfloat16)
    hi = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    lo = torch.zeros(m, n, dtype=two_passes.RESIDUAL_DTYPE, device=device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    timings = []
    for fn in (lambda: quack_bridge.pair_addmm_(hi, lo, a, b), lambda: torch.mm(a, b, out=out)):
        fn()
        timings.append(median_ms(fn, device, repeats)[0])
    return timings[0], timings[1]


def measure(device: torch.device, shape: tuple[int, int, int], budget: int, repeats: int) -> dict:
    """One shape: ``{"folds": [(M, K, H, calls, fold ms, torch.mm ms)], "plans": [(plan, moved, ms, chosen)]}``."""
    hidden, weight, labels = inputs(device, *shape)
    hidden.requires_grad_()
    weight.requires_grad_()

    def step():
        hidden.grad = weight.grad = None
        linear_cross_entropy(hidden, weight, labels, backend="triton", tile_budget_bytes=budget).backward()

    seen: list = []
    with recorded_folds() as folds, forced_plan(None, seen):
        step()
    row = {"shape": "x".join(map(str, shape)), "folds": [], "plans": []}
    for (m, k, n), calls in sorted(folds.items(), key=lambda item: -item[1]):
        row["folds"].append((m, k, n, calls, *_fold_and_mm_ms(m, k, n, device, repeats)))
    if not seen:
        return row  # the step took no lean plan (the budget holds the default one)
    options, choice = seen[-1]  # the gradient pass's (the statistics pass weighs the same rule first)
    done = set()
    for _, moved, plan in options:
        key = (plan.block_rows, plan.cols, plan.gather_rows)
        if key in done:
            continue
        done.add(key)
        with forced_plan(key, []):
            step()
            ms = median_ms(step, device, repeats)[0]
        row["plans"].append((plan, moved, ms, plan == choice))
    return row


def report(rows: list[dict], budget: int) -> list[str]:
    lines = [f"linear_cross_entropy forward + backward under tile_budget_bytes = {budget / 2**20:g} MiB (bf16, "
             "logits of std ~4, 10% of labels ignored); median ms"]
    for row in rows:
        lines += ["", f"== {row['shape']}: the hidden gradient's folds against torch.mm of the same operands"]
        lines += text_table(["[M, K] @ [K, H]", "calls", "fold ms", "torch.mm ms", "fold / mm"], [
            [f"[{m}, {k}] @ [{k}, {n}]", str(calls), f"{fold:.3f}", f"{mm:.3f}", f"{fold / mm:.2f}"]
            for m, k, n, calls, fold, mm in row["folds"]])
        if row["plans"]:
            lines += ["", f"== {row['shape']}: every plan the lean rule weighs, forced (* the rule's)"]
            lines += text_table(["", "rows", "cols", "gather", "model GB", "step ms"], [
                ["*" if chosen else "", str(plan.block_rows), str(plan.cols), str(plan.gather_rows),
                 f"{moved / 1e9:.2f}", f"{ms:.1f}"] for plan, moved, ms, chosen in row["plans"]])
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lean_breakdown", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxHxV")
    parser.add_argument("--budget-mib", type=float, default=256.0, help="tile_budget_bytes in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device, budget = torch.device(args.device), int(args.budget_mib * 2**20)
    rows = []
    for text in args.shapes.split(","):
        rows.append(measure(device, parse_shape(text), budget, args.repeats))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(report(rows, budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
