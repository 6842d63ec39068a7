"""Whether and how a call runs QuACK's epilogues (:mod:`.quack_epilogues`), the optional kernels of the GPU backend.

QuACK (``quack-kernels``) is imported only where it is installed and a call can use it: bf16 operands on a GPU of
compute capability 9.x, contiguous, with rows of 16-byte multiples; the one pass's statistics only for the plain
log-sum-exp (:func:`fuses_statistics`), the gradient pass's ``dz`` only where the gradient reaches the log-probs
alone (:func:`fuses_softmax_grad`). A tile whose operands are not 16-byte aligned runs without it; a QuACK that
cannot be imported or run is turned off for the process with one warning, and the caller does the work itself.
"""

from __future__ import annotations

import importlib.util
import warnings
from types import ModuleType
from typing import Optional, Sequence

import torch

from ...head_inputs import HeadInputs

# The module once imported, or None once found missing or broken (then for the whole process, the error that
# turned it off in _QUACK_ERROR).
_QUACK: dict[str, Optional[ModuleType]] = {}
_QUACK_ERROR: dict[str, str] = {}


def load() -> Optional[ModuleType]:
    """:mod:`.quack_epilogues`, or ``None`` where QuACK is not installed or could not be imported (said once)."""
    if "module" not in _QUACK:
        module = None
        if importlib.util.find_spec("quack") is not None:
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
                  "cuBLAS and its own Triton kernels instead (same results, slower). Measured with quack-kernels "
                  "0.6.4 and nvidia-cutlass-dsl 4.6.2.", stacklevel=3)


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
                 scale: torch.Tensor, out: torch.Tensor, label_logit: torch.Tensor) -> bool:
    """:func:`.quack_epilogues.softmax_grad` into ``out`` and ``label_logit`` (``out`` contiguous); ``False``: it
    did not run (the caller writes the tile itself)."""
    return out.is_contiguous() and _run(
        lambda q: q.softmax_grad(h, weight, labels, lse, scale, out, label_logit),
        h, weight, labels, lse, scale, out, label_logit)


def aligned16(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary, as QuACK's TMA needs (QuACK raises otherwise): a slice of a
    per-row vector at a row that is not a multiple of 4 does not, nor may a parameter gathered into a flat buffer
    (DeepSpeed ZeRO-3)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def runs_on(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether QuACK's SM90 GEMM can take these operands: bf16 on a GPU of compute capability 9.x, contiguous,
    rows of 16-byte multiples (its TMA loads)."""
    return (h.is_cuda and h.dtype == weight.dtype == torch.bfloat16 and h.is_contiguous() and weight.is_contiguous()
            and h.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0 and torch.cuda.get_device_capability(h.device)[0] == 9)


def fuses_statistics(head: HeadInputs, h: torch.Tensor, return_entropy: bool, statistics: Sequence[str]) -> bool:
    """Whether the one pass's logits matmul can take its statistics from QuACK's epilogue for this call: only the
    log-sum-exp and label logit asked of it (no entropy, no token statistics) of raw logits (no bias, soft-cap,
    temperature or logit scale), on operands it :func:`runs_on` (the kept rows ``h`` and the weight)."""
    asks_lse_only = not return_entropy and not statistics and head.bias is None and head.transform.is_identity
    return asks_lse_only and runs_on(h, head.weight)


def fuses_softmax_grad(head: HeadInputs, h: torch.Tensor, weight: torch.Tensor, has_g_lp: bool,
                       has_g_ent: bool) -> bool:
    """Whether the gradient pass can take each ``dz`` tile from QuACK's epilogue: the gradient reaches the
    log-probs alone (no entropy gradient), no bias or logit transform, operands it :func:`runs_on`, QuACK
    loaded."""
    return (has_g_lp and not has_g_ent and head.bias is None and head.transform.is_identity and runs_on(h, weight)
            and load() is not None)
