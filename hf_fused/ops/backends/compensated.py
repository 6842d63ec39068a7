"""``hi + lo += a @ b``: a matmul that accumulates into an unevaluated pair: a bf16 ``hi``, an int8 residual ``lo``.

Why: the memory-lean gradient loop (:mod:`.triton_cublas`, vocabulary chunks outside) adds one product
``dz @ w_chunk`` per vocabulary chunk into the hidden-state gradient ``[M, H]``. An fp32 accumulator costs
``4·M·H`` bytes on top of the gradient; adding into the bf16 gradient itself rounds once per chunk (~19
roundings for a 151,936-token vocabulary instead of eager's one). Here the running sum is the pair
``(hi, lo)`` of two ``[M, N]`` tensors: ``hi`` (bf16) is the gradient that is returned, ``lo``
(:data:`RESIDUAL_DTYPE`, int8: a quarter of an fp32 buffer) carries what ``hi`` cannot hold, in fixed point
relative to ``hi``'s own spacing. The pair stands for::

    hi + lo·ulp(hi)/254,   ulp(hi) = 2^(E−134) for hi's biased exponent E ≥ 1, 2⁻¹³³ (bf16's subnormal
                           spacing) for E = 0, i.e. zero and subnormals

so ``lo`` ∈ [−127, 127] spans exactly ``±½ulp(hi)``, the most a round-to-nearest ``hi`` leaves over. Each
chunk's product is accumulated in fp32 registers (``tl.dot``) and folded into the pair in the epilogue, per
element (``h``: the stored ``hi`` as fp32; ``l``: ``lo`` decoded with that ``h``'s ulp)::

    t   = (h + l) + acc                   # fp32, two roundings
    hi' = round_bf16(t)                   # to nearest, ties to even
    r   = t − hi'                         # exact in fp32 (Sterbenz; t rounded to fewer bits)
    lo' = rint(r·254/ulp(hi'))            # exact, ties to even; 0 where hi' is ±inf or NaN

Memory traffic per chunk is 6 bytes per output element (read and write 2 + 1), against 8 for an fp32 ``C``;
the extra memory is ``lo``, ``M·N`` bytes (64 MiB at M = 32768, H = 2048, against 256 MiB for an fp32
accumulator). ``|r| ≤ ½ulp(hi')`` for every finite ``hi'``, binade edges included: when ``t`` rounds up to a
power of two, ``hi'``'s ulp is the larger spacing above it and ``|r|`` is at most a quarter of it. ±inf and
NaN pass through as in eager's fp32 sum (``l`` is always finite, so ``inf + l + acc`` stays inf), and an
fp32 or bf16 overflow of ``t`` gives ±inf.

The bf16-residual version of this fold formed ``h + acc`` with Knuth's TwoSum (TAOCP vol. 2, §4.2.2) to make
one of the two fp32 roundings exact. It saves at most ``2⁻²⁴·|t|`` ≈ 2⁻¹⁷ of an ulp of ``hi``, 2⁻⁸ of the
residual's own step error, and with the int8 decoding and encoding beside it its four extra additions and
temporaries made ptxas spill (sm_90: 104 bytes for 256×128/e2, 40 for 128×256/s3/e2 gathering hi rows), so
it is gone.

Error (u = 2⁻⁸, bf16's unit roundoff; ulp at the new ``hi'``). The quantisation of ``lo'`` is the only
new error of a fold: ``|t − (hi' + lo'·ulp/254)| ≤ ulp/508``, exactly (half a step; ``r``, the scaling and
the rint are exact). Beside it the fp32 stage rounds twice, ``≤ 2⁻²⁴·(|h + l| + |t|)``, and decoding ``l``
rounds twice (``2⁻⁷/254`` and the product: ``≤ 2⁻²³·|l| ≤ 2⁻²⁴·ulp(h)``, plus 2⁻¹⁵⁰ where ``l`` is an
fp32 subnormal). The previous bf16 residual rounded ``r`` to bf16: ``≤ u·|r| ≤ u·½ulp = ulp/512``,
relative to ``|r|`` (smaller for small ``r``); the int8 step's bound is 256/254 of that (0.8 % more) and
absolute, both about 2⁻⁹ of an ulp of ``hi`` against a bf16 accumulator's up to ½ulp per chunk. After k
folds ``hi`` is the round-to-nearest of the fp32 value ``t_k``, and

    |t_k − Σ_j acc_j| ≤ Σ_{j<k} ulp(hi_j)/508 + Σ_{j≤k} (the fold's fp32 and decoding roundings above)

(the k-th fold's own quantisation does not touch ``hi_k``; ``acc_j`` is the j-th fp32-accumulated product):
eager's one rounding of the fp32 sum, except for values within that distance — at most ``(k−1)/508`` of the
largest ``hi``'s ulp — of a rounding tie. fp16 is refused: measured with a half-precision residual, an fp16
pair's largest error exceeded eager's on an H100 (an int8 residual for fp16 is not measured).

No finalize step: a last fold ``hi = round(hi + lo·ulp/254)`` could not improve ``hi``. ``hi`` is already
``round(t_k)``, the nearest bf16 to the best value the kernel ever held (``t_k``); the stored pair is
``t_k`` moved by ``lo``'s quantisation, and re-rounding it changes ``hi`` only where that quantisation pushed
``lo`` onto or past the midpoint to a neighbour: ``lo = ±127`` (exactly ``±½ulp``: a tie, which
round-half-to-even may resolve one ulp away from ``t_k``), or, where ``|hi|`` is a power of two with E ≥ 2
(the neighbour towards zero is only ``½ulp`` away, the midpoint ``¼ulp`` = 63.5 steps), ``lo = ∓64`` towards
zero — which needs ``|r| ≥ ¼ulp``, while ``round(t_k) = hi`` needs ``|r| ≤ ¼ulp``: only ``t_k`` exactly on
that tie, where the neighbour is no nearer (and not round-half-to-even's choice). The fold is a no-op or makes
``hi`` worse, so the caller returns ``hi`` as it is and frees ``lo``.

Rounding to bf16 is done on the bit pattern (round to nearest, ties to even, NaN kept NaN) rather than
with ``.to(tl.bfloat16)``: Triton's interpreter, which runs these kernels on CPU in CI, truncates
fp32 → bf16 (Triton 3.9), and one code path on GPU and in CI is what the tests check. Under the
interpreter the ``tl.dot`` operands are also widened to fp32 first (its ``tl.dot`` on bf16 reads the raw
bits as integers); products of two bf16 values are exact in fp32, so this changes nothing but the
order of the fp32 additions.

Launch configuration: a fixed table keyed on the shape's class (:func:`default_config`), not
``triton.autotune``: the kernel updates ``hi``/``lo`` in place, so autotuning would need a copy of both per
candidate config (``restore_value``), and the row count M changes with every batch (only the non-ignored
rows are computed), which would re-tune — many timed launches — at each new M in the training loop.
``benchmarks/compensated_gemm.py`` sweeps :data:`SWEEP_CONFIGS` on a GPU to choose the table.

Two kernels share the tile order and the epilogue. The pointer-load one (any GPU, any strides) launches a
program per output tile. The Hopper one (sm_90 and later; ``GemmConfig.tma``, conditions in
:func:`compensated_addmm_`) loads ``a`` and ``b`` tiles with TMA through host-side tensor descriptors over the
operands' own shapes (the zero fill past them replaces the masks, ragged K included), and launches one
persistent program per multiprocessor, looping over the tiles in the same grouped order with the loop nest
flattened (``tl.range(..., flatten=True)``) so that the next tile's loads overlap this tile's epilogue; no
warp specialization. Both compute the same fp32 sums in the same order per tile. It is written for the
memory-lean path's ``dz [M, K]`` row-major and ``w[v0:v1] [K, N]`` (N contiguous) and compiles for sm_90
with Triton 3.6 and 3.9. The default table is the pointer kernel's, run by the Hopper kernel wherever it
applies: on an H100 (docs/gpu_results.md, fourth session) that is 2–8% faster than the pointer kernel at every
shape of ``python -m benchmarks.compensated_gemm``, 1.13–1.26× cuBLAS's fp32-output addmm at N = 2048 and 0.96×
at N = 4096; the rest of the gap is the epilogue, which the next tile's loads overlap only partly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

# bf16 only: with a half-precision residual (before the int8 one), an fp16 pair's largest error came out 1.7%
# above eager's one rounding after 5 chunks on an H100 (bf16: no worse), so fp16 gradients keep the fp32
# accumulator.
_PAIR_DTYPE = torch.bfloat16
# The residual: int8 fixed point in steps of ulp(hi)/254, so that ±127 is exactly ±½ulp (module docstring).
RESIDUAL_DTYPE = torch.int8
_DECODE_STEP = tl.constexpr(2.0**-7 / 254)  # a step, ulp/254, over the binade 2^(E−127) of hi (ulp = 2⁻⁷ of it)
_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5·2²³: x + this − this is x rounded to an integer, ties to even, |x| < 2²²


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch shape: a ``block_m × block_n`` output tile per program, ``block_k`` deep K steps,
    programs ordered in groups of ``group_m`` row-blocks (so the ``b`` columns a group reads stay in L2,
    as in Triton's matmul tutorial), ``num_warps`` warps, ``num_stages`` software-pipelined loads, and the
    epilogue run on ``epilogue_split`` (1, 2 or 4) column slices of the tile one after another.

    ``tma`` picks the kernel: ``True`` the Hopper one (TMA loads of ``a`` and ``b``, persistent programs; a
    ``ValueError`` where the operands or the device do not allow it: the conditions are listed under
    :func:`compensated_addmm_`), ``False`` the pointer-load one, ``None`` the Hopper one on CUDA devices where
    those conditions hold and the pointer one elsewhere (CPU included: the interpreter runs the Hopper kernel
    only when asked with ``True``)."""

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


