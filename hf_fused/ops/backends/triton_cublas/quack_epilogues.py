"""QuACK's Hopper GEMM (``quack-kernels``) with hf_fused's epilogues: the optional QuACK kernels of the GPU backend.

- :func:`logits_with_statistics`: the one pass's logits tile with each row's log-sum-exp and label logit reduced
  in the matmul's epilogue (the statistics kernel's read of the tile gone: 3–6 % less time per step).
- :func:`softmax_grad`: the two passes' ``dz`` tile ``−g·exp(z − lse)`` and the gathered label logit, from which
  :func:`.logits_epilogues.label_grad_` sets the label column (the Triton fused-``dz`` kernel's bits, 16–22 % less
  time per tile on an H200); of the bf16 logit, or of the fp32 accumulator where the statistics came from it
  (there also of ``acc·logit_scale``).
- :func:`scaled_exp_logits`: QuACK's scaled-exp epilogue (``quack.epilogue.scaled_exp``) with a window on its
  shifts: the tile stored as ``E = bf16(2^(z·log2 e − k))`` with ``k`` the rounded maximum of each (row,
  ``tile_n``-column tile) outside ``±SHIFT_WINDOW`` and 0 inside (:class:`WindowedMaxLog2`), each tile's Σ E, its
  ``k`` and the label logit from the fp32 accumulator (fp32-faithful statistics), and, for the entropy, a variant
  that also reduces each tile's Σ E·z (:func:`scaled_exp_entropy_epi`); the one pass takes ``dz`` as ``E`` scaled
  per row (:func:`~.shifted_tile.exp_tile_row_factors_`: one shift per row, which the window gives every row whose
  logits lie within ±44 nats) or :func:`~.shifted_tile.shifted_gradient_` turns ``E`` into ``dz``. Without a tile to store, the two passes'
  statistics pass: the partials alone. Logits that are the matmul's times a constant (a logit scale, a sampling
  temperature) take hf_fused's variants of both, of ``acc·scale`` (:func:`scaled_exp_logit_scale_epi`).
- :func:`matmul_f32`: QuACK's fp32-output matmul, adding into an fp32 accumulator through TMA reduce-add stores
  (the weight gradient's accumulation over tiles; ping-pong for a short reduction, :func:`matmul_f32_config`).
- :func:`pair_addmm`: the compensated pair's fold (:mod:`.compensated`) in QuACK's epilogue: ``hi + lo += a @ b``
  with ``hi`` the matmul's C and D, the int8 residual read and written beside it, bit for bit the Triton fold's
  arithmetic on QuACK's fp32 accumulator.

The first two round the fp32 accumulator to bf16 first (unless told not to), as the matmul's store does, so every
statistic is that of the rounded tile (docs/design/numerics.md, "Epilogues"). This module imports QuACK and the CuTe
DSL at import time; :mod:`.quack_bridge` imports it only where ``quack`` is installed and a call can use it, and turns
it off for the process, with one warning, when importing or running it raises. Measured with quack-kernels 0.6.4 and
nvidia-cutlass-dsl 4.6.2 (QuACK 0.6.5 with the DSL 4.7 and 4.8 could not build any epilogue).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import identity_epi
from quack.epilogue.math import pexp, pexp2
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce, Scalar, TileLoad
from quack.epilogue.scaled_exp import LOG2E, MaxLog2, _max_prepass
from quack.rounding import _bits_f32, _f32_bits

_LABELS = ColVecLoad("target")


@gemm_epilogue(
    outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_LABELS)},
    extra_ops=(_LABELS,),
)
def bf16_logits_statistics(acc):
    """The bf16 logit (as fp32) is stored, reduced into the row's online log-sum-exp, and gathered at the
    row's label column."""
    z = Float32(cutlass.BFloat16(acc))
    return {"D": z, "lse": z, "target_logit": z}


