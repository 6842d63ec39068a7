"""Where one peer's step spends its GPU time: ``python -m benchmarks.profile --shape S --peer P``.

A developer's tool beside the benchmark: the same inputs and step as ``python -m benchmarks``
(gradients accumulated into existing ``.grad`` buffers, as its timing loop does), one warm-up, then
``--steps`` steps under ``torch.profiler``; prints the kernels by total CUDA time and the wall time
per step. ``--gaps`` also lists where the GPU sat idle between kernels (the cost of host syncs and
of Python between launches, which kernel totals do not show); ``--host-ops`` adds, under each gap, the
host-side operators that started while the GPU waited (``benchmarks.host_time`` then says which Python functions
the host time goes to).
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch

from .peers import select_peers
from .problems import make_inputs, select_problems
from .runner import _step, _zero_grads


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="one shape name (python -m benchmarks --list)")
    parser.add_argument("--peer", required=True, help="one peer key")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20, help="kernel rows to print")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gaps", action="store_true", help="also print the GPU's idle gaps between kernels")
    parser.add_argument("--host-ops", action="store_true", help="with --gaps: the host operators inside each gap")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    (problem,) = select_problems(args.shape, quick=False)
    (peer,) = select_peers(args.peer)
    peer.load()
    inp = make_inputs(problem, device, torch.bfloat16)
    _zero_grads(inp)
    _step(peer, problem, inp)
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            _step(peer, problem, inp)
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    print(f"{problem.name} / {peer.key}: {wall_ms:.2f} ms per step (wall, under the profiler)")
    if args.gaps:
        print_gaps(prof, args.steps, args.rows, host_ops=args.host_ops)
    return 0


def print_gaps(prof, steps: int, rows: int, min_us: float = 20.0, host_ops: bool = False) -> None:
    """Idle time of the GPU between consecutive kernels (memcpy/memset count as busy), per step, and the
    largest gaps with the kernels around them; with ``host_ops``, under each gap the host operators that started
    inside it, longest first (an enclosing autograd Function's whole span among them)."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    if not spans:
        print("no GPU events recorded")
        return
    gaps, busy_end, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start - busy_end >= min_us:
            gaps.append((start - busy_end, before, name, start))
        if end > busy_end:
            busy_end, before = end, name
    total = (busy_end - spans[0][0]) / 1e3
    idle = sum(g[0] for g in gaps) / 1e3
    print(f"GPU span {total / steps:.2f} ms per step, idle in gaps >= {min_us:.0f} us: {idle / steps:.2f} ms per step "
          f"({len(gaps) / steps:.0f} gaps per step)")
    host = [e for e in prof.events() if e.device_type == DeviceType.CPU] if host_ops else []
    for gap, before, after, start in sorted(gaps, reverse=True)[:rows]:
        print(f"  {gap / 1e3:8.3f} ms  after {before[:60]!r}  before {after[:60]!r}")
        inside = sorted((e for e in host if start - gap <= e.time_range.start < start),
                        key=lambda e: e.time_range.elapsed_us(), reverse=True)
        for e in inside[:4]:
            print(f"      {e.time_range.elapsed_us() / 1e3:7.3f} ms  {e.name[:60]!r}")


if __name__ == "__main__":
    raise SystemExit(main())
