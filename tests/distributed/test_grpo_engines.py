"""``hf_fused.FusedGRPOTrainer`` under DeepSpeed ZeRO-3 and ZeRO-2, FSDP2, FSDP1 and DDP (``accelerate launch
--config_file examples/distributed/{zero3,zero2,fsdp2,fsdp1,ddp}.yaml``, 2 CPU processes over gloo) against
``trl.GRPOTrainer`` under the same engine, on the scripted rollouts of tests/grpo_harness.py (the same
completions for both), 2 optimizer steps of SGD with β = 0 (on-policy).

Compared: every logged metric of every step (loss, grad_norm, entropy, rewards, clip ratios; relative
1e-5 + 1e-7 absolute: fp32 sums in another order), and every updated parameter (``‖θ − θ_stock‖ /
‖θ_stock − θ_0‖ ≤ 2e-5``: SGD makes the update −lr·gradient, so a gradient error shows in proportion;
measured ≤ 7e-6, from the reduce-scatter's fp32 order). The GRPO loss value at ratio 1 does not depend on
the log-probs (DESIGN.md): the parameters carry the parity claim. Also checked: hf_fused computed the head (the
stock trainer never reached it); under ZeRO-3 lm_head was partitioned (numel 0 outside its forward) and
every head computation went through the gather path. Every engine's stock and fused runs share one launch
(grpo_worker.py, ``launch.SharedLaunches``; each run under its engine's accelerate environment).
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


def engine_runs(config: str) -> list[Run]:
    """``[stock, fused]`` under ``config``."""
    return [Run.of(config, 2, dict(trainer=trainer, model="word-llama", steps=2))
            for trainer in ("GRPOTrainer", "FusedGRPOTrainer")]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, saved_models) -> SharedLaunches:
    plans = {"test_fused_grpo_matches_stock_grpo_under_the_same_engine": engine_runs}
    return SharedLaunches(tmp_path_factory.mktemp("grpo"), planned_runs(request, plans),
                          lambda runs, dirs: run_cases(runs, dirs, HERE / "grpo_worker.py", model_dirs=saved_models),
                          load_train_result, key=lambda run: run.rank_count)


@pytest.mark.parametrize("config", ["zero3", "zero2", "fsdp2", "fsdp1", "ddp"])
def test_fused_grpo_matches_stock_grpo_under_the_same_engine(config, runs):
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    stock, fused = (runs(run) for run in engine_runs(config))  # each checks the engine wrapped the model

    assert_matches_stock_under_engine(fused, stock, config)
