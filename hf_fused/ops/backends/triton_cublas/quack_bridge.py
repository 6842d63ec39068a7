"""Whether and how a call runs QuACK's epilogues (:mod:`.quack_epilogues`), the optional kernels of the GPU backend.

QuACK (``quack-kernels``) is imported only where it is installed and a call can use it: bf16 operands on a GPU of
compute capability 9.x, contiguous, with rows of 16-byte multiples; the one pass's statistics only for the plain
log-sum-exp (:func:`fuses_statistics`), the gradient pass's ``dz`` only where the gradient reaches the log-probs
alone (:func:`fuses_softmax_grad`); the one pass's fp32-faithful tile and the two passes' statistics where the
vocabulary splits into QuACK's column tiles, the logits are a multiple of the matmul's (a logit scale or temperature:
:func:`logits_scale`) and the fp32 statistics are asked for (:func:`scaled_exp_tile_n`); the fp32 accumulations of
bf16 products (:func:`matmul_f32_`) and the compensated pair's folds (:func:`pair_addmm_`). A tile whose operands
are not 16-byte aligned runs without it; a QuACK that cannot be imported or run is turned off for the process with
one warning, and the caller does the work itself; ``HF_FUSED_QUACK=0`` keeps it off where it is installed
(:data:`ENV`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from types import ModuleType
from typing import Optional, Sequence

import torch

from ...devices import capability
from ...head_inputs import HeadInputs
from . import fp32_logits_rule
from .compensated import PAIR_DTYPE, RESIDUAL_DTYPE, compensated_addmm_
from .matmul import GemmConfig, addmm_f32_, mm_f32_, tma_operand

#: The scaled-exp matmul's column tiles (the granularity of its power-of-two shifts), in QuACK's own order of
#: preference (``_pick_tile_n1`` in quack/linear_cross_entropy.py, 0.6.4: 192 measured best at Llama's vocabulary).
SCALED_EXP_TILES = (192, 256, 128, 64)

# The module once imported, or None once found missing or broken (then for the whole process, the error that
# turned it off in _QUACK_ERROR).
_QUACK: dict[str, Optional[ModuleType]] = {}
_QUACK_ERROR: dict[str, str] = {}


#: The environment variable that keeps QuACK off for the process where it is installed (``0``); unset or ``1``: used
#: where it runs. Read where a call first asks for QuACK.
ENV = "HF_FUSED_QUACK"


def installed() -> bool:
    """Whether QuACK is installed and not turned off by :data:`ENV` (no import).

    Raises:
        ValueError: for a value of :data:`ENV` other than ``0`` or ``1``.
    """
    value = os.environ.get(ENV) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1 (QuACK's kernels off or on where installed), got {value!r}")
    return value == "1" and importlib.util.find_spec("quack") is not None


def load() -> Optional[ModuleType]:
    """:mod:`.quack_epilogues`, or ``None`` where QuACK is not :func:`installed` or could not be imported (said
    once)."""
    if "module" not in _QUACK:
        module = None
        if installed():
            try:
                from . import quack_epilogues as module
            except Exception as err:  # noqa: BLE001 - any QuACK / CuTe DSL version that cannot build it
                _failed(err)
        _QUACK["module"] = module
    return _QUACK["module"]


def last_error() -> Optional[str]:
    """Why QuACK was turned off in this process (``None`` while it is not): for a test or a bug report."""
    return _QUACK_ERROR.get("error")


def _failed(err: BaseException) -> None:
    _QUACK["module"] = None
    _QUACK_ERROR["error"] = f"{type(err).__name__}: {err}"
    warnings.warn(f"hf_fused: QuACK's fused epilogues are unavailable ({type(err).__name__}: {err}); hf_fused uses "
                  "cuBLAS and its own Triton kernels instead. Measured with quack-kernels 0.6.4 and nvidia-cutlass-dsl "
                  "4.6.2.", stacklevel=3)


def _run(launch, *operands: torch.Tensor) -> bool:
    """``launch(quack_epilogues)``, where QuACK is available and every operand starts 16-byte aligned (its TMA
    raises otherwise); ``False`` where it is not, or where the launch raises (then turned off for the process, said
    once), so that the caller does the work itself."""
    module = load()
    if module is None or not aligned16(*operands):
        return False
    try:
        launch(module)
    except Exception as err:  # noqa: BLE001 - turned off for the process, said once
        _failed(err)
        return False
    return True


def logits_with_statistics(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, label_logit: torch.Tensor) -> bool:
    """:func:`.quack_epilogues.logits_with_statistics` into ``out``, ``lse`` and ``label_logit``; ``False``: it did
    not run (the caller computes them itself)."""
    return _run(lambda q: q.logits_with_statistics(h, weight, labels, out, lse=lse, label_logit=label_logit),
                h, weight, labels, out, label_logit)


def softmax_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 scale: torch.Tensor, out: torch.Tensor, label_logit: torch.Tensor, *,
                 round_logits: bool = True, logit_scale: float = 1.0) -> bool:
    """:func:`.quack_epilogues.softmax_grad` into ``out`` and ``label_logit`` (``out`` contiguous; ``logit_scale``:
    :func:`logits_scale`, with ``round_logits=False`` only); ``False``: it did not run (the caller writes the tile
    itself)."""
    return out.is_contiguous() and _run(
        lambda q: q.softmax_grad(h, weight, labels, lse, scale, out, label_logit, round_logits=round_logits,
                                 logit_scale=logit_scale),
        h, weight, labels, lse, scale, out, label_logit)


def scaled_exp_logits(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: Optional[torch.Tensor],
                      sum_exp: torch.Tensor, max_log2: torch.Tensor, label_logit: torch.Tensor, tile_n: int,
                      sum_ez: Optional[torch.Tensor] = None, scale: float = 1.0) -> bool:
    """:func:`.quack_epilogues.scaled_exp_logits` into ``out``, ``sum_exp``, ``max_log2``, ``label_logit`` (and
    ``sum_ez`` where given); ``False``: it did not run (the caller computes the tile and its statistics itself)."""
    extra = {} if sum_ez is None else {"sum_ez": sum_ez}
    return _run(lambda q: q.scaled_exp_logits(h, weight, labels, out, sum_exp=sum_exp, max_log2=max_log2,
                                              label_logit=label_logit, tile_n=tile_n, scale=scale, **extra),
                h, weight, labels, *([] if out is None else [out]), sum_exp, max_log2, label_logit,
                *extra.values())


def scaled_exp_statistics_(sum_exp: torch.Tensor, max_log2: torch.Tensor, lse: torch.Tensor,
                           offsets: Optional[torch.Tensor] = None, sum_ez: Optional[torch.Tensor] = None,
                           sum_pz: Optional[torch.Tensor] = None) -> None:
    """From :func:`scaled_exp_logits`' per-tile partials (fp32 ``[rows, T]``: Σ of ``E = 2^(z·log2 e − k)`` and
    ``k``): each row's log-sum-exp ``k_r·ln 2 + log Σ_t sum_exp[t]·2^(k_t − k_r)`` (``k_r`` the row's largest ``k``,
    so no term overflows) into ``lse [rows]``; where given, each tile's shift in nats, ``k·ln 2``, into ``offsets
    [rows, T]`` (the stored value is ``exp(z − offset)``, :func:`~.shifted_tile.shifted_gradient_`'s ``log_tile``);
    with ``sum_ez`` (Σ E·z per tile), each row's ``Σ p·z = Σ_t sum_ez[t]·2^(k_t − k_r) / Σ_t sum_exp[t]·2^(k_t −
    k_r)`` into ``sum_pz [rows]`` (the entropy is ``lse − Σ p·z``). The partials are scaled in place (no buffer of
    their size beside them)."""
    if offsets is not None:
        torch.mul(max_log2, math.log(2.0), out=offsets)
    k_r = max_log2.amax(dim=1, keepdim=True)
    scale = torch.exp2(max_log2.sub_(k_r))
    total = sum_exp.mul_(scale).sum(dim=1)
    torch.add(total.log(), k_r[:, 0], alpha=math.log(2.0), out=lse)
    if sum_ez is not None:
        torch.div(sum_ez.mul_(scale).sum(dim=1), total, out=sum_pz)


#: Whether the fp32 accumulations of bf16 products (:func:`matmul_f32_`) take QuACK's matmul where it runs.
MATMUL_F32 = True


def matmul_f32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) into an fp32 ``out`` from bf16 operands: QuACK's
    :func:`.quack_epilogues.matmul_f32` where it runs (the same fp32 sums as cuBLAS's up to their order; the
    accumulation through TMA reduce-add stores), else cuBLAS (:func:`~.matmul.addmm_f32_`,
    :func:`~.matmul.mm_f32_`)."""
    if not (MATMUL_F32 and runs_matmul_f32(out, a, b)
            and _run(lambda q: q.matmul_f32(a, b, out, accumulate=accumulate), a, b, out)):
        (addmm_f32_ if accumulate else mm_f32_)(out, a, b)