def logits_with_statistics(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, *, lse: torch.Tensor,
    label_logit: torch.Tensor,
) -> None:
    """``out = hidden @ weight.T`` rounded to bf16, and per row the log-sum-exp and label logit of ``out``.

    Args:
        hidden: ``[M, H]`` bf16, contiguous, ``H`` a multiple of 8 (16-byte rows for the TMA loads).
        weight: ``[V, H]`` bf16, contiguous, ``V`` a multiple of 8.
        labels: ``[M]`` int64 in ``[0, V)`` (the kept rows' labels).
        out: ``[M, V]`` bf16, contiguous: the logits tile, written.
        lse, label_logit: fp32 ``[M]``, contiguous: written.
    """
    res = bf16_logits_statistics(hidden, weight.mT, out={"D": out}, target=labels, target_logit=label_logit,
                                 tuned=False)
    lse.copy_(res["lse"])


@gemm_epilogue(
    ops={"lse": ColVecLoad("lse"), "scale": ColVecLoad("scale")},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_LABELS)},
    extra_ops=(_LABELS,),
)
def bf16_softmax_grad(acc, lse, scale):
    """The tile stores ``scale·p`` with ``p = exp(z − lse)`` of the bf16 logit ``z`` (the logits gradient but at the
    label column, fixed afterwards from the gathered label logit)."""
    z = Float32(cutlass.BFloat16(acc))
    return {"D": scale * pexp(z - lse), "target_logit": z}


@gemm_epilogue(
    ops={"lse": ColVecLoad("lse"), "scale": ColVecLoad("scale"), "logit_scale": Scalar("logit_scale")},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_LABELS)},
    extra_ops=(_LABELS,),
)
def fp32_softmax_grad(acc, lse, scale, logit_scale):
    """:func:`bf16_softmax_grad` of the logits ``z = acc·logit_scale`` taken from the fp32 accumulator itself
    (statistics taken from it too): no logit is rounded before the exponential. A logit scale over a temperature is
    one fp32 rounding, as :func:`scaled_exp_logit_scale_epi` takes them for the statistics; at 1 the product is
    ``acc`` itself, bit for bit."""
    z = acc * logit_scale
    return {"D": scale * pexp(z - lse), "target_logit": z}


def softmax_grad(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
    out: torch.Tensor, label_logit: torch.Tensor, *, round_logits: bool = True, logit_scale: float = 1.0,
) -> None:
    """``out = scale[:, None]·exp(z − lse[:, None])`` rounded to bf16, ``z = bf16(hidden @ weight.T)`` (with
    ``round_logits``, as cuBLAS's tile holds it) or the matmul's fp32 accumulator itself (``round_logits=False``:
    the two passes whose statistics came from the accumulator), and the label logit of ``z`` where the label falls in
    the tile's columns (``label_logit`` left as it is elsewhere).

    Args:
        hidden: ``[M, H]`` bf16, contiguous, ``H`` a multiple of 8.  weight: ``[N, H]`` bf16, contiguous, ``N`` a
            multiple of 8 (a row slice of the lm_head).
        labels: ``[M]`` int64, each row's label column relative to the slice (out of ``[0, N)``: none here).
        lse, scale: fp32 ``[M]``, contiguous (the row's log-sum-exp over the whole vocabulary; ``−∂L/∂logp``).
        out: ``[M, N]`` bf16, contiguous: written.  label_logit: fp32 ``[M]``: written where the label is inside.
        logit_scale: the logits are ``z = acc·logit_scale`` (a logit scale over a sampling temperature; only with
            ``round_logits=False``, :func:`fp32_softmax_grad`), ``lse`` and the label logit of those.
    Every tensor must start 16-byte aligned (QuACK's TMA).

    Raises:
        ValueError: a ``logit_scale`` other than 1 with ``round_logits``."""
    if round_logits:
        if logit_scale != 1.0:
            raise ValueError("softmax_grad: a logit_scale other than 1 takes the fp32 accumulator (round_logits=False)")
        bf16_softmax_grad(hidden, weight.mT, out={"D": out}, lse=lse, scale=scale, target=labels,
                          target_logit=label_logit, tuned=False)
        return
    fp32_softmax_grad(hidden, weight.mT, out={"D": out}, lse=lse, scale=scale, logit_scale=float(logit_scale),
                      target=labels, target_logit=label_logit, tuned=False)


