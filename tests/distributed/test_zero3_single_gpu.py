"""DeepSpeed ZeRO-3 on one GPU (``accelerate launch --config_file examples/distributed/zero3.yaml
--num_processes 1``): with world size 1 ZeRO-3 still partitions the parameters (``lm_head.weight`` outside
its module's call is empty), so the gather path of hf_fused.model.distributed runs on the device as on CPU
ranks. FusedTrainer with small tiles and GA 2 against the single-process unpatched Trainer on the GPU:
logged losses and updated parameters with the tolerances of test_engines.py (fp32), plus lm_head's
gathers and reductions counted per micro-batch. Skipped without CUDA (run on the device machine)."""

from __future__ import annotations

import pytest

from launch import train
from models import VOCAB
from parity import SMALL_TILES, assert_head_gathered_and_reduced_once_per_micro_batch, assert_matches_reference

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def test_zero3_world_size_one_on_gpu_matches_single_process_reference(saved_models):
    pytest.importorskip("deepspeed")
    common = dict(model_dir=saved_models("llama"), batch=2, ga=2, cuda=True)
    ref = train(dict(common, trainer="Trainer"), None)
    got = train(dict(common, trainer="FusedTrainer", tile_budget_bytes=SMALL_TILES, count_head_events=True), "zero3",
                processes=1)
    assert got["lm_head_numel"] == 0, "ZeRO-3 with world size 1 should still partition lm_head's weight"
    assert_matches_reference(got, ref, ranks=1)
    assert_head_gathered_and_reduced_once_per_micro_batch(got, micro_batches=len(ref["losses"]) * 2,
                                                          tokens_per_micro_batch=2 * 12, vocab=VOCAB)