# Shared memory per stage: (block_m + block_n)·block_k·2 bytes: 48 KiB for 128×256×64 (3 stages = 144 KiB,
# 4 = 192 KiB, within an H100's 227 KiB). The fp32 accumulator is block_m·block_n/(32·num_warps) registers
# per thread (128 for 128×256 on 8 warps); the epilogue_split keeps hi, lo and the fold's temporaries of one
# column slice beside it within 255 registers. ptxas for sm_90 (Triton 3.9's bundled one, compiled without a
# GPU), with the int8 residual, registers / spilled stack bytes (contiguous K; gathered hi rows alike except
# where noted): 128×256 w8: e1 255/856, e2 255/0 (254/16 gathering hi rows, s3), e4 198/0; 256×128 w8:
# e2 255/0, e4 192/0; 128×128 w4: e1 255/1032, e4 221/0; 128×128 w8 e1: 215/0; 64×128 w4: e1 222/0,
# e2 128/0 (the bf16 residual's were 0–36 registers fewer: e.g. 196, 208, 128 for the three below).
# Stages: 4 beat 3 on 7 of the 8 lean-path shapes of ``python -m benchmarks.compensated_gemm`` on an H100
# (1.06–1.33× cuBLAS's fp32-output addmm time with the bf16 residual; with the int8 one 1.06–1.31×, third and
# fourth sessions in docs/gpu_results.md).
# The TMA kernel (tma=None or True on sm_90), same compiler, pipelined loads in shared memory, registers / stack
# bytes (contiguous K; gathered hi rows where they differ), shared memory: 128×256×64 w8: s3/e4 201/0 (202/0),
# 160 KiB; s4/e4 206/0 (205/0), 208 KiB; s3/e2 254/16 (255/32); s4/e2 254/40 (255/32), 224 KiB; 256×128×64 w8:
# s3/e4 208/0 (221/0); s3/e2 255/8 (255/16); 128×128×64 w8 s4/e1 243/0 (241/0); 128×128×64 w4 s4/e4 212/0
# (226/0); 64×128×64 w4 s4/e2 128/0 (129/0). Triton 3.6's compiler: as many spilled bytes or fewer (s4/e2: 16),
# registers within 10 of these.
# On an H100 the TMA kernel with LARGE (s4/e4) was the fastest TMA config, or within 1% of it, at all 5 benchmark
# shapes, so the table below serves both kernels (all three compile without spills for sm_90).
LARGE = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=4)
MEDIUM = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=1)
SMALL = GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4, epilogue_split=2)