#: The shifts' window, in powers of two: a column tile whose rounded maximum ``k`` (in log2 units) lies in
#: ``[−SHIFT_WINDOW, SHIFT_WINDOW]`` (logits within ±44 nats) is stored unshifted, ``exp(z)``; one outside it is
#: shifted by ``k ∓ SHIFT_WINDOW``, so no stored value passes ``2^(SHIFT_WINDOW + 1/2)`` and none in a tile above the
#: window's floor underflows unless ``2^−62`` below its maximum. A row whose tiles are all inside has one shift, 0,
#: and its gradient is the tile scaled per row (:func:`~.shifted_tile.exp_tile_row_factors_`).
SHIFT_WINDOW = 64


class WindowedMaxLog2(MaxLog2):
    """QuACK's ``MaxLog2`` (``k = rne(max·log2 e)`` per row and column tile) with the shifts' window:
    ``k − clamp(k, −SHIFT_WINDOW, SHIFT_WINDOW)``, for the stored values and the written ``k`` alike."""

    def config_key(self):
        return (self.round_to_int, SHIFT_WINDOW)

    @cute.jit
    def stat_value(self, total, group_cols):
        k = cute.math.roundeven(total * Float32(LOG2E))
        return k - cute.arch.fmin(cute.arch.fmax(k, Float32(-SHIFT_WINDOW)), Float32(SHIFT_WINDOW))


def _scaled_max_prepass(acc, scale):
    return {"max_log2": acc * scale}


def _scaled_exp_declaration(entropy: bool, logit_scale: bool) -> dict:
    """``gemm_epilogue``'s arguments for QuACK's scaled-exp epilogue as ``scaled_exp_target_epi`` declares it (the
    prepass maximum, windowed: :class:`WindowedMaxLog2`; each tile's Σ E, its shift and the label logit) with each (row, tile)'s Σ E·z too (``entropy``)
    and of the logits ``acc·scale`` (``logit_scale``: a ``scale`` scalar operand). Fresh ops for each epilogue."""
    max_log2, labels = WindowedMaxLog2("max_log2"), ColVecLoad("target")
    reduces = {"sum_exp": ColVecReduce("sum_exp")}
    if entropy:  # Σ E·z as a product reduce: one fused multiply-add per element, the product never rounded on its own
        reduces["sum_ez"] = ColVecReduce("sum_ez", scaled=True)
    return dict(
        ops={"max_log2": max_log2, **({"scale": Scalar("scale")} if logit_scale else {})},
        prepass=_scaled_max_prepass if logit_scale else _max_prepass, prepass_outs=("max_log2",), reduces=reduces,
        outs={"target_logit": ColVecSelect("target_logit", idx_op=labels)},
        extra_ops=(max_log2.out("max_log2_out"), labels),
    )


@gemm_epilogue(**_scaled_exp_declaration(entropy=False, logit_scale=False))
def scaled_exp_epi(acc, max_log2):
    """QuACK's ``scaled_exp_target_epi`` with the shifts' window (:class:`WindowedMaxLog2`): the tile ``E``, each
    (row, tile)'s Σ E and shift, the label logit, from the fp32 accumulator."""
    e = pexp2(acc * LOG2E - max_log2)
    return {"D": e, "sum_exp": e, "target_logit": acc}


@gemm_epilogue(**_scaled_exp_declaration(entropy=True, logit_scale=False))
def scaled_exp_entropy_epi(acc, max_log2):
    """QuACK's ``scaled_exp_target_epi`` plus each (row, tile)'s Σ E·z of the fp32 logits ``z``: the entropy's
    ``Σ p·z`` from the accumulator, not from the stored bf16 values."""
    e = pexp2(acc * LOG2E - max_log2)
    return {"D": e, "sum_exp": e, "sum_ez": (e, acc), "target_logit": acc}


