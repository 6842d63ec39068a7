"""The tile loop of a vocabulary-sharded head: each rank computes the logits of its own vocabulary rows, tile by
tile, and the per-row statistics of every tile are merged over the tensor-parallel group with one O(rows)
all-reduce pair (:func:`~hf_fused.ops.vocab_parallel.merged_tile_statistics`) before the tile's gradient is formed.

:class:`VocabParallelBackend` meets :class:`~hf_fused.ops.backends.protocol.TokenLossBackend` for one call's
:class:`~hf_fused.ops.vocab_parallel.VocabLayout`; the ops choose it when given ``vocab_parallel=`` (through
:func:`hf_fused.ops.prepare.prepare`). It is the torch reference's loop (fp32 tiles of ``TILE_BUFFERS`` arrays,
plain matmuls: cuBLAS on a GPU) with the merge in the middle: the weight gradient of a rank's rows stays on the
rank, the hidden states' gradient is the rank's part of a sum that the ops all-reduce once per backward
(:func:`~hf_fused.ops.vocab_parallel.sum_gradient_over`). The recompute backward needs no collective: the merged
log-sum-exp and entropy of the forward are all it reads.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence, Union

import torch

from ..grads import HeadGrads
from ..head_inputs import HeadInputs, NeededGrads
from ..tiling import rows_per_tile, tiles
from ..vocab_parallel import VocabLayout, label_gradient_, merged_tile_statistics
from .protocol import HeadPass, TileGrads, logprob_tile_grads
from .torch_reference import TorchReferenceBackend

_NO_GRADS = NeededGrads(False, False, False)
_reference = TorchReferenceBackend


def vocab_parallel_backend(layout: VocabLayout, device: torch.device, name: Optional[str] = None):
    """The backend of a call on a vocabulary-sharded head: the GPU backend's kernels and schedules over the rank's
    rows (:class:`~hf_fused.ops.backends.triton_cublas.vocab_parallel.TritonVocabParallelBackend`) where the
    backend named (``name``, else ``$HF_FUSED_BACKEND``, else ``"triton"`` for CUDA tensors where Triton is
    installed) is ``"triton"``, else :class:`VocabParallelBackend` (the torch loop: fp32 tiles, several times slower
    on a GPU: docs/tensor_parallel.md). A rank with no rows (``torch.chunk`` of a vocabulary smaller than the group's
    tiles) makes every rank run the torch loop: all decide from the same layout.

    Raises:
        ValueError: a backend other than ``"torch"`` or ``"triton"``; ``"triton"`` for non-CUDA tensors without
            Triton's interpreter (as :func:`~hf_fused.ops.backends.get_backend`).
    """
    from . import available_backends, get_backend

    name = name or os.environ.get("HF_FUSED_BACKEND")
    if not name:
        name = "triton" if device.type == "cuda" and "triton" in available_backends() else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(
            f"vocab_parallel runs the torch tile loop or the GPU backend's ('triton') with a merge of the per-row "
            f"statistics over the group; backend={name!r} has no vocabulary-parallel schedule. Pass backend=None, "
            "'triton' or 'torch'"
        )
    if name == "torch" or layout.min_width == 0:
        return VocabParallelBackend(layout)
    get_backend(device, name)  # its checks (Triton installed; CUDA tensors, or Triton's interpreter)
    from .triton_cublas.vocab_parallel import TritonVocabParallelBackend

    return TritonVocabParallelBackend(layout)


class VocabParallelBackend:
    """The per-rank tile loop of a vocabulary-sharded head (module docstring). ``head.weight`` (and ``head.bias``)
    are this rank's rows ``[layout.shard.start, layout.shard.stop)``; ``head.labels`` are global ids in ``[0, V)``.
    Every rank of the group runs the same tiles (``rows_per_tile`` of the widest rank's rows) over the same rows."""

    name = "vocab_parallel"

    def __init__(self, layout: VocabLayout):
        self.layout = layout

    def _tile_rows(self, head: HeadInputs) -> int:
        return rows_per_tile(self.layout.max_width, head.tile_budget_bytes)

    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Union[None, torch.Tensor, Callable[[], torch.Tensor]], *,
        need: NeededGrads, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """As :meth:`TorchReferenceBackend.logprobs_with_grads`, over this rank's slice (never ``None``)."""
        tile_grads = logprob_tile_grads(grad_logprobs) if need.any else None
        return self._one_pass(head, tile_grads, need, return_entropy, statistics)

    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> HeadPass:
        """As :meth:`TorchReferenceBackend.token_loss_with_grads`: ``tile_grads`` gets each tile's merged
        log-probs (and entropies), the same on every rank, so every rank forms its slice's logits gradient from the
        same per-row gradients."""
        return self._one_pass(head, tile_grads, need, return_entropy, statistics, grads_read_entropy)

    def logprobs_forward(self, head: HeadInputs, *, return_entropy: bool = False,
                         statistics: Sequence[str] = ()) -> HeadPass:
        """Merged per-row statistics only (``grads`` ``None``)."""
        return self._one_pass(head, None, _NO_GRADS, return_entropy, statistics)

    def _one_pass(self, head: HeadInputs, tile_grads: Optional[TileGrads], need: NeededGrads, return_entropy: bool,
                  statistics: Sequence[str], grads_read_entropy: bool = True) -> HeadPass:
        head = head.computed()
        labels, rows, transform, shard = head.labels, head.rows, head.transform, self.layout.shard
        weight32 = head.weight.float()
        grads = _reference._new_grads(head, need) if tile_grads is not None else None
        m = rows.numel()
        out_logp = torch.empty(m, dtype=torch.float32, device=head.hidden.device)
        out_lse = torch.empty_like(out_logp)
        out_ent = torch.empty_like(out_logp) if return_entropy else None
        token_stats = {name: torch.empty(m, dtype=torch.bool if name == "is_top1" else torch.float32,
                                         device=head.hidden.device) for name in statistics}
        start = 0
        for idx in tiles(rows, self._tile_rows(head)):
            stop = start + idx.numel()
            h32, z, tanh = _reference._logits(head, weight32, idx)
            y = labels.index_select(0, idx)
            merged = merged_tile_statistics(z, y, self.layout, entropy=return_entropy, statistics=statistics,
                                            probs=grads is not None)
            out_logp[start:stop], out_lse[start:stop] = merged.logprobs, merged.lse
            if out_ent is not None:
                out_ent[start:stop] = merged.entropy
            for name, values in merged.statistics.items():
                token_stats[name][start:stop] = values
            if grads is not None:
                ent = out_ent[start:stop] if out_ent is not None else None
                g_lp, g_ent = tile_grads(start, stop, out_logp[start:stop], ent if grads_read_entropy else None)
                dz = _logits_grad(merged.log_probs, merged.probs, ent, g_lp, g_ent)
                dz = transform.backward(label_gradient_(dz, y, shard, g_lp), tanh)
                _reference._accumulate(grads, dz, h32, start, stop, weight32)
                del dz
            del z, tanh, merged
            start = stop
        return HeadPass(out_logp, out_ent, out_lse, grads, token_stats)

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """The recompute over this rank's slice from the merged ``lse`` / ``entropy`` of the forward: local, no
        collective (the hidden states' gradient is this rank's part of the sum)."""
        head = head.computed()
        labels, rows, shard = head.labels, head.rows, self.layout.shard
        weight32 = head.weight.float()
        grads = _reference._new_grads(head, need)
        start = 0
        for idx in tiles(rows, self._tile_rows(head)):
            stop = start + idx.numel()
            h32, z, tanh = _reference._logits(head, weight32, idx)
            logp = z.sub_(lse[start:stop].unsqueeze(1))
            p = logp.exp()
            g_lp = None if grad_logprobs is None else grad_logprobs[start:stop]
            g_ent = None if grad_entropy is None else grad_entropy[start:stop]
            ent = None if entropy is None else entropy[start:stop]
            dz = _logits_grad(logp, p, ent, g_lp, g_ent)
            if g_lp is not None:
                label_gradient_(dz, labels.index_select(0, idx), shard, g_lp)
            dz = head.transform.backward(dz, tanh)
            _reference._accumulate(grads, dz, h32, start, stop, weight32)
            del z, tanh, dz, logp, p
            start = stop
        return grads


def _logits_grad(log_probs, probs, entropy, g_lp, g_ent):
    """``dz_j = −g_lp·p_j − g_H·p_j·(log p_j + H)`` in the tile arrays ``log_probs`` / ``probs`` (overwritten);
    the ``+g_lp·1[j = y]`` term is :func:`~hf_fused.ops.vocab_parallel.label_gradient_`'s. ``g_lp`` or ``g_ent``
    may be ``None`` (not both)."""
    if g_ent is not None:
        dz = log_probs.add_(entropy.unsqueeze(1)).mul_(probs).mul_(-g_ent.unsqueeze(1))  # −g_H·p_j(log p_j + H)
        if g_lp is not None:
            dz.sub_(probs.mul_(g_lp.unsqueeze(1)))
        return dz
    return probs.mul_(-g_lp.unsqueeze(1))
