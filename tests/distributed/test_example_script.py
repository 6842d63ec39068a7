"""examples/distributed/train.py runs as documented: ``accelerate launch --config_file
examples/distributed/zero3.yaml examples/distributed/train.py --model tiny`` (2 CPU processes, ZeRO-3,
FusedTrainer) finishes and reports its losses. Parity is test_engines.py's job; this pins the example."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from launch import CONFIGS, REPO, free_port, worker_env

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]


def test_example_script_trains_under_zero3(tmp_path):
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "zero3.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()), str(CONFIGS / "train.py"),
           "--model", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "3", "--lr", "1e-3",
           "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    match = re.search(r"hf_fused distributed example: (\d+) processes, loss ([\d.]+) -> ([\d.]+) over (\d+) steps",
                      proc.stdout)
    assert match, proc.stdout[-3000:]
    assert match.group(1) == "2" and match.group(4) == "3"
