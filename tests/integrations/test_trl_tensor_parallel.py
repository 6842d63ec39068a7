"""How hf_fused serves TRL's rollout trainers under tensor parallelism
(:mod:`hf_fused.integrations.trl.tensor_parallel`), on stand-ins for a trainer, its accelerator and accelerate's
device mesh: which trainers and layouts it serves, what it refuses, and the data-parallel view of meshes the 2-rank
runs do not reach; tests/distributed/test_tensor_parallel.py trains the real trainers on 2 gloo ranks."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from accelerate import ParallelismConfig

from hf_fused.integrations.trl.tensor_parallel import (DataParallelAccelerator, DataParallelLayout,
                                                       data_parallel_view, serve_tensor_parallel_rollouts)


def _trainer(class_name: str, config=None, **attributes):
    cls = type(class_name, (), {"__module__": "trl.trainer.stand_in"})
    trainer = type("Mine", (cls,), {})()  # a subclass: found along the MRO
    trainer.accelerator = SimpleNamespace(parallelism_config=config)
    vars(trainer).update(attributes)
    return trainer


def _mesh_accelerator(config: ParallelismConfig) -> SimpleNamespace:
    """An accelerator whose ``torch_device_mesh`` lays the ranks out as accelerate's ``build_device_mesh`` does."""
    names, shape = config._get_mesh()
    return SimpleNamespace(parallelism_config=config, torch_device_mesh=SimpleNamespace(
        mesh_dim_names=names, mesh=torch.arange(config.total_size).view(shape)))


def _as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)


@pytest.mark.parametrize("attribute", ["use_vllm", "use_transformers_continuous_batching"])
def test_unverified_generation_under_tensor_parallelism_is_refused(attribute):
    trainer = _trainer("GRPOTrainer", ParallelismConfig(tp_size=2), **{attribute: True})
    match = rf"Mine under tensor parallelism \(tp_size=2\) with {attribute}=True"
    with pytest.raises(NotImplementedError, match=match):
        serve_tensor_parallel_rollouts(trainer)


def test_context_parallelism_beside_tensor_parallelism_is_refused():
    config = SimpleNamespace(tp_enabled=True, tp_size=2, cp_enabled=True, cp_size=2, sp_enabled=False, sp_size=1)
    with pytest.raises(NotImplementedError, match=r"context or sequence parallelism \(cp_size=2"):
        serve_tensor_parallel_rollouts(_trainer("RLOOTrainer", config))


def test_a_generation_batch_of_partial_groups_per_replica_is_refused(monkeypatch):
    """TRL checked ``generation_batch_size`` against the process count (2 × 2 = 4 completions); a replica of 2 ranks
    generates 2, half a group of 4."""
    config = ParallelismConfig(tp_size=2)
    trainer = _trainer("GRPOTrainer", args=SimpleNamespace(per_device_train_batch_size=2, steps_per_generation=1,
                                                            num_generations=4, generation_batch_size=4, seed=0))
    trainer.accelerator = _mesh_accelerator(config)
    _as_rank(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match=r"= 2 completions per data-parallel replica.*num_generations = 4"):
        serve_tensor_parallel_rollouts(trainer)


@pytest.mark.parametrize("name,config", [("GRPOTrainer", None), ("GRPOTrainer", ParallelismConfig()),
                                         ("SFTTrainer", ParallelismConfig(tp_size=2)),
                                         ("DPOTrainer", ParallelismConfig(tp_size=2))])
def test_other_trainers_and_layouts_pass_untouched(name, config):
    trainer = _trainer(name, config)
    assert serve_tensor_parallel_rollouts(trainer) is None and "_compute_loss" not in vars(trainer)


