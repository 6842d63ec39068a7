"""Which TRL trainers hf_fused refuses under tensor parallelism (:mod:`hf_fused.integrations.trl.tensor_parallel`),
on stand-ins for a trainer and its accelerator; tests/distributed/test_tensor_parallel.py builds the real trainers on
2 gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_fused.integrations.trl.tensor_parallel import refuse_tensor_parallel_rollouts


def _trainer(class_name: str, tp_size=None):
    cls = type(class_name, (), {})
    trainer = type("Mine", (cls,), {})()  # a subclass: found along the MRO
    config = None if tp_size is None else SimpleNamespace(tp_enabled=tp_size > 1, tp_size=tp_size)
    trainer.accelerator = SimpleNamespace(parallelism_config=config)
    return trainer


@pytest.mark.parametrize("name", ["GRPOTrainer", "RLOOTrainer"])
def test_rollout_trainers_under_tensor_parallelism_are_refused(name):
    with pytest.raises(NotImplementedError, match=rf"Mine under tensor parallelism \(tp_size=2\).*TRL's {name}"):
        refuse_tensor_parallel_rollouts(_trainer(name, tp_size=2))


@pytest.mark.parametrize("name,tp_size", [("GRPOTrainer", None), ("GRPOTrainer", 1), ("SFTTrainer", 2),
                                          ("DPOTrainer", 2)])
def test_other_trainers_and_layouts_pass(name, tp_size):
    refuse_tensor_parallel_rollouts(_trainer(name, tp_size))
