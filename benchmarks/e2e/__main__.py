"""Command line of the end-to-end benchmark: ``python -m benchmarks.e2e --help``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..measure import device_name, progress, save_json, versions
from . import __doc__ as PACKAGE_DOC
from .distill import DISTILL_VARIANTS, distill_part, distill_setting, distill_table
from .grpo import GRPO_MODELS, GRPO_VARIANTS, grpo_part, grpo_setting
from .models import SFT_MODELS, SHAPES, attn_implementation, is_gemma2
from .report import plot, table
from .sft import ALL_SFT_VARIANTS, SFT_VARIANTS, sft_part

def environment(device: torch.device) -> dict:
    v = versions()
    return {"device": str(device), "device_name": device_name(device), **v, "liger_kernel": v.get("liger-kernel"),
            "hf_fused_backend": "triton" if device.type == "cuda" else "torch"}


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_list(s: str, allowed: tuple, what: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    repeated = sorted({x for x in items if items.count(x) > 1})
    if repeated:  # the table and the JSON key runs by name: a second run would hide the first
        raise argparse.ArgumentTypeError(f"{what} given twice: {', '.join(repeated)} (run the command again instead)")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=PACKAGE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("e2e_out"), help="output directory (default e2e_out)")
    p.add_argument("--parts", type=lambda s: parse_list(s, ("sft", "grpo", "distill"), "part"),
                   default=["sft", "grpo"], help="comma-separated, run in this order (default sft,grpo; also distill)")
    p.add_argument("--seq-lens", type=parse_ints, default=None,
                   help="SFT sequence lengths (default 4096,16384,32768; --tiny: 64,128,256)")
    p.add_argument("--sft-variants", type=lambda s: parse_list(s, ALL_SFT_VARIANTS, "SFT variant"),
                   default=list(SFT_VARIANTS), help=f"default {','.join(SFT_VARIANTS)}; also liger_flce, hf_fused_liger")
    p.add_argument("--grpo-variants", type=lambda s: parse_list(s, GRPO_VARIANTS, "GRPO variant"),
                   default=list(GRPO_VARIANTS), help=f"default {','.join(GRPO_VARIANTS)}")
    p.add_argument("--model", choices=sorted(SFT_MODELS), default="qwen3-1.7b",
                   help="SFT model shape (default qwen3-1.7b; gemma2-2b: 256k vocabulary, final logits soft-capped at "
                        "30, eager attention)")
    p.add_argument("--grpo-model", choices=GRPO_MODELS, default="qwen3-0.6b",
                   help="GRPO model shape (default qwen3-0.6b; --tiny: a tiny Qwen3)")
    p.add_argument("--grpo-off-policy-kl", action="store_true",
                   help="off-policy step with a KL term: old and reference log-probs given (the current ones plus "
                        "noise, as benchmarks.problems' off-policy problem), beta 0.04 (default: on-policy, beta 0)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run (default 1)")
    p.add_argument("--optim", default="adamw_torch", help="SFT optimizer (TrainingArguments.optim; default adamw_torch)")
    p.add_argument("--grpo-precision", choices=("bf16", "trl-default"), default="bf16",
                   help="GRPO model precision: bf16 weights (default; fp32 on CPU), or trl-default: what GRPOTrainer "
                        "does with a model it loads itself, float32 weights with every step under bf16 autocast "
                        "(GRPOConfig.bf16=True)")
    p.add_argument("--grpo-completions", type=int, default=None, help="completions per step (default 8; --tiny 4)")
    p.add_argument("--grpo-prompt-len", type=int, default=None, help="prompt tokens (default 512; --tiny 16)")
    p.add_argument("--grpo-completion-len", type=int, default=None, help="completion tokens (default 2048; --tiny 32)")
    p.add_argument("--distill-variants", type=lambda s: parse_list(s, DISTILL_VARIANTS, "distillation variant"),
                   default=list(DISTILL_VARIANTS), help=f"default {','.join(DISTILL_VARIANTS)}")
    p.add_argument("--distill-beta", type=float, default=1.0,
                   help="DistillationConfig.beta (default 1.0, TRL's: reverse KL; 0 forward KL, between: JSD)")
    p.add_argument("--distill-completions", type=int, default=None,
                   help="distillation completions per step (default 8; --tiny 4), of --grpo-prompt-len prompt and "
                        "--grpo-completion-len completion tokens")
    p.add_argument("--position-ids", action="store_true",
                   help="SFT rows carry position_ids (DeepSpeed's Ulysses sequence parallelism requires them; "
                        "benchmarks.e2e.distributed passes it under such a config)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda if available)")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke test)")
    p.add_argument("--time-budget", type=float, default=450.0,
                   help="seconds after start past which no new run starts (default 450)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def launched_ranks() -> tuple[int, int]:
    """(rank, world size) of this process under ``accelerate launch`` / ``torchrun`` (their ``RANK`` and
    ``WORLD_SIZE``); (0, 1) for a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve_args(args, parser) -> argparse.Namespace:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (use --tiny --device cpu)")
    args.rank, args.world_size = launched_ranks()
    if args.world_size > 1:
        if args.parts != ["sft"]:  # part B calls GRPOTrainer._compute_loss itself, outside any engine
            parser.error(f"under {args.world_size} processes only --parts sft runs (the Trainer's engine); "
                         "run the GRPO part as one process")
        if device.type == "cuda" and device.index is None:  # one GPU per rank, as accelerate places them
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    args.device = device
    # bf16 weights on CUDA; fp32 on CPU, where bf16 matmuls are very slow and only the plumbing is tested.
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = args.tiny
    args.sft_shape = SFT_MODELS[args.model][1 if tiny else 0]
    args.grpo_shape = "tiny" if tiny else args.grpo_model
    # TRL's default: float32 master weights, each step under bf16 autocast (its GRPOConfig has bf16=True).
    args.grpo_dtype, args.grpo_autocast = ((torch.float32, torch.bfloat16) if args.grpo_precision == "trl-default"
                                           else (args.dtype, None))
    args.max_positions = 512 if tiny else 40960
    args.seq_lens = args.seq_lens or ([64, 128, 256] if tiny else [4096, 16384, 32768])
    args.grpo_completions = args.grpo_completions or (4 if tiny else 8)
    args.grpo_prompt_len = args.grpo_prompt_len or (16 if tiny else 512)
    args.grpo_completion_len = args.grpo_completion_len or (32 if tiny else 2048)
    # part C: a Qwen3-1.7B-shaped student and a Qwen3-8B-shaped teacher (hidden 4096) over the same vocabulary
    args.distill_student, args.distill_teacher = ("tiny", "tiny") if tiny else ("qwen3-1.7b", "qwen3-8b")
    args.distill_completions = args.distill_completions or (4 if tiny else 8)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def new_doc(args, argv) -> dict:
    dt = str(args.dtype).replace("torch.", "")
    return {
        "argv": argv,
        "env": environment(args.device),
        "sft": {
            "model": (f"{args.sft_shape}-shaped {'Gemma-2' if is_gemma2(args.sft_shape) else 'Qwen3'} (random init, "
                      f"tied, {dt}, {attn_implementation(args.sft_shape)})"),
            "setup": (f"Trainer (trl_* variants: trl.SFTTrainer), batch 1, grad checkpointing, {args.optim}, median of "
                      f"{args.steps} timed steps after {args.warmup} warm-up"),
            "shape": SHAPES[args.sft_shape],
            "variants": args.sft_variants,
            "runs": [],
        },
        "grpo": {
            "model": (f"{args.grpo_shape}-shaped Qwen3 (random init, tied, "
                      f"{'float32 under bf16 autocast' if args.grpo_autocast else dt}, sdpa)"),
            "setup": (f"_compute_loss + backward, {args.grpo_completions} x ({args.grpo_prompt_len} prompt + "
                      f"{args.grpo_completion_len} completion) tokens, dapo, {grpo_setting(args)}, grad checkpointing, "
                      f"median of {args.steps} after {args.warmup} warm-up"),
            "shape": SHAPES[args.grpo_shape],
            "runs": [],
        },
        "distill": {
            "model": (f"DistillationTrainer, {args.distill_student}-shaped Qwen3 student (random init, tied, {dt}, "
                      f"sdpa), {args.distill_teacher}-shaped Qwen3 teacher (untied)"),
            "setup": distill_setting(args),
            "runs": [],
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = resolve_args(parser.parse_args(argv), parser)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # Ranks that decided apart whether to start a run would wait on each other's collectives forever: under
    # several processes every run starts (the launcher bounds the time; benchmarks.e2e.distributed).
    deadline = start + args.time_budget if args.world_size == 1 else float("inf")
    doc = new_doc(args, argv)
    doc["env"].update(rank=args.rank, world_size=args.world_size)
    name = "e2e.json" if args.world_size == 1 else f"e2e.rank{args.rank}.json"

    def save():
        doc["total_s"] = time.perf_counter() - start
        save_json(doc, args.out / name)

    runs = (len(args.sft_variants) * len(args.seq_lens) if "sft" in args.parts else 0) + (
        len(args.grpo_variants) if "grpo" in args.parts else 0) + (
        len(args.distill_variants) if "distill" in args.parts else 0)
    # Under a launcher every rank's output goes to one log: no bars there, the per-run lines say enough.
    bar = progress(runs, "e2e", not args.no_progress and args.world_size == 1)
    bar.write(f"e2e: {doc['env']}")
    threads = torch.get_num_threads()
    if args.tiny and args.device.type == "cpu":
        torch.set_num_threads(1)  # tiny matmuls: extra threads only add contention on a shared CPU
    try:
        for part in args.parts:
            {"sft": sft_part, "grpo": grpo_part, "distill": distill_part}[part](args, args.device, doc, save,
                                                                                 deadline, bar)
    finally:
        torch.set_num_threads(threads)
        bar.close()
    save()
    if args.rank == 0:  # one table per launch; the other ranks' numbers are in their JSON files
        text = "\n".join([table(doc)] + ([""] + distill_table(doc) if distill_table(doc) else []))
        (args.out / "e2e.txt").write_text(text + "\n")
        plot(doc, args.out / "e2e.png")
        print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