@gemm_epilogue(**_scaled_exp_declaration(entropy=False, logit_scale=True))
def scaled_exp_logit_scale_epi(acc, max_log2, scale):
    """QuACK's ``scaled_exp_target_epi`` of the logits ``z = acc·scale`` (a logit scale over a temperature, one
    fp32 rounding): the shifts from their maximum, the tile, sums and label logit of ``z``."""
    z = acc * scale
    e = pexp2(z * LOG2E - max_log2)
    return {"D": e, "sum_exp": e, "target_logit": z}


@gemm_epilogue(**_scaled_exp_declaration(entropy=True, logit_scale=True))
def scaled_exp_logit_scale_entropy_epi(acc, max_log2, scale):
    """:func:`scaled_exp_entropy_epi` of the logits ``z = acc·scale``."""
    z = acc * scale
    e = pexp2(z * LOG2E - max_log2)
    return {"D": e, "sum_exp": e, "sum_ez": (e, z), "target_logit": z}


def scaled_exp_logits(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: Optional[torch.Tensor], *,
    sum_exp: torch.Tensor, max_log2: torch.Tensor, label_logit: torch.Tensor, tile_n: int,
    sum_ez: Optional[torch.Tensor] = None, scale: float = 1.0,
) -> None:
    """QuACK's scaled-exp logits matmul (``scaled_exp_target_epi`` with the shifts' window, launched as QuACK's own
    linear cross-entropy launches it): with ``z = hidden @ weight.T`` in fp32, ``m[r, t] = rne(log2 e · max of z[r,
    t·tile_n : (t + 1)·tile_n])`` and ``k = m − clamp(m, −SHIFT_WINDOW, SHIFT_WINDOW)``, ``out[r, c] =
    bf16(2^(z[r, c]·log2 e − k[r, c // tile_n]))``, ``sum_exp[r, t]`` the fp32 Σ of the tile's values before
    rounding, ``max_log2 = k``, ``label_logit[r] = z[r, labels[r]]``.

    Args:
        hidden: ``[M, H]`` bf16, contiguous, ``H`` a multiple of 8.  weight: ``[V, H]`` bf16, contiguous.
        labels: ``[M]`` int64 in ``[0, V)``.
        out: ``[M, V]`` bf16, contiguous: written; or None: nothing is stored (the two passes' statistics pass,
            which needs the partials alone).
        sum_exp, max_log2: fp32 ``[M, V // tile_n]``, contiguous: written.  label_logit: fp32 ``[M]``: written.
        tile_n: the matmul's column tile, which divides ``V`` (:func:`.quack_bridge.scaled_exp_tile_n`).
        sum_ez: fp32 ``[M, V // tile_n]``, contiguous, or None: written with each tile's fp32 Σ of the stored values
            times their logits (:func:`scaled_exp_entropy_epi`).
        scale: the logits are ``z = (hidden @ weight.T)·scale`` (a logit scale over a sampling temperature; 1: QuACK's
            own epilogue, :func:`scaled_exp_logit_scale_epi` otherwise), everything above of those.
    """
    epi_args = dict(max_log2=tile_n, sum_exp=sum_exp, max_log2_out=max_log2, target=labels,
                    target_logit=label_logit)
    if sum_ez is not None:
        epi_args["sum_ez"] = sum_ez
    if scale == 1.0:
        epilogue = scaled_exp_epi if sum_ez is None else scaled_exp_entropy_epi
    else:
        epilogue = scaled_exp_logit_scale_epi if sum_ez is None else scaled_exp_logit_scale_entropy_epi
        epi_args["scale"] = float(scale)
    epilogue.gemm(
        hidden, weight, out, epi_args=epi_args,
        # QuACK's own launch of this epilogue (quack/linear_cross_entropy.py, 0.6.4): ping-pong hides the two-phase
        # epilogue up to 208 columns
        tile_M=128, tile_N=tile_n, cluster_M=2, cluster_N=1, pingpong=tile_n <= 208,
    )


