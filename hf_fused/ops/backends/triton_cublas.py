"""GPU backend: cuBLAS matmuls for the tiles, Triton epilogues (:mod:`.triton_kernels`) between them.

Loop order: vocabulary chunks outside, token rows inside. Each weight-gradient chunk ``dW[v0:v1]`` is
complete after its chunk (cuBLAS reduces over all rows in fp32 and rounds once; over several row blocks into an
fp32 ``[cols, H]`` accumulator that lives in the bf16 gradient's rows not written yet, or in the tile buffer:
:func:`hf_fused.ops.tiling.weight_gradient_chunks`), so the ``[V, H]`` weight gradient is never held in fp32 and
the accumulator takes no memory of its own; the hidden-state gradient
``[M, H]`` accumulates across chunks in an fp32 buffer (cuBLAS), or, under an explicit ``tile_budget_bytes`` and
for bf16, as a compensated pair (the gradient itself plus an int8 residual, :mod:`.compensated`: a Triton matmul
whose fp32 accumulator is folded into the pair, no less accurate than eager's one rounding). Under an explicit
budget the plan (:func:`hf_fused.ops.tiling.lean_two_pass_plan`) counts everything inside it, the kept hidden
rows included: one compact copy, or each row block gathered again per chunk when the copy leaves too little.

Passes: statistics (``2·M·H·V`` FLOPs: log-sum-exp, label logit, entropy, and the token statistics when
asked) then gradients (recompute ``2·M·H·V`` + ``dX`` ``2·M·H·V`` + ``dW`` ``2·M·H·V``): ``8·M·H·V`` in all,
on the non-ignored rows M only.
One preallocated ``[rows, V_chunk]`` tile in the weight dtype holds the logits cuBLAS writes (as
eager transformers and TRL's chunked head round them) and then, in place, ``dz``; every statistic and
accumulation after the matmul is fp32. Its shape comes from :func:`hf_fused.ops.tiling.two_pass_plan`. On a
Hopper GPU with bf16 operands the gradient pass writes ``dz`` straight from its own logits matmul's epilogue
instead (:mod:`.logits_epilogues`: the same rounded logits and formula, the logits never stored).

Cross-entropy (plain or token-weighted) and log-probs given a ``grad_hint`` take a one-pass path
instead (token rows outside, whole vocabulary rows per tile, gradients right after each row's
log-sum-exp: ``6·M·H·V``) when the planner's rule allows it (:func:`hf_fused.ops.tiling.one_pass_plan`: by
default when its ``[V, H]`` weight-gradient accumulator and tile fit in a quarter of the free device memory: fp32
(for a 2-byte gradient half of it in the gradient's own bytes, :func:`hf_fused.ops.grads.split_accumulator`),
or for a bf16 gradient the compensated pair of :mod:`.compensated` — the gradient itself and an int8 residual,
folded by :func:`.compensated_addmm_` after each tile and scaled by the upstream gradient in backward); see
:meth:`TritonCublasBackend.logprobs_with_grads`. Otherwise they return ``None`` and the op falls back to the
two passes above, the gradient pass in its backward.

Where QuACK (``quack-kernels``) is installed, the one pass of plain bf16 cross-entropy on a Hopper GPU, or of
log-probs with a ``grad_hint`` whose token loss does not read the entropy (a returned entropy then from the
gradient kernel's Σ p·z), takes each tile's
log-sum-exp and label logit from the epilogue of QuACK's logits matmul instead of the statistics kernel
(:mod:`.quack_epilogues`: the same rounded tile, 3–6 % less time per step), and the two passes' gradient pass,
where the gradient reaches the log-probs only and no bias or transform applies, writes each ``dz`` tile from the
epilogue of QuACK's logits matmul instead of the Triton one (the label column then set by
:func:`.logits_epilogues.label_grad_`: the same bits, 16–22 % less time per tile); a QuACK that cannot run it is turned
off with one warning.
"""

from __future__ import annotations

import importlib.util
import warnings
from types import ModuleType
from typing import Optional, Sequence

import torch

from ..grads import HeadGrads, fp32_view, round_rows_in_place_, split_accumulator
from ..head_inputs import HeadInputs, NeededGrads
from ..logit_transform import LogitTransform
from ..tiling import (
    TILE_ACCUMULATOR_ALIGN, LeanPlan, OnePassPlan, WeightChunk, accumulation_row_bytes, hidden_accumulator,
    one_pass_accumulators, one_pass_plan, tile_accumulator_offset, two_pass_tile_plan, weight_gradient_chunks,
)
from . import logits_epilogues
from .compensated import RESIDUAL_DTYPE, compensated_addmm_, one_pass_config, wave_rows
from .protocol import HeadPass, TileGrads

