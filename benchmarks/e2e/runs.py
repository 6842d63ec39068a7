"""What the end-to-end parts share around a trainer's steps: timing the steps, the record of a timed run, a run
guarded so that an OOM or an error becomes a row instead of ending the benchmark, and the loop over a part's
variants within the time budget."""

from __future__ import annotations

import math
import statistics
import time
import traceback
from typing import Callable, Optional

import torch

from ..measure import GIB, free_memory, is_oom, peak_gib, reset_peak, short_error, synchronize
from .models import checkpointing_on, n_params


def timed_steps(model, step: Callable[[], torch.Tensor], device: torch.device, n: int):
    """``n`` steps of ``step()`` (the loss) and its backward from zeroed gradients: ``(seconds, losses, peak GiB,
    gradient norm of the last step)``."""
    times, losses = [], []
    reset_peak(device)
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        loss.backward()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = peak_gib(device)
    grad_norm = math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in model.parameters() if p.grad is not None))
    return times, losses, peak, grad_norm


def step_record(times, warmup: int, tokens: int, peak, weights, losses, grad_norm, model, build_s, **extra) -> dict:
    """The JSON record of a timed run: the median step after ``warmup`` warm-up steps and its tokens/s."""
    timed = times[warmup:]
    return {
        "status": "ok",
        "step_s": timed,
        "step_s_median": statistics.median(timed),
        "warmup_step_s": times[:warmup],
        "tokens_per_s": tokens / statistics.median(timed),
        "peak_gib": peak,
        "weights_gib": weights,
        "peak_above_weights_gib": None if peak is None else peak - weights,
        "losses": losses,
        "grad_norm_last": grad_norm,
        "checkpointing": checkpointing_on(model),
        "build_s": build_s,
        "params": n_params(model),
        **extra,
    }


def guarded_run(once: Callable[[], dict], device: torch.device, **labels) -> dict:
    """``once()`` from freed memory; an OOM or an error becomes its record (with the traceback's end)."""
    leftover = free_memory(device)
    t0 = time.perf_counter()
    try:
        result = once()
    except Exception as e:  # noqa: BLE001
        result = {"status": "OOM" if is_oom(e) else "error", "error": short_error(e)}
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
        result["peak_gib"] = peak_gib(device)
    result.update(**labels, wall_s=time.perf_counter() - t0,
                  allocated_before_gib=None if leftover is None else leftover / GIB)
    free_memory(device)
    return result


def run_variants(name: str, variants, runs: list, reason: Optional[str], deadline: float, bar, save,
                 run: Callable[[str], dict], describe: Callable[[dict], str]) -> None:
    """Each variant's record into ``runs`` (skipped with ``reason``, or past ``deadline``), saving after each and
    advancing ``bar`` (:func:`benchmarks.measure.progress`)."""
    for variant in variants:
        if reason:
            res = {"status": "skipped", "note": reason, "variant": variant}
        elif time.perf_counter() > deadline:
            res = {"status": "skipped", "note": "time budget", "variant": variant}
        else:
            bar.write(f"{name} {variant:10s} ...")
            res = run(variant)
            bar.write(f"    -> {describe(res)}  ({res['wall_s']:.1f} s)")
        runs.append(res)
        save()
        bar.update(1)