def runs_matmul_f32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether QuACK's fp32-output matmul can take ``out [M, N] += a [M, K] @ b [K, N]``: bf16 operands on a GPU of
    compute capability 9.x that its TMA can read (``a`` row- or column-major, ``b`` row-major with ``N`` a multiple
    of 8), an fp32 contiguous ``out``."""
    return out.dtype == torch.float32 and out.is_contiguous() and _reads_product(a, b)


def _reads_product(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 ``a [M, K]`` and ``b [K, N]`` on a GPU of compute capability 9.x that QuACK's TMA reads: ``a`` row- or
    column-major, ``b`` row-major with ``N`` a multiple of 8."""
    return (a.dtype == b.dtype == torch.bfloat16 and a.is_cuda and b.shape[1] % 8 == 0 and b.stride(1) == 1
            and tma_operand(a) is None and tma_operand(b) is None and capability(a.device)[0] == 9)


#: Whether the compensated pair's fold (:func:`pair_addmm_`) takes QuACK's matmul where it runs.
PAIR_FOLD = True


def pair_addmm_(hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                config: Optional[GemmConfig] = None) -> None:
    """``hi + lo·ulp(hi)/254 += a @ b`` (:func:`~.compensated.compensated_addmm_`'s pair, no gathered rows): QuACK's
    matmul with the fold in its epilogue (:func:`.quack_epilogues.pair_addmm`) where :func:`runs_pair_fold`, else the
    Triton fold (:func:`~.compensated.compensated_addmm_` with ``config``)."""
    if not (PAIR_FOLD and runs_pair_fold(hi, lo, a, b)
            and _run(lambda q: q.pair_addmm(a, b, hi, lo), a, b, hi, lo)):
        compensated_addmm_(hi, lo, a, b, config=config)


