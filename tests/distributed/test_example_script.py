"""examples/distributed/train.py runs as documented: ``accelerate launch --config_file
examples/distributed/zero3.yaml examples/distributed/train.py --model tiny`` (2 CPU processes, ZeRO-3,
FusedTrainer) finishes and reports its losses. Parity is test_engines.py's job; this pins the example.

Launched through ``launch.accelerate_launch`` like every other launch of the suite: a rendezvous port outside the
ephemeral range, run again if that port was taken before rank 0 bound it, a timeout that stops every rank. (It
once built its own command: a port from the ephemeral range, chosen a launcher start-up — seconds, a minute
under load — before rank 0 bound it, no retry, and a timeout that left the ranks running.)"""

from __future__ import annotations

import re

import pytest
import torch

from launch import CONFIGS, accelerate_launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]


def test_example_script_trains_under_zero3(tmp_path):
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    output = accelerate_launch("zero3", CONFIGS / "train.py", "--model", "tiny", "--seq-len", "32", "--batch", "2",
                               "--steps", "3", "--lr", "1e-3", "--output-dir", str(tmp_path / "out"))
    match = re.search(r"hf_fused distributed example: (\d+) processes, loss ([\d.]+) -> ([\d.]+) over (\d+) steps",
                      output)
    assert match, output[-3000:]
    assert match.group(1) == "2" and match.group(4) == "3"
