"""Run every (problem, peer) pair on one device and collect one record per pair.

For each problem: make the inputs, compute the float64 reference once, then for each peer: import it (failure →
``skipped``), check it supports the problem (``n/a``) and has it in its installed version (``skipped``), run one
warm-up forward+backward, measure the peak memory of a second one and compare its loss / gradients (/ log-probs,
entropy) with the reference, then time it. Out of memory → ``OOM``; any other exception → ``error`` with its text.
Everything the peer allocated is freed before the next one. Results are written to the JSON after every pair, so a
run cut short keeps what it did (and ``--resume`` continues it).
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import measure
from .peers import HFFusedPeer, Peer
from .problems import Inputs, Problem, make_inputs
from .reference import Reference, compute_reference

FLOP_CONVENTION = (
    "useful FLOPs = 6·N·H·V for cross-entropy (logits, dX, dW), 8·N·H·V for GRPO (logits in forward, recomputed "
    "logits, dX, dW), (6·H + 2·H_t)·N·V for distillation (student logits, dX, dW; teacher logits) and 6·N·H·V for a "
    "sparse teacher (its top-K log-probs are inputs), N = the KEPT "
    "tokens only (the same count for every peer, so TFLOP/s is proportional to 1/time; peers that also compute "
    "ignored rows get no credit for them)"
)
MEMORY_BASELINE = (
    "peak memory above inputs and gradients = the peak allocated during one forward+backward minus what was "
    "allocated just before it (CUDA: max_memory_allocated after reset_peak_memory_stats; CPU: the peak of the bytes "
    "held by tensors created during the call, counted op by op), minus the bytes of the gradients that end up in "
    "hidden.grad and weight.grad (which start as None, so the step's own gradients become them). The baseline holds "
    "the problem's inputs and the CUDA caching allocator's persistent blocks from the warm-up call (e.g. the cuBLAS "
    "workspace), so the figure counts the peer's own buffers: logits/tiles, saved tensors, fp32 accumulators, and "
    "any gradient copy beyond the final .grad. The float64 reference lives on the host."
)

OK, SKIPPED, NA, OOM, ERROR = "ok", "skipped", "n/a", "OOM", "error"


@dataclass
class RunConfig:
    device: torch.device
    dtype: torch.dtype
    problems: list[Problem]
    peers: list[Peer]
    repeats: int
    out_dir: Path
    reference: bool = True
    resume: bool = False
    seed: int = 0
    matmul_n: int = 8192
    # The ceiling's product held for this many seconds (its rate at the power limit); 0: a burst of 50 products.
    ceiling_hold_s: float = 0.0
    progress: bool = True
    argv: Optional[list[str]] = None
    # Each step under torch.autocast in this dtype (None: no autocast). With fp32 inputs that is mixed precision:
    # fp32 master weights and gradients, bf16 matmuls, what TRL's GRPOTrainer trains by default (it loads a model
    # in float32 and its config has bf16=True).
    autocast: Optional[torch.dtype] = None


def matmul_dtype(cfg: RunConfig) -> torch.dtype:
    """The dtype the problems' matmuls run in, so the ceiling is measured in it: the autocast dtype when one is
    given (fp32 inputs under bf16 autocast multiply in bf16; an fp32 ceiling would make fractions above 100 %)."""
    return cfg.autocast if cfg.autocast is not None else cfg.dtype


def run_step(peer: Peer, problem: Problem, inp: Inputs, autocast: Optional[torch.dtype] = None):
    """One forward+backward (under ``torch.autocast(dtype=autocast)`` when given, as ``Trainer(bf16=True)`` runs a
    step); returns detached (loss, logps, entropy)."""
    device_type = inp.weight.device.type
    logps = entropy = None
    with peer.step_context(), torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
        if problem.kind == "ce":
            loss = peer.ce_loss(inp)
        elif problem.kind == "distill":
            loss = peer.distill(inp)
        elif problem.kind == "sparse":
            loss = peer.sparse(inp)
        else:
            loss, logps, entropy = peer.grpo(inp)
        loss.backward()
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    return detach(loss), detach(logps), detach(entropy)


def _errors(inp: Inputs, ref: Reference, loss, logps, entropy) -> dict:
    out = {
        "loss": float(loss),
        "loss_ref": ref.loss,
        "loss_rel_err": abs(float(loss) - ref.loss) / max(abs(ref.loss), 1e-300),
        "grad_hidden_rel_err": measure.relative_error(inp.hidden.grad, ref.grad_hidden),
        "grad_weight_rel_err": measure.relative_error(inp.weight.grad, ref.grad_weight),
    }
    valid = inp.valid.reshape(-1)
    if logps is not None and ref.logps is not None:
        out["logp_rel_err"] = measure.relative_error(logps.reshape(-1).float() * valid, ref.logps)
    if entropy is not None and ref.entropy is not None:
        out["entropy_rel_err"] = measure.relative_error(entropy.reshape(-1).float() * valid, ref.entropy)
    return out


def run_pair(peer: Peer, problem: Problem, inp: Inputs, ref: Optional[Reference], cfg: RunConfig,
             ceiling: Optional[float]) -> dict:
    """Measure one peer on one problem; never raises (failures become the record's status)."""
    rec = {"problem": problem.name, "peer": peer.key, "label": peer.label, "status": OK, "note": ""}
    try:
        peer.load()
    except Exception as e:  # ImportError, or a broken install raising something else on import
        rec.update(status=SKIPPED, note=f"unavailable: {measure.short_error(e)}")
        return rec
    rec["version"] = peer.version()
    rec["call"] = peer.describe()
    reason = peer.unsupported(problem.kind, cfg.device) or peer.unsupported_problem(problem)
    if reason:
        rec.update(status=NA, note=reason)
        return rec
    missing = peer.unavailable(problem.kind)
    if missing:
        rec.update(status=SKIPPED, note=missing)
        return rec
    if isinstance(peer, HFFusedPeer):
        try:
            rec["backend"] = peer.backend_name(cfg.device)
        except Exception as e:
            rec.update(status=ERROR, note=f"backend: {measure.short_error(e)}")
            return rec
    rec["has_entropy"] = problem.kind == "grpo" and peer.has_entropy and peer.with_entropy
    phase = "warm-up"
    step = lambda: run_step(peer, problem, inp, cfg.autocast)  # noqa: E731
    try:
        for t in (inp.hidden, inp.weight):  # the warm-up accumulates into .grad buffers, as the timed steps do
            t.grad = torch.zeros_like(t)
        step()  # compile / autotune / allocator warm-up
        inp.hidden.grad = inp.weight.grad = None  # the gradients this step produces become .grad
        phase = "memory"
        (loss, logps, entropy), peak = measure.peak_memory(step, cfg.device)
        peak -= sum(t.grad.numel() * t.grad.element_size() for t in (inp.hidden, inp.weight) if t.grad is not None)
        rec["peak_mem_bytes"] = peak
        rec["loss"] = float(loss)
        if ref is not None:
            phase = "errors"
            rec.update(_errors(inp, ref, loss, logps, entropy))
        del loss, logps, entropy
        phase = "timing"  # gradients accumulate into the .grad buffers the memory step left, as in training
        ms, timer = measure.median_ms(step, cfg.device, cfg.repeats)
        tflops = problem.flops(inp.n_valid) / (ms * 1e-3) / 1e12
        rec.update(time_ms=ms, timer=timer, tflops=tflops, ceiling_tflops=ceiling,
                   frac_of_ceiling=tflops / ceiling if ceiling else None)  # no ceiling on CPU: no fraction
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status=OOM, note=f"out of memory in {phase}: {measure.short_error(e, 160)}")
    except Exception as e:
        rec.update(status=ERROR, note=f"{phase}: {measure.short_error(e)}")
    finally:
        inp.hidden.grad = inp.weight.grad = None
        measure.free_memory(cfg.device)
    return rec


