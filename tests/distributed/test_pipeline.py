"""Pipeline parallelism with a loss that owns the output layer: a tiny Llama split into 2 stages on 2 CPU
processes (``torch.distributed.pipelining``, GPipe, 2 microbatches, gloo), ``hf_fused.LinearCrossEntropyLoss``
as the schedule's ``loss_fn``; against the unsplit, unpatched model on the same batch: the loss (sum of
the microbatch losses) and every parameter's gradient, relative 1e-5 (fp32; the fused op sums over tiles
and the microbatches split the batch, both reorder fp32 sums: measured ≤ 1e-6)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from launch import HERE, run
from references import RTOL

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]


def test_two_stage_pipeline_with_linear_cross_entropy_loss_matches_unsplit_model(tmp_path):
    out = tmp_path / "errors.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(HERE / "pipeline_worker.py"), str(out)])
    doc = json.loads(out.read_text())
    errors = doc["errors"]
    assert "loss" in errors and "lm_head.weight" in errors
    assert len(errors) == doc["parameters"] + 1, "every parameter is owned by one stage and compared"
    worst = {k: v for k, v in errors.items() if not v <= RTOL}
    assert not worst, worst
