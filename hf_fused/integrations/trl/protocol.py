"""TRL 1.16's fused-head protocol as hf_fused serves it: the options a trainer gives ``add_fused_lm_head``, the
fields of ``FusedCausalLMOutput``, and how both are recognised (or refused) on an installed TRL."""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Optional

#: ``add_fused_lm_head``'s parameters and ``FusedCausalLMOutput``'s fields in TRL 1.16: the protocol served here.
ADD_HEAD_PARAMETERS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask", "aux_loss")
#: ``FusedCausalLMOutput``'s gradient-free per-token statistics: computed by ``linear_logprobs(statistics=...)``
#: under the same names.
STATISTICS_FIELDS = ("mean_logits", "is_top1", "log_sum_sq_probs")
#: Names TRL's installed ``_fused_forward`` closes over that hold its options.
CLOSURE_OPTIONS = ("temperature", "cast_lm_head_to_fp32", "outputs")
#: Where hf_fused keeps a patched model's TRL head options.
OPTIONS_ATTR = "_hf_fused_trl_head"


@dataclass(frozen=True)
class TrlHeadOptions:
    """The arguments a TRL trainer gave ``add_fused_lm_head`` for one model."""

    temperature: float = 1.0
    cast_lm_head_to_fp32: bool = False
    outputs: tuple = ("log_probs",)


class TrlProtocolError(RuntimeError):
    """TRL's fused-head protocol is not the one hf_fused serves (a TRL version it does not know)."""


def protocol_mismatch(trl_utils) -> Optional[str]:
    params = tuple(inspect.signature(trl_utils.add_fused_lm_head).parameters)
    if params != ADD_HEAD_PARAMETERS:
        return f"trl.trainer.utils.add_fused_lm_head takes {params}, expected {ADD_HEAD_PARAMETERS}"
    output_cls = getattr(trl_utils, "FusedCausalLMOutput", None)
    fields = tuple(f.name for f in dataclasses.fields(output_cls)) if output_cls is not None else None
    if fields != OUTPUT_FIELDS:
        return f"trl.trainer.utils.FusedCausalLMOutput has fields {fields}, expected {OUTPUT_FIELDS}"
    return None


def trl_head_options_in(forward: Any) -> Optional[TrlHeadOptions]:
    """The options of TRL's ``_fused_forward`` found in ``forward`` or the wrappers around it (a bound method's
    ``__func__``, ``functools.wraps``' ``__wrapped__``, accelerate's ``ConvertOutputsToFp32.model_forward``).

    Raises:
        TrlProtocolError: a function named ``_fused_forward`` from TRL that does not close over TRL 1.16's options.
    """
    seen = set()
    current = forward
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        func = getattr(current, "__func__", current)
        code = getattr(func, "__code__", None)
        # functools.wraps gave it the model's __module__ and __qualname__: its code object says where it is from.
        if code is not None and code.co_name == "_fused_forward" and _is_trl_file(code.co_filename):
            cells = dict(zip(code.co_freevars, func.__closure__ or ()))
            if not all(name in cells for name in CLOSURE_OPTIONS + ("original_forward",)):
                raise TrlProtocolError(
                    f"TRL's fused head (_fused_forward in {code.co_filename}) closes over {code.co_freevars}, not over "
                    f"{CLOSURE_OPTIONS}: hf_fused cannot read its options. hf_fused serves TRL 1.16's fused head."
                )
            values = {name: cells[name].cell_contents for name in CLOSURE_OPTIONS}
            return TrlHeadOptions(float(values["temperature"]), bool(values["cast_lm_head_to_fp32"]),
                                  tuple(values["outputs"]))
        nxt = getattr(func, "__wrapped__", None)
        if nxt is None:
            nxt = getattr(current, "model_forward", None)  # accelerate's ConvertOutputsToFp32
        current = nxt
    return None


def _is_trl_file(filename: str) -> bool:
    return f"{os.sep}trl{os.sep}" in filename
