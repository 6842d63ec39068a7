"""hf_fused's preparation of a distillation teacher that TRL 1.16 leaves unprepared under FSDP
(``hf_fused.integrations.trl.teacher_fsdp``, trl#6573's fix of trl#2580): TRL's ``prepare_fsdp`` once, only under FSDP
and only for a teacher TRL did not wrap itself (a TRL that includes the fix hands over a wrapped one). The prepared
teacher under FSDP2 and FSDP1 in training, against stock TRL: tests/distributed/test_distillation_engines.py."""

from __future__ import annotations

import types

import pytest
import torch.nn as nn

from hf_fused.integrations.trl import teacher_fsdp

trl_models = pytest.importorskip("trl.models")
fsdp = pytest.importorskip("torch.distributed.fsdp")


class _Sharded(fsdp.FSDPModule, nn.Linear):
    """Stands for a teacher that ``fully_shard`` has wrapped (built without a process group)."""


def _trainer(teacher, fsdp_enabled: bool):
    return types.SimpleNamespace(teacher_model=teacher, is_fsdp_enabled=fsdp_enabled, accelerator=object())


@pytest.fixture
def prepare_calls(monkeypatch):
    calls = []

    def prepare_fsdp(model, accelerator):
        calls.append((model, accelerator))
        return object.__new__(_Sharded)

    monkeypatch.setattr(trl_models, "prepare_fsdp", prepare_fsdp)
    return calls


def test_an_unwrapped_teacher_under_fsdp_is_prepared_once_with_trls_prepare_fsdp(prepare_calls):
    teacher = nn.Linear(2, 3)
    trainer = _trainer(teacher, fsdp_enabled=True)
    assert teacher_fsdp.prepare_teacher_under_fsdp(trainer)
    assert prepare_calls == [(teacher, trainer.accelerator)]
    assert isinstance(trainer.teacher_model, _Sharded)
    assert not teacher_fsdp.prepare_teacher_under_fsdp(trainer)  # wrapped now: left alone
    assert len(prepare_calls) == 1


def test_a_teacher_trl_wrapped_itself_or_no_fsdp_or_no_teacher_is_left_alone(prepare_calls):
    wrapped = object.__new__(_Sharded)
    for trainer in (_trainer(wrapped, True), _trainer(nn.Linear(2, 3), False), _trainer(None, True)):
        teacher = trainer.teacher_model
        assert not teacher_fsdp.teacher_left_unprepared(trainer)
        assert not teacher_fsdp.prepare_teacher_under_fsdp(trainer)
        assert trainer.teacher_model is teacher
    assert prepare_calls == []


def test_fsdp1_whole_passes_through_parameters_no_fsdp1_teacher_holds():
    head = nn.Linear(2, 3)
    with teacher_fsdp.fsdp1_whole([head.weight, None]):
        assert head.weight.shape == (3, 2)