def folds_pairs(device: torch.device) -> bool:
    """Whether :func:`pair_addmm_` can take the folds of a pair on ``device`` (for operands QuACK's TMA reads): the
    switch on, a GPU of compute capability 9.x, QuACK loaded."""
    return PAIR_FOLD and device.type == "cuda" and capability(device)[0] == 9 and load() is not None


def runs_pair_fold(hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether QuACK's matmul can fold ``a @ b`` into the pair: what :func:`runs_matmul_f32` asks of the operands,
    with a contiguous bf16 ``hi`` and int8 ``lo`` of the product's shape."""
    shape = (a.shape[0], b.shape[1])
    return (hi.dtype == PAIR_DTYPE and lo.dtype == RESIDUAL_DTYPE and hi.is_contiguous() and lo.is_contiguous()
            and tuple(hi.shape) == tuple(lo.shape) == shape and _reads_product(a, b))


def scaled_exp_row_stats_(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, stats: tuple,
                          tile_n: int, return_entropy: bool, scale: float = 1.0) -> bool:
    """The two passes' statistics of whole vocabulary rows from QuACK's scaled-exp matmul with nothing stored
    (:func:`scaled_exp_logits` with ``out=None``), folded by :func:`scaled_exp_statistics_` as the one pass folds
    its tiles': into ``stats`` (:data:`~.tiles.RowStats` of ``h``'s rows) the log-sum-exp as (running max, Σexp) =
    (lse, 1), Σ p·z (with ``return_entropy``) and the label logit, which :func:`~.tiles.finish_row_stats` reads;
    ``scale``: :func:`logits_scale`. ``False``: it did not run, ``stats`` untouched (the caller computes them
    itself)."""
    rows, n_tiles = h.shape[0], weight.shape[0] // tile_n
    f32 = dict(dtype=torch.float32, device=h.device)
    sum_exp, max_log2 = torch.empty((rows, n_tiles), **f32), torch.empty((rows, n_tiles), **f32)
    sum_ez = torch.empty((rows, n_tiles), **f32) if return_entropy else None
    label_logit = torch.empty(rows, **f32)
    if not scaled_exp_logits(h, weight, labels, None, sum_exp, max_log2, label_logit, tile_n, sum_ez, scale):
        return False
    run_max, run_sum, run_zp, stats_label = stats[:4]
    scaled_exp_statistics_(sum_exp, max_log2, run_max, None, sum_ez, run_zp)
    run_sum.fill_(1.0)
    stats_label.copy_(label_logit)
    return True


def statistics_row_bytes(vocab_size: int, tile_n: int, return_entropy: bool) -> int:
    """What :func:`scaled_exp_row_stats_` holds per row: its per-tile partials (Σ E, ``k``, and Σ E·z with the
    entropy), their scale and the row's total, fp32."""
    return 4 * (vocab_size // tile_n) * (3 + return_entropy) + 4


def tile_n_for(vocab_size: int) -> Optional[int]:
    """The first of :data:`SCALED_EXP_TILES` that divides ``vocab_size`` (the shifts are per whole tile), or None."""
    return next((n for n in SCALED_EXP_TILES if vocab_size % n == 0), None)


def scaled_exp_tile_n(head: HeadInputs, h: torch.Tensor, statistics: Sequence[str],
                      schedule: str = "one_pass_quack") -> Optional[int]:
    """The column tile with which a call takes its fp32-faithful statistics (the log-sum-exp, label logit and
    entropy) from QuACK's scaled-exp matmul (:func:`.quack_epilogues.scaled_exp_logits`): in the one pass with its
    logits tile (``schedule`` ``"one_pass_quack"``), in the two passes' statistics pass with nothing stored
    (``"two_passes_quack"``, :func:`scaled_exp_row_stats_`); or None. It takes them where no token statistics are
    asked of it, the logits are a multiple of the matmul's (:func:`logits_scale`: raw, a logit scale, a temperature),
    it :func:`runs_on` the operands (``h``: the rows as the pass reads them), ``schedule`` asks for it
    (:func:`~.fp32_logits_rule.enabled`: on by default on CUDA, off with ``HF_FUSED_FP32_LOGITS=0``), the vocabulary
    splits into whole column tiles (:func:`tile_n_for`) and QuACK loads."""
    if statistics or logits_scale(head) is None or not runs_on(h, head.weight):
        return None
    if not fp32_logits_rule.enabled(schedule, h.device):
        return None
    tile_n = tile_n_for(head.weight.shape[0])
    return tile_n if tile_n is not None and load() is not None else None


def scaled_exp_row_bytes(head: HeadInputs) -> int:
    """What :func:`scaled_exp_tile_n`'s path holds per tile row beside the tile (its per-tile sums, Σ E·z, maxima
    and shifts, fp32): 0 where it cannot run (a bias or soft-cap, QuACK not installed, not a bf16 weight of a
    compute-capability-9 GPU as the matmuls read it, no column tile divides the vocabulary). No import of QuACK."""
    weight = head.weight
    tile_n = tile_n_for(weight.shape[0])
    if (tile_n is None or logits_scale(head) is None or not weight.is_cuda
            or head.operand_dtype != torch.bfloat16 or capability(weight.device)[0] != 9
            or not installed()):
        return 0
    return 4 * 4 * (weight.shape[0] // tile_n)


def logits_scale(head: HeadInputs) -> Optional[float]:
    """``s`` where the call's logits are the matmul's times ``s`` (no bias, no soft-cap): ``logit_scale /
    temperature``, what the scaled-exp epilogues multiply the accumulator by; None otherwise."""
    transform = head.transform
    if head.bias is not None or transform.softcap is not None:
        return None
    return float(transform.logit_scale) / float(transform.temperature)


def raw_logits(head: HeadInputs) -> bool:
    """Whether the call's logits are the matmul's own (no bias, soft-cap, temperature or logit scale): what the
    QuACK epilogues of the bf16 logits compute on."""
    return head.bias is None and head.transform.is_identity


def aligned16(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary, as QuACK's TMA needs (QuACK raises otherwise): a slice of a
    per-row vector at a row that is not a multiple of 4 does not, nor may a parameter gathered into a flat buffer
    (DeepSpeed ZeRO-3)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def runs_on(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether QuACK's SM90 GEMM can take these operands: bf16 on a GPU of compute capability 9.x, contiguous,
    rows of 16-byte multiples (its TMA loads)."""
    return (h.is_cuda and h.dtype == weight.dtype == torch.bfloat16 and h.is_contiguous() and weight.is_contiguous()
            and h.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0 and capability(h.device)[0] == 9)


def fuses_statistics(head: HeadInputs, h: torch.Tensor, return_entropy: bool, statistics: Sequence[str]) -> bool:
    """Whether the one pass's logits matmul can take its statistics from QuACK's epilogue for this call: only the
    log-sum-exp and label logit asked of it (no entropy, no token statistics) of raw logits (no bias, soft-cap,
    temperature or logit scale), on operands it :func:`runs_on` (the kept rows ``h`` and the weight)."""
    asks_lse_only = not return_entropy and not statistics and raw_logits(head)
    return asks_lse_only and runs_on(h, head.weight)


def fuses_softmax_grad(head: HeadInputs, h: torch.Tensor, weight: torch.Tensor, has_g_lp: bool,
                       has_g_ent: bool, from_accumulator: bool = False) -> bool:
    """Whether the gradient pass can take each ``dz`` tile from QuACK's epilogue: the gradient reaches the
    log-probs alone (no entropy gradient), operands it :func:`runs_on`, QuACK loaded, and raw logits (no bias or
    logit transform); ``from_accumulator`` (``dz`` of the fp32 accumulator, after statistics taken from it): where
    asked for (``"two_passes_quack"``, :func:`~.fp32_logits_rule.enabled`), also logits that are the matmul's times a
    constant (:func:`logits_scale`: a logit scale, a temperature)."""
    if from_accumulator and not fp32_logits_rule.enabled("two_passes_quack", h.device):
        return False
    logits_ok = raw_logits(head) or (from_accumulator and logits_scale(head) is not None)
    return has_g_lp and not has_g_ent and logits_ok and runs_on(h, weight) and load() is not None
