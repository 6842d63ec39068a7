"""Pure-PyTorch backend: the reference implementation of the tiled math, on any device.

Every tile gathers its (non-ignored) token rows, computes fp32 logits ``[rows, V]`` against the full
vocabulary, and reduces them to per-token statistics or to gradient contributions before the next
tile starts, so nothing of size ``[N, V]`` exists. Per token ``t`` with logits ``z`` (after the logit
transform), label ``y``:

    lse = logsumexp(z)        logp = z[y] − lse        p = softmax(z)        H = lse − Σ_j p_j z_j
    ∂logp/∂z_j = 1[j = y] − p_j                         ∂H/∂z_j = −p_j (log p_j + H)

The logits-gradient ``dz`` then goes through the transform's derivative and the head:
``dh = dz · W``, ``dW += dzᵀ · h``, ``db += Σ_rows dz``, all accumulated in fp32.

The gradient-free token statistics (:mod:`hf_fused.ops.token_statistics`) come from the same tile, when asked:
``Σ_j z_j / V``, ``argmax_j z_j == y`` and ``log Σ_j p_j² = 2·log ‖p‖₂``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..grads import HeadGrads
from ..head_inputs import HeadInputs, NeededGrads
from ..tiling import TILE_BUFFERS, rows_per_tile, tiles
from .protocol import HeadPass, TileGrads, logprob_tile_grads

_NO_GRADS = NeededGrads(False, False, False)


class TorchReferenceBackend:
    """The CPU/CI reference, meeting :class:`~hf_fused.ops.backends.protocol.TokenLossBackend`:
    ``logprobs_with_grads`` (one pass, with the gradients of a known upstream), ``logprobs_forward``
    (statistics), ``logprobs_backward`` (recompute) and ``token_loss_with_grads``."""

    name = "torch"

    # -- shared tile steps -------------------------------------------------------------------------
    @staticmethod
    def _logits(head: HeadInputs, weight32, idx):
        h32 = head.hidden.index_select(0, idx).float()
        raw = h32 @ weight32.t()
        if head.bias is not None:
            raw += head.bias.float()
        z, tanh = head.transform.forward(raw)
        return h32, z, tanh

    @staticmethod
    def _new_grads(head: HeadInputs, need: NeededGrads) -> HeadGrads:
        hidden, weight, bias = head.hidden, head.weight, head.bias
        return HeadGrads(
            hidden=torch.zeros((head.rows.numel(), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
            if need.hidden
            else None,
            weight=torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need.weight else None,
            bias=torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if (need.bias and bias is not None)
            else None,
        )

    @staticmethod
    def _accumulate(grads: HeadGrads, dz_raw, h32, start, stop, weight32) -> None:
        if grads.hidden is not None:
            torch.mm(dz_raw, weight32, out=grads.hidden[start:stop])
        if grads.weight is not None:
            grads.weight.addmm_(dz_raw.t(), h32)
        if grads.bias is not None:
            grads.bias += dz_raw.sum(0)

    # -- log-probabilities and the gradients of Σ g·logp, in one pass --------------------------------
    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Union[None, torch.Tensor, Callable[[], torch.Tensor]], *,
        need: NeededGrads, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """Per-row statistics and, from the same logits, the gradients of ``Σ grad_logprobs · logprobs``
        (``grad_logprobs`` fp32 ``[M]``): each tile's ``dz = g·(onehot(y) − p)`` right after its log-sum-exp.
        ``grads`` is ``None`` when ``need`` requests none (then ``grad_logprobs`` may be ``None``). A GPU
        backend returns ``None`` instead when its budget cannot hold this one-pass working set; the reference
        always can (its backward holds the same fp32 ``[V, H]``).

        ``statistics``: names among :data:`~hf_fused.ops.token_statistics.TOKEN_STATISTICS`, computed from the
        same logits tiles into :attr:`HeadPass.statistics` (fp32, ``is_top1`` bool)."""
        tile_grads = logprob_tile_grads(grad_logprobs) if need.any else None
        return self._one_pass(head, tile_grads, need, return_entropy, statistics)

    # -- a token-separable loss and its gradients, in one pass (hf_fused.ops.token_loss) ---------------
    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> HeadPass:
        """Like :meth:`logprobs_with_grads`, but each tile's per-row gradients come from
        ``tile_grads(start, stop, logp [r], entropy [r] or None) -> (g_lp [r], g_ent [r] or None)`` (fp32, kept
        rows ``start:stop``), called right after the tile's statistics; then
        ``dz_j = g_lp·(1[j = y] − p_j) − g_ent·p_j·(log p_j + H)`` from the same logits. ``tile_grads`` gets
        ``None`` for the entropy unless ``grads_read_entropy``. Never ``None`` (see :meth:`logprobs_with_grads`)."""
        return self._one_pass(head, tile_grads, need, return_entropy, statistics, grads_read_entropy)

    def _one_pass(self, head: HeadInputs, tile_grads: Optional[TileGrads], need: NeededGrads,
                  return_entropy: bool, statistics: Sequence[str], grads_read_entropy: bool = True) -> HeadPass:
        """The loop behind the forward methods; statistics only (``grads`` ``None``) without ``tile_grads``."""
        head = head.computed()  # the reference computes from whole cast operands
        hidden, weight, labels, rows, transform = head.hidden, head.weight, head.labels, head.rows, head.transform
        weight32 = weight.float()
        grads = None
        if tile_grads is not None:
            grads = self._new_grads(head, need)
        m = rows.numel()
        out_logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        out_lse = torch.empty_like(out_logp)
        out_ent = torch.empty_like(out_logp) if return_entropy else None
        token_stats = {
            name: torch.empty(m, dtype=torch.bool if name == "is_top1" else torch.float32, device=hidden.device)
            for name in statistics
        }
        start = 0
        for idx in tiles(rows, rows_per_tile(weight.shape[0], head.tile_budget_bytes)):
            stop = start + idx.numel()
            h32, z, tanh = self._logits(head, weight32, idx)
            if grads is None:
                del tanh  # only a gradient needs it
                tanh = None
            y = labels.index_select(0, idx).unsqueeze(1)
            # On z itself, before it becomes log p in place: z − lse can round distinct logits into a tie.
            if "mean_logits" in token_stats:
                token_stats["mean_logits"][start:stop] = z.sum(1) / z.shape[1]
            if "is_top1" in token_stats:  # argmax returns the first maximum, as TRL's accuracy counts it
                token_stats["is_top1"][start:stop] = z.argmax(1) == y.squeeze(1)
            lse = torch.logsumexp(z, dim=1, keepdim=True)
            out_logp[start:stop] = (z.gather(1, y) - lse).squeeze(1)
            out_lse[start:stop] = lse.squeeze(1)
            logp = z.sub_(lse)  # log p_j, in place of z
            need_p = out_ent is not None or grads is not None or "log_sum_sq_probs" in token_stats
            p = logp.exp() if need_p else None
            ent = None
            if out_ent is not None:
                out_ent[start:stop] = -torch.mul(p, logp).sum(1)
                ent = out_ent[start:stop]
            if "log_sum_sq_probs" in token_stats:  # log Σ p² = 2·log ‖p‖₂, without a third tile for p²
                token_stats["log_sum_sq_probs"][start:stop] = 2 * torch.linalg.vector_norm(p, dim=1).log()
            if grads is not None:
                g_lp, g_ent = tile_grads(start, stop, out_logp[start:stop], ent if grads_read_entropy else None)
                # dz in the two tile arrays already alive (logp, p): the working set stays 3 tiles with tanh.
                if g_ent is not None:
                    dz = logp.add_(ent.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))  # −g_H·p_j(log p_j + H)
                    dz.sub_(p.mul_(g_lp.unsqueeze(1)))
                else:
                    dz = p.mul_(-g_lp.unsqueeze(1))
                dz.scatter_add_(1, y, g_lp.unsqueeze(1))  # + g_lp·1[j = y]: ∂logp_y/∂z_j = 1[j = y] − p_j
                dz = transform.backward(dz, tanh)
                self._accumulate(grads, dz, h32, start, stop, weight32)
                del dz
            del z, tanh, logp, p
            start = stop
        return HeadPass(out_logp, out_ent, out_lse, grads, token_stats)

    # -- what a call runs --------------------------------------------------------------------------
    def describe_plan(self, weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None,
                      need_weight: Optional[bool] = None, n_tokens: Optional[int] = None) -> str:
        """One line: the reference's tile (``rows_per_tile`` rows of ``TILE_BUFFERS`` fp32 ``[rows, V]`` arrays)
        and the fp32 accumulators beside it, for ``n_rows`` kept tokens (``n_tokens`` is not needed: ignored rows
        are never computed)."""
        vocab_size, hidden_size = weight.shape
        need_weight = weight.requires_grad if need_weight is None else need_weight
        rows = min(rows_per_tile(vocab_size, tile_budget_bytes), max(n_rows, 1))
        held = [(TILE_BUFFERS * 4 * rows * vocab_size, f"{TILE_BUFFERS} fp32 [rows, {vocab_size}] arrays")]
        if weight.dtype != torch.float32:
            held.append((4 * vocab_size * hidden_size, "an fp32 copy of the weight"))
        if need_weight:
            held.append((4 * vocab_size * hidden_size, "the fp32 weight gradient"))
        size = sum(nbytes for nbytes, _ in held)
        return (f"torch reference, one pass per tile: {rows} rows per tile, {size / 2**30:.2f} GiB working set ("
                f"{', '.join(what for _, what in held)})")

    # -- log-probabilities: statistics forward, recompute backward ---------------------------------
    def logprobs_forward(
        self, head: HeadInputs, *, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """Per-row ``logprobs``, ``entropy`` (or ``None``) and ``lse``, all fp32, for the rows in ``head.rows``;
        the token statistics as in :meth:`logprobs_with_grads`; ``grads`` ``None``."""
        return self._one_pass(head, None, _NO_GRADS, return_entropy, statistics)

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """Gradients from upstream ``grad_logprobs [M]`` / ``grad_entropy [M]`` (fp32, either may be None)."""
        head = head.computed()
        weight, labels, rows = head.weight, head.labels, head.rows
        weight32 = weight.float()
        grads = self._new_grads(head, need)
        start = 0
        for idx in tiles(rows, rows_per_tile(weight.shape[0], head.tile_budget_bytes)):
            stop = start + idx.numel()
            h32, z, tanh = self._logits(head, weight32, idx)
            logp = z.sub_(lse[start:stop].unsqueeze(1))  # log p_j, in place of z
            p = logp.exp()
            # Build dz in the two tile arrays already alive (logp, p): the working set stays 3 tiles.
            if grad_entropy is not None:
                # ∂H/∂z_j = −p_j (log p_j + H)
                g_h = grad_entropy[start:stop].unsqueeze(1)
                dz = logp.add_(entropy[start:stop].unsqueeze(1)).mul_(p).mul_(-g_h)
                if grad_logprobs is not None:
                    dz.sub_(p.mul_(grad_logprobs[start:stop].unsqueeze(1)))
            else:
                dz = p.mul_(-grad_logprobs[start:stop].unsqueeze(1))
            del logp, p
            if grad_logprobs is not None:
                # ∂logp_y/∂z_j = 1[j = y] − p_j: the −p_j part is above
                g_lp = grad_logprobs[start:stop].unsqueeze(1)
                dz.scatter_add_(1, labels.index_select(0, idx).unsqueeze(1), g_lp)
            dz = head.transform.backward(dz, tanh)
            self._accumulate(grads, dz, h32, start, stop, weight32)
            del z, tanh, dz
            start = stop
        return grads
