"""Peak tensor memory of a code region, on CUDA or CPU.

Usage::

    with track_peak_memory("cpu") as mem:
        loss = loss_fn(hidden, weight, labels)
        loss.backward()
    print(mem.peak_bytes)

``peak_bytes`` is the highest number of bytes held, at any moment inside the region, by
tensors *allocated inside the region* (the baseline at entry is 0).  Forward outputs,
autograd-saved activations, backward temporaries and new gradients all count, as long as the
backward runs inside the ``with`` block.

* CUDA: read from the caching allocator (``torch.cuda.max_memory_allocated`` minus the bytes
  allocated at entry).  Exact for the device, including kernel workspaces.
* CPU: PyTorch keeps no allocation statistics, so a ``TorchDispatchMode`` sees every aten op,
  adds the storage size of each output tensor that is not an alias of an input, and
  subtracts it when that storage is freed.  Scratch buffers that a kernel allocates and frees
  internally (invisible to the dispatcher) are not counted, nor are tensors created outside
  the region and later resized inside it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryReport", "track_peak_memory"]


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
