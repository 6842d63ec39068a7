"""DeepSpeed ZeRO-3 on one GPU (``accelerate launch --config_file examples/distributed/zero3.yaml
--num_processes 1``): with world size 1 ZeRO-3 still partitions the parameters (``lm_head.weight`` outside
its module's call is empty), so the gather path of hf_fused.model.distributed runs on the device as on CPU
ranks. FusedTrainer with small tiles and GA 2 against the single-process unpatched Trainer on the GPU:
logged losses and updated parameters with the tolerances of test_engines.py (fp32), plus lm_head's
gathers and reductions counted per micro-batch. Skipped without CUDA (run on the device machine)."""

from __future__ import annotations

import pytest

from launch import train
from parity import assert_matches_reference
from test_engines import TILE_BUDGET, assert_head_gathered_and_reduced_once_per_micro_batch
from tiny_models import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def test_zero3_world_size_one_on_gpu_matches_single_process_reference(tmp_path):
    pytest.importorskip("deepspeed")
    model_dir = tmp_path / "llama"
    make_model("llama", tie_word_embeddings=False).save_pretrained(model_dir)
    common = dict(model_dir=str(model_dir), batch=2, ga=2, cuda=True)
    ref = train(dict(common, out=str(tmp_path / "ref.pt"), trainer="Trainer"), None)
    got = train(dict(common, out=str(tmp_path / "z3.pt"), trainer="FusedTrainer", tile_budget_bytes=TILE_BUDGET,
                     count_head_events=True), "zero3", processes=1)
    assert got["lm_head_numel"] == 0, "ZeRO-3 with world size 1 should still partition lm_head's weight"
    assert_matches_reference(got, ref, ranks=1)
    assert_head_gathered_and_reduced_once_per_micro_batch(got, micro_batches=len(ref["losses"]) * 2)