def matmul_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> None:
    """``out = a @ b``, or with ``accumulate`` ``out += a @ b``, in fp32 from bf16 operands: QuACK's fp32-output
    weight-gradient matmul (``quack.epilogue.library.identity_epi``), launched as QuACK's linear cross-entropy
    launches its ``dW`` (quack/linear_cross_entropy.py, 0.6.4); ``accumulate`` adds through the TMA reduce-add store,
    so the multiprocessors never read ``out`` (half the accumulation's traffic of a matmul with ``C = out``).

    Args:
        a: ``[M, K]`` bf16, row- or column-major (a transposed view: ``dzᵀ``).
        b: ``[K, N]`` bf16, row-major, ``N`` a multiple of 8.
        out: ``[M, N]`` fp32, contiguous: written, or added to.
    """
    identity_epi.gemm(a, b.mT, out, epi_args={}, add_to_output=accumulate, tile_K=64, **matmul_f32_config(*b.shape))


def matmul_f32_config(k: int, n: int) -> dict:
    """:func:`matmul_f32`'s tiles for ``K`` and ``N``: QuACK's linear cross-entropy's (cooperative ``128 × 256``, or
    ``× 192`` where it divides ``N``), but for a ``K`` of at most :data:`PINGPONG_MAX_K` (the one pass's ``dW`` over
    one tile of rows) the ping-pong kernel, whose epilogue (the fp32 reduce-add store) runs while the other
    warpgroup multiplies: at ``K`` 1966, ``[75968, 2048]`` 0.833 ms against 0.934 cooperative (``192 × 128``), at ``K``
    2048, ``[64128, 4096]`` 1.543 against 1.566 (``128 × 128``), the same sums (docs/performance.md, H200,
    2026-11-30)."""
    if k <= PINGPONG_MAX_K:
        return dict(tile_M=192 if n <= 2048 else 128, tile_N=128, cluster_M=1, cluster_N=2, pingpong=True)
    return dict(tile_M=128, tile_N=192 if n % 192 == 0 else 256, cluster_M=1, cluster_N=2)


def _binade(x):
    """``2^(E − 127)`` for ``x``'s biased exponent ``E`` clamped to [1, 254], fp32: the binade of ``x`` (zero and
    subnormals: ``2⁻¹²⁶``; ±inf and NaN: ``2¹²⁷``), as :func:`.compensated.decode_residual` clamps it."""
    b = _bits_f32(_f32_bits(x) & 0x7F800000)
    return cute.arch.fmin(cute.arch.fmax(b, Float32(2.0**-126)), Float32(2.0**127))


#: The residual's step over hi's binade, ``ulp/254 = 2⁻⁷/254`` of it, rounded to fp32 as the Triton fold's constant.
_DECODE_STEP = 2.0**-7 / 254
#: ``2²³ + 128``: an fp32 ``x + _BYTE_BIAS`` for an integer-valued ``|x| < 128`` is ``2²³ + (x + 128)`` exactly, its
#: low byte ``x + 128`` in the bits (fp32's spacing there is 1), and for a real ``x`` it rounds to an integer, ties to
#: even (``2²³ + 128`` is even).
_BYTE_BIAS = 2.0**23 + 128


