"""The kept rows of one call (the positions whose label is not ``ignore_index``), counted on the device and read
by the host at their first use (:class:`KeptRows`).

Compacting the ignored rows out before any matmul needs their count on the host, and reading it is a host sync,
which waits for every kernel queued before it. Read where the op first needs it instead of where the labels are
checked, the host work in between (the op's autograd Function, the plan, the buffers, the first tile's launch) runs
while the device still works through what was queued before the call, rather than after it with the device idle.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class KeptRows:
    """The kept rows ``[M]`` (int64, ascending) of a ``[N]`` mask, counted by kernels at construction and read once.

    Args:
        kept: ``[N]`` bool mask of the rows to compute.
        counts: int64 ``[k ≥ 1]`` device tensor whose first element is ``kept.sum()``; the rest are the caller's
            own checks, read in the same transfer.
        check: called once with the counts as Python ints when they are read; raises for bad input (labels out of
            range, say), so that the error reaches the caller from the op whichever use reads them first.
        defer: False reads the count here (a plain ``tolist``, no copy or event: what Dynamo traces).
    """

    def __init__(self, kept: torch.Tensor, counts: torch.Tensor,
                 check: Optional[Callable[[list], None]] = None, *, defer: bool = True) -> None:
        self._kept, self._counts, self._check = kept, counts, check
        self._rows: Optional[torch.Tensor] = None
        self._ready = None
        if not defer:
            self.rows()
        elif counts.is_cuda:
            # the copy queued now, right behind the counting kernels, and waited for alone at the first use: work
            # the op queues in between (the first tile) does not delay the read
            self._counts = counts.to("cpu", non_blocking=True)  # into pinned memory
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(counts.device))  # the copy's stream, whatever is current

    @classmethod
    def of(cls, rows: torch.Tensor) -> "KeptRows":
        """Rows already known (``[M]`` int64, ascending)."""
        out = cls.__new__(cls)
        out._kept = out._counts = out._check = out._ready = None
        out._rows = rows
        return out

    @property
    def known(self) -> bool:
        """Whether the count has been read (no host sync left)."""
        return self._rows is not None

    @property
    def device(self) -> torch.device:
        return self._rows.device if self._rows is not None else self._kept.device

    @property
    def bound(self) -> int:
        """``M`` once known, else ``N``: an upper bound on the count that needs no host sync."""
        return self._rows.numel() if self._rows is not None else self._kept.numel()

    def rows(self) -> torch.Tensor:
        """The kept rows, ``[M]`` int64 ascending: on the first call, the one host sync (and ``check``)."""
        if self._rows is None:
            if self._ready is not None:
                self._ready.synchronize()  # the one host sync of the call
            host = self._counts.tolist()
            if self._check is not None:
                self._check(host)
            self._rows = torch.nonzero_static(self._kept, size=int(host[0])).squeeze(1)
            self._kept = self._counts = self._check = self._ready = None
        return self._rows

    def leading(self, count: int) -> torch.Tensor:
        """The first ``count`` kept rows, ``[count]`` int64, without reading the count: where fewer rows are kept,
        the missing ones are row 0 (a valid index, whatever its label: the caller must check the count before
        using them). Once the count is known, a slice of :meth:`rows`."""
        if self._rows is not None:
            return self._rows[:count]
        return torch.nonzero_static(self._kept, size=count, fill_value=0).squeeze(1)


__all__ = ["KeptRows"]
