"""Example scripts run through script_runner.py (TRL's scripts with hf_fused's one change, as users launch them): a
run's description, its results, and the check that hf_fused really ran in it. Shared by test_trl_scripts.py and
test_distillation_engines.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from launch import HERE, Run, run_cases
from parity import assert_wrapped_by

RUNNER = HERE / "script_runner.py"


def script_run(script: Path, *args: str, engine: str | Path | None = None, processes: int = 2) -> Run:
    """``script`` with ``args`` through the runner: under ``accelerate launch --config_file <engine>.yaml``
    (``processes`` ranks), or as one plain process when ``engine`` is None; a run with ``--no_fused_loss`` is
    the unpatched one."""
    case = dict(script=str(script), args=list(args), fused="--no_fused_loss" not in args)
    return Run.of(engine, 1 if engine is None else processes, case)


def launch_scripts(runs: list[Run], dirs: list[Path]) -> None:
    """One launch of the runner for ``runs`` (one engine's, ``launch.SharedLaunches``)."""
    run_cases(runs, dirs, RUNNER)


def load_script_run(run: Run, out_dir: Path) -> dict:
    """What the script and script_runner.py wrote in ``out_dir``: every logged step with a loss (``logs``, ``losses``),
    each rank's head counts (``counts``), the parameters before and after training; after checking that the engine
    wrapped the model."""
    logs = [e for e in json.loads((out_dir / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    counts = [json.loads((out_dir / f"run.{rank}.json").read_text()) for rank in range(run.processes)]
    got = {"logs": logs, "losses": [e["loss"] for e in logs], "counts": counts, "world": run.processes,
           "dir": out_dir, **torch.load(out_dir / "run.params.pt")}
    if run.config is not None:
        assert_wrapped_by(got, run.config, run.processes)
    return got


def assert_hf_fused_ran(fused: dict, unpatched: dict, engine: str | None, calls: int = 3 * 2) -> None:
    """hf_fused computed the head at least ``calls`` times on every rank of ``fused`` (by default each of a rank's
    3 × 2 micro-batches, and apply_fused_loss's probe), under ZeRO-3 from a partitioned lm_head, and never in the
    ``unpatched`` run (a script whose patch silently did nothing would match its reference exactly)."""
    assert all(c["head_calls"] == 0 for c in unpatched["counts"]), ("the unpatched script reached hf_fused",
                                                                     unpatched["counts"])
    for count in fused["counts"]:
        assert count["head_calls"] >= calls, count
        if engine == "zero3":
            assert count["partitioned_head_calls"] == count["head_calls"], count
