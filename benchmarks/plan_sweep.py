"""Tile-plan sweep for the GPU backend: ``python -m benchmarks.plan_sweep --device cuda``.

A developer's tool, not a peer comparison. For each shape it times the GPU backend's forward+backward
with the planner forced to several ``(rows per block, columns per chunk)`` plans, and the three cuBLAS
GEMMs of one vocabulary chunk alone (logits ``z = h·W_cᵀ``, the fp32 hidden-state accumulation
``dh += dz·W_c`` and the weight-gradient chunk ``dW_c = dzᵀ·h``), so that the time spent outside the
GEMMs (Triton epilogues, launches) and each GEMM's rate at that chunk width can be read off one table.
Shapes name the kept (non-ignored) rows M directly: ``ce:M:H:V`` (cross-entropy) or ``lp:M:H:V``
(log-probs + entropy, backward with both upstream gradients, as GRPO runs it).

``--one-pass-shapes M:H:V,...`` times the one-pass path instead (``linear_logprobs`` with a matching
``grad_hint``) at forced rows per tile, with each of its per-tile steps alone: the logits GEMM, the
statistics and gradient kernels, the ``dh`` GEMM and the fp32 ``dW`` accumulation.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import torch

from hf_fused.ops import LogitTransform, linear_cross_entropy, linear_logprobs
from hf_fused.ops.backends.compensated import RESIDUAL_DTYPE, compensated_addmm_, one_pass_config
from hf_fused.ops.backends.triton_cublas import TritonCublasBackend, _addmm_f32_
from hf_fused.ops.tiling import (
    LeanPlan, OnePassPlan, forced_plans, hidden_accumulator, lean_two_pass_plan, two_pass_plan,
)
from .measure import free_memory, median_ms
from .report import text_table

DEFAULT_SHAPES = "ce:7373:2048:151936,ce:29491:2048:151936,ce:14746:4096:128256,lp:28672:2048:151936,lp:28672:4096:151936"


def _inputs(kind: str, m: int, h: int, v: int, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device=device) * (4.0 / h**0.5)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (m,), generator=gen, device=device)
    g_lp = torch.randn(m, generator=gen, device=device) if kind == "lp" else None
    g_ent = torch.randn(m, generator=gen, device=device) if kind == "lp" else None
    return hidden, weight, labels, g_lp, g_ent


def _step(kind, hidden, weight, labels, g_lp, g_ent, budget):
    hidden.grad = weight.grad = None
    if kind == "ce":
        linear_cross_entropy(hidden, weight, labels, reduction="sum", tile_budget_bytes=budget,
                             backend="triton").backward()
    else:
        logp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, tile_budget_bytes=budget,
                                    backend="triton")
        torch.autograd.backward([logp, ent], [g_lp, g_ent])


def _peak_gib(fn, device) -> float:
    """Run ``fn`` twice (warm-up, then measured); GiB allocated above the start at the second's peak."""
    fn()
    if device.type != "cuda":
        return float("nan")
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def _gemm_ms(m, h, cols, device, repeats):
    """Median ms of the three GEMMs of one full-height chunk ``[m, cols]``."""
    a = torch.randn(m, h, device=device, dtype=torch.bfloat16)
    w = torch.randn(cols, h, device=device, dtype=torch.bfloat16) * 0.02
    tile = torch.randn(m, cols, device=device, dtype=torch.bfloat16)
    acc = torch.zeros(m, h, device=device, dtype=torch.float32)
    dw = torch.empty(cols, h, device=device, dtype=torch.bfloat16)
    fns = {
        "z": lambda: torch.mm(a, w.t(), out=tile),
        "dh": lambda: _addmm_f32_(acc, tile, w),
        "dW": lambda: torch.mm(tile.t(), a, out=dw),
    }
    out = {}
    for name, fn in fns.items():
        fn()
        out[name] = median_ms(fn, device, repeats)[0]
    return out


def _one_pass_parts_ms(rows, h, v, device, repeats, accumulator="fp32"):
    """Median ms of each per-tile step of the one-pass path on one ``[rows, V]`` tile (``dW``: the accumulation
    into the fp32 buffer, or the compensated pair's fold)."""
    backend = TritonCublasBackend()
    a = torch.randn(rows, h, device=device, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=device, dtype=torch.bfloat16) * (4.0 / h**0.5)
    y = torch.randint(0, v, (rows,), device=device)
    tile = torch.empty(rows, v, device=device, dtype=torch.bfloat16)
    dh = torch.empty(rows, h, device=device, dtype=torch.bfloat16)
    acc = torch.zeros(v, h, device=device, dtype=torch.float32)
    g = torch.randn(rows, device=device)
    scalars = backend._scalars(LogitTransform(), None)
    stats = backend._new_stats(rows, device)
    torch.mm(a, w.t(), out=tile)
    backend._stats(tile, 0, None, y, stats, scalars, True)
    lse = stats[0] + stats[1].log()
    fns = {
        "z": lambda: torch.mm(a, w.t(), out=tile),
        "stats": lambda: backend._stats(tile, 0, None, y, backend._new_stats(rows, device), scalars, True),
        "grad": lambda: backend._grad(tile, 0, None, y, lse, lse, g, lse, scalars, True, False),
        "dh": lambda: torch.mm(tile, w, out=dh),
        "dW": lambda: _addmm_f32_(acc, tile.t(), a),
    }
    if accumulator == "pair":
        hi = torch.zeros(v, h, device=device, dtype=torch.bfloat16)
        lo = torch.zeros(v, h, device=device, dtype=RESIDUAL_DTYPE)
        fns["dW"] = lambda: compensated_addmm_(hi, lo, tile.t(), a, config=one_pass_config(v, h, device))
    out = {}
    for name, fn in fns.items():
        fn()
        out[name] = median_ms(fn, device, repeats)[0]
    return out


