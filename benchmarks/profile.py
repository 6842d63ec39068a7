"""Where one peer's step spends its GPU time: ``python -m benchmarks.profile --shape S --peer P``.

A developer's tool beside the benchmark: the same inputs and step as ``python -m benchmarks``
(gradients accumulated into existing ``.grad`` buffers, as its timing loop does), one warm-up, then
``--steps`` steps under ``torch.profiler``; prints the kernels by total CUDA time and the wall time
per step.
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
