"""The one measuring module of every benchmark entry point (``python -m benchmarks``, ``python -m benchmarks.e2e``,
``benchmarks.e2e.distributed``) and of the examples: time, peak memory, error against float64, the environment,
and the output (JSON, text table, plot, progress bar).

* Time (:func:`median_ms`): the median over repeated calls, CUDA-synchronized. On CUDA with Triton importable,
  ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` (it flushes L2 before each call) with
  ``warmup``/``rep`` sized from a first timed call so that about ``repeats`` calls are timed; otherwise CUDA events
  around each call; on CPU ``time.perf_counter``.
* Memory (:func:`track_peak_memory`, :func:`peak_memory`): the peak ABOVE everything alive before the region. CUDA:
  ``max_memory_allocated() − memory_allocated()`` after ``reset_peak_memory_stats()``. CPU, where PyTorch keeps no
  allocator statistics: a ``TorchDispatchMode`` adds the storage of every tensor an aten op creates and subtracts
  it when the storage is freed (scratch buffers a kernel allocates and frees internally are invisible to it).
  Timing is never measured under the mode.
* Error (:func:`relative_error`): ``‖x − x_ref‖ / ‖x_ref‖`` in float64 against a reference kept on the host.
* Output: :func:`save_json` (atomic, so a run cut short leaves a readable file), :func:`text_table`,
  :func:`plot_panels` (matplotlib; ``None`` without it), :func:`progress` (tqdm; a silent bar without it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30

# ---------------------------------------------------------------------------------------------- environment


def versions() -> dict:
    """Python, torch and the installed versions of the packages the benchmarks compare (``None``: not installed)."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "transformers", "trl", "liger-kernel", "cut-cross-entropy", "quack-kernels", "hf_fused"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def short_error(exc: BaseException, n: int = 300) -> str:
    """``Type: message`` on one line, at most ``n`` characters of message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text if len(text) <= n else text[: n - 1] + '…'}"


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------------- time


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """Median wall time of ``fn()`` in milliseconds and the name of the timer used. Call ``fn`` at least once before
    (warm-up: compilation, autotuning, allocator)."""
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


def held_ms(fn: Callable[[], object], device: torch.device, seconds: float) -> list[float]:
    """``fn()`` called back to back for ``seconds`` of host time, with no host synchronization between calls (on
    CUDA the host queues ahead; the device runs on until every call is done): each call's time in milliseconds
    (CUDA events; on CPU the wall time of each). Call ``fn`` at least once before (warm-up)."""
    times: list[float] = []
    pairs = []
    synchronize(device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        else:
            times.append(time_once_ms(fn, device))
    synchronize(device)
    return times or [start.elapsed_time(end) for start, end in pairs]


def duration_arg(positive: bool):
    """An argparse ``type`` for a duration (seconds or milliseconds, as the option says): a float ``> 0``
    (``positive``) or ``>= 0``, else an error naming what was given."""
    bound = "> 0" if positive else ">= 0"

    def parse(text: str) -> float:
        value = float(text)
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text!r}: give a duration {bound}")
        return value
    return parse


def matmul_product(device: torch.device, dtype: torch.dtype, n: int) -> Callable[[], object]:
    """The ceiling's product: a call of ``torch.mm`` on ``n×n`` random operands in ``dtype`` (``2·n³`` FLOPs)."""
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _matmul_ms(device: torch.device, dtype: torch.dtype, n: int, repeats: int, hold_s: float) -> tuple[float, str]:
    fn = matmul_product(device, dtype, n)
    fn()
    if hold_s > 0:
        times = held_ms(fn, device, hold_s)
        return statistics.median(times[len(times) // 2:]), "held: median of the last half"
    return median_ms(fn, device, 50 if device.type == "cuda" else max(repeats, 3))


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int, hold_s: float = 0.0) -> dict:
    """The dense-matmul ceiling: median TFLOP/s of an ``n×n @ n×n`` product in ``dtype``. By default (``hold_s``
    0) on CUDA a burst of 50 products (about 70 ms at 8192 on an H200): the rate before the power limit lowers the
    clock, which a step held for seconds does not keep. ``hold_s > 0``: the products back to back for that many
    seconds (:func:`held_ms`), the median of the last half: the rate held (on an H200 at its 700 W limit, 671
    against the burst's 790 TFLOP/s: docs/performance.md, H200, 2026-11-30)."""
    ms, timer = _matmul_ms(device, dtype, n, repeats, hold_s)
    free_memory(device)  # the operands died with _matmul_ms's frame
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12,
            "timer": timer, "hold_s": hold_s}


# ---------------------------------------------------------------------------------------------- memory


def free_memory(device: torch.device) -> Optional[int]:
    """Collect garbage, empty the CUDA cache and reset its peak counter; the bytes still allocated on CUDA (``None``
    on CPU, which has no allocator statistics)."""
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


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[object, int]:
    """``(fn(), peak bytes above the pre-call allocation)``, read by :func:`track_peak_memory`."""
    gc.collect()
    with track_peak_memory(device) as mem:
        out = fn()
    return out, mem.peak_bytes