@gemm_epilogue(ops={"lo": TileLoad("lo")}, outputs=("lo_out",))
def pair_fold_epi(acc, c, lo):
    """The fold of :func:`.compensated._fold` on the fp32 product ``acc``: ``t = (hi + lo·ulp(hi)/254) + acc``,
    ``hi ← bf16(t)`` (D, round to nearest even), the residual ``rint((t − hi)·254/ulp(hi))`` (ties to even, clamped
    to ±127) into ``lo_out``, 0 where ``hi`` is ±inf or NaN; ``254/ulp(hi) = 16256·2^(128 − E)`` from ``hi``'s binade
    bits (``2^(128 − E)`` has biased exponent ``255 − E``). The residual travels as its two's-complement byte
    (QuACK's tile loads and stores take ``uint8``): read as ``u`` in [0, 255] (or ``s`` in [−128, 127], which the
    same arithmetic takes), it is ``((u + 128) mod 256) − 128``; written, ``q mod 256``. Both through the low byte of
    ``x + 2²³ + 128`` (:data:`_BYTE_BIAS`), integer bit operations instead of the conversion units' rounding
    instructions."""
    q = _bits_f32((_f32_bits(lo + Float32(_BYTE_BIAS)) & 0xFF) | 0x4B000000) - Float32(_BYTE_BIAS)
    t = (c + (q * Float32(_DECODE_STEP)) * _binade(c)) + acc
    hi = Float32(cutlass.BFloat16(t))
    scale = _bits_f32(0x7F800000 - _f32_bits(_binade(hi)))
    y = (t - hi) * scale * Float32(16256.0) + Float32(_BYTE_BIAS)  # 2²³ + 128 + rint(·), the product exact
    y = cute.arch.fmin(cute.arch.fmax(y, Float32(_BYTE_BIAS - 127)), Float32(_BYTE_BIAS + 127))  # NaN: −127 here
    special = (_f32_bits(hi) & 0x7F800000) == 0x7F800000  # hi ±inf or NaN: the residual 0
    y = Float32(cutlass.select_(special, Float32(_BYTE_BIAS), y))
    return {"D": hi, "lo_out": _bits_f32(_f32_bits(y) ^ 0x80) - Float32(2.0**23)}  # low byte (q + 128) ^ 0x80


def pair_addmm(a: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``hi + lo·ulp(hi)/254 += a @ b`` in place (:func:`.compensated.compensated_addmm_`'s contract), the fold in
    the epilogue of QuACK's matmul (tiles: :func:`pair_fold_config`): ``hi`` is the matmul's C and its D,
    ``lo`` read and rewritten through its bytes as ``uint8``. Each output tile is read and written by one CTA, each
    sub-tile read before it is written, so C and D may be one tensor.

    Args:
        a: ``[M, K]`` bf16, row- or column-major.  b: ``[K, N]`` bf16, row-major, ``N`` a multiple of 8.
        hi: ``[M, N]`` bf16, contiguous.  lo: ``[M, N]`` int8, contiguous.
    """
    lo_bytes = lo.view(torch.uint8)
    pair_fold_epi.gemm(a, b.mT, hi, hi, epi_args={"lo": lo_bytes, "lo_out": lo_bytes}, tile_K=64,
                       **pair_fold_config(*b.shape))


def pair_fold_config(k: int, n: int) -> dict:
    """:func:`pair_addmm`'s tiles for ``K`` and ``N``: for a ``K`` of at most :data:`PAIR_PINGPONG_MAX_K` (the one
    pass's ``dW`` over one tile of rows, the two passes' ``dh`` over a narrow chunk) the ping-pong kernel on
    ``128 × 128`` tiles, whose epilogue (the fold's reads and writes of the pair) runs while the other warpgroup
    multiplies, else the cooperative ``128 × 256``. On an H200 (docs/performance.md, 2026-11-30), ms: at ``K`` 2048,
    ``[151936, 2048]`` 2.12–2.23 against 4.41 on :func:`matmul_f32`'s ``192 × 128``; ``[14732, 4096]`` at ``K`` 2944
    0.550 against 0.653, at 1664 0.383 against 0.464; at ``K`` 10112, ``[4204, 2048]`` 0.272 against 0.256."""
    if k <= PAIR_PINGPONG_MAX_K:
        return dict(tile_M=128, tile_N=128, cluster_M=1, cluster_N=2, pingpong=True)
    return dict(tile_M=128, tile_N=256, cluster_M=1, cluster_N=2)


#: The longest reduction for which :func:`pair_fold_config` takes the ping-pong kernel (measured at 1664–2944 and
#: 10112, where the cooperative one is as fast or faster).
PAIR_PINGPONG_MAX_K = 4096

#: The longest reduction for which :func:`matmul_f32` takes the ping-pong kernel (measured up to 2048; a longer
#: ``K`` spends relatively less in the epilogue that it hides).
PINGPONG_MAX_K = 2048