# Triton launch shapes, measured on an H100 (docs/bench/h100/session13/sweep_*.txt) and an H200 (the gradient
# kernel's, docs/gpu_results.md). The statistics kernel: 1024 columns per block on 4 warps for whole-vocabulary
# rows (0.232 ms per 2048 × 151936 tile, 2.7 TB/s, with or without the entropy); rows of at most
# _STATS_NARROW_COLS columns (the two passes' narrow chunks) on one warp (0.078 ms at 29,491 × 2432).
_STATS_BLOCK_V, _STATS_WARPS = 1024, 4
_STATS_NARROW_COLS, _STATS_NARROW_WARPS = 4096, 1
_GRAD_BLOCK_V, _GRAD_WARPS = 2048, 8


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator without an fp32 copy of the operands."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _mm_f32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` into an fp32 buffer (cuBLAS writes fp32 from bf16 operands: no rounding to bf16)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


# QuACK's Hopper GEMMs with hf_fused's epilogues (:mod:`.quack_epilogues`): the module once imported, or None
# once found missing or broken (then for the whole process, the error that turned it off in _QUACK_ERROR).
_QUACK: dict[str, Optional[ModuleType]] = {}
_QUACK_ERROR: dict[str, str] = {}


def _quack() -> Optional[ModuleType]:
    """:mod:`.quack_epilogues`, or ``None`` where QuACK is not installed or could not be imported (said once)."""
    if "module" not in _QUACK:
        module = None
        if importlib.util.find_spec("quack") is not None:
            try:
                from . import quack_epilogues as module
            except Exception as err:  # noqa: BLE001 - any QuACK / CuTe DSL version that cannot build it
                _quack_failed(err)
        _QUACK["module"] = module
    return _QUACK["module"]


def _quack_failed(err: BaseException) -> None:
    _QUACK["module"] = None
    _QUACK_ERROR["error"] = f"{type(err).__name__}: {err}"  # why it is off, for a test or a bug report
    warnings.warn(f"hf_fused: QuACK's fused epilogues are unavailable ({type(err).__name__}: {err}); hf_fused uses "
                  "cuBLAS and its own Triton kernels instead (same results, slower). Measured with quack-kernels "
                  "0.6.4 and nvidia-cutlass-dsl 4.6.2.", stacklevel=3)


def _run_quack(launch, *operands: torch.Tensor) -> bool:
    """``launch(quack_epilogues)``, where QuACK is available and every operand starts 16-byte aligned (its TMA
    raises otherwise); ``False`` where it is not, or where the launch raises (then turned off for the process, said
    once), so that the caller does the work itself."""
    module = _quack()
    if module is None or not _aligned16(*operands):
        return False
    try:
        launch(module)
    except Exception as err:  # noqa: BLE001 - turned off for the process, said once
        _quack_failed(err)
        return False
    return True


def _quack_statistics(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, label_logit: torch.Tensor) -> bool:
    """:func:`.quack_epilogues.logits_with_statistics` into ``out``, ``lse`` and ``label_logit`` (:func:`_run_quack`;
    ``False``: the caller computes them itself)."""
    return _run_quack(lambda q: q.logits_with_statistics(h, weight, labels, out, lse=lse, label_logit=label_logit),
                      h, weight, labels, out, label_logit)


def _quack_softmax_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                        scale: torch.Tensor, out: torch.Tensor, label_logit: torch.Tensor) -> bool:
    """:func:`.quack_epilogues.softmax_grad` into ``out`` and ``label_logit`` (:func:`_run_quack`, and ``out``
    contiguous; ``False``: the caller writes the tile itself)."""
    return out.is_contiguous() and _run_quack(
        lambda q: q.softmax_grad(h, weight, labels, lse, scale, out, label_logit),
        h, weight, labels, lse, scale, out, label_logit)


