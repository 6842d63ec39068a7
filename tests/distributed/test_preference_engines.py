"""TRL's experimental ``ORPOTrainer`` and ``CPOTrainer`` on a patched model under DeepSpeed ZeRO-3 and ZeRO-2, FSDP2,
FSDP1 and DDP (``accelerate launch --config_file examples/distributed/{zero3,zero2,fsdp2,fsdp1,ddp}.yaml``, 2 CPU
processes over gloo) against the same trainer on the unpatched model under the same engine: hf_fused answers
``concatenated_forward`` from hidden states (:mod:`hf_fused.integrations.trl.concatenated_forward`), through the
fused-head call the engines' DPO tests cover, here with lm_head partitioned (ZeRO-3) or sharded (FSDP).

Compared, as tests/distributed/test_grpo_engines.py does: every logged metric of every step (loss, log-probs,
rewards, NLL, log-odds, the logits means; relative 1e-5 + 1e-7 absolute) and every updated parameter
(``‖θ − θ_stock‖ / ‖θ_stock − θ_0‖ ≤ 2e-5``, SGD). Also checked: hf_fused computed the head on every step of the
patched run and never in the unpatched one; under ZeRO-3 every head computation found lm_head partitioned.
"""

from __future__ import annotations

import pytest
import torch

from launch import HERE, Run, SharedLaunches, load_train_result, planned_runs, run_cases
from parity import assert_matches_stock_under_engine

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]

CASES = [("zero3", "orpo"), ("zero2", "cpo"), ("fsdp2", "orpo"), ("fsdp1", "cpo"), ("ddp", "cpo")]


def engine_runs(config: str, trainer: str) -> list[Run]:
    """``[stock, fused]`` under ``config``."""
    return [Run.of(config, 2, dict(trainer=trainer, patch=patch, model="word-llama", steps=2))
            for patch in (False, True)]


def _planned(case: str) -> list[Run]:
    config, trainer = case.split("-")
    return engine_runs(config, trainer)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, saved_models) -> SharedLaunches:
    plans = {"test_patched_model_matches_stock_under_the_same_engine": _planned}
    return SharedLaunches(tmp_path_factory.mktemp("preference"), planned_runs(request, plans),
                          lambda runs, dirs: run_cases(runs, dirs, HERE / "preference_worker.py",
                                                       model_dirs=saved_models),
                          load_train_result, key=lambda run: run.rank_count)


@pytest.mark.parametrize("case", [f"{config}-{trainer}" for config, trainer in CASES])
def test_patched_model_matches_stock_under_the_same_engine(case, runs):
    config, trainer = case.split("-")
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    stock, fused = (runs(run) for run in engine_runs(config, trainer))  # each checks the engine wrapped the model

    assert {"logits/chosen", "logps/rejected", "nll_loss"} <= stock["logs"][0].keys()
    assert_matches_stock_under_engine(fused, stock, config)
