"""TRL's ``GKDTrainer`` (``trl.experimental.gkd``) on hf_fused: its generalized JSD computed from hidden states.

TRL 1.16's ``GKDTrainer.compute_loss`` calls the student and the teacher without labels, so both build their full
``[B, T, V]`` logits, and computes ``generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1],
labels[:, 1:], beta=self.beta, num_items_in_batch=...)`` (temperature 1, ``"batchmean"``). The same divergences
as ``DistillationTrainer``'s (β = 0 forward KL, β = 1 reverse KL, otherwise the generalized JSD), so the entry
:data:`TRL_GKD` of the inventory wraps ``compute_loss``: for a patched student it computes that loss with
:func:`hf_fused.ops.linear_distillation_loss` (:func:`fused_gkd_loss`), with the same value and gradients and no
``[N, V]`` tensor of either model:

* the teacher runs its forward with its lm_head call answered by an empty tensor (its hidden states kept, its logits
  never built; the teacher itself is not patched; its logit transform is measured once on its forward, as
  :func:`hf_fused.apply_fused_loss` measures it, or is a patched teacher's);
* the student is called through its wrappers (DDP, DeepSpeed, PEFT) with :data:`CALL_KEYWORD`, which the extension
  registered in :mod:`hf_fused.integrations` answers: the divergence is computed inside the student's lm_head call,
  where engines have its parameters whole, exactly as its fused loss is.

Under FSDP, TRL 1.16 leaves the teacher unprepared (on the CPU of a GPU rank: huggingface/trl#2580); for a patched
student the entry's ``__init__`` wrapper prepares it with TRL's ``prepare_fsdp``, as trl#6573 proposes
(:mod:`.teacher_fsdp`). Its lm_head, sharded once its forward has returned (an FSDP2 DTensor, a piece of FSDP1's flat
parameter), is gathered once per call; under FSDP1 its logit transform is measured through the wrapper's call.

Where its options do not allow it, ``compute_loss`` is TRL's (full logits) and a one-time
:class:`~hf_fused.model.FusedLossBypassedWarning` says why and what to do: a subclass with its own
``generalized_jsd_loss`` (a divergence hf_fused cannot know), ``return_outputs=True`` (the caller wants the student's
logits), a teacher hf_fused cannot read. Evaluation without gradients is not warned about.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...model import FusedLossVerificationError, find_causal_lm, head_tensors, is_fused
from ...model.distributed import partitioned_head_params
from ...model.forward import lm_head_answering
from ...model.lm_head import check_head_supported, is_fsdp1_unit
from ...model.transform_probe import measure_logit_transform
from ...ops import LogitTransform
from ..patching import ThirdPartyPatch
from .bypass import warn_full_logits_once
from .divergence import CALL_KEYWORD, DistillationCall, TeacherHead
from .teacher_fsdp import prepare_teacher_under_fsdp

#: TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` parameters and the defaults ``compute_loss`` relies on.
JSD_PARAMETERS = ("student_logits", "teacher_logits", "labels", "beta", "temperature", "reduction",
                  "num_items_in_batch")
JSD_DEFAULTS = {"temperature": 1.0, "reduction": "batchmean"}
#: The keywords of ``compute_loss``'s two calls in TRL 1.16 (the models', then ``generalized_jsd_loss``'s): what
#: :func:`fused_gkd_loss` reproduces (no temperature, no reduction passed).
COMPUTE_LOSS_CALLS = (("input_ids", "attention_mask"),
                      ("student_logits", "teacher_logits", "labels", "beta", "num_items_in_batch"))


def fused_gkd_loss(trainer, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
    """``GKDTrainer.compute_loss(model, inputs, num_items_in_batch=...)`` of TRL 1.16 for a patched student, from
    both models' hidden states: the generalized JSD (``trainer.beta``, temperature 1) between the student and
    ``trainer.teacher_model`` at every position whose next token is labelled (``inputs["labels"][:, 1:] != -100``),
    summed and divided by ``num_items_in_batch`` or, without it, by the number of those positions.

    Raises:
        TypeError, NotImplementedError: the teacher has no lm_head hf_fused can read.
    """
    teacher = trainer.teacher_model
    teacher.eval()
    with torch.no_grad():
        teacher_head = _teacher_head(teacher, inputs["input_ids"], inputs["attention_mask"])
    labels = F.pad(inputs["labels"][:, 1:], (0, 1), value=-100)  # position t predicts token t + 1; the last nothing
    call = DistillationCall(teacher_head, labels, float(trainer.beta), 1.0, num_items_in_batch)
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **{CALL_KEYWORD: call})
    return out.loss


# The measured logit transform of each teacher, or why it could not be read (keyed weakly: a teacher is never kept
# alive here).
_TRANSFORMS: "weakref.WeakKeyDictionary[nn.Module, Union[LogitTransform, Exception]]" = weakref.WeakKeyDictionary()


def _teacher_head(teacher: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TeacherHead:
    """The teacher's forward on the batch with its lm_head call answered by an empty tensor (no logits), as a
    :class:`TeacherHead`: the states its lm_head received and its lm_head read as hf_fused reads one."""
    causal_lm = find_causal_lm(teacher)
    lm_head = causal_lm.get_output_embeddings()
    transform = teacher_transform(causal_lm, teacher)
    seen = {}

    def answer(hidden):
        seen["hidden"] = hidden
        return hidden.new_empty(*hidden.shape[:-1], 0)

    with lm_head_answering(lm_head, answer):
        teacher(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if "hidden" not in seen:
        raise RuntimeError(f"the teacher's forward ({type(causal_lm).__name__}) did not call its lm_head")
    hidden = seen["hidden"]
    # ZeRO-3's partitioned head parameters, and an FSDP1 teacher's (teacher_fsdp.fsdp1_whole), gathered for the call
    params = tuple({id(p): p for p in (*partitioned_head_params(lm_head), *lm_head.parameters())}.values())
    return TeacherHead(tensors=lambda: head_tensors(lm_head, hidden), params=params,
                       logit_scale=transform.logit_scale, softcap=transform.softcap)


def teacher_transform(causal_lm: nn.Module, teacher: Optional[nn.Module] = None) -> LogitTransform:
    """The logit transform of the teacher's forward (``causal_lm``, inside ``teacher`` if given): a patched teacher's,
    or measured once (a short forward, as :func:`hf_fused.apply_fused_loss` measures it; collective under ZeRO-3 and
    FSDP, where every rank computes the loss; through FSDP1's wrapper, whose call unshards the parameters).

    Raises:
        NotImplementedError, FusedLossVerificationError: as :func:`hf_fused.apply_fused_loss` would for it.
    """
    state = causal_lm.__dict__.get("_hf_fused")
    if state is not None:
        return state.transform
    if causal_lm not in _TRANSFORMS:
        try:
            check_head_supported(causal_lm.get_output_embeddings())
            _TRANSFORMS[causal_lm] = measure_logit_transform(teacher if is_fsdp1_unit(teacher) else causal_lm)
        except (NotImplementedError, FusedLossVerificationError) as error:
            _TRANSFORMS[causal_lm] = error  # measured once, whatever the outcome
    found = _TRANSFORMS[causal_lm]
    if isinstance(found, Exception):
        raise found
    return found


# -- the inventory's entry ---------------------------------------------------------------------------------------


def gkd_shape_mismatch(trainer_cls: type) -> Optional[str]:
    """Why the installed TRL's ``GKDTrainer`` is not the one :func:`fused_gkd_loss` reproduces (``None`` when it is)."""
    jsd = inspect.signature(trainer_cls.generalized_jsd_loss)
    if tuple(jsd.parameters) != JSD_PARAMETERS:
        return f"GKDTrainer.generalized_jsd_loss takes {tuple(jsd.parameters)}, expected {JSD_PARAMETERS}"
    defaults = {name: jsd.parameters[name].default for name in JSD_DEFAULTS}
    if defaults != JSD_DEFAULTS:
        return f"GKDTrainer.generalized_jsd_loss defaults to {defaults}, expected {JSD_DEFAULTS}"
    code = trainer_cls.compute_loss.__code__
    calls = tuple(c for c in code.co_consts if isinstance(c, tuple) and all(isinstance(k, str) for k in c))
    if calls != COMPUTE_LOSS_CALLS or "generalized_jsd_loss" not in code.co_names:
        return (f"GKDTrainer.compute_loss makes calls with keywords {calls}, expected {COMPUTE_LOSS_CALLS} "
                "(TRL 1.16's)")
    return None


def _why_not_fused(trainer, original_jsd, return_outputs: bool) -> Optional[str]:
    """Why :func:`fused_gkd_loss` cannot answer this call (``None`` when it can). Measures the teacher's transform on
    its first call (a short forward on every rank)."""
    if return_outputs:
        return ("the caller asked for the student's outputs (return_outputs=True), which hold its logits; call "
                "compute_loss without return_outputs to train on hf_fused's loss")
    if type(trainer).generalized_jsd_loss is not original_jsd:
        return (f"{type(trainer).__qualname__} overrides generalized_jsd_loss, a divergence of the logits hf_fused "
                "cannot compute from hidden states; keep TRL's generalized_jsd_loss (beta selects forward KL, reverse "
                "KL or the JSD), use DistillationTrainer, or compute your loss in compute_loss with "
                "hf_fused.linear_distillation_loss from model(..., fused_output='hidden_states')")
    try:
        teacher = getattr(trainer, "teacher_model", None)
        teacher_transform(find_causal_lm(teacher), teacher)
    except (TypeError, NotImplementedError, FusedLossVerificationError) as error:
        return (f"hf_fused cannot read the teacher's head ({error}); a teacher whose lm_head is nn.Linear (or a "
                "PEFT LoRA layer around one) and whose forward only scales or soft-caps its output is computed from "
                "its hidden states")
    return None


def _install(module: types.ModuleType, patch: ThirdPartyPatch) -> None:
    """Wrap ``GKDTrainer.compute_loss`` (see the module docstring) and ``GKDTrainer.__init__`` (for a patched student,
    a teacher TRL left unprepared under FSDP is prepared, :mod:`.teacher_fsdp`); or, for a ``GKDTrainer`` of another
    shape, record why not and warn."""
    trainer_cls = module.GKDTrainer
    why = gkd_shape_mismatch(trainer_cls)
    if why is not None:
        patch.refuse(why, "GKDTrainer will compute its loss from the full logits, on patched models too. hf_fused "
                          "serves TRL 1.16's GKDTrainer.")
        return
    live = patch.liveness()
    original = trainer_cls.compute_loss
    original_jsd = trainer_cls.generalized_jsd_loss

    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (live() and isinstance(self, trainer_cls) and is_fused(model)):
            return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        why_not = _why_not_fused(self, original_jsd, return_outputs)
        if why_not is None:
            return fused_gkd_loss(self, model, inputs, num_items_in_batch)
        if model.training and torch.is_grad_enabled():
            warn_full_logits_once(model, "GKDTrainer.compute_loss computes its loss from the student's and the "
                                  "teacher's full [tokens, vocab] logits here, not from hidden states, because "
                                  f"{why_not}.")
        return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    compute_loss.__hf_fused__ = True
    patch.rebind(trainer_cls, "compute_loss", compute_loss)

    init = trainer_cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if live() and is_fused(self.model):
            prepare_teacher_under_fsdp(self)

    __init__.__hf_fused__ = True
    patch.rebind(trainer_cls, "__init__", __init__)


TRL_GKD = ThirdPartyPatch(
    name="GKDTrainer.compute_loss",
    module="trl.experimental.gkd.gkd_trainer",
    target="trl.experimental.gkd.gkd_trainer.GKDTrainer.compute_loss and GKDTrainer.__init__",
    trigger="first apply_fused_loss; applied when trl.experimental.gkd.gkd_trainer is imported (at once if it is)",
    versions="trl 1.16 (generalized_jsd_loss's parameters and defaults and compute_loss's calls checked at install; "
             "another shape: nothing wrapped, a warning)",
    why="GKDTrainer computes its divergence from both models' full logits; for a patched student hf_fused computes "
        "it from hidden states in one pass. Under FSDP TRL 1.16 leaves the teacher unprepared (huggingface/trl#2580: "
        "on the CPU of a GPU rank); for a patched student __init__ then prepares it with trl.models.prepare_fsdp, the "
        "fix of the open trl#6573, only where TRL left it unwrapped (that part can go once the supported TRL "
        "includes #6573)",
    passes_through="a student that is not patched, another trainer's call, and (with a one-time warning saying why "
                   "and what to do) a subclass's own generalized_jsd_loss, return_outputs=True or a teacher hf_fused "
                   "cannot read: TRL's compute_loss; an unpatched student or a teacher TRL wrapped itself: TRL's "
                   "__init__ and teacher, unchanged",
    apply=_install,
)