# What the benchmark times on one GPU run: the table above and neighbours worth comparing, on each kernel
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


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: fewest, largest programs are fastest
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, device: torch.device) -> GemmConfig:
    """The largest tile of ``LARGE``/``MEDIUM``/``SMALL`` that still gives every multiprocessor of ``device``
    at least two output tiles (fewer tiles than that leaves SMs idle for a whole K loop); ``SMALL`` otherwise.
    All three leave ``tma`` at None: the TMA kernel on sm_90 and later where the operands allow it."""
    waves = 2 * _multiprocessors(device)
    for config in (LARGE, MEDIUM):
        if triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n) >= waves:
            return config
    return SMALL


def one_pass_config(m: int, n: int, device: torch.device) -> GemmConfig:
    """The launch shape for the one pass's weight-gradient fold (``[V, H] += dzᵀ [V, rows] @ h [rows, H]``: M the
    vocabulary, K one tile's rows, so few K steps per output tile and the fold's read and write of hi and lo weigh
    more than in the lean path): :data:`LARGE` with 3 stages where ``n`` ≤ 2048, else :func:`default_config`. On an
    H100 (``python -m benchmarks.compensated_gemm --tma-only --shapes 151936:2048:2048,151936:2048:4096``, eighth
    session) 3 stages took 2.34 ms against 2.57–2.60 for 4 at N = 2048, and 5.00 against 4.93–4.99 at N = 4096."""
    config = default_config(m, n, device)
    return dataclasses.replace(config, num_stages=3) if config == LARGE and n <= 2048 else config


