"""How much host (Python) time one peer's step costs: the benchmark's step at a tiny size, where the GPU's work is
negligible, so that the wall time per step is what the host spends launching it; then the functions that time
goes to (``cProfile``, by own time). On a real shape the GPU idles for this long after each host sync.

    python -m benchmarks.host_time --shape grpo-16x2k-h2048-v152k-offpolicy-kl --peer hf_fused_hint [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time
from typing import Optional

import torch

from .peers import select_peers
from .problems import make_inputs, select_problems
from .runner import _step, _zero_grads


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a shape name (python -m benchmarks --list): its kind, "
                        "loss type and options; the sizes are replaced by --tokens, --hidden, --vocab")
    parser.add_argument("--peer", required=True, help="one peer key")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=25, help="functions to print")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    (problem,) = select_problems(args.shape, quick=False)
    if problem.kind == "grpo":
        rows = max(1, args.tokens // problem.T)
        problem = dataclasses.replace(problem, N=rows * problem.T, B=rows, H=args.hidden, V=args.vocab)
    else:
        problem = dataclasses.replace(problem, N=args.tokens, H=args.hidden, V=args.vocab)
    (peer,) = select_peers(args.peer)
    peer.load()
    inp = make_inputs(problem, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    _zero_grads(inp)
    for _ in range(3):  # compile, autotune, allocator
        _step(peer, problem, inp)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        _step(peer, problem, inp)
    sync(device)
    wall = (time.perf_counter() - start) * 1e3 / args.steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        _step(peer, problem, inp)
    sync(device)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.rows)
    print(out.getvalue())
    print(f"{problem.describe()} / {peer.key}: {wall:.3f} ms of host time per step (wall, {args.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
