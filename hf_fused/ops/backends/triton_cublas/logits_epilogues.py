"""The two passes' gradient-pass logits matmul with ``dz`` computed in its epilogue (Triton, Hopper).

One persistent Triton matmul (TMA loads, one program per multiprocessor, the next tile's loads overlapping this
tile's epilogue) rounds each fp32 logit to bf16 (the value cuBLAS would store), computes ``dz`` from it with the
gradient kernel's formula (:mod:`.triton_kernels`) and stores ``dz``: the logits tile is never written. 6–11 %
faster than cuBLAS's matmul plus the gradient kernel at the two passes' tile shapes on an H100 (1–2 % of a step).

:func:`applies` says whether a call can use it (CUDA, compute capability ≥ 9.0, bf16; on CPU under
``TRITON_INTERPRET=1`` inside :func:`forced`). :func:`label_grad_` sets the label column of a ``dz`` tile that
QuACK's epilogue wrote (:func:`.quack_epilogues.softmax_grad`). Numerics, and why the statistics pass keeps
cuBLAS: docs/design/numerics.md ("Epilogues").
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import capability, kernel_device, multiprocessors
from .matmul import GemmConfig, halves, round_bf16, tile_order, tma_operand, tma_tile_product
from .triton_kernels import apply_transform, logit_grad

#: The launch shape: 128×256 output tiles on 8 warps, 4 pipelined stages, the epilogue on four 64-column slices
#: (the fp32 accumulator alone is 128 registers per thread; ptxas for sm_90, Triton 3.9, spills 24 bytes of stack
#: in the plain case, 544 with a bias, soft-cap, scaling and an entropy gradient). 3 stages were up to 12 % slower
#: on an H100.
CONFIG = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=4, tma=True)

# What a ``forced`` block set: None (the rule of :func:`applies`), True or False.
_FORCED: dict = {}


@contextlib.contextmanager
def forced(enabled: bool):
    """Within the block :func:`applies` answers ``enabled`` for every call whose operands the kernel can read
    (tests: True runs the kernel under Triton's interpreter on CPU; benchmarks: False times cuBLAS's tiles and the
    gradient kernel instead). Process-wide, not per thread."""
    previous = dict(_FORCED)
    _FORCED["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def applies(h: torch.Tensor, weight: torch.Tensor, tile: torch.Tensor) -> bool:
    """Whether :func:`logits_grad_` can compute ``h @ weight.T``'s ``dz`` into ``tile`` (``[rows, cols]`` buffer):
    by default on a CUDA device of compute capability ≥ 9.0 with bf16 operands (an fp32 matmul stays cuBLAS's:
    Triton's fp32 ``tl.dot`` is TF32 or slow), inside a :func:`forced` block as it says where the operands are
    bf16 or (CPU, interpreter) fp32; always with all three row-major, ``h`` and ``weight`` TMA-aligned (base
    address and row stride multiples of 16 bytes)."""
    enabled = _FORCED.get("enabled")
    if enabled is False or h.dtype != weight.dtype or tile.dtype != weight.dtype:
        return False
    if enabled is None:
        if not (weight.is_cuda and weight.dtype == torch.bfloat16):
            return False
        if capability(weight.device) < (9, 0):
            return False
    elif weight.dtype not in (torch.bfloat16, torch.float32) or (weight.is_cuda and weight.dtype != torch.bfloat16):
        return False
    return tile.stride(-1) == 1 and all(t.stride(-1) == 1 and tma_operand(t) is None for t in (h, weight))


@triton.jit
def _grad_slice(acc, rm, rn, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                logit_scale, softcap, inv_temperature, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
                SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr):
    """``dz`` of one column slice ``acc [len(rm), len(rn)]`` (rows ``rm``, columns ``rn``), stored:
    :func:`~.triton_kernels.logit_grad`'s formula, element for element, on the rounded logit (plus bias)."""
    raw = acc
    if ROUND == 1:  # on the bit pattern: the interpreter's fp32 → bf16 conversion truncates
        _, raw = round_bf16(acc)
    elif ROUND == 2:  # cvt.rn: the same rounding, one instruction per pair on the GPU
        raw = acc.to(tl.bfloat16).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(Bias + col_offset + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    z, th = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    dz, _ = logit_grad(z, th, (rn + col_offset)[None, :] == labels[:, None], lse[:, None], ent[:, None],
                        g_lp[:, None], g_ent[:, None], logit_scale, inv_temperature, SOFTCAP, SCALED, HAS_G_LP,
                        HAS_G_ENT)
    # pointer stores: a TMA store of each slice (through shared memory) was 1–6 % slower on an H100
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(DZ + rm[:, None].to(tl.int64) * stride_dz + rn[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def _logits_grad_kernel(
    A_DESC, B_DESC, DZ, stride_dz, M, N, K, col_offset, Bias, Labels, LSE, ENT, G_LP, G_ENT,
    logit_scale, softcap, inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WIDEN_DOT: tl.constexpr, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr,
):
    """Tiles ``pid, pid + NUM_PROGRAMS, …`` of ``h [M, K] @ w [N, K]ᵀ`` (``A_DESC`` over ``h`` in
    ``[BLOCK_M, BLOCK_K]`` boxes, ``B_DESC`` over ``w`` in ``[BLOCK_N, BLOCK_K]`` boxes, whose zero fill past their
    shapes stands in for masks) in :func:`~.matmul.tile_order`'s grouped order; each tile's ``dz`` is stored into
    ``DZ`` (``[M, N]``, row stride ``stride_dz``) in four column slices."""
    start = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # a separate tile counter for the epilogue, so that the flattened loop issues the next tile's loads while
    # this tile's epilogue runs (as in Triton's persistent matmul tutorial)
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tma_tile_product(A_DESC, B_DESC, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, False, True,
                               WIDEN_DOT)
        tile_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = tile_order(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m_c = pid_m_c * BLOCK_M
        off_n_c = pid_n_c * BLOCK_N
        rm = off_m_c + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        labels = tl.load(Labels + rm, mask=m_ok, other=-1)
        lse = tl.load(LSE + rm, mask=m_ok, other=0.0)
        ent = tl.load(ENT + rm, mask=m_ok, other=0.0)
        g_lp = tl.load(G_LP + rm, mask=m_ok, other=0.0)
        g_ent = tl.load(G_ENT + rm, mask=m_ok, other=0.0)
        # four column slices: the whole tile's temporaries beside its accumulator would spill
        left, right = halves(acc, BLOCK_M, BLOCK_N // 2)
        q0, q1 = halves(left, BLOCK_M, BLOCK_N // 4)
        q2, q3 = halves(right, BLOCK_M, BLOCK_N // 4)
        SLICE: tl.constexpr = BLOCK_N // 4
        rn = off_n_c + tl.arange(0, SLICE)
        _grad_slice(q0, rm, rn, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                    logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)
        _grad_slice(q1, rm, rn + SLICE, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                    logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)
        _grad_slice(q2, rm, rn + 2 * SLICE, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                    logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)
        _grad_slice(q3, rm, rn + 3 * SLICE, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                    logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)


def logits_grad_(
    h: torch.Tensor, w: torch.Tensor, dz: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
    g_lp: torch.Tensor, g_ent: torch.Tensor, *, has_g_lp: bool, has_g_ent: bool, col_offset: int,
    bias: Optional[torch.Tensor], scalars: dict, config: GemmConfig = CONFIG, round_logits: bool = True,
) -> None:
    """``dz [M, N]`` ← the logits-gradient of ``h @ w.T`` (columns ``col_offset …`` of the vocabulary), as
    ``triton_kernels.grad_kernel`` computes it from a stored tile: with ``z`` the (transformed) logit,
    ``logp = z − lse`` and ``p = exp(logp)``, ``g_lp·(1[c = label] − p) − g_ent·p·(logp + ent)``, through the
    logit transform's derivative (× 1/temperature, × (1 − tanh²) for the soft-cap, × logit_scale).

    Args:
        h: ``[M, H]`` row-major (the kept hidden rows), bf16 (fp32 under the interpreter).
        w: ``[N, H]`` row-major, ``h``'s dtype (a row slice of the lm_head weight).
        dz: ``[M, N]`` in ``h``'s dtype, row-major: written (the tile the gradient matmuls read).
        labels: ``[M]`` int64. lse, ent, g_lp, g_ent: fp32 ``[M]``, contiguous (zeros where a gradient is absent;
            ``has_g_lp`` and ``has_g_ent`` say which are).
        bias: the whole ``[V]`` bias or None. scalars: :func:`~.tiles.kernel_scalars` (the logit transform).
        round_logits: round each bf16 logit as cuBLAS's tile would hold it (statistics from such tiles), or
            ``False``: ``dz`` from the fp32 accumulator (statistics from it, :mod:`.fused_matmul`).

    The operands must pass :func:`applies` (row-major, 16-byte aligned rows).

    Raises:
        ValueError: for a ``config`` whose ``epilogue_split`` is not 4 (the kernel's epilogue is built for four
            column slices) or that is not the TMA kernel's.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if config.epilogue_split != 4 or config.tma is False:
        raise ValueError(f"logits_grad_: the kernel runs TMA loads and a four-slice epilogue; got {config.name}")

    m, k = h.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    a_desc = TensorDescriptor(h, [m, k], [h.stride(0), 1], [config.block_m, config.block_k])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [config.block_n, config.block_k])
    programs = multiprocessors(h.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    with kernel_device(h):
        _logits_grad_kernel[(min(tiles, programs),)](
            a_desc, b_desc, dz, dz.stride(0), m, n, k, col_offset, bias if bias is not None else lse, labels, lse, ent,
            g_lp, g_ent, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_PROGRAMS=programs, WIDEN_DOT=not h.is_cuda and h.dtype == torch.bfloat16,
            ROUND=(2 if h.is_cuda else 1) if round_logits and h.dtype == torch.bfloat16 else 0, HAS_G_LP=has_g_lp,
            HAS_G_ENT=has_g_ent, num_warps=config.num_warps, num_stages=config.num_stages, **scalars,
        )


def label_grad_(dz: torch.Tensor, labels: torch.Tensor, label_logit: torch.Tensor, lse: torch.Tensor,
                g_lp: torch.Tensor, *, col_offset: int) -> None:
    """Each row's label column of a ``dz [M, N]`` chunk (columns ``col_offset …``), where the label falls in it, set
    to ``g_lp·(1 − exp(z_y − lse))``: the logits gradient at the label, for a ``dz`` that holds ``−g_lp·p``
    everywhere (QuACK's epilogue, :func:`.quack_epilogues.softmax_grad`); ``grad_kernel``'s formula and rounding
    there, so the chunk is the one :func:`logits_grad_` writes (plain log-probs gradient: no entropy term, bias
    or transform).

    Args:
        dz: ``[M, N]`` bf16, unit column stride.  labels: int64 ``[M]`` (the whole vocabulary's columns).
        label_logit: fp32 ``[M]``, the bf16-rounded logit at the label (read only where it is in the chunk).
        lse, g_lp: fp32 ``[M]``.
    """
    m, n = dz.shape
    if m == 0 or n == 0:
        return
    with kernel_device(dz):
        _label_grad_kernel[(triton.cdiv(m, _LABEL_BLOCK),)](
            dz, dz.stride(0), m, n, col_offset, labels, label_logit, lse, g_lp,
            ROUND=(2 if dz.is_cuda else 1) if dz.dtype == torch.bfloat16 else 0, BLOCK=_LABEL_BLOCK)


_LABEL_BLOCK = 256


@triton.jit
def _label_grad_kernel(DZ, stride_dz, M, N, col_offset, Labels, ZY, LSE, G_LP, ROUND: tl.constexpr,
                       BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    label = tl.load(Labels + rows, mask=rows < M, other=-1)
    inside = (rows < M) & (label >= col_offset) & (label < col_offset + N)
    p = tl.exp(tl.load(ZY + rows, mask=inside, other=0.0) - tl.load(LSE + rows, mask=inside, other=0.0))
    dz = tl.load(G_LP + rows, mask=inside, other=0.0) * (1.0 - p)
    if ROUND == 1:  # the interpreter's fp32 → bf16 conversion truncates: round on the bit pattern
        dz, _ = round_bf16(dz)
    ptrs = DZ + rows.to(tl.int64) * stride_dz + (label - col_offset)
    tl.store(ptrs, dz.to(DZ.dtype.element_ty), mask=inside)


__all__ = ["CONFIG", "applies", "forced", "label_grad_", "logits_grad_"]
