"""FSDP2 (``torch.distributed.fsdp.fully_shard`` called directly; through accelerate: test_engines.py): a
patched model sharded over 2 processes (CPU over gloo, or 2 GPUs over NCCL: ranks.py) against the unpatched,
unsharded model: loss and every parameter gradient (gathered to full tensors) to 1e-5. The lm_head weight is then
a sharded DTensor that FSDP2 all-gathers around lm_head's own call, which is where hf_fused computes the loss."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from launch import HERE, run
from tiny_models import RTOL

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
    ),
]


@pytest.mark.parametrize(
    "arch, tied, when",
    [("llama", "untied", "before"), ("qwen3", "tied", "before"), ("gemma2", "untied", "after"),
     ("llama", "untied", "before-head-unit")],
    ids=["llama-untied-patch-then-shard", "qwen3-tied-patch-then-shard", "gemma2-softcap-shard-then-patch",
         "llama-lm_head-own-unit"],
)
def test_fsdp2_sharded_fused_loss_matches_unsharded_reference(tmp_path, arch, tied, when):
    out = tmp_path / "errors.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(HERE / "fsdp2_worker.py"), str(out), arch, tied, *when.split("-", 1)])
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["lm_head_sharded"]
    worst = {k: v for k, v in doc["errors"].items() if not v <= RTOL}
    assert not worst, worst
    assert len(doc["errors"]) > 10  # the loss and every parameter were compared