def _problem_info(problem: Problem) -> dict:
    return {"kind": problem.kind, "N": problem.N, "H": problem.H, "V": problem.V, "B": problem.B, "T": problem.T,
            "H_t": problem.H_t, "beta": problem.beta, "K": problem.K, "description": problem.describe()}


def run(cfg: RunConfig) -> dict:
    """Run the benchmark; returns the results document (also written to ``out_dir/bench.json``)."""
    path = cfg.out_dir / "bench.json"
    doc = (measure.load_json(path) if cfg.resume and path.exists()
           else {"runs": [], "problems": {}, "results": []})
    done = {(r["problem"], r["peer"]) for r in doc["results"]}
    todo = [(p, peer) for p in cfg.problems for peer in cfg.peers if (p.name, peer.key) not in done]

    # A matmul ceiling is a GPU's (tensor-core peak); on CPU a small probe matmul is no ceiling for a tiled loss
    # whose tiles are larger, so fractions of it would mislead: none is measured.
    ceiling = (measure.matmul_tflops(cfg.device, matmul_dtype(cfg), cfg.matmul_n, cfg.repeats, cfg.ceiling_hold_s)
               if cfg.device.type == "cuda" else None)
    doc["runs"].append({
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": cfg.argv if cfg.argv is not None else sys.argv[1:],
        "device": measure.device_name(cfg.device),
        "dtype": str(cfg.dtype).replace("torch.", ""),
        "autocast": None if cfg.autocast is None else str(cfg.autocast).replace("torch.", ""),
        "versions": measure.versions(),
        "matmul_ceiling": ceiling,
        "timer": measure.timer_name(cfg.device),
        "repeats": cfg.repeats,
        "flop_convention": FLOP_CONVENTION,
        "memory_baseline": MEMORY_BASELINE,
    })
    run_index = len(doc["runs"]) - 1
    measure.save_json(doc, path)

    bar = measure.progress(len(todo), "bench", cfg.progress, unit="pair")
    for problem in cfg.problems:
        peers = [peer for peer in cfg.peers if (problem.name, peer.key) not in done]
        if not peers:
            continue
        bar.set_postfix_str(f"{problem.name}: inputs + float64 reference")
        info = _problem_info(problem)
        try:
            inp = make_inputs(problem, cfg.device, cfg.dtype, cfg.seed)
        except Exception as e:  # e.g. out of memory: every pair of this problem fails the same way
            status = OOM if isinstance(e, torch.cuda.OutOfMemoryError) else ERROR
            for peer in peers:
                doc["results"].append({"problem": problem.name, "peer": peer.key, "label": peer.label, "status": status,
                                       "note": f"inputs: {measure.short_error(e)}", "run": run_index})
                bar.update(1)
            doc["problems"][problem.name] = {**info, "n_valid": None, "reference": "no inputs"}
            measure.save_json(doc, path)
            measure.free_memory(cfg.device)
            continue
        info.update(n_valid=inp.n_valid, seed=cfg.seed, dtype=str(cfg.dtype).replace("torch.", ""))
        ref = None
        if cfg.reference:
            try:
                ref = compute_reference(problem, inp)
                info.update(reference="float64", reference_loss=ref.loss, reference_seconds=ref.seconds)
            except torch.cuda.OutOfMemoryError as e:
                info.update(reference=f"OOM: {measure.short_error(e, 160)}")
            except Exception as e:
                info.update(reference=f"error: {measure.short_error(e)}")
            measure.free_memory(cfg.device)
        else:
            info.update(reference="skipped (--no-reference)")
        doc["problems"][problem.name] = info
        for peer in peers:
            bar.set_postfix_str(f"{problem.name} / {peer.key}")
            rec = run_pair(peer, problem, inp, ref, cfg, ceiling["tflops"] if ceiling else None)
            rec["run"] = run_index
            doc["results"].append(rec)
            measure.save_json(doc, path)
            bar.update(1)
        del inp, ref
        measure.free_memory(cfg.device)
    bar.close()
    return doc
