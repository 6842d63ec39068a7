"""Where one step's device time goes, kernel by kernel: ``python -m benchmarks.kernel_breakdown [--device cuda]
[--shapes ce] [--peers hf_fused,quack] [--repeats 5] [--top 8] [--quick]``.

For each problem of :mod:`benchmarks.problems` and each peer of :mod:`benchmarks.peers` with an entry point for its
kind, the forward + backward that ``python -m benchmarks`` times (the same inputs and call, gradients set to None
before each step), after two warm-up steps: the median step over ``--repeats``, then one step under
``torch.profiler``. Its kernels are summed by :data:`CATEGORIES` (the matmuls by library, hf_fused's own Triton
kernels, PyTorch's elementwise kernels, copies), with ``idle``: the time between the step's first and last kernel
in which none ran (host work the device waited on), and the ``--top`` kernels by time. ``ideal`` is the problem's
useful FLOPs (:meth:`~benchmarks.problems.Problem.flops`) at the bf16 matmul rate measured in the same run: a
step at ``ideal`` would be its matmuls at that rate and nothing else.

On CPU the profiler's operators stand in for kernels (self time; no idle): a smoke test of the tool.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from collections import defaultdict
from typing import Iterable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from . import measure
from .peers import Peer, select_peers
from .problems import Problem, all_problems, make_inputs, select_problems
from .runner import run_step

#: ``(category, name fragments)``: a kernel goes to the first category one of whose fragments its lower-cased name
#: holds (hf_fused's Triton kernels are matched by their own names first, :func:`hf_fused_kernel_names`).
CATEGORIES = (
    ("QuACK GEMM", ("quackepilogue", "kernel_cutlass")),
    ("cuBLAS GEMM", ("nvjet", "xmma", "gemm", "cutlass", "sm90_", "sm80_", "ampere_")),
    ("copies", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy")),
    ("PyTorch elementwise", ("elementwise", "reduce_kernel", "vectorized", "fill", "index", "gather", "scatter",
                             "cub::")),
)
HF_FUSED_TRITON = "hf_fused Triton"


def hf_fused_kernel_names() -> frozenset[str]:
    """The names of the Triton kernels defined in hf_fused's GPU backend (as the profiler names their launches);
    empty without Triton. Its QuACK module is left out: importing it imports QuACK, whose kernels are QuACK's."""
    try:
        from triton.runtime.jit import KernelInterface  # a compiled kernel's class and the interpreter's

        from hf_fused.ops.backends import triton_cublas
    except ImportError:
        return frozenset()
    names = set()
    for info in pkgutil.iter_modules(triton_cublas.__path__):
        if info.name != "quack_epilogues":
            module = importlib.import_module(f"{triton_cublas.__name__}.{info.name}")
            names.update(name for name, obj in inspect.getmembers(module) if isinstance(obj, KernelInterface))
    return frozenset(names)


def category(name: str, own: frozenset[str]) -> str:
    """The category of a kernel (or, on CPU, an operator) named ``name``; ``own``: hf_fused's kernel names."""
    if name in own:
        return HF_FUSED_TRITON
    lower = name.lower()
    for label, fragments in CATEGORIES:
        if any(fragment in lower for fragment in fragments):
            return label
    return "other"


def kernel_times(events: Iterable, device: torch.device) -> tuple[dict[str, tuple[int, float]], Optional[float]]:
    """``({name: (launches, ms)}, idle ms)`` of one profiled step: the device's kernels and the gaps between them
    (on CPU: each operator's self time, no idle)."""
    times: dict[str, list] = defaultdict(lambda: [0, 0.0])
    if device.type != "cuda":
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CPU and event.self_cpu_time_total > 0:
                times[event.name][0] += 1
                times[event.name][1] += event.self_cpu_time_total / 1e3
        return {k: (n, ms) for k, (n, ms) in times.items()}, None
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    idle, reach = 0.0, None
    for start, end, name in spans:
        times[name][0] += 1
        times[name][1] += (end - start) / 1e3
        if reach is not None and start > reach:
            idle += (start - reach) / 1e3
        reach = end if reach is None else max(reach, end)
    return {k: (n, ms) for k, (n, ms) in times.items()}, idle


