"""The matmul toolkit of the GPU backend: fp32-output cuBLAS products, and what its Triton matmuls share.

- :func:`addmm_f32_` / :func:`mm_f32_`: ``acc (+)= a @ b`` into an fp32 buffer from half-precision operands (cuBLAS
  writes fp32: no rounding of the product to bf16, no fp32 copy of the operands).
- :class:`GemmConfig` and the launch table (:data:`LARGE`, :data:`MEDIUM`, :data:`SMALL`, :func:`default_config`,
  :data:`SWEEP_CONFIGS`), :func:`wave_rows` (row counts that fill whole waves of a persistent matmul).
- Triton building blocks used by :mod:`.compensated` and :mod:`.logits_epilogues`: the grouped tile order
  (:func:`tile_order`), the TMA product of one tile (:func:`tma_tile_product`), exact bf16 ↔ fp32 conversions
  (:func:`to_fp32`, :func:`round_bf16`), column halves of a tile (:func:`halves`), and :func:`tma_operand`.

Why the launch table is fixed rather than autotuned, and the registers each shape takes:
docs/design/numerics.md ("Launch shapes").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import multiprocessors


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator without an fp32 copy of the operands."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def mm_f32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` into an fp32 buffer (cuBLAS writes fp32 from bf16 operands: no rounding to bf16)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch shape: a ``block_m × block_n`` output tile per program, ``block_k`` deep K steps,
    programs ordered in groups of ``group_m`` row-blocks (so the ``b`` columns a group reads stay in L2,
    as in Triton's matmul tutorial), ``num_warps`` warps, ``num_stages`` software-pipelined loads, and the
    epilogue run on ``epilogue_split`` (1, 2 or 4) column slices of the tile one after another.

    ``tma`` picks the kernel: ``True`` the Hopper one (TMA loads of ``a`` and ``b``, persistent programs; a
    ``ValueError`` where the operands or the device do not allow it: the conditions are listed under
    :func:`~.compensated.compensated_addmm_`), ``False`` the pointer-load one, ``None`` the Hopper one on CUDA
    devices where those conditions hold and the pointer one elsewhere (CPU included: the interpreter runs the
    Hopper kernel only when asked with ``True``)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    epilogue_split: int = 1
    tma: Optional[bool] = None

    @property
    def name(self) -> str:
        kernel = {None: "", True: "/tma", False: "/ptr"}[self.tma]
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/w{self.num_warps}/s{self.num_stages}"
                f"/e{self.epilogue_split}{kernel}")


# The default table: each compiles for sm_90 without spills (registers per shape: docs/design/numerics.md). On an
# H100 the TMA kernel with LARGE was the fastest TMA config, or within 1% of it, at every benchmarked shape.
LARGE = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=4)
MEDIUM = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=1)
SMALL = GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4, epilogue_split=2)

# What a launch-shape sweep times on one GPU run: the table above and neighbours worth comparing, on each kernel
# (explicit tma=False/True, so that every name says which kernel it timed), plus 128×256 with 4 stages at e2 on
# the TMA kernel.
_NEIGHBOURS = (
    LARGE,
    GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, epilogue_split=4),
    GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, epilogue_split=2),
    GemmConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3, epilogue_split=4),
    MEDIUM,
    GemmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4, epilogue_split=4),
    SMALL,
)
SWEEP_CONFIGS = tuple(dataclasses.replace(c, tma=False) for c in _NEIGHBOURS) + tuple(
    dataclasses.replace(c, tma=True)
    for c in _NEIGHBOURS + (GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=2),)
)


def default_config(m: int, n: int, device: torch.device) -> GemmConfig:
    """The largest tile of ``LARGE``/``MEDIUM``/``SMALL`` that still gives every multiprocessor of ``device``
    at least two output tiles (fewer tiles than that leaves SMs idle for a whole K loop); ``SMALL`` otherwise.
    All three leave ``tma`` at None: the TMA kernel on sm_90 and later where the operands allow it."""
    waves = 2 * multiprocessors(device)
    for config in (LARGE, MEDIUM):
        if triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n) >= waves:
            return config
    return SMALL


def wave_rows(n: int, device: torch.device) -> int:
    """The fewest rows ``M`` (a multiple of ``LARGE.block_m``) whose ``[M, n]`` product, in ``LARGE``'s output
    tiles, is a whole number of waves on ``device``'s multiprocessors; 1 off CUDA (the interpreter has no
    waves). Each program of a persistent kernel takes tiles in turn, so a last wave that fills only part of
    the GPU costs as long as a full one: 7373 rows of a 2048-wide product are 464 tiles, 3.5 waves of 132 SMs,
    8448 rows 528 tiles, 4 waves, for 12 % more work at the same time on an H100."""
    if device.type != "cuda":
        return 1
    sms, col_tiles = multiprocessors(device), triton.cdiv(n, LARGE.block_n)
    return LARGE.block_m * (sms // math.gcd(sms, col_tiles))


def tma_operand(t: torch.Tensor) -> Optional[str]:
    """Why a 2-D operand cannot be read through a TMA descriptor (None if it can): one of its strides must be 1
    (the box's contiguous dimension: the last one, or the first read as the transpose), its base address a
    multiple of 16 bytes and its other stride too (``cuTensorMapEncodeTiled``'s alignment rules, which
    ``TensorDescriptor`` asserts)."""
    if t.data_ptr() % 16:
        return f"its base address {t.data_ptr():#x} is not 16-byte aligned"
    if t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0:
        return None
    if t.stride(0) == 1 and t.stride(1) * t.element_size() % 16 == 0:
        return None
    return f"its strides {t.stride()} have no 1 beside a multiple of 16 bytes"


@triton.jit
def to_fp32(x):
    """A bf16 block as fp32, exactly: the 16 bits on top of a zero low half."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """fp32 → (the bf16 value to store, that value as fp32), round to nearest, ties to even, on the bit pattern
    (Triton's interpreter truncates in ``.to(tl.bfloat16)``; one code path on GPU and in CI)."""
    bits = x.to(tl.uint32, bitcast=True)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped half
    # is above one half, or equal to it with an odd kept half; overflow rounds to ±inf as it should.
    kept = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    kept = tl.where(x != x, 0x7FC0, kept)  # NaN stays NaN (its low bits could carry into the sign)
    value = (kept << 16).to(tl.float32, bitcast=True)
    stored = kept.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return stored, value


@triton.jit
def tile_order(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The ``(row-block, column-block)`` of output tile number ``pid`` in the grouped order: GROUP_M consecutive
    row-blocks sweep the column-blocks together, so a group reads each B column-block once from DRAM and then
    from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def tma_tile_product(A_DESC, B_DESC, off_m, off_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """The fp32 ``[BLOCK_M, BLOCK_N]`` product tile at ``(off_m, off_n)`` over ``k_tiles`` K steps, its operand
    boxes loaded through TMA descriptors (``A_T``/``B_T``: the descriptor is over the transpose); ``WIDEN_DOT``
    widens bf16 operands to fp32 first (the interpreter's ``tl.dot`` on bf16 reads the raw bits as integers;
    products of two bf16 values are exact in fp32)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_tiles):
        off_k = k * BLOCK_K
        if A_T:
            a = A_DESC.load([off_k, off_m]).T
        else:
            a = A_DESC.load([off_m, off_k])
        if B_T:
            b = B_DESC.load([off_n, off_k]).T
        else:
            b = B_DESC.load([off_k, off_n])
        if WIDEN_DOT:
            acc = tl.dot(to_fp32(a), to_fp32(b), acc)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def halves(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """``x [ROWS, 2·HALF]`` as its left and right ``[ROWS, HALF]`` column halves."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, HALF)), (0, 2, 1)))


__all__ = [
    "LARGE",
    "MEDIUM",
    "SMALL",
    "SWEEP_CONFIGS",
    "GemmConfig",
    "addmm_f32_",
    "default_config",
    "halves",
    "mm_f32_",
    "multiprocessors",
    "round_bf16",
    "tile_order",
    "tma_operand",
    "tma_tile_product",
    "to_fp32",
    "wave_rows",
]