def one_pass_sweep(specs: str, rows_list: list[int], device, repeats, accumulator: str = "fp32") -> list[tuple]:
    out = []
    for spec in specs.split(","):
        m, h, v = map(int, spec.split(":"))
        hidden, weight, labels, _, _ = _inputs("lp", m, h, v, device)
        hint = torch.randn(m, device=device)
        for rows in rows_list:
            with forced_plans(one_pass=OnePassPlan(rows, accumulator, 0)):
                def fn():
                    hidden.grad = weight.grad = None
                    logp, _ = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint,
                                              backend="triton")
                    logp.backward(hint)

                peak = _peak_gib(fn, device)
                ms = median_ms(fn, device, repeats)[0]
            parts = _one_pass_parts_ms(rows, h, v, device, repeats, accumulator)
            tiles = math.ceil(m / rows)
            out.append((spec, rows, ms, 6 * m * h * v / ms / 1e9, peak,
                        *(tiles * parts[k] for k in ("z", "stats", "grad", "dh", "dW"))))
            print(out[-1], flush=True)
        del hidden, weight
        free_memory(device)
    header = ["one pass M:H:V", "rows", "ms", "TF/s", "GiB", "z ms", "stats ms", "grad ms", "dh ms", "dW+= ms", "sum ms"]
    body = [[r[0], r[1], f"{r[2]:.2f}", f"{r[3]:.0f}", f"{r[4]:.2f}", *(f"{t:.2f}" for t in (*r[5:10], sum(r[5:10])))]
            for r in out]
    print("\n(step times summed over tiles)\n" + "\n".join(text_table(header, body)))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated kind:M:H:V (default {DEFAULT_SHAPES})")
    parser.add_argument("--cols", default="2112,4096,4224,6336,8192,8448",
                        help="chunk widths to force (rows per block = M), besides the default plan and 'split2'")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=int, default=None, help="tile_budget_bytes for the default plan")
    parser.add_argument("--one-pass-shapes", default=None, help="M:H:V,... : sweep the one-pass path instead")
    parser.add_argument("--one-pass-rows", default="1024,2048,4096", help="rows per tile for --one-pass-shapes")
    parser.add_argument("--one-pass-accumulator", default="fp32", choices=("fp32", "pair"),
                        help="the one pass's weight-gradient accumulator for --one-pass-shapes (default fp32)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.one_pass_shapes:
        one_pass_sweep(args.one_pass_shapes, [int(r) for r in args.one_pass_rows.split(",")], device, args.repeats,
                       args.one_pass_accumulator)
        return 0
    rows = []
    for spec in args.shapes.split(","):
        kind, m, h, v = spec.split(":")
        m, h, v = int(m), int(h), int(v)
        hidden, weight, labels, g_lp, g_ent = _inputs(kind, m, h, v, device)
        if args.budget is None:
            default_plan = two_pass_plan(m, v, 2, None)
        else:  # every row kept (the sweep's inputs) and bf16: the lean plan's compensated pair
            _, residual = hidden_accumulator(m, h, torch.bfloat16, args.budget)
            lean = lean_two_pass_plan(m, h, v, 2, args.budget, reserved_bytes=residual,
                                      accumulator_row_bytes=4 * h + 2 * residual // m, weight_chunk=True)
            default_plan = (lean.block_rows, lean.cols)
        plans = {"default": None, "split2": (math.ceil(m / 2), min(v, default_plan[1] * 2))}
        plans.update({f"cols={c}": (m, c) for c in map(int, args.cols.split(","))})
        flops = (6 if kind == "ce" else 8) * m * h * v
        for label, plan in plans.items():
            block_rows, cols = plan or default_plan
            forced = None if plan is None else LeanPlan(*plan, gather_rows=False, bytes=0)
            with forced_plans(two_pass=forced, one_pass=False):
                fn = lambda: _step(kind, hidden, weight, labels, g_lp, g_ent, args.budget)  # noqa: E731
                peak = _peak_gib(fn, device)
                ms = median_ms(fn, device, args.repeats)[0]
            g = _gemm_ms(block_rows, h, cols, device, args.repeats)
            chunks = math.ceil(v / cols) * math.ceil(m / block_rows)
            gemm_total = chunks * (2 * g["z"] + g["dh"] + g["dW"])  # z twice: statistics pass + recompute
            tf = lambda t: 2 * block_rows * h * cols / t / 1e9  # noqa: E731
            rows.append((spec, label, block_rows, cols, ms, flops / ms / 1e9, peak, gemm_total,
                         tf(g["z"]), tf(g["dh"]), tf(g["dW"])))
            print(rows[-1], flush=True)
        del hidden, weight
        free_memory(device)
    header = ["shape", "plan", "rows", "cols", "ms", "TF/s", "GiB", "gemm ms", "z TF", "dh TF", "dW TF"]
    body = [[r[0], r[1], r[2], r[3], f"{r[4]:.2f}", f"{r[5]:.0f}", f"{r[6]:.2f}", f"{r[7]:.2f}",
             *(f"{t:.0f}" for t in r[8:11])] for r in rows]
    print("\n" + "\n".join(text_table(header, body, align_left=2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