def measure_case(peer: Peer, problem: Problem, device: torch.device, repeats: int, own: frozenset[str]) -> dict:
    """One peer on one problem: ``{"ms", "kernels" {name: (launches, ms)}, "categories" {label: ms}, "idle"}``."""
    inp = make_inputs(problem, device, torch.bfloat16 if device.type == "cuda" else torch.float32)

    def step():
        inp.hidden.grad = inp.weight.grad = None
        run_step(peer, problem, inp)

    for _ in range(2):
        step()
    ms, _ = measure.median_ms(step, device, repeats)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        measure.synchronize(device)
    kernels, idle = kernel_times(prof.events(), device)
    categories: dict[str, float] = defaultdict(float)
    for name, (_, kernel_ms) in kernels.items():
        categories[category(name, own)] += kernel_ms
    return {"ms": ms, "kernels": kernels, "categories": dict(categories), "idle": idle, "n_kept": inp.n_valid}


def report(problem: Problem, peer: Peer, row: dict, ideal_ms: Optional[float], top: int) -> list[str]:
    """The lines printed for one case: a summary, then its ``top`` kernels."""
    total = sum(ms for _, ms in row["kernels"].values())
    parts = [f"step {row['ms']:.2f} ms", f"kernels {total:.2f} ms"]
    if row["idle"] is not None:
        parts.append(f"idle {row['idle']:.2f} ms")
    if ideal_ms is not None:
        parts.append(f"ideal {ideal_ms:.2f} ms ({ideal_ms / row['ms']:.0%} of the step)")
    lines = [f"{problem.name} · {peer.key}: " + ", ".join(parts)]
    cats = sorted(row["categories"].items(), key=lambda kv: -kv[1])
    lines.append("  by category: " + ", ".join(f"{label} {ms:.2f}" for label, ms in cats))
    kernels = sorted(row["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
    lines += measure.text_table(["ms", "launches", "kernel"],
                                [[f"{ms:.2f}", str(n), name[:110]] for name, (n, ms) in kernels], align_left=0)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_breakdown",
        description="One forward+backward per problem and peer under torch.profiler: device time by kernel and "
        "category (QuACK's and cuBLAS's matmuls, hf_fused's Triton kernels, PyTorch's elementwise kernels), idle "
        "time between kernels, against the problem's useful FLOPs at the measured bf16 matmul rate.",
        epilog=f"shapes: {', '.join(p.name for p in all_problems(quick=False))}",
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--shapes", default="ce", help="shape names, kinds or groups, as python -m benchmarks")
    parser.add_argument("--peers", default="hf_fused,quack", help="peer keys, as python -m benchmarks")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (median; default 5)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per case (default 8)")
    parser.add_argument("--ceiling-hold", type=measure.duration_arg(False), default=0.0, metavar="SECONDS",
                        help="the ceiling's product held this long (its rate at the power limit) instead of a burst")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    problems = select_problems(args.shapes, args.quick)
    peers = select_peers(args.peers)
    ceiling = None
    if device.type == "cuda":
        ceiling = measure.matmul_tflops(device, torch.bfloat16, 8192, args.repeats, args.ceiling_hold)["tflops"]
        how = f"held {args.ceiling_hold:g} s" if args.ceiling_hold else "a burst"
        print(f"{measure.device_name(device)}: bf16 matmul {ceiling:.0f} TFLOP/s (8192³, {how})")
    own = hf_fused_kernel_names()
    summary = []
    for problem in problems:
        for peer in peers:
            why = peer.cannot_run(problem, device)
            if why:
                print(f"{problem.name} · {peer.key}: {why}")
                continue
            row = measure_case(peer, problem, device, args.repeats, own)
            measure.free_memory(device)  # the case's inputs died with its frame
            ideal = problem.flops(row["n_kept"]) / (ceiling * 1e12) * 1e3 if ceiling else None
            print("\n".join(report(problem, peer, row, ideal, args.top)), flush=True)
            cats = row["categories"]
            summary.append([problem.name, peer.key, f"{row['ms']:.2f}",
                            "" if row["idle"] is None else f"{row['idle']:.2f}", "" if ideal is None else f"{ideal:.2f}",
                            *[f"{cats.get(label, 0.0):.2f}" for label in _labels()]])
    if summary:
        print()
        print("\n".join(measure.text_table(["problem", "peer", "step ms", "idle", "ideal", *_labels()], summary,
                                           align_left=2)))
    return 0


def _labels() -> list[str]:
    return [label for label, _ in CATEGORIES[:2]] + [HF_FUSED_TRITON] + [label for label, _ in CATEGORIES[2:]] + [
        "other"]


if __name__ == "__main__":
    sys.exit(main())
