"""A distillation teacher that TRL 1.16 leaves unprepared under FSDP, prepared the way TRL prepares DPO's reference
model (huggingface/trl#2580, fixed upstream by the open pull request huggingface/trl#6573).

TRL 1.16's ``DistillationTrainer`` and ``GKDTrainer`` prepare their teacher with ``prepare_deepspeed`` under DeepSpeed
and otherwise with ``accelerator.prepare_model(teacher, evaluation_mode=True)``. Under FSDP that call neither moves
nor wraps the model (accelerate leaves device placement to FSDP, and wraps only in ``accelerator.prepare``), so on GPU
ranks the teacher stays where it was loaded, on the CPU, and its first forward fails ("Expected all tensors to be on
the same device ... cpu"). On CPU ranks it runs, unsharded. trl#6573 prepares it with ``trl.models.prepare_fsdp``
under FSDP; :func:`prepare_teacher_under_fsdp` applies that fix after TRL's ``__init__`` for the trainers of a
patched student (the ``__init__`` wrappers of :mod:`.distillation` and :mod:`.gkd`).

It acts only where TRL left the teacher unwrapped: a TRL that prepares it itself hands over an FSDP-wrapped teacher,
which is left alone, whatever its version. Remove it when the TRL that hf_fused supports prepares the teacher under
FSDP (trl#6573 merged).

The fused distillation paths then read the teacher's sharded lm_head: under FSDP2 its weight is a ``Shard(0)``
DTensor outside the teacher's forward, gathered once per call with ``full_tensor()`` as TRL's kernel gathers it
(:func:`hf_fused.integrations.trl.divergence.student_divergence`). Under FSDP1 (``use_orig_params``) it is a view
into this rank's shard of the flat parameter once the teacher's forward has returned (a 1-D piece, or empty), which
TRL's kernel cannot read either; :func:`register_fsdp1_teacher` records the FSDP unit that holds it, and
:func:`fsdp1_whole` gathers that unit for the call (``summon_full_params``, this unit's parameters only).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ...model.lm_head import is_fsdp1_unit


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP1's ``FullyShardedDataParallel`` or carries FSDP2's ``fully_shard``
    (``FSDPModule``): what ``trl.models.prepare_fsdp`` leaves alone."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FullyShardedDataParallel, FSDPModule))


def teacher_left_unprepared(trainer) -> bool:
    """Whether ``trainer`` (a ``DistillationTrainer`` or ``GKDTrainer`` after its ``__init__``) runs FSDP with a
    teacher that TRL left unwrapped."""
    teacher = getattr(trainer, "teacher_model", None)
    return (isinstance(teacher, nn.Module) and bool(getattr(trainer, "is_fsdp_enabled", False))
            and not is_fsdp_wrapped(teacher))


def prepare_teacher_under_fsdp(trainer) -> bool:
    """Prepare ``trainer.teacher_model`` with ``trl.models.prepare_fsdp(teacher, trainer.accelerator)`` (FSDP1:
    wrapped with the plugin's auto-wrap policy on the accelerator's device; FSDP2: ``fully_shard`` on the
    accelerator's mesh, moved to its device; in eval mode), where :func:`teacher_left_unprepared`; an FSDP1 teacher,
    prepared here or by TRL, is registered for the fused paths (:func:`register_fsdp1_teacher`). Collective: every
    rank builds its trainer.

    Returns:
        whether the teacher was prepared here.
    """
    prepared = teacher_left_unprepared(trainer)
    if prepared:
        from trl.models import prepare_fsdp

        trainer.teacher_model = prepare_fsdp(trainer.teacher_model, trainer.accelerator)
    if isinstance(getattr(trainer, "teacher_model", None), nn.Module):
        register_fsdp1_teacher(trainer.teacher_model)  # prepared here or by TRL
    return prepared


#: An FSDP1 teacher's lm_head parameters (kept weakly, by identity: a tensor's ``==`` is elementwise) -> the FSDP unit
#: whose flat parameter holds them.
_FSDP1_HEAD_UNITS = WeakIdKeyDictionary()


def register_fsdp1_teacher(teacher: nn.Module) -> None:
    """Record the FSDP unit holding the lm_head parameters of ``teacher`` if it is FSDP1's
    ``FullyShardedDataParallel`` (its innermost unit around lm_head: the root under accelerate's auto-wrap policies,
    which wrap decoder layers), for :func:`fsdp1_whole`. Without ``use_orig_params`` lm_head keeps no parameters of
    its own (FSDP1 sets views of the flat parameter, whole on the root after its forward): nothing is recorded."""
    if not is_fsdp1_unit(teacher):
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ...model import find_causal_lm

    lm_head = find_causal_lm(teacher).get_output_embeddings()
    units = [unit for unit in FullyShardedDataParallel.fsdp_modules(teacher)
             if any(module is lm_head for module in unit.modules())]
    for param in lm_head.parameters():
        _FSDP1_HEAD_UNITS[param] = units[-1]  # fsdp_modules lists the root first: the last is the innermost


@contextlib.contextmanager
def fsdp1_whole(params):
    """Those of ``params`` that are a registered FSDP1 teacher's lm_head parameters, whole for the block: their unit
    gathered with ``summon_full_params(unit, recurse=False, writeback=False)`` (read-only, nested units untouched).
    Collective: every rank computes the loss."""
    units = list({id(u): u for u in (_FSDP1_HEAD_UNITS.get(p) for p in params if p is not None) if u is not None}
                 .values())
    if not units:
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    with contextlib.ExitStack() as stack:
        for unit in units:
            stack.enter_context(FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False))
        yield
