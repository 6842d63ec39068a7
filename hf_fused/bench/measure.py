"""Timing and memory of one callable on one device.

* Time: the median over repeated calls, CUDA-synchronized. On CUDA with Triton importable:
  ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` (it flushes L2 before each call),
  with ``warmup``/``rep`` sized from a first timed call so that about ``repeats`` calls are timed;
  otherwise CUDA events around each call; on CPU ``time.perf_counter``.
* Memory: ``max_memory_allocated() − memory_allocated()`` around one call, after
  ``reset_peak_memory_stats()``: the peak ABOVE everything alive before the call (see
  :data:`MEMORY_BASELINE`). Not available on CPU (``None``).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional

import torch

MEMORY_BASELINE = (
    "peak memory above inputs and gradients = torch.cuda.max_memory_allocated() during one forward+backward "
    "minus torch.cuda.memory_allocated() just before it (after reset_peak_memory_stats), minus the bytes of "
    "the gradients that end up in hidden.grad and weight.grad (which start as None, so the step's own "
    "gradients become them). The baseline holds the problem's inputs (hidden, weight, labels, GRPO "
    "mask/ids/advantages) and the CUDA caching allocator's persistent blocks from the warm-up call (e.g. the "
    "cuBLAS workspace). The figure therefore counts the peer's own buffers: logits/tiles, saved tensors, fp32 "
    "accumulators, and any gradient copy beyond the final .grad. The float64 reference lives on the host."
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timer_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "time.perf_counter median"
    try:
        import triton.testing  # noqa: F401

        return "triton.testing.do_bench median"
    except ImportError:
        return "CUDA events median"


def time_once_ms(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, str]:
    """Median wall time of ``fn()`` in milliseconds and the name of the timer used. ``fn`` has been
    called at least once before (warm-up: compilation, autotuning, allocator)."""
    repeats = max(1, int(repeats))
    timer = _timer_name(device)
    if timer.startswith("triton"):
        from triton.testing import do_bench

        est = max(time_once_ms(fn, device), 1e-3)
        # do_bench runs ~max(1, warmup/est) warm-up and ~max(1, rep/est) timed calls (after its own 5-call estimate).
        return float(do_bench(fn, warmup=est, rep=est * repeats, return_mode="median")), timer
    if device.type == "cuda":
        fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return statistics.median(times), timer
    return statistics.median(time_once_ms(fn, device) for _ in range(repeats)), timer


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[object, Optional[int]]:
    """``(fn(), peak bytes above the pre-call allocation)``; the peak is ``None`` off CUDA."""
    if device.type != "cuda":
        return fn(), None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> dict:
    """The dense-matmul ceiling: median TFLOP/s of an ``n×n @ n×n`` product in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    fn = lambda: torch.mm(a, b, out=out)  # noqa: E731
    fn()
    ms, timer = median_ms(fn, device, 50 if device.type == "cuda" else max(repeats, 3))
    del a, b, out
    free_memory(device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12,
            "timer": timer}
