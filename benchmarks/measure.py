"""Timing and memory, the one measuring module of the kernel benchmark (``python -m benchmarks``), the
end-to-end benchmark (``python -m benchmarks.e2e``) and the examples.

* Time: the median over repeated calls, CUDA-synchronized. On CUDA with Triton importable:
  ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` (it flushes L2 before each call),
  with ``warmup``/``rep`` sized from a first timed call so that about ``repeats`` calls are timed;
  otherwise CUDA events around each call; on CPU ``time.perf_counter``.
* Memory (:func:`track_peak_memory`, :func:`peak_memory`): the peak ABOVE everything alive before the
  region (see :data:`MEMORY_BASELINE`). CUDA: ``max_memory_allocated() − memory_allocated()`` after
  ``reset_peak_memory_stats()``. CPU, where PyTorch keeps no allocator statistics: a ``TorchDispatchMode``
  adds the storage of every tensor an aten op creates and subtracts it when the storage is freed (scratch
  buffers a kernel allocates and frees internally are invisible to it). Timing is never measured under
  the mode.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30

MEMORY_BASELINE = (
    "peak memory above inputs and gradients = torch.cuda.max_memory_allocated() during one forward+backward "
    "minus torch.cuda.memory_allocated() just before it (after reset_peak_memory_stats) on CUDA; on CPU the "
    "peak of the bytes held by tensors created during the call, counted op by op (track_peak_memory); minus the bytes of "
    "the gradients that end up in hidden.grad and weight.grad (which start as None, so the step's own "
    "gradients become them). The baseline holds the problem's inputs (hidden, weight, labels, GRPO "
    "mask/ids/advantages) and the CUDA caching allocator's persistent blocks from the warm-up call (e.g. the "
    "cuBLAS workspace). The figure therefore counts the peer's own buffers: logits/tiles, saved tensors, fp32 "
    "accumulators, and any gradient copy beyond the final .grad. The float64 reference lives on the host."
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> Optional[int]:
    """Collect garbage, empty the CUDA cache and reset its peak counter; the bytes still allocated on
    CUDA (``None`` on CPU, which has no allocator statistics)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocated_gib(device: torch.device) -> Optional[float]:
    """GiB allocated now on CUDA; ``None`` on CPU."""
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def peak_gib(device: torch.device) -> Optional[float]:
    """GiB at the CUDA allocator's peak since the last reset; ``None`` on CPU."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def short_error(exc: BaseException, n: int = 300) -> str:
    """``Type: message`` on one line, at most ``n`` characters of message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text if len(text) <= n else text[: n - 1] + '…'}"


def timer_name(device: torch.device) -> str:
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
    timer = timer_name(device)
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


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[object, int]:
    """``(fn(), peak bytes above the pre-call allocation)``, read by :func:`track_peak_memory`."""
    gc.collect()
    with track_peak_memory(device) as mem:
        out = fn()
    return out, mem.peak_bytes


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


class MemoryReport:
    """Result of ``track_peak_memory``.

    Attributes:
        device: the ``torch.device`` measured.
        peak_bytes: peak bytes above the region's starting point (int, final after the
            ``with`` block exits; on CPU it is also kept up to date inside the block).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __repr__(self) -> str:
        return f"MemoryReport(device={self.device}, peak_bytes={self.peak_bytes})"


class _LiveTensorBytes(TorchDispatchMode):
    """Tallies bytes of storages created by aten ops while the mode is active.

    A storage is identified by its Python ``UntypedStorage`` object, which PyTorch keeps alive
    (and identical for every view) exactly as long as the underlying memory lives, so a weakref
    callback on it marks the moment the memory is released.
    """

    def __init__(self, report: MemoryReport):
        super().__init__()
        self._report = report
        self._live = 0
        self._lock = threading.Lock()  # the autograd engine may run ops on another thread
        # id() of each live tracked storage -> weakref whose callback fires when it is freed
        # (the dict also keeps the weakrefs, and so their callbacks, alive).
        self._tracked: dict[int, weakref.ref] = {}

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._tracked.pop(key, None)
            self._live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Outputs sharing storage with an input are views or in-place results: no new memory.
        inputs = {
            id(x.untyped_storage())
            for x in tree_flatten((args, kwargs))[0]
            if isinstance(x, torch.Tensor) and x.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._tracked or st.device.type == "meta":
                continue
            nbytes = st.nbytes()
            with self._lock:
                self._tracked[key] = weakref.ref(st, lambda _, k=key, n=nbytes: self._release(k, n))
                self._live += nbytes
                if self._live > self._report.peak_bytes:
                    self._report.peak_bytes = self._live
        return out


@contextlib.contextmanager
def track_peak_memory(device: str | torch.device = "cpu") -> Iterator[MemoryReport]:
    """Measure the peak bytes allocated by tensors inside the ``with`` block.

    Args:
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``, ...).  On CUDA only that
            device's allocator is read; on CPU every tensor created by an aten op is counted,
            whatever its device.

    Yields:
        A ``MemoryReport`` whose ``peak_bytes`` (int) is final when the block exits.

    Raises:
        ValueError: for a device type other than cpu or cuda.
    """
    device = torch.device(device)
    report = MemoryReport(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        try:
            yield report
        finally:
            torch.cuda.synchronize(device)
            report.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - start)
    elif device.type == "cpu":
        with _LiveTensorBytes(report):
            yield report
    else:
        raise ValueError(f"track_peak_memory supports cpu and cuda devices, got {device}")