def wave_rows(n: int, device: torch.device) -> int:
    """The fewest rows ``M`` (a multiple of ``LARGE.block_m``) whose ``[M, n]`` product, in ``LARGE``'s output
    tiles, is a whole number of waves on ``device``'s multiprocessors; 1 off CUDA (the interpreter has no
    waves). Each program of the persistent kernel takes tiles in turn, so a last wave that fills only part of
    the GPU costs as long as a full one: 7373 rows of a 2048-wide product are 464 tiles, 3.5 waves of 132 SMs,
    8448 rows 528 tiles, 4 waves, for 12 % more work at the same time on an H100
    (docs/gpu_results.md, fifth session)."""
    if device.type != "cuda":
        return 1
    sms, col_tiles = _multiprocessors(device), triton.cdiv(n, LARGE.block_n)
    return LARGE.block_m * (sms // math.gcd(sms, col_tiles))


@triton.jit
def _to_fp32(x):
    """A bf16 block as fp32, exactly: the 16 bits on top of a zero low half."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round(x):
    """fp32 → (the bf16 value to store, that value as fp32), round to nearest, ties to even."""
    bits = x.to(tl.uint32, bitcast=True)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped half
    # is above one half, or equal to it with an odd kept half; overflow rounds to ±inf as it should.
    kept = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    kept = tl.where(x != x, 0x7FC0, kept)  # NaN stays NaN (its low bits could carry into the sign)
    value = (kept << 16).to(tl.float32, bitcast=True)
    stored = kept.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return stored, value


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def _compensated_addmm_kernel(
    A, B, HI, LO, HI_ROWS, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_hm, stride_hn, stride_lm, stride_ln,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN_DOT: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GATHER_HI: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``(HI, LO) += A @ B`` (see the module docstring for the epilogue);
    with ``GATHER_HI`` product row ``i`` lands in ``HI`` row ``HI_ROWS[i]`` (``LO`` stays compact)."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

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
            acc = tl.dot(_to_fp32(a), _to_fp32(b), acc)
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
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tma_tile_product(A_DESC, B_DESC, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T, WIDEN_DOT)
        tile_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = _tile(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _epilogue(acc, HI, LO, HI_ROWS, pid_m_c, pid_n_c, M, N, stride_hm, stride_hn, stride_lm, stride_ln,
                  BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, GATHER_HI)


@triton.jit
def tma_tile_product(A_DESC, B_DESC, off_m, off_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """The fp32 ``[BLOCK_M, BLOCK_N]`` product tile at ``(off_m, off_n)`` over ``k_tiles`` K steps, its operand
    boxes loaded through TMA descriptors (``A_T``/``B_T``: the descriptor is over the transpose, as in
    :func:`_compensated_addmm_tma_kernel`); ``WIDEN_DOT`` widens bf16 operands to fp32 first (the interpreter)."""
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
            acc = tl.dot(_to_fp32(a), _to_fp32(b), acc)
        else:
            acc = tl.dot(a, b, acc)
    return acc


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
        left, right = _halves(acc, BLOCK_M, BLOCK_N // 2)
        rn_left = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        if EPILOGUE_SPLIT == 2:
            _fold(left, HI, LO, rm, hm, rn_left, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(right, HI, LO, rm, hm, rn_left + BLOCK_N // 2, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
        else:
            q0, q1 = _halves(left, BLOCK_M, BLOCK_N // 4)
            q2, q3 = _halves(right, BLOCK_M, BLOCK_N // 4)
            rn_q = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)
            _fold(q0, HI, LO, rm, hm, rn_q, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q1, HI, LO, rm, hm, rn_q + BLOCK_N // 4, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q2, HI, LO, rm, hm, rn_q + BLOCK_N // 2, M, N, stride_hm, stride_hn, stride_lm, stride_ln)
            _fold(q3, HI, LO, rm, hm, rn_q + 3 * (BLOCK_N // 4), M, N, stride_hm, stride_hn, stride_lm, stride_ln)


@triton.jit
def _halves(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """``x [ROWS, 2·HALF]`` as its left and right ``[ROWS, HALF]`` column halves."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, HALF)), (0, 2, 1)))


@triton.jit
def _fold(acc, HI, LO, rm, hm, rn, M, N, stride_hm, stride_hn, stride_lm, stride_ln):
    """``(HI[hm], LO[rm])[:, rn] ← split(HI + LO + acc)`` for an fp32 product block ``acc [len(rm), len(rn)]``
    (``hm``: the rows of ``HI``, ``rm`` itself unless gathered): the fold of the module docstring."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    hi_ptrs = HI + hm[:, None].to(tl.int64) * stride_hm + rn[None, :] * stride_hn
    # The same columns, seen by Triton's alignment analysis as runs of 8: otherwise it gives each thread 16
    # contiguous int8 of lo (one 128-bit access) and hi's loads the same layout, while hi's bf16 store is
    # capped at 8 per thread, and the layout conversion between them spilled the e2 tiles (ptxas, sm_90).
    # tl.max_contiguous(rn, 8) did not change the layout.
    rn8 = (rn // 8) * 8 + rn % 8
    lo_ptrs = LO + rm[:, None].to(tl.int64) * stride_lm + rn8[None, :] * stride_ln
    h = _to_fp32(tl.load(hi_ptrs, mask=mask, other=0.0))
    low = _decode(tl.load(lo_ptrs, mask=mask, other=0), h)
    t = (h + low) + acc
    hi_new, hi32 = _round(t)
    tl.store(hi_ptrs, hi_new, mask=mask)
    tl.store(lo_ptrs, _encode(t - hi32, hi32), mask=mask)


@triton.jit
def _decode(q, h):
    """The residual ``q`` (int8) of the pair element whose hi is ``h`` (fp32) as fp32: ``q·ulp(h)/254``, with
    ``ulp(h) = 2⁻⁷·2^(E−127)`` for ``h``'s biased exponent E clamped to [1, 254] (zero and subnormals: the
    subnormal spacing 2⁻¹³³; ±inf/NaN, whose ``q`` is 0: a finite stand-in). ``q·(2⁻⁷/254)`` rounds once
    (relative error ≤ 2⁻²⁴ in the constant and as much in the product); the power-of-two factor is exact
    except where the result is an fp32 subnormal (only for |h| < 2⁻¹¹¹: absolute error ≤ 2⁻¹⁵⁰)."""
    binade = tl.minimum(tl.maximum(h.to(tl.uint32, bitcast=True) & 0x7F800000, 0x00800000), 0x7F000000)
    return (q.to(tl.float32) * _DECODE_STEP) * binade.to(tl.float32, bitcast=True)


@triton.jit
def _encode(r, hi32):
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
    pair that rounds only the residual, to ``ulp(hi)/508`` (module docstring: formulas, error bound, why no
    finalize step).

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
        config: launch shape and kernel; default :func:`default_config` for ``(M, N)`` on the tensors' device.

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
        TypeError: on ``a``, ``b`` or ``hi`` not bf16 (fp16 is refused: see ``_PAIR_DTYPE``), or ``lo`` not
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
    if any(t.dtype != _PAIR_DTYPE for t in (a, b, hi)):
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
    use_tma = _uses_tma(hi, a, b, config)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    common = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  WIDEN_DOT=not hi.is_cuda, EPILOGUE_SPLIT=config.epilogue_split, GATHER_HI=hi_rows is not None,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    with torch.cuda.device(hi.device) if hi.is_cuda else contextlib.nullcontext():
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_t, b_t = a.stride(1) != 1, b.stride(1) != 1
            # Descriptors over the operands' own shapes: TMA fills a box's part past them with zeros, which is
            # what the pointer kernel's masks load (a vocabulary chunk K of any length included).
            a_desc = (TensorDescriptor(a, [k, m], [a.stride(1), 1], [config.block_k, config.block_m]) if a_t else
                      TensorDescriptor(a, [m, k], [a.stride(0), 1], [config.block_m, config.block_k]))
            b_desc = (TensorDescriptor(b, [n, k], [b.stride(1), 1], [config.block_n, config.block_k]) if b_t else
                      TensorDescriptor(b, [k, n], [b.stride(0), 1], [config.block_k, config.block_n]))
            programs = _multiprocessors(hi.device)
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


def compensated_scale_(hi: torch.Tensor, lo: torch.Tensor, factor) -> torch.Tensor:
    """``hi ← round_bf16(factor·(hi + lo·ulp(hi)/254))`` in place, and ``hi`` returned: a pair's value scaled
    by the upstream gradient and rounded once, as an fp32 accumulator's ``(acc·factor).to(bf16)`` would be.

    The sum ``hi + lo·ulp/254`` and the product each round once in fp32 (``≤ 2⁻²⁴`` relative each); the
    bf16 rounding is to nearest, ties to even. A ``factor`` of exactly 1.0 (a Python float) returns ``hi``
    untouched: it already is the round-to-nearest of the best sum the pair held (module docstring, "No
    finalize step").

    Args:
        hi: bf16, contiguous (e.g. the one pass's ``[V, H]`` weight gradient).
        lo: :data:`RESIDUAL_DTYPE` (int8) of ``hi``'s shape, contiguous: its residual.
        factor: a Python float, or a 0-d fp32 tensor on ``hi``'s device (the upstream gradient: read by the
            kernel, no host sync).

    Raises:
        ValueError: on shapes that differ, or ``hi``/``lo`` not contiguous.
        TypeError: on ``hi`` not bf16 or ``lo`` not int8.
    """
    if hi.shape != lo.shape or not (hi.is_contiguous() and lo.is_contiguous()):
        raise ValueError(f"compensated_scale_ needs contiguous hi and lo of one shape; got hi {tuple(hi.shape)} "
                         f"{hi.stride()}, lo {tuple(lo.shape)} {lo.stride()}")
    if hi.dtype != _PAIR_DTYPE or lo.dtype != RESIDUAL_DTYPE:
        raise TypeError(f"compensated_scale_ needs a bf16 hi and an int8 lo; got {hi.dtype}, {lo.dtype}")
    if isinstance(factor, float) and factor == 1.0:
        return hi
    factor = torch.as_tensor(factor, dtype=torch.float32, device=hi.device).reshape(())
    n = hi.numel()
    if n:
        with torch.cuda.device(hi.device) if hi.is_cuda else contextlib.nullcontext():
            _scale_pair_kernel[(triton.cdiv(n, _SCALE_BLOCK),)](hi, lo, factor, n, BLOCK=_SCALE_BLOCK)
    return hi


_SCALE_BLOCK = 4096


@triton.jit
def _scale_pair_kernel(HI, LO, FACTOR, n, BLOCK: tl.constexpr):
    """One ``BLOCK`` of :func:`compensated_scale_` over the flat pair (int64 offsets: a ``[V, H]`` pair can
    pass 2³¹ elements)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = _to_fp32(tl.load(HI + offs, mask=mask, other=0.0))
    t = (h + _decode(tl.load(LO + offs, mask=mask, other=0), h)) * tl.load(FACTOR)
    stored, _ = _round(t)
    tl.store(HI + offs, stored, mask=mask)


def _uses_tma(hi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> bool:
    """Whether :func:`compensated_addmm_` runs the TMA kernel for these operands and ``config``; raises
    ``ValueError`` where ``config.tma`` is True and it cannot."""
    reason = _tma_unmet(hi, a, b, config)
    if config.tma and reason:
        raise ValueError(f"compensated_addmm_: {config} asks for the TMA kernel, but {reason}")
    return reason is None and (bool(config.tma) or hi.is_cuda)


def _tma_operand(t: torch.Tensor) -> Optional[str]:
    """Why a 2-D bf16 operand cannot be read through a TMA descriptor (None if it can): one of its strides must
    be 1 (the box's contiguous dimension: the last one, or the first read as the transpose), its base address a
    multiple of 16 bytes and its other stride too (``cuTensorMapEncodeTiled``'s alignment rules, which
    ``TensorDescriptor`` asserts)."""
    if t.data_ptr() % 16:
        return f"its base address {t.data_ptr():#x} is not 16-byte aligned"
    if t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0:
        return None
    if t.stride(0) == 1 and t.stride(1) * t.element_size() % 16 == 0:
        return None
    return f"its strides {t.stride()} have no 1 beside a multiple of 16 bytes"


def _tma_unmet(hi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> Optional[str]:
    """Why the TMA kernel cannot run (None if it can): ``config.tma`` is False; ``hi`` is on a CUDA device of
    compute capability below 9.0 (CPU tensors, under Triton's interpreter, only when ``config.tma`` is True);
    ``a`` or ``b`` fails :func:`_tma_operand`."""
    if config.tma is False:
        return "config.tma is False"
    if hi.is_cuda and torch.cuda.get_device_capability(hi.device) < (9, 0):
        return f"{torch.cuda.get_device_name(hi.device)} is not a Hopper (sm_90) or later GPU"
    for t, name in ((a, "a"), (b, "b")):
        reason = _tma_operand(t)
        if reason:
            return f"{name} does not suit TMA: {reason}"
    return None


__all__ = [
    "GemmConfig",
    "LARGE",
    "MEDIUM",
    "RESIDUAL_DTYPE",
    "SMALL",
    "SWEEP_CONFIGS",
    "compensated_addmm_",
    "compensated_scale_",
    "wave_rows",
    "default_config",
    "one_pass_config",
]