def _aligned16(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary, as QuACK's TMA needs (QuACK raises otherwise): a slice of a
    per-row vector at a row that is not a multiple of 4 does not, nor may a parameter gathered into a flat buffer
    (DeepSpeed ZeRO-3)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _fuses_statistics(head: HeadInputs, h: torch.Tensor, return_entropy: bool, statistics: Sequence[str]) -> bool:
    """Whether the one pass's logits matmul can take its statistics from QuACK's epilogue for this call: only the
    log-sum-exp and label logit asked of it (no entropy, no token statistics) of raw logits (no bias, soft-cap,
    temperature or logit scale), and the kept rows ``h`` and the weight bf16 on a GPU of compute capability
    9.x, contiguous, with rows of 16-byte multiples (its TMA loads)."""
    asks_lse_only = not return_entropy and not statistics and head.bias is None and head.transform.is_identity
    return asks_lse_only and _quack_runs_on(h, head.weight)


def _quack_runs_on(h: torch.Tensor, weight: torch.Tensor) -> bool:
    return (h.is_cuda and h.dtype == weight.dtype == torch.bfloat16 and h.is_contiguous() and weight.is_contiguous()
            and h.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0 and torch.cuda.get_device_capability(h.device)[0] == 9)


class TritonCublasBackend:
    """Same interface as :class:`~hf_fused.ops.backends.torch_reference.TorchReferenceBackend`
    (:class:`~hf_fused.ops.backends.protocol.TokenLossBackend`)."""

    name = "triton"

    def __init__(self) -> None:
        from . import triton_kernels  # imported here so CPU-only installs never need triton

        self.kernels = triton_kernels

    # -- planning: every decision is :mod:`hf_fused.ops.tiling`'s ---------------------------------------
    @staticmethod
    def _plan(head: HeadInputs, *, reserved_bytes: int = 0, accumulator_row_bytes: int = 0,
              weight_chunk: bool = False, row_quantum: int = 1) -> LeanPlan:
        """The two passes' tile for ``head`` (:func:`~hf_fused.ops.tiling.two_pass_tile_plan`: under the default
        rule the tile alone within ``DEFAULT_TILE_BUDGET_BYTES`` beside one compact copy of the kept hidden rows;
        under an explicit budget :func:`~hf_fused.ops.tiling.lean_two_pass_plan`, which counts the accumulator
        (``reserved_bytes``, moving ``accumulator_row_bytes`` per row and chunk), the kept rows (a compact copy or a
        per-block gather) and the fp32 weight-gradient chunk (``weight_chunk``) inside the budget, row blocks in
        whole ``row_quantum``s)."""
        hidden, weight = head.hidden, head.weight
        m_rows, (vocab_size, hidden_size), elem = head.rows.numel(), weight.shape, head.operand_dtype.itemsize
        cast = hidden.dtype != head.operand_dtype  # gathered rows pass through hidden's dtype before the cast
        return two_pass_tile_plan(
            m_rows, hidden_size, vocab_size, elem, head.tile_budget_bytes, reserved_bytes=reserved_bytes,
            copy_bytes=TritonCublasBackend._compact_bytes(head),
            gather_row_bytes=hidden_size * (elem + (hidden.element_size() if cast else 0)),
            accumulator_row_bytes=accumulator_row_bytes, weight_chunk=weight_chunk, row_quantum=row_quantum,
            # an fp32 weight under autocast: each vocabulary chunk cast into a [cols, H] buffer (no whole copy)
            col_bytes=hidden_size * elem if head.casts_weight() else 0,
        )

    @staticmethod
    def _compact_bytes(head: HeadInputs) -> int:
        """Bytes of the copy :meth:`_compact` makes: none when every row is kept in the operands' dtype."""
        hidden, m_rows, dtype = head.hidden, head.rows.numel(), head.operand_dtype
        if m_rows == hidden.shape[0] and hidden.dtype == dtype:
            return 0
        return m_rows * hidden.shape[1] * dtype.itemsize

    @staticmethod
    def _compact(head: HeadInputs):
        """The kept rows' hidden states (in the operands' dtype) and labels."""
        hidden, labels, rows = head.hidden.to(head.operand_dtype), head.labels, head.rows
        if rows.numel() == hidden.shape[0]:
            return hidden, labels
        return hidden.index_select(0, rows), labels.index_select(0, rows)

    @staticmethod
    def _row_blocks(head: HeadInputs, plan: LeanPlan, compact: Optional[torch.Tensor], buf: Optional[torch.Tensor]):
        """``(r0, r1, hidden rows [r1 − r0, H] in weight's dtype)`` for each row block of ``plan``: slices of the
        ``compact`` copy, or (``plan.gather_rows``) the block gathered into ``buf`` (``[block_rows, H]``, one buffer
        for the whole pass: a block still referenced when the next chunk starts must not hold a second one).
        Iterate once per vocabulary chunk."""
        m_rows = head.rows.numel()
        if compact is not None:
            for r0 in range(0, m_rows, plan.block_rows):
                yield r0, min(r0 + plan.block_rows, m_rows), compact[r0 : r0 + plan.block_rows]
            return
        hidden, dtype = head.hidden, head.operand_dtype
        for r0 in range(0, m_rows, plan.block_rows):
            r1 = min(r0 + plan.block_rows, m_rows)
            index = head.rows[r0:r1]
            if hidden.dtype == dtype:
                yield r0, r1, torch.index_select(hidden, 0, index, out=buf[: r1 - r0])
            else:
                yield r0, r1, buf[: r1 - r0].copy_(hidden.index_select(0, index))

    @staticmethod
    def _rows_source(head: HeadInputs, plan: LeanPlan):
        """``(compact hidden rows or None, gather buffer or None, the kept rows' labels)`` for :meth:`_row_blocks`."""
        if plan.gather_rows:
            hidden, rows = head.hidden, head.rows
            buf = torch.empty((min(plan.block_rows, rows.numel()), hidden.shape[1]), dtype=head.operand_dtype,
                              device=hidden.device)
            return None, buf, head.labels.index_select(0, rows)
        h, y = TritonCublasBackend._compact(head)
        return h, None, y

    @staticmethod
    def _scalars(transform: LogitTransform, bias):
        return dict(
            logit_scale=float(transform.logit_scale),
            softcap=float(transform.softcap or 1.0),
            inv_temperature=1.0 / float(transform.temperature),
            HAS_BIAS=bias is not None,
            SOFTCAP=transform.softcap is not None,
            SCALED=float(transform.logit_scale) != 1.0 or float(transform.temperature) != 1.0,
        )

    # -- kernel launches ---------------------------------------------------------------------------
    def _stats(self, z, col_offset, bias, labels, stats, scalars, return_entropy):
        """Fold the raw logits ``z [rows, cols]`` (columns from ``col_offset``) into ``stats`` (:meth:`_new_stats`):
        the running max, Σexp, Σexp·z and label logit, and those of the token statistics it holds."""
        run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
        warps = _STATS_NARROW_WARPS if z.shape[1] <= _STATS_NARROW_COLS else _STATS_WARPS
        self.kernels.stats_kernel[(z.shape[0],)](
            z, z.stride(0), z.shape[1], col_offset, bias if bias is not None else labels, labels,
            run_max, run_sum, run_zp, label_logit,
            # statistics not asked for: any valid pointer, never read (their flags compile them out)
            run_max if z_sum is None else z_sum, labels if arg is None else arg, run_max if sum_sq is None else sum_sq,
            ENTROPY=return_entropy, SUM_Z=z_sum is not None, ARGMAX=arg is not None, SUM_SQ=sum_sq is not None,
            BLOCK_V=_STATS_BLOCK_V, num_warps=warps, **scalars,
        )

    def _grad(self, z, col_offset, bias, labels, lse, ent, g_lp, g_ent, scalars, has_g_lp, has_g_ent,
              sum_pz: Optional[torch.Tensor] = None):
        """Overwrite the raw logits ``z [rows, cols]`` with ``dz`` (see ``grad_kernel``); with ``sum_pz``
        (fp32 ``[rows]``), write each row's Σ p·z over the columns into it."""
        self.kernels.grad_kernel[(z.shape[0],)](
            z, z.stride(0), z, z.stride(0), z.shape[1], col_offset, bias if bias is not None else lse, labels,
            lse, ent, g_lp, g_ent, lse if sum_pz is None else sum_pz, HAS_G_LP=has_g_lp, HAS_G_ENT=has_g_ent,
            SUM_PZ=sum_pz is not None, BLOCK_V=_GRAD_BLOCK_V, num_warps=_GRAD_WARPS, **scalars,
        )

    @staticmethod
    def _new_stats(m_rows, device, statistics=()):
        """Per-row accumulators ``[M]``: (running max, Σexp(z−m), Σexp(z−m)·z, label logit, Σz, first arg-max,
        Σexp(2(z−m))), the last three ``None`` unless a statistic in ``statistics`` needs them."""
        f32 = dict(dtype=torch.float32, device=device)
        zeros = lambda dtype=torch.float32: torch.zeros(m_rows, dtype=dtype, device=device)  # noqa: E731
        return (
            torch.full((m_rows,), float("-inf"), **f32), zeros(), zeros(), zeros(),
            zeros() if "mean_logits" in statistics else None,
            zeros(torch.int64) if "is_top1" in statistics else None,
            zeros() if "log_sum_sq_probs" in statistics else None,
        )

    @staticmethod
    def _finish(stats, labels, vocab_size, return_entropy, statistics):
        """``(logprobs, entropy or None, lse, token statistics)`` of the rows from their accumulators
        (the formulas of :mod:`hf_fused.ops.token_statistics`)."""
        run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
        log_sum = run_sum.log()
        lse = run_max + log_sum
        entropy = lse - run_zp / run_sum if return_entropy else None
        values = {
            "mean_logits": lambda: z_sum / vocab_size,
            "is_top1": lambda: arg == labels,
            # log Σ exp(2z − 2·lse) = log Σexp(2(z − m)) − 2·log Σexp(z − m): the running max cancels
            "log_sum_sq_probs": lambda: sum_sq.log() - 2 * log_sum,
        }
        return label_logit - lse, entropy, lse, {name: values[name]() for name in statistics}

    # -- the interface -----------------------------------------------------------------------------
    def logprobs_forward(
        self, head: HeadInputs, *, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """Like :meth:`TorchReferenceBackend.logprobs_forward`, vocabulary chunks outside: the token statistics
        are online reductions across chunks like the log-sum-exp."""
        weight, bias, dtype = head.weight, _operand_bias(head), head.operand_dtype
        plan = self._plan(head)
        h, buf, y = self._rows_source(head, plan)
        m_rows, vocab_size = head.rows.numel(), weight.shape[0]
        stats = self._new_stats(m_rows, weight.device, statistics)
        scalars = self._scalars(head.transform, bias)
        tile_buf = torch.empty((plan.block_rows, plan.cols), dtype=dtype, device=weight.device)
        w_buf = _weight_chunk_buffer(head, plan.cols)
        for v0 in range(0, vocab_size, plan.cols):
            w_chunk = head.weight_rows(v0, min(v0 + plan.cols, vocab_size), w_buf)
            for r0, r1, h_rows in self._row_blocks(head, plan, h, buf):
                z = torch.mm(h_rows, w_chunk.t(), out=tile_buf[: r1 - r0, : w_chunk.shape[0]])
                self._stats(z, v0, bias, y[r0:r1], _row_slice(stats, r0, r1), scalars, return_entropy)
        logp, entropy, lse, token_stats = self._finish(stats, y, vocab_size, return_entropy, statistics)
        return HeadPass(logp, entropy, lse, None, token_stats)

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """Like :meth:`TorchReferenceBackend.logprobs_backward`, vocabulary chunks outside (module docstring)."""
        hidden, weight, bias, rows = head.hidden, head.weight, _operand_bias(head), head.rows
        dtype = head.operand_dtype  # the matmuls' operands: a weight in another dtype is cast chunk by chunk
        need_hidden, need_weight = need.hidden, need.weight
        m_rows, (vocab_size, hidden_size) = rows.numel(), weight.shape
        grads = HeadGrads()
        # The hidden-state gradient accumulates over vocabulary chunks (tiling.hidden_accumulator): in fp32 under
        # the default rule (cuBLAS writes it), or, under an explicit budget, for bf16 as the compensated pair
        # (d_hidden, d_hidden_lo) whose hi is hidden's whole gradient (the kept rows written through ``hi_rows``),
        # so only the residual is extra; the explicit budget then covers it too.
        kind, extra = hidden_accumulator(m_rows, hidden_size, hidden.dtype, head.tile_budget_bytes)
        pair = need_hidden and kind == "pair" and dtype == torch.bfloat16
        moved = accumulation_row_bytes("pair" if pair else "fp32", hidden_size, hidden.element_size()) if (
            need_hidden) else 0
        # The pair's matmul is a persistent kernel: row blocks that fill whole waves of the GPU (compensated.wave_rows).
        plan = self._plan(head, reserved_bytes=extra if need_hidden else 0, accumulator_row_bytes=moved,
                          weight_chunk=need_weight, row_quantum=wave_rows(hidden_size, weight.device) if pair else 1)
        h, buf, y = self._rows_source(head, plan)
        gather = pair and m_rows != hidden.shape[0]
        d_hidden = d_hidden_lo = None
        if pair:
            d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            d_hidden_lo = torch.zeros((m_rows, hidden_size), dtype=RESIDUAL_DTYPE, device=hidden.device)
        elif need_hidden:  # the first chunk writes it
            d_hidden = torch.empty((m_rows, hidden_size), dtype=torch.float32, device=hidden.device)
        if need_weight:
            # In the given weight's dtype: fp32 for an fp32 weight under autocast (cuBLAS writes fp32 from the
            # bf16 operands), the compute dtype otherwise (one rounding, as eager's). Every chunk writes its rows
            # below (no fill), unless no row is kept.
            new = torch.empty if m_rows else torch.zeros
            grads.weight = new(weight.shape, dtype=head.weight_grad_dtype or weight.dtype, device=weight.device)
        if need.bias and bias is not None:
            grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        zeros = torch.zeros(m_rows, dtype=torch.float32, device=weight.device)
        g_lp = zeros if grad_logprobs is None else grad_logprobs.to(torch.float32).contiguous()
        g_ent = zeros if grad_entropy is None else grad_entropy.to(torch.float32).contiguous()
        ent = zeros if entropy is None else entropy
        block_rows, cols = plan.block_rows, plan.cols
        scalars = self._scalars(head.transform, bias)
        tile_buf = torch.empty((block_rows, cols), dtype=dtype, device=weight.device)
        w_buf = _weight_chunk_buffer(head, cols)
        w_like = weight if w_buf is None else w_buf  # what the chunks' operands look like, for the checks below
        # dz straight from the logits matmul's epilogue where it runs (the logits are never written): QuACK's
        # where installed and the gradient is the log-probs' alone (16 % less time per tile than the Triton
        # matmul's on an H200, the same bits: docs/gpu_results.md, fifteenth session), else the Triton kernel
        rows_operand = h if buf is None else buf
        fused = logits_epilogues.applies(rows_operand, w_like, tile_buf)
        quack_dz = (fused and grad_logprobs is not None and grad_entropy is None and bias is None
                    and head.transform.is_identity and _quack_runs_on(rows_operand, w_like) and _quack() is not None)
        if quack_dz:
            neg_g_lp = g_lp.neg()  # the epilogue's per-row factor: dz = −g_lp·p off the label
            label_logit = torch.empty(block_rows, dtype=torch.float32, device=weight.device)
        chunks = weight_gradient_chunks(vocab_size, hidden_size, plan, m_rows, dtype.itemsize,
                                        grads.weight.element_size() if need_weight else 4)
        for chunk in chunks:
            v0, v1 = chunk.v0, chunk.v1
            w_chunk = head.weight_rows(v0, v1, w_buf)
            # several row blocks add into this chunk's fp32 accumulator (tiling.WeightChunk); the first sets it
            tile, d_w_chunk32 = _chunk_buffers(chunk, tile_buf, grads.weight, hidden_size, block_rows < m_rows)
            for r0, r1, h_rows in self._row_blocks(head, plan, h, buf):
                dz = tile[: r1 - r0]
                if quack_dz and _quack_softmax_grad(h_rows, w_chunk, y[r0:r1] - v0, lse[r0:r1], neg_g_lp[r0:r1], dz,
                                                    label_logit[: r1 - r0]):
                    logits_epilogues.label_grad_(dz, y[r0:r1], label_logit, lse[r0:r1], g_lp[r0:r1], col_offset=v0)
                elif fused:
                    logits_epilogues.logits_grad_(
                        h_rows, w_chunk, dz, y[r0:r1], lse[r0:r1], ent[r0:r1], g_lp[r0:r1], g_ent[r0:r1],
                        has_g_lp=grad_logprobs is not None, has_g_ent=grad_entropy is not None, col_offset=v0,
                        bias=bias, scalars=scalars,
                    )
                else:
                    torch.mm(h_rows, w_chunk.t(), out=dz)
                    self._grad(
                        dz, v0, bias, y[r0:r1], lse[r0:r1], ent[r0:r1], g_lp[r0:r1], g_ent[r0:r1], scalars,
                        grad_logprobs is not None, grad_entropy is not None,
                    )
                if gather:
                    compensated_addmm_(d_hidden, d_hidden_lo[r0:r1], dz, w_chunk, hi_rows=rows[r0:r1])
                elif pair:
                    compensated_addmm_(d_hidden[r0:r1], d_hidden_lo[r0:r1], dz, w_chunk)
                elif d_hidden is not None:
                    (_addmm_f32_ if v0 else _mm_f32_)(d_hidden[r0:r1], dz, w_chunk)
                if d_w_chunk32 is not None:
                    (_addmm_f32_ if r0 else _mm_f32_)(d_w_chunk32, dz.t(), h_rows)
                elif need_weight:
                    if grads.weight.dtype == dtype:
                        torch.mm(dz.t(), h_rows, out=grads.weight[v0:v1])
                    else:
                        _mm_f32_(grads.weight[v0:v1], dz.t(), h_rows)
                if grads.bias is not None:
                    grads.bias[v0:v1] += dz.float().sum(0)
            if d_w_chunk32 is not None:
                _round_into_(grads.weight, chunk, d_w_chunk32, tile_buf)
        grads.hidden = d_hidden  # fp32 [M, H] in the order of ``rows``, or (the pair) hidden's whole bf16 gradient
        grads.hidden_scattered = pair
        return grads

    # -- one pass: token rows outside, full vocabulary per tile --------------------------------------
    @staticmethod
    def _one_pass_plan(head: HeadInputs, need: NeededGrads) -> Optional[OnePassPlan]:
        """The call's one pass (tile rows and weight-gradient accumulator), or ``None`` for the two passes
        (:func:`~hf_fused.ops.tiling.one_pass_plan`), counting the kept rows' fp32 hidden gradient (held until
        backward), where rows are gathered (:meth:`_one_pass_gathers`) each tile's gathered rows, and under autocast
        the whole casts the pass makes (:meth:`~hf_fused.ops.head_inputs.HeadInputs.cast_bytes`)."""
        device, view, casts = head.weight.device, head.computed(meta=True), head.cast_bytes()
        weight = view.weight
        vocab_size, hidden_size = weight.shape
        accumulators = one_pass_accumulators(need.weight, view.weight_grad_dtype or weight.dtype, weight.dtype)
        gradient = head.rows.numel() * hidden_size * 4 if need.hidden else 0
        return one_pass_plan(vocab_size, hidden_size, weight.element_size(), accumulators, head.tile_budget_bytes,
                             device, gradient + casts, TritonCublasBackend._one_pass_gather_row_bytes(view))

    @staticmethod
    def _one_pass_gathers(head: HeadInputs) -> bool:
        """Whether the one pass gathers each tile's kept hidden rows into a ``[rows, H]`` buffer (some rows are
        ignored, or hidden's dtype is not the weight's) instead of slicing hidden itself: a buffer the size of one
        tile's rows rather than a compact copy of every kept row (0.11 GiB at 29,491 × 2048 in bf16)."""
        return head.rows.numel() != head.hidden.shape[0] or head.hidden.dtype != head.weight.dtype

    @staticmethod
    def _one_pass_gather_row_bytes(head: HeadInputs) -> int:
        """Bytes per tile row of the gathered rows (the buffer, and hidden's dtype on the way when it differs)."""
        if not TritonCublasBackend._one_pass_gathers(head):
            return 0
        hidden, weight = head.hidden, head.weight
        cast = hidden.element_size() if hidden.dtype != weight.dtype else 0
        return hidden.shape[1] * (weight.element_size() + cast)

    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Optional[torch.Tensor], *, need: NeededGrads,
        return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> Optional[HeadPass]:
        """Like :meth:`TorchReferenceBackend.logprobs_with_grads`: one pass (6·M·H·V), token rows outside
        and whole vocabulary rows per tile, or ``None`` when the planner (:mod:`hf_fused.ops.tiling`) chooses
        the two passes."""
        tile_grads = None
        if need.any:
            g_lp = grad_logprobs.to(torch.float32).contiguous()
            tile_grads = lambda r0, r1, logp, entropy: (g_lp[r0:r1], None)  # noqa: E731
        return self._one_pass(head, tile_grads, need, return_entropy, statistics, entropy_in_grads=False)

    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> Optional[HeadPass]:
        """Like :meth:`TorchReferenceBackend.token_loss_with_grads` on the one-pass schedule of
        :meth:`logprobs_with_grads`: per full-vocabulary row block, the statistics kernel (or QuACK's epilogue),
        then ``tile_grads(r0, r1, logp, entropy)`` on the block's ``[rows]`` statistics for the per-row
        ``(g_lp, g_ent)``, then the gradient kernel on the same logits. ``None`` when the planner chooses
        two passes (the op then runs statistics + recompute)."""
        return self._one_pass(head, tile_grads, need, return_entropy, statistics,
                              entropy_in_grads=grads_read_entropy)

    def _one_pass(self, head: HeadInputs, tile_grads: Optional[TileGrads], need: NeededGrads,
                  return_entropy: bool, statistics: Sequence[str], *, entropy_in_grads: bool = True,
                  ) -> Optional[HeadPass]:
        """The one-pass loop behind both methods above: per full-vocabulary row block, the statistics kernel,
        then (when ``tile_grads`` is given) ``tile_grads(r0, r1, logp, entropy) -> (g_lp, g_ent or None)`` and
        the gradient kernel on the same logits, then dh and the fp32 dW accumulation. ``None`` when the
        planner chooses two passes; ``grads`` is ``None`` without ``tile_grads``. The token statistics of the
        rows come from the same statistics kernel. ``tile_grads`` is passed the entropy only with
        ``entropy_in_grads`` (its loss reads it); without, where QuACK's epilogue gives the statistics
        (:func:`_fuses_statistics`), a returned entropy comes from the gradient kernel's Σ p·z."""
        need_hidden, need_weight = need.hidden, need.weight
        plan = self._one_pass_plan(head, need)
        if plan is None:
            return None
        # Every tile reads the whole weight: under autocast one cast copy for the pass (the plan counted it)
        head = head.computed()
        weight, bias = head.weight, head.bias
        block_rows = plan.rows
        m_rows, (vocab_size, hidden_size) = head.rows.numel(), weight.shape
        device = weight.device
        gathers = self._one_pass_gathers(head)
        if gathers:
            y = head.labels.index_select(0, head.rows)
            rows_buf = torch.empty((min(block_rows, max(m_rows, 1)), hidden_size), dtype=weight.dtype, device=device)
        else:
            y, rows_buf = head.labels, head.hidden
        compact, gather_buf = (None, rows_buf) if gathers else (rows_buf, None)
        blocks = self._row_blocks(head, LeanPlan(block_rows, vocab_size, gathers, 0), compact, gather_buf)
        grads = HeadGrads()
        # the first tile writes the fp32 accumulator (no fill, no read of zeros), unless no row is kept; an fp32
        # weight gradient (fp32 master weights, accumulator "none") is that accumulator itself. The pair starts at
        # zero: its fold reads what it adds to.
        new = torch.empty if m_rows else torch.zeros
        pair = need_weight and plan.accumulator == "pair"
        # "fp32" for a 2-byte gradient: its first V // 2 rows accumulate in the gradient's own bytes, the rest in a
        # buffer (grads.split_accumulator): 2·V·H bytes beside the gradient, each tile's dW in two matmuls
        grad_dtype = head.weight_grad_dtype or weight.dtype
        split = need_weight and plan.accumulator == "fp32" and grad_dtype.itemsize == 2
        d_weight32 = new(weight.shape, dtype=torch.float32, device=weight.device) if (
            need_weight and not pair and not split) else None
        if split:
            grads.weight = new(weight.shape, dtype=grad_dtype, device=weight.device)
            d_weight_head, grads.weight_tail = split_accumulator(grads.weight, zero=not m_rows)
            v_split = d_weight_head.shape[0]
        if pair:
            grads.weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            grads.weight_residual = torch.zeros(weight.shape, dtype=RESIDUAL_DTYPE, device=weight.device)
            fold_config = one_pass_config(vocab_size, hidden_size, device)
        d_hidden = torch.empty((m_rows, hidden_size), dtype=torch.float32, device=device) if need_hidden else None
        if need.bias and bias is not None:
            grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        stats = self._new_stats(m_rows, device, statistics)
        scalars = self._scalars(head.transform, bias)
        tile_buf = torch.empty((min(block_rows, max(m_rows, 1)), vocab_size), dtype=weight.dtype, device=device)
        late_entropy = return_entropy and tile_grads is not None and not entropy_in_grads
        fused = _fuses_statistics(head, rows_buf, return_entropy and not late_entropy, statistics)
        for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
            dz = tile_buf[: r1 - r0]
            row_stats = _row_slice(stats, r0, r1)
            run_max, run_sum, run_zp, label_logit = row_stats[:4]
            fused = fused and _quack_statistics(h, weight, y[r0:r1], dz, run_max, label_logit)
            if fused:
                run_sum.fill_(1.0)  # the log-sum-exp as (running max, Σexp) = (lse, 1)
            else:
                torch.mm(h, weight.t(), out=dz)
                self._stats(dz, 0, bias, y[r0:r1], row_stats, scalars, return_entropy)
            if tile_grads is None:
                continue
            lse = run_max + run_sum.log()
            ent = lse - run_zp / run_sum if entropy_in_grads and return_entropy and not fused else None
            g_lp, g_ent = tile_grads(r0, r1, label_logit - lse, ent)
            # fused statistics with an entropy asked for: Σ p·z into run_zp (run_sum is 1), for _finish
            self._grad(dz, 0, bias, y[r0:r1], lse, lse if ent is None else ent, g_lp,
                       lse if g_ent is None else g_ent, scalars, True, g_ent is not None,
                       sum_pz=run_zp if return_entropy and fused else None)
            if d_hidden is not None:  # each row's dh is complete within its tile
                _mm_f32_(d_hidden[r0:r1], dz, weight)
            if d_weight32 is not None:
                (_addmm_f32_ if r0 else _mm_f32_)(d_weight32, dz.t(), h)
            elif split:
                (_addmm_f32_ if r0 else _mm_f32_)(d_weight_head, dz[:, :v_split].t(), h)
                (_addmm_f32_ if r0 else _mm_f32_)(grads.weight_tail, dz[:, v_split:].t(), h)
            elif pair:
                compensated_addmm_(grads.weight, grads.weight_residual, dz.t(), h, config=fold_config)
            if grads.bias is not None:
                grads.bias += dz.float().sum(0)
        grads.hidden = d_hidden
        if not pair and not split:
            grads.weight = d_weight32
        logp, entropy, lse, token_stats = self._finish(stats, y, vocab_size, return_entropy, statistics)
        return HeadPass(logp, entropy, lse, grads if tile_grads is not None else None, token_stats)


def _chunk_buffers(chunk: WeightChunk, tile_buf: torch.Tensor, grad_weight: Optional[torch.Tensor],
                   hidden_size: int, several_blocks: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(the [block_rows, v1 − v0] view of tile_buf that the chunk's dz goes to, its fp32 [v1 − v0, H]
    weight-gradient accumulator or None)`` where ``chunk.accumulator`` says (:class:`~hf_fused.ops.tiling.
    WeightChunk`): for ``"direct"``, ``None`` (one row block writes the gradient itself) or, over
    ``several_blocks``, an fp32 gradient's own rows; the gradient's unwritten rows seen as fp32; the tile buffer
    behind a packed dz; or a new buffer."""
    width, block_rows = chunk.v1 - chunk.v0, tile_buf.shape[0]
    if grad_weight is None or chunk.accumulator == "direct":
        in_place = several_blocks and grad_weight is not None and grad_weight.dtype == torch.float32
        return tile_buf[:, :width], (grad_weight[chunk.v0 : chunk.v1] if in_place else None)
    acc = None
    if chunk.accumulator == "tile":
        flat, row = tile_buf.view(-1), -(-width // TILE_ACCUMULATOR_ALIGN) * TILE_ACCUMULATOR_ALIGN
        offset = tile_accumulator_offset(block_rows, width, tile_buf.element_size()) // tile_buf.element_size()
        tile = flat[: block_rows * row].view(block_rows, row)[:, :width]
        acc = fp32_view(flat[offset : offset + 4 * width * hidden_size // tile_buf.element_size()], width)
    else:
        tile = tile_buf[:, :width]
        if chunk.accumulator == "gradient":
            acc = fp32_view(grad_weight[chunk.v0 : chunk.v0 + 2 * width].view(-1), width)
    if acc is None:  # "buffer", or a view whose start is not 4-byte aligned (an odd H)
        acc = torch.empty((width, hidden_size), dtype=torch.float32, device=tile_buf.device)
    return tile, acc


def _round_into_(grad_weight: torch.Tensor, chunk: WeightChunk, acc: torch.Tensor, tile_buf: torch.Tensor) -> None:
    """``grad_weight[v0:v1] = acc`` rounded once (the chunk's fp32 accumulator, :func:`_chunk_buffers`). For a
    ``"gradient"`` chunk ``acc`` is the gradient's own rows ``[v0, v0 + 2·width)``: rounded in place
    (:func:`~hf_fused.ops.grads.round_rows_in_place_`) through the now free tile buffer."""
    out = grad_weight[chunk.v0 : chunk.v1]
    if chunk.accumulator == "direct":  # an fp32 gradient, its own accumulator
        return
    if chunk.accumulator != "gradient" or acc.data_ptr() != out.data_ptr():  # "tile", "buffer" or a fallback
        out.copy_(acc)
        return
    round_rows_in_place_(out, acc, tile_buf.view(-1).view(grad_weight.dtype))


def _row_slice(stats, r0, r1):
    return tuple(None if t is None else t[r0:r1] for t in stats)


def _operand_bias(head: HeadInputs) -> Optional[torch.Tensor]:
    """The bias in the operands' dtype, as ``F.linear`` under autocast adds it (``[V]``: cast whole)."""
    bias = head.bias
    return None if bias is None else bias.to(head.operand_dtype)


def _weight_chunk_buffer(head: HeadInputs, cols: int) -> Optional[torch.Tensor]:
    """The ``[cols, H]`` buffer each vocabulary chunk of a weight in another dtype is cast into
    (:meth:`~hf_fused.ops.head_inputs.HeadInputs.weight_rows`, counted by the plan's ``col_bytes``); ``None``
    when the weight is in the operands' dtype (its slices are the operands)."""
    if not head.casts_weight():
        return None
    return torch.empty((min(cols, head.weight.shape[0]), head.weight.shape[1]), dtype=head.operand_dtype,
                       device=head.weight.device)
