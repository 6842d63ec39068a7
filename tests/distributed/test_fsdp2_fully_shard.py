"""FSDP2 (``torch.distributed.fsdp.fully_shard`` called directly; through accelerate: test_engines.py): a
patched model sharded over 2 processes (CPU over gloo, or 2 GPUs over NCCL: ranks.py) against the unpatched,
unsharded model: loss and every parameter gradient (gathered to full tensors) to 1e-5. The lm_head weight is then
a sharded DTensor that FSDP2 all-gathers around lm_head's own call, which is where hf_fused computes the loss.
Every configuration runs in one launch of fsdp2_worker.py (``launch.SharedLaunches``)."""

from __future__ import annotations

import pytest
import torch

from launch import HERE, Run, SharedLaunches, load_json_result, planned_runs, torchrun_cases
from references import RTOL

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
    ),
]

CONFIGURATIONS = {
    "llama-untied-patch-then-shard": dict(arch="llama", tied=False, patch_before_sharding=True, head_unit=False),
    "qwen3-tied-patch-then-shard": dict(arch="qwen3", tied=True, patch_before_sharding=True, head_unit=False),
    "gemma2-softcap-shard-then-patch": dict(arch="gemma2", tied=False, patch_before_sharding=False, head_unit=False),
    # lm_head its own FSDP2 unit: resharded after its call, as a layer is
    "llama-lm_head-own-unit": dict(arch="llama", tied=False, patch_before_sharding=True, head_unit=True),
}


def configuration_run(name: str) -> list[Run]:
    return [Run.of("torchrun", 2, CONFIGURATIONS[name])]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> SharedLaunches:
    plans = {"test_fsdp2_sharded_fused_loss_matches_unsharded_reference": configuration_run}
    return SharedLaunches(tmp_path_factory.mktemp("fsdp2"), planned_runs(request, plans),
                          torchrun_cases(HERE / "fsdp2_worker.py"), load_json_result)


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_fsdp2_sharded_fused_loss_matches_unsharded_reference(name, runs):
    (run,) = configuration_run(name)
    doc = runs(run)
    assert doc["world"] == 2 and doc["lm_head_sharded"]
    worst = {k: v for k, v in doc["errors"].items() if not v <= RTOL}
    assert not worst, worst
    assert len(doc["errors"]) > 10  # the loss and every parameter were compared
