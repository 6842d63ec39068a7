"""The end-to-end SFT benchmark under each distributed engine, launched the way users launch training.

``python -m benchmarks.e2e.distributed [--engines ddp,zero2,zero3,fsdp2,fsdp1] [--seq-lens 32768] --out DIR``

For each engine, one ``accelerate launch --config_file examples/distributed/<engine>.yaml -m benchmarks.e2e
--parts sft ...`` (the configs shipped for users, 2 processes, one GPU each over NCCL; on CPU, gloo and
DeepSpeed's CPU accelerator): every rank runs part A of :mod:`benchmarks.e2e` (the same model, variants and
step timer; ``Trainer`` / ``SFTTrainer`` hand the model to the engine) on its own rows, batch 1 per rank, and
writes ``DIR/<engine>/e2e.rank<R>.json``. By default the variants of one engine run one after another in the
same processes (one launch per engine: imports and NCCL start-up once) and the memory still allocated when a
variant starts is recorded beside its peak ("held before"): DDP, ZeRO-2 and FSDP2 free everything between
variants, DeepSpeed ZeRO-3 does not (each engine it builds keeps its partitions alive, 13 GiB per variant at
Qwen3-1.7B), so ``--launch per-variant`` gives each variant launches of its own (``DIR/<engine>/<variant>/``), as
the Ulysses config (``zero3_sp2``) always does: DeepSpeed sets its sequence-parallel groups up once per process.
Under the context- and sequence-parallel configs both ranks share each row.

The table (``DIR/e2e_distributed.txt``, and ``.json``; ``.png`` plots the first two columns) gives per engine and
variant: tokens/s of all ranks (the sum over ranks of the row length over that rank's median step), the peak memory
of the fullest GPU (``torch.cuda.max_memory_allocated`` over ``train()`` on each rank; the largest), the ratio to
the unpatched model's tokens/s under the same engine, and the step-1 loss (``Trainer`` logs the mean over ranks, so
it is comparable across engines and variants). A launch that fails or overruns ``--timeout`` is recorded with the
tail of its output and the next engine runs.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1`` are set in the launch's environment unless already given): on shared multi-GPU
hosts a program that uses it can put the GPUs out of service.

CPU smoke test: ``python -m benchmarks.e2e.distributed --tiny --device cpu --engines ddp --out /tmp/e2e_dist``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from .__main__ import parse_ints, parse_list
from .models import SFT_MODELS
from ..measure import plot_panels, progress, save_json
from .report import fmt_gib
from .sft import ALL_SFT_VARIANTS

REPO = Path(__file__).resolve().parent.parent.parent
CONFIGS = REPO / "examples" / "distributed"
ENGINES = ("ddp", "zero2", "zero3", "fsdp2", "fsdp1", "fsdp2_cp2", "zero3_sp2")
#: Without Liger's fused cross-entropy under ZeRO-3 nothing would show whether it runs there: every variant
#: is tried under every engine and what fails is recorded as it failed.
DEFAULT_VARIANTS = ("plain", "liger", "hf_fused", "trl_sft", "hf_fused_trl_sft")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.distributed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("e2e_distributed"), help="output directory")
    p.add_argument("--engines", type=lambda s: parse_list(s, ENGINES, "engine"), default=list(ENGINES),
                   help=f"comma-separated accelerate configs of examples/distributed (default {','.join(ENGINES)})")
    p.add_argument("--sft-variants", type=lambda s: parse_list(s, ALL_SFT_VARIANTS, "SFT variant"),
                   default=list(DEFAULT_VARIANTS), help=f"default {','.join(DEFAULT_VARIANTS)}")
    p.add_argument("--seq-lens", type=parse_ints, default=None, help="tokens per rank and step (default 32768; "
                                                                      "--tiny: 128)")
    p.add_argument("--model", choices=sorted(SFT_MODELS), default="qwen3-1.7b")
    p.add_argument("--processes", type=int, default=2, help="ranks (default 2: one per GPU)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run (default 1)")
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda if available")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke test)")
    p.add_argument("--launch", choices=("per-engine", "per-variant"), default="per-engine",
                   help="one launch per engine (default) or per engine and variant (clean memory under ZeRO-3)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take (default 900)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def row_sharing(engine: str) -> tuple[str, int]:
    """How many ranks share each row under ``engine``'s config, and how: ``("cp", N)`` for torch's context
    parallelism, ``("sp", N)`` for DeepSpeed's Ulysses sequence parallelism, ``("", 1)`` otherwise. Each sharing
    rank reports the whole row length over its step, so tokens/s of all ranks is their sum over N."""
    import yaml  # accelerate's own dependency

    config = yaml.safe_load((CONFIGS / f"{engine}.yaml").read_text()).get("parallelism_config") or {}
    for kind in ("cp", "sp"):
        size = int(config.get(f"parallelism_config_{kind}_size", 1))
        if size > 1:
            return kind, size
    return "", 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(cpu: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false"}
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator (gloo without oneCCL)
        env["OMP_NUM_THREADS"] = "1"  # several ranks on few cores: intra-op threads only oversubscribe
    return env


def launch_command(engine: str, variants: list[str], args, out: Path) -> list[str]:
    inner = ["--parts", "sft", "--sft-variants", ",".join(variants), "--model", args.model,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--optim", args.optim, "--out", str(out)]
    if args.seq_lens:
        inner += ["--seq-lens", ",".join(map(str, args.seq_lens))]
    if args.tiny:
        inner.append("--tiny")
    if row_sharing(engine)[0] == "sp":  # DeepSpeed's Ulysses dataloader adapter requires them
        inner.append("--position-ids")
    if args.device:
        inner += ["--device", args.device]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{engine}.yaml"),
            "--num_processes", str(args.processes), "--main_process_port", str(free_port()),
            "-m", "benchmarks.e2e", *inner]


def run_engine(engine: str, variants: list[str], args, out: Path, bar) -> dict:
    """One launch of ``variants`` under ``engine``; returns {"engine", "variants", "status", "wall_s", "ranks":
    [each rank's document, None where a rank wrote none], "output_tail"}."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("e2e.rank*.json"):
        old.unlink()
    cmd = launch_command(engine, variants, args, out)
    bar.write(f"[{engine}] {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(out / "launch.log", "w+") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(args.device == "cpu"), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts the ranks in sessions of their own: the launcher's process group misses them
            import psutil  # accelerate's own dependency

            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
            rc = None
        logf.seek(0)
        tail = logf.read()[-4000:]
    ranks = []
    for r in range(args.processes):
        path = out / f"e2e.rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    status = "ok" if rc == 0 else ("timeout" if rc is None else f"exit {rc}")
    bar.write(f"[{engine}] {status} in {time.perf_counter() - t0:.0f} s")
    return {"engine": engine, "variants": variants, "status": status, "wall_s": time.perf_counter() - t0, "ranks": ranks,
            "output_tail": None if rc == 0 else tail}


def combine(engine_run: dict, variants: list[str]) -> list[dict]:
    """One row per (variant, sequence length) over the ranks' runs: tokens/s of all ranks is the sum of each
    rank's row length over its median step, divided by the ranks that share a row (context or sequence
    parallelism)."""
    ranks = [d for d in engine_run["ranks"] if d is not None]
    kind, share = row_sharing(engine_run["engine"])
    rows = []
    keys = []
    for d in ranks:
        for r in d["sft"]["runs"]:
            if (r["variant"], r["seq_len"]) not in keys:
                keys.append((r["variant"], r["seq_len"]))
    for variant, seq_len in sorted(keys, key=lambda k: (variants.index(k[0]), k[1])):
        per_rank = [next((r for r in d["sft"]["runs"] if (r["variant"], r["seq_len"]) == (variant, seq_len)), None)
                    for d in ranks]
        row = {"engine": engine_run["engine"], "variant": variant, "seq_len": seq_len, "ranks_seen": len(per_rank)}
        bad = [r for r in per_rank if r is None or r["status"] != "ok"]
        if bad or len(per_rank) < len(engine_run["ranks"]):
            first = next((r for r in bad if r is not None), None)
            row.update(status=first["status"] if first else "missing",
                       error=(first or {}).get("error") or (first or {}).get("note"))
        elif share > 1 and not all((r.get("wrapper") or "").endswith(f"{kind}{share}") for r in per_rank):
            # the ranks each trained whole rows: counting them as shared would halve the tokens they did
            row.update(status=f"not {kind} {share}",
                       error=f"{engine_run['engine']} asks for {kind} {share}, the ranks ran "
                             f"{sorted({r.get('wrapper') for r in per_rank}, key=str)}")
        else:
            peaks = [r["peak_gib"] for r in per_rank if r["peak_gib"] is not None]  # none on CPU
            row.update(status="ok",
                       tokens_per_s=sum(r["tokens_per_s"] for r in per_rank) / share,
                       peak_gib_per_gpu=max(peaks) if peaks else None,
                       allocated_before_gib=max((r.get("allocated_before_gib") or 0.0) for r in per_rank),
                       loss_step1=per_rank[0]["losses"][0] if per_rank[0].get("losses") else None,
                       forward=per_rank[0].get("forward"), wrapper=per_rank[0].get("wrapper"))
        rows.append(row)
    return rows


def table(doc: dict) -> str:
    env = doc.get("env") or {}
    lines = [f"hf_fused e2e under distributed engines: {doc['processes']} ranks on {env.get('device_name', '?')}, "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, trl {env.get('trl')}, "
             f"liger {env.get('liger_kernel')}; {doc['model']}, batch 1 per rank, grad checkpointing, median of "
             f"{doc['steps']} timed steps after {doc['warmup']}",
             f"  {'engine':10s}{'variant':18s}{'tokens':>8s}{'tok/s (all)':>13s}{'vs plain':>10s}"
             f"{'peak GiB/GPU':>14s}{'held before':>13s}{'loss@1':>10s}  wrapped by"]
    plain = {(r["engine"], r["seq_len"]): r["tokens_per_s"] for r in doc["rows"]
             if r["variant"] == "plain" and r["status"] == "ok"}
    for r in doc["rows"]:
        head = f"  {r['engine']:10s}{r['variant']:18s}{r['seq_len']:>8d}"
        if r["status"] != "ok":
            lines.append(head + f"  {r['status']}: {(r.get('error') or '')[:110]}")
            continue
        base = plain.get((r["engine"], r["seq_len"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        loss = f"{r['loss_step1']:.4f}" if r["loss_step1"] is not None else "-"
        lines.append(head + f"{r['tokens_per_s']:>13.0f}{ratio:>10s}{fmt_gib(r['peak_gib_per_gpu']):>14s}"
                            f"{fmt_gib(r['allocated_before_gib']):>13s}{loss:>10s}  {r.get('wrapper') or '-'}")
    for e in doc["engines"]:
        if e["status"] != "ok":
            lines.append(f"  note: {e['engine']} launch of {','.join(e['variants'])} {e['status']} after "
                         f"{e['wall_s']:.0f} s; output tail in its launch.log")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Optional[Path]:
    """Tokens/s of all ranks and the fullest GPU's peak memory per engine, one line per variant (and length)."""
    engines = list(dict.fromkeys(r["engine"] for r in doc["rows"]))
    lens = {r["seq_len"] for r in doc["rows"]}
    speed, memory = {}, {}
    for r in doc["rows"]:
        if r["status"] != "ok":
            continue
        label = r["variant"] + (f" @ {r['seq_len']}" if len(lens) > 1 else "")
        speed.setdefault(label, []).append((engines.index(r["engine"]), r["tokens_per_s"]))
        if r.get("peak_gib_per_gpu") is not None:
            memory.setdefault(label, []).append((engines.index(r["engine"]), r["peak_gib_per_gpu"]))
    common = dict(xticks=engines, xlabel="engine (accelerate config)", log=False)
    return plot_panels(path, [dict(common, title="training speed", ylabel="tokens/s, all ranks", series=speed),
                              dict(common, title="peak memory", ylabel="peak GiB of the fullest GPU", series=memory,
                                   empty="memory not measured on this device")],
                       f"{doc['processes']} ranks, {doc['model']}") if engines else None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.processes < 2:
        parser.error("--processes must be >= 2 (one process: python -m benchmarks.e2e)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SFT_MODELS[args.model][1 if args.tiny else 0]
    doc = {"argv": argv, "launch": args.launch, "processes": args.processes, "steps": args.steps, "warmup": args.warmup,
           "model": f"{shape}-shaped model", "engines": [], "rows": [], "env": None}
    launches = []
    for engine in args.engines:
        # DeepSpeed sets its Ulysses process groups up once per process: a second Trainer in it fails ("sequence
        # parallel group is already initialized"), so each variant gets a launch of its own there.
        if args.launch == "per-engine" and row_sharing(engine)[0] != "sp":
            launches.append((engine, list(args.sft_variants), args.out / engine))
        else:
            launches += [(engine, [v], args.out / engine / v) for v in args.sft_variants]
    bar = progress(len(launches), "launches", not args.no_progress, unit="launch")
    for engine, variants, out in launches:
        e = run_engine(engine, variants, args, out, bar)
        bar.update(1)
        doc["engines"].append({k: v for k, v in e.items() if k != "ranks"})
        doc["rows"] += combine(e, args.sft_variants)
        first = next((d for d in e["ranks"] if d is not None), None)
        if first and doc["env"] is None:
            doc["env"] = {k: v for k, v in first["env"].items() if k not in ("rank", "device")}
        save_json(doc, args.out / "e2e_distributed.json")
    bar.close()
    text = table(doc)
    (args.out / "e2e_distributed.txt").write_text(text + "\n")
    plot(doc, args.out / "e2e_distributed.png")
    print("\n" + text, flush=True)
    return 0 if all(e["status"] == "ok" for e in doc["engines"]) else 1


if __name__ == "__main__":
    sys.exit(main())