class MemoryReport:
    """Result of :func:`track_peak_memory`.

    Attributes:
        device: the ``torch.device`` measured.
        peak_bytes: peak bytes above the region's starting point (int, final after the ``with`` block exits; on CPU
            it is also kept up to date inside the block).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __repr__(self) -> str:
        return f"MemoryReport(device={self.device}, peak_bytes={self.peak_bytes})"


class _LiveTensorBytes(TorchDispatchMode):
    """Tallies bytes of storages created by aten ops while the mode is active.

    A storage is identified by its Python ``UntypedStorage`` object, which PyTorch keeps alive (and identical for
    every view) exactly as long as the underlying memory lives, so a weakref callback on it marks the moment the
    memory is released.
    """

    def __init__(self, report: MemoryReport):
        super().__init__()
        self._report = report
        self._live = 0
        self._lock = threading.Lock()  # the autograd engine may run ops on another thread
        # id() of each live tracked storage -> weakref whose callback fires when it is freed (the dict also keeps
        # the weakrefs, and so their callbacks, alive).
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
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``, ...). On CUDA only that device's allocator is
            read; on CPU every tensor created by an aten op is counted, whatever its device.

    Yields:
        A :class:`MemoryReport` whose ``peak_bytes`` (int) is final when the block exits.

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


# ---------------------------------------------------------------------------------------------- error


@torch.no_grad()
def relative_error(value: torch.Tensor, ref: torch.Tensor, chunk_elems: int = 1 << 25) -> float:
    """``‖value − ref‖ / ‖ref‖`` in float64 (``‖value − ref‖`` where ``ref`` is 0), streaming ``ref`` (on the host,
    where the references live so that the peers get the device) to ``value``'s device in chunks.

    Raises:
        ValueError: ``value`` and ``ref`` hold different numbers of elements.
    """
    v, r = value.detach().reshape(-1), ref.reshape(-1)
    if v.numel() != r.numel():
        raise ValueError(f"shape mismatch: {tuple(value.shape)} vs reference {tuple(ref.shape)}")
    num = torch.zeros((), dtype=torch.float64, device=v.device)
    den = torch.zeros((), dtype=torch.float64, device=v.device)
    for s in range(0, r.numel(), chunk_elems):
        rc = r[s : s + chunk_elems].to(v.device)
        num += (v[s : s + chunk_elems].double() - rc).square().sum()
        den += rc.square().sum()
    den_f = float(den)
    return float(num.sqrt()) / den_f**0.5 if den_f > 0 else float(num.sqrt())


# ---------------------------------------------------------------------------------------------- output


def load_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def save_json(doc: dict, path: Path) -> None:
    """Write ``doc`` to ``path`` through a temporary file, so that a reader never sees half a document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def text_table(header: list[str], rows: list[list[str]], align_left: int = 1) -> list[str]:
    """Lines of a plain-text table: a header, a rule, the rows; the first ``align_left`` columns left-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < align_left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return [fmt_row(header), "  ".join("-" * w for w in widths), *map(fmt_row, rows)]


def plot_panels(path: Path, panels: list[dict], title: str = "", columns: int = 2) -> Optional[Path]:
    """Line plots, one panel each, saved as a PNG; ``None`` (nothing written) without matplotlib or panels.

    Each panel is a dict: ``title``, ``xlabel``, ``ylabel``, ``xticks`` (the labels of x = 0, 1, ...), ``series``
    (label → list of ``(x, y)``; a label containing ``hf_fused`` is drawn solid, the others dashed), optional
    ``marks`` (list of ``(x, text)`` written at the top, e.g. where a peer ran out of memory), ``log`` (log y
    axis, default True) and ``empty`` (the text shown when no series has a point).
    """
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for j, (label, points) in enumerate(panel["series"].items()):
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="os^vD<>ph*"[j % 10], linestyle="-" if "hf_fused" in label else "--",
                        label=label)
        for j, (x, text) in enumerate(panel.get("marks", [])):
            ax.annotate(text, (x, 0.98 - 0.05 * (j % 12)), xycoords=("data", "axes fraction"), ha="center", va="top",
                        fontsize=7, color="red")
        ax.set_xticks(range(len(panel["xticks"])))
        ax.set_xticklabels(panel["xticks"], fontsize=8)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_title(panel.get("title", ""))
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            if panel.get("log", True):
                ax.set_yscale("log")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, panel.get("empty", "nothing measured"), ha="center", va="center",
                    transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def write(self, s):
        print(s, flush=True)

    def close(self):
        pass


def progress(total: int, desc: str, enabled: bool = True, unit: str = "run"):
    """A tqdm bar over ``total`` steps (``update``, ``set_postfix_str``, ``write``, ``close``); a silent stand-in
    when disabled or without tqdm (``write`` then prints)."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)  # its write() prints above the bar
