"""Command line of the ops benchmark: ``python -m benchmarks --help``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from . import measure
from .peers import ALL_PEERS, DEFAULT_PEERS, select_peers
from .problems import KINDS, PROBLEM_GROUPS, all_problems, select_problems

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="hf_fused's lm_head losses side by side with every peer (eager PyTorch, TRL's heads, Liger, "
        "Apple CCE, QuACK, torch): median forward+backward time, peak memory above inputs+gradients, TFLOP/s "
        "(and the fraction of a measured matmul ceiling on CUDA) and the loss/gradient error against a float64 "
        "reference, for cross-entropy, GRPO and distillation problems. Writes DIR/bench.json, bench.txt, bench.png.",
        epilog=f"shapes: {', '.join(p.name for p in all_problems(quick=False))} (kinds: {', '.join(KINDS)}; groups: "
        f"{', '.join(PROBLEM_GROUPS)}); --list shows them with --quick's. Default peers: {', '.join(DEFAULT_PEERS)}.",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory (default: bench_out)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated shape names, kinds ({', '.join(KINDS)}) or groups "
                             f"({', '.join(PROBLEM_GROUPS)}); default: every kind's shapes")
    parser.add_argument("--peers", default=None,
                        help="comma-separated peer keys, hf_fused_<n>mib / hf_fused_<n>gib (hf_fused at that "
                             "tile_budget_bytes), or 'all'")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per pair (median; default 5)")
    parser.add_argument("--hf-backend", default=None, help="force an hf_fused backend (e.g. torch, triton)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="input dtype (default: bf16 on CUDA, fp32 on CPU where bf16 matmuls are very slow)")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                        help="run each forward+backward under torch.autocast in this dtype; with --dtype fp32 this is "
                             "mixed precision (fp32 master weights and gradients), what TRL's GRPOTrainer trains by "
                             "default: it loads models in float32 and its config sets bf16=True")
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 reference (no error columns)")
    parser.add_argument("--no-entropy", action="store_true", help="GRPO: do not ask peers for the entropy")
    parser.add_argument("--resume", action="store_true",
                        help="keep DIR/bench.json and run only the (shape, peer) pairs it does not have yet")
    parser.add_argument("--matmul-n", type=int, default=None,
                        help="size of the ceiling matmul (default 8192, 256 with --quick)")
    parser.add_argument("--ceiling-hold", type=measure.duration_arg(False), default=0.0, metavar="SECONDS",
                        help="measure the ceiling with its product held this long (the rate at the GPU's power limit, "
                             "what a step held for seconds gets; median of the last half) instead of a burst of 50")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list", action="store_true", help="list shapes and peers and exit")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        shapes = all_problems(args.quick)
        width = max(len(p.name) for p in shapes)
        for p in shapes:
            print(f"shape {p.name:{width}s}  {p.describe()}")
        for cls in ALL_PEERS:
            print(f"peer  {cls.key:{width}s}  {cls.label}{'' if cls.key in DEFAULT_PEERS else ' (on request)'}")
        return 0
    try:
        problems = select_problems(args.shapes, args.quick)
        peers = select_peers(args.peers, with_entropy=not args.no_entropy, hf_backend=args.hf_backend)
    except ValueError as e:
        parser.error(str(e))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (use --device cpu --quick)")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)

    from .report import publish
    from .runner import RunConfig, run

    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = RunConfig(
        device=device, dtype=dtype, problems=problems, peers=peers, repeats=args.repeats, out_dir=args.out,
        reference=not args.no_reference, resume=args.resume, seed=args.seed,
        matmul_n=args.matmul_n or (256 if args.quick else 8192), progress=not args.no_progress, argv=argv,
        autocast=DTYPES[args.autocast] if args.autocast else None, ceiling_hold_s=args.ceiling_hold,
    )
    publish(run(cfg), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
