"""``hi + lo += a @ b``: a matmul that accumulates into an unevaluated pair, a bf16 ``hi`` and an int8 residual ``lo``.

The compensated accumulator of the GPU backend: the two passes' hidden-state gradient under an explicit budget
and the one pass's ``"pair"`` weight-gradient accumulator add one product per vocabulary chunk (or tile) into a
bf16 gradient without an fp32 buffer. The pair stands for ``hi + lo·ulp(hi)/254``; each product is accumulated in
fp32 registers and folded into the pair in the matmul's epilogue, which rounds only the residual (to
``ulp(hi)/508``): as accurate as eager's one rounding of an fp32 sum, for ``M·N`` extra bytes instead of ``4·M·N``.

:func:`compensated_addmm_` folds a product in; :mod:`.compensated_pair` makes a pair from an fp32 block and scales
a pair by the upstream gradient, rounding it once. The format, the fold, its error bound, why there is no finalize
step and why the launch table is fixed: docs/design/numerics.md ("The compensated pair").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import capability, kernel_device, multiprocessors
from .matmul import (
    LARGE, GemmConfig, default_config, halves, round_bf16, tile_order, tma_operand, tma_tile_product,
    to_fp32,
)

# bf16 only: with a half-precision residual, an fp16 pair's largest error came out 1.7% above eager's one rounding
# after 5 chunks on an H100 (bf16: no worse), so fp16 gradients keep the fp32 accumulator.
PAIR_DTYPE = torch.bfloat16
# The residual: int8 fixed point in steps of ulp(hi)/254, so that ±127 is exactly ±½ulp.
RESIDUAL_DTYPE = torch.int8
_DECODE_STEP = tl.constexpr(2.0**-7 / 254)  # a step, ulp/254, over the binade 2^(E−127) of hi (ulp = 2⁻⁷ of it)
_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5·2²³: x + this − this is x rounded to an integer, ties to even, |x| < 2²²


def one_pass_config(m: int, n: int, device: torch.device) -> GemmConfig:
    """The launch shape for the one pass's weight-gradient fold (``[V, H] += dzᵀ [V, rows] @ h [rows, H]``: M the
    vocabulary, K one tile's rows, so few K steps per output tile and the fold's read and write of hi and lo weigh
    more than in the lean path): :data:`~.matmul.LARGE` with 3 stages where ``n`` ≤ 2048, else
    :func:`~.matmul.default_config`. On an H100 3 stages took 2.34 ms against 2.57–2.60 for 4 at N = 2048
    (151936 × 2048 × 2048), and 5.00 against 4.93–4.99 at N = 4096."""
    config = default_config(m, n, device)
    return dataclasses.replace(config, num_stages=3) if config == LARGE and n <= 2048 else config


@triton.jit
def _compensated_addmm_kernel(
    A, B, HI, LO, HI_ROWS, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_hm, stride_hn, stride_lm, stride_ln,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN_DOT: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GATHER_HI: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``(HI, LO) += A @ B`` (the fold: docs/design/numerics.md);
    with ``GATHER_HI`` product row ``i`` lands in ``HI`` row ``HI_ROWS[i]`` (``LO`` stays compact)."""
    pid_m, pid_n = tile_order(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # int64 row/column offsets: a [V, H] weight slice can span more than 2³¹ elements.
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & (rk[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & n_ok[None, :], other=0.0)
        if WIDEN_DOT:
            acc = tl.dot(to_fp32(a), to_fp32(b), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _epilogue(acc, HI, LO, HI_ROWS, pid_m, pid_n, M, N, stride_hm, stride_hn, stride_lm, stride_ln,
              BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, GATHER_HI)


@triton.jit
def _compensated_addmm_tma_kernel(
    A_DESC, B_DESC, HI, LO, HI_ROWS, M, N, K, stride_hm, stride_hn, stride_lm, stride_ln,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WIDEN_DOT: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GATHER_HI: tl.constexpr,
):
    """``_compensated_addmm_kernel`` for Hopper: ``A``/``B`` tiles come through TMA descriptors (``A_DESC`` over
    ``a [M, K]`` in ``[BLOCK_M, BLOCK_K]`` blocks, or over ``a.T [K, M]`` in ``[BLOCK_K, BLOCK_M]`` blocks with
    ``A_T``; ``B_DESC`` over ``b [K, N]`` in ``[BLOCK_K, BLOCK_N]`` blocks, or over ``b.T`` with ``B_T``), whose
    zero fill past the descriptor's shape stands in for the pointer kernel's masks, and each of NUM_PROGRAMS
    programs computes tiles ``pid, pid + NUM_PROGRAMS, …`` of the same grouped order; the epilogue is the
    pointer kernel's."""
    start = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue's tile number is counted separately from the loads' (as in Triton's persistent matmul
    # tutorial): with the loop nest flattened, the next tile's loads are issued while this tile's epilogue
    # runs, and a shared counter would tie the two together.
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tma_tile_product(A_DESC, B_DESC, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T, WIDEN_DOT)
        tile_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = tile_order(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _epilogue(acc, HI, LO, HI_ROWS, pid_m_c, pid_n_c, M, N, stride_hm, stride_hn, stride_lm, stride_ln,
                  BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, GATHER_HI)


@triton.jit
def _epilogue(acc, HI, LO, HI_ROWS, pid_m, pid_n, M, N, stride_hm, stride_hn, stride_lm, stride_ln,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, GATHER_HI: tl.constexpr):
    """Folds the fp32 product tile ``acc [BLOCK_M, BLOCK_N]`` at ``(pid_m, pid_n)`` into the pair."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    hm = rm
    if GATHER_HI:
        hm = tl.load(HI_ROWS + rm, mask=rm < M, other=0)
    # The epilogue in EPILOGUE_SPLIT column slices: a whole 128×256 tile's hi, lo and fold temporaries next to
    # its accumulator need more than 255 registers per thread (ptxas spills ~600 bytes of stack, sm_90).
    if EPILOGUE_SPLIT == 1:
        _fold(acc, HI, LO, rm, hm, rn, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
    else:
        left, right = halves(acc, BLOCK_M, BLOCK_N // 2)
        rn_left = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        if EPILOGUE_SPLIT == 2:
            _fold(left, HI, LO, rm, hm, rn_left, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(right, HI, LO, rm, hm, rn_left + BLOCK_N // 2, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
        else:
            q0, q1 = halves(left, BLOCK_M, BLOCK_N // 4)
            q2, q3 = halves(right, BLOCK_M, BLOCK_N // 4)
            rn_q = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)
            _fold(q0, HI, LO, rm, hm, rn_q, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q1, HI, LO, rm, hm, rn_q + BLOCK_N // 4, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q2, HI, LO, rm, hm, rn_q + BLOCK_N // 2, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q3, HI, LO, rm, hm, rn_q + 3 * (BLOCK_N // 4), M, N, stride_hm, stride_hn, stride_lm, stride_ln)



@triton.jit
def _fold(acc, HI, LO, rm, hm, rn, M, N, stride_hm, stride_hn, stride_lm, stride_ln):
    """``(HI[hm], LO[rm])[:, rn] ← split(HI + LO + acc)`` for an fp32 product block ``acc [len(rm), len(rn)]``
    (``hm``: the rows of ``HI``, ``rm`` itself unless gathered): the fold of docs/design/numerics.md."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    hi_ptrs = HI + hm[:, None].to(tl.int64) * stride_hm + rn[None, :] * stride_hn
    # The same columns, seen by Triton's alignment analysis as runs of 8: otherwise it gives each thread 16
    # contiguous int8 of lo (one 128-bit access) and hi's loads the same layout, while hi's bf16 store is
    # capped at 8 per thread, and the layout conversion between them spilled the e2 tiles (ptxas, sm_90).
    # tl.max_contiguous(rn, 8) did not change the layout.
    rn8 = (rn // 8) * 8 + rn % 8
    lo_ptrs = LO + rm[:, None].to(tl.int64) * stride_lm + rn8[None, :] * stride_ln
    h = to_fp32(tl.load(hi_ptrs, mask=mask, other=0.0))
    low = decode_residual(tl.load(lo_ptrs, mask=mask, other=0), h)
    t = (h + low) + acc
    hi_new, hi32 = round_bf16(t)
    tl.store(hi_ptrs, hi_new, mask=mask)
    tl.store(lo_ptrs, encode_residual(t - hi32, hi32), mask=mask)


@triton.jit
def decode_residual(q, h):
    """The residual ``q`` (int8) of the pair element whose hi is ``h`` (fp32) as fp32: ``q·ulp(h)/254``, with
    ``ulp(h) = 2⁻⁷·2^(E−127)`` for ``h``'s biased exponent E clamped to [1, 254] (zero and subnormals: the
    subnormal spacing 2⁻¹³³; ±inf/NaN, whose ``q`` is 0: a finite stand-in). ``q·(2⁻⁷/254)`` rounds once
    (relative error ≤ 2⁻²⁴ in the constant and as much in the product); the power-of-two factor is exact
    except where the result is an fp32 subnormal (only for |h| < 2⁻¹¹¹: absolute error ≤ 2⁻¹⁵⁰)."""
    binade = tl.minimum(tl.maximum(h.to(tl.uint32, bitcast=True) & 0x7F800000, 0x00800000), 0x7F000000)
    return (q.to(tl.float32) * _DECODE_STEP) * binade.to(tl.float32, bitcast=True)


@triton.jit
def encode_residual(r, hi32):
    """The int8 residual ``rint(r·254/ulp(hi))`` ∈ [−127, 127] of a remainder ``r = t − hi`` (fp32, exact) and
    the new ``hi`` as fp32 ``hi32``; 0 where ``hi`` is ±inf or NaN. Exact, ties to even, with E = ``hi``'s
    biased exponent (at least 1): ``ulp(hi) = 2^(E−134)``, so ``r·254/ulp = (r·2^(128−E))·(254·2⁶)``. The
    power of two ``2^(128−E)`` is a normal fp32 for every E in [1, 254] (``2^(134−E)`` itself would reach
    2¹³³, past fp32's range) and both products are exact: ``r`` is a multiple of ``t``'s fp32 spacing, at
    least ``2⁻¹⁷·ulp(hi)`` (2⁻¹⁶ in hi's binade, 2⁻¹⁷ below a power of two that t rounded up to, 2⁻¹⁶ of the
    subnormal spacing), so with ``|r| ≤ ½ulp`` the product is ``127·k·2⁻¹⁶`` for an integer ``|k| ≤ 2¹⁶``:
    23 bits. Adding and subtracting 1.5·2²³ then rounds it to an integer, ties to even. The clamp to ±127
    never binds for a round-to-nearest ``hi``; it keeps the int8 conversion defined regardless."""
    exponent = (hi32.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = ((255 - tl.maximum(exponent, 1)) << 23).to(tl.float32, bitcast=True)
    q = (r * scale * 16256.0 + _RINT_MAGIC) - _RINT_MAGIC
    q = tl.where(exponent != 0xFF, tl.minimum(tl.maximum(q, -127.0), 127.0), 0.0)
    return q.to(tl.int8)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` byte addresses ``t`` can touch (an over-approximation for non-dense strides)."""
    last = t.data_ptr() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) * t.element_size()
    return t.data_ptr(), last + t.element_size() - 1


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0 or y.numel() == 0:
        return False
    (x0, x1), (y0, y1) = _span(x), _span(y)
    return x0 <= y1 and y0 <= x1


def compensated_addmm_(
    hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, hi_rows: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
) -> None:
    """``hi + lo·ulp(hi)/254 += a @ b`` in place, with fp32 accumulation of the product and a fold into the
    pair that rounds only the residual, to ``ulp(hi)/508`` (formulas, error bound, why no finalize step:
    docs/design/numerics.md).

    Args:
        hi: ``[M, N]`` bf16, any strides: the running sum rounded to its dtype (use it as the result).
        lo: ``[M, N]`` :data:`RESIDUAL_DTYPE` (int8), any strides: the residual ``sum − hi ≈ lo·ulp(hi)/254``
            with ``hi``'s row of the same element; start both at zero
            (``torch.zeros([M, N], dtype=RESIDUAL_DTYPE, device=...)``). Where ``hi`` is ±inf or NaN (as eager's
            fp32 sum would be), ``lo`` is 0 and means nothing.
        a: ``[M, K]`` bf16, any strides (e.g. the logits gradient ``dz``, or a transposed view).
        b: ``[K, N]``, ``a``'s dtype, any strides (e.g. a row slice ``weight[v0:v1]`` of the lm_head weight).
        hi_rows: optional ``[M]`` int64 row indices into a taller ``hi [R, N]``: row ``i`` of the sum is
            ``hi[hi_rows[i]] + lo[i]`` (the kept tokens' rows of a whole ``[N_tokens, H]`` gradient, so that
            ``hi`` is the returned gradient itself, with no compact copy to scatter afterwards).
        config: launch shape and kernel; default :func:`~.matmul.default_config` for ``(M, N)`` on the tensors' device.

    Kernel: the Hopper one (TMA loads of ``a``/``b``, one persistent program per multiprocessor) where
    ``config.tma`` is not False, ``hi`` is on a CUDA device of compute capability ≥ (9, 0) (or, with
    ``config.tma`` True only, on CPU under the interpreter), and each of ``a`` and ``b`` has one stride equal
    to 1 (row-major, or column-major read as the transpose), its other stride a multiple of 8 elements
    (16 bytes) and its ``data_ptr()`` a multiple of 16; the pointer-load kernel otherwise. ``hi``, ``lo`` and
    ``hi_rows`` are read and written through pointers by both, with any strides.

    Raises:
        ValueError: on shapes that do not chain, tensors on different devices, ``hi``/``lo`` memory that
            overlaps each other or ``a``/``b`` (the kernel reads one while writing the other), or
            ``config.tma`` True where the conditions above for the Hopper kernel do not hold.
        TypeError: on ``a``, ``b`` or ``hi`` not bf16 (fp16 is refused: see ``PAIR_DTYPE``), or ``lo`` not
            :data:`RESIDUAL_DTYPE` (a bf16 ``lo`` of the former bf16 pair included).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before Triton is imported).
    """
    if hi_rows is not None and (hi_rows.dim() != 1 or hi_rows.dtype != torch.int64 or
                                hi_rows.numel() != a.shape[0] or hi_rows.device != hi.device):
        raise ValueError(f"compensated_addmm_: hi_rows must be int64 [M] = [{a.shape[0]}] on hi's device, got "
                         f"{hi_rows.dtype} {tuple(hi_rows.shape)} on {hi_rows.device}")
    hi_m = a.shape[0] if hi_rows is None else hi.shape[0]
    if a.dim() != 2 or b.dim() != 2 or hi.dim() != 2 or a.shape[1] != b.shape[0] or \
            hi.shape != (hi_m, b.shape[1]) or lo.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"compensated_addmm_ needs hi, lo [M, N], a [M, K], b [K, N]; got hi {tuple(hi.shape)}, "
                         f"lo {tuple(lo.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    if any(t.dtype != PAIR_DTYPE for t in (a, b, hi)):
        raise TypeError(f"compensated_addmm_ needs bf16 a, b and hi (fp16 gradients: use an fp32 accumulator); "
                        f"got a {a.dtype}, b {b.dtype}, hi {hi.dtype}")
    if lo.dtype != RESIDUAL_DTYPE:
        raise TypeError(f"compensated_addmm_ needs an int8 residual lo: allocate it with torch.zeros([M, N], "
                        f"dtype=RESIDUAL_DTYPE, device=hi.device); got lo {lo.dtype}")
    if len({t.device for t in (hi, lo, a, b)}) != 1:
        raise ValueError(f"compensated_addmm_ needs one device; got hi {hi.device}, lo {lo.device}, a {a.device}, "
                         f"b {b.device}")
    for out, out_name in ((hi, "hi"), (lo, "lo")):
        for other, other_name in ((lo, "lo"), (a, "a"), (b, "b")):
            if other is not out and _overlap(out, other):
                raise ValueError(f"compensated_addmm_: {out_name} overlaps {other_name} in memory")
    m, n = lo.shape
    k = a.shape[1]
    if m == 0 or n == 0 or k == 0:
        return  # nothing to add (and no fold: the pair is left exactly as it was)
    config = config or default_config(m, n, hi.device)
    if config.epilogue_split not in (1, 2, 4) or config.block_n % (16 * config.epilogue_split):
        raise ValueError(f"compensated_addmm_: epilogue_split must be 1, 2 or 4 and divide block_n into slices of "
                         f"≥ 16 columns; got {config}")
    use_tma = uses_tma(hi, a, b, config)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    common = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  WIDEN_DOT=not hi.is_cuda, EPILOGUE_SPLIT=config.epilogue_split, GATHER_HI=hi_rows is not None,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    with kernel_device(hi):
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_t, b_t = a.stride(1) != 1, b.stride(1) != 1
            # Descriptors over the operands' own shapes: TMA fills a box's part past them with zeros, which is
            # what the pointer kernel's masks load (a vocabulary chunk K of any length included).
            a_desc = (TensorDescriptor(a, [k, m], [a.stride(1), 1], [config.block_k, config.block_m]) if a_t else
                      TensorDescriptor(a, [m, k], [a.stride(0), 1], [config.block_m, config.block_k]))
            b_desc = (TensorDescriptor(b, [n, k], [b.stride(1), 1], [config.block_n, config.block_k]) if b_t else
                      TensorDescriptor(b, [k, n], [b.stride(0), 1], [config.block_k, config.block_n]))
            programs = multiprocessors(hi.device)
            _compensated_addmm_tma_kernel[(min(tiles, programs),)](
                a_desc, b_desc, hi, lo, lo if hi_rows is None else hi_rows, m, n, k,
                hi.stride(0), hi.stride(1), lo.stride(0), lo.stride(1), A_T=a_t, B_T=b_t, NUM_PROGRAMS=programs,
                **common,
            )
        else:
            _compensated_addmm_kernel[(tiles,)](
                a, b, hi, lo, lo if hi_rows is None else hi_rows, m, n, k,
                a.stride(0), a.stride(1), b.stride(0), b.stride(1), hi.stride(0), hi.stride(1), lo.stride(0),
                lo.stride(1), EVEN_K=k % config.block_k == 0, **common,
            )


def uses_tma(hi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> bool:
    """Whether :func:`compensated_addmm_` runs the TMA kernel for these operands and ``config``.

    Raises:
        ValueError: where ``config.tma`` is True and it cannot (the reason named).
    """
    reason = _tma_unmet(hi, a, b, config)
    if config.tma and reason:
        raise ValueError(f"compensated_addmm_: {config} asks for the TMA kernel, but {reason}")
    return reason is None and (bool(config.tma) or hi.is_cuda)


def _tma_unmet(hi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> Optional[str]:
    """Why the TMA kernel cannot run (None if it can): ``config.tma`` is False; ``hi`` is on a CUDA device of
    compute capability below 9.0 (CPU tensors, under Triton's interpreter, only when ``config.tma`` is True);
    ``a`` or ``b`` fails :func:`~.matmul.tma_operand`."""
    if config.tma is False:
        return "config.tma is False"
    if hi.is_cuda and capability(hi.device) < (9, 0):
        return f"{torch.cuda.get_device_name(hi.device)} is not a Hopper (sm_90) or later GPU"
    for t, name in ((a, "a"), (b, "b")):
        reason = tma_operand(t)
        if reason:
            return f"{name} does not suit TMA: {reason}"
    return None


__all__ = [
    "RESIDUAL_DTYPE",
    "compensated_addmm_",
    "one_pass_config",
    "uses_tma",
]
