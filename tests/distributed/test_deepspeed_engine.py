"""DeepSpeed's own API (no Trainer, no accelerate): ``apply_fused_loss(engine)`` after
``deepspeed.initialize`` under ZeRO-3 and ZeRO-2, 2 CPU processes over gloo (``DS_ACCELERATOR=cpu``).
The patch finds the model inside the engine (which forwards unknown attributes to it) and its probe runs
through DeepSpeed's hooks; 3 SGD steps against an unpatched copy trained without DeepSpeed on all ranks'
batches: losses relative 1e-5, parameters ``‖θ − θ_ref‖ / ‖θ_ref − θ_0‖ ≤ 2e-5`` (reasons in
parity.py). Both stages run in one launch of deepspeed_worker.py (``launch.SharedLaunches``)."""

from __future__ import annotations

import pytest
import torch

from launch import HERE, Run, SharedLaunches, load_json_result, planned_runs, torchrun_cases

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]


def stage_run(stage: int) -> list[Run]:
    return [Run.of("torchrun", 2, dict(stage=stage))]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> SharedLaunches:
    plans = {"test_patched_deepspeed_engine_matches_reference": stage_run}
    return SharedLaunches(tmp_path_factory.mktemp("deepspeed"), planned_runs(request, plans),
                          torchrun_cases(HERE / "deepspeed_worker.py"), load_json_result)


@pytest.mark.parametrize("stage", [3, 2])
def test_patched_deepspeed_engine_matches_reference(stage, runs):
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    (run,) = stage_run(stage)
    doc = runs(run)
    assert doc["world"] == 2
    if stage == 3:
        assert doc["lm_head_numel"] == 0, "ZeRO-3 should have partitioned lm_head's weight"
    for step, (got, ref) in enumerate(zip(doc["losses"], doc["ref_losses"])):
        assert abs(got - ref) <= 1e-5 * abs(ref), f"step {step}: {got} vs {ref}"
    worst = {k: v for k, v in doc["errors"].items() if not v <= 2e-5}
    assert not worst, worst
    assert len(doc["errors"]) > 10