def test_a_served_trainer_scores_and_computes_its_loss_in_the_data_parallel_view(monkeypatch):
    """On rank 1 of a ``(dp_shard 2, tp 2)`` mesh: the generation batch counts the 2 replicas (the trainer's copy of
    ``args``; the user's is left alone), and inside ``_generate_and_score_completions`` and ``_compute_loss`` the
    accelerator and the TRL module's ``gather`` / ``gather_object`` are the views, outside them the originals.
    Serving twice changes nothing."""
    module = types.ModuleType("trl.trainer.stand_in")
    gather, gather_object = module.gather, module.gather_object = (lambda t: t), (lambda o: o)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    seen = {}

    class GRPOTrainer:
        __module__ = module.__name__

        def _generate_and_score_completions(self, inputs):
            seen["score"] = (self.accelerator.process_index, self.accelerator.num_processes,
                             module.gather.__wrapped__ is gather, module.gather_object.__wrapped__ is gather_object)
            return inputs

        def _compute_loss(self, model, inputs):
            seen["loss"] = (self.accelerator.process_index, self.accelerator.num_processes)
            return inputs

    trainer = GRPOTrainer()
    accelerator = trainer.accelerator = _mesh_accelerator(ParallelismConfig(dp_shard_size=2, tp_size=2))
    args = trainer.args = SimpleNamespace(per_device_train_batch_size=4, steps_per_generation=2, num_generations=4,
                                          generation_batch_size=32, seed=0)
    _as_rank(monkeypatch, 1, 4)
    layout = serve_tensor_parallel_rollouts(trainer)
    assert (layout.index, layout.size, layout.leaders) == (0, 2, (0, 2))
    assert trainer.args.generation_batch_size == 16 and args.generation_batch_size == 32
    assert trainer._generate_and_score_completions("rows") == "rows" and trainer._compute_loss(None, 7) == 7
    assert seen == {"score": (0, 2, True, True), "loss": (0, 2)}
    assert trainer.accelerator is accelerator and (module.gather, module.gather_object) == (gather, gather_object)
    assert serve_tensor_parallel_rollouts(trainer) is layout


@pytest.mark.parametrize("sizes", [dict(dp_shard_size=2, tp_size=2), dict(dp_replicate_size=2, dp_shard_size=2,
                                                                            tp_size=2)])
def test_replicas_of_a_data_parallel_times_tensor_parallel_mesh(sizes, monkeypatch):
    """Every rank's view of accelerate's mesh layout (the gathers given every rank's rows): each rank's replica is
    accelerate's data-loader index (rank // tp_size), a gather keeps each replica's first rank's rows in replica order,
    ``reduce`` sums (averages) over replicas, ``gather_object`` keeps one object per replica, and
    ``data_parallel_view`` puts the trainer's accelerator and its module's functions back on exit."""
    config = ParallelismConfig(**sizes)
    world, tp = config.total_size, config.tp_size
    accelerator = _mesh_accelerator(config)
    per_rank = [torch.tensor([[10.0 * r, 10.0 * r + 1]]) for r in range(world)]  # one row of 2 per rank
    accelerator.gather = lambda t: torch.cat([p.view_as(t) for p in per_rank])  # accelerate's: every rank's rows
    replicas = world // tp
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        layout = DataParallelLayout.of(accelerator)
        assert (layout.index, layout.size, layout.leaders) == (rank // tp, replicas, tuple(range(0, world, tp)))
        view = DataParallelAccelerator(accelerator, layout)
        assert (view.process_index, view.num_processes) == (rank // tp, replicas)
        assert torch.equal(view.gather(per_rank[rank]), torch.cat(per_rank[::tp]))
        assert torch.equal(view.reduce(per_rank[rank][0]), torch.cat(per_rank[::tp]).sum(0))
        assert torch.equal(view.reduce(per_rank[rank][0], reduction="mean"), torch.cat(per_rank[::tp]).mean(0))
        module = types.ModuleType("trl_module")  # accelerate's gather_object: every rank's list, concatenated

        def tagged(value, r):
            return f"{value}@{r}" if isinstance(value, str) else [tagged(v, r) for v in value]

        module.gather_object = lambda values: [item for r in range(world) for item in tagged(values, r)]
        trainer = SimpleNamespace(accelerator=accelerator)
        with data_parallel_view(trainer, layout, module):
            assert isinstance(trainer.accelerator, DataParallelAccelerator)
            assert module.gather_object(["a", "b"]) == [f"{v}@{r}" for r in range(0, world, tp) for v in "ab"]
        assert trainer.accelerator is accelerator and module.gather_object(["a"]) == [f"a@{r}" for r in range(world)]
