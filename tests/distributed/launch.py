"""Run tests/distributed workers the way users launch training: ``accelerate launch --config_file`` with the
ready configs under ``examples/distributed/``, 2 CPU processes over gloo (DeepSpeed's CPU accelerator
falls back to gloo without oneCCL) or, with ``HF_FUSED_TEST_DEVICE=cuda``, 2 GPUs over NCCL (ranks.py), or as
one plain process for the single-process reference."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ranks import CUDA

HERE = Path(__file__).parent
REPO = HERE.parent.parent
CONFIGS = REPO / "examples" / "distributed"
WORKER = HERE / "train_worker.py"
#: One launch (2 ranks: imports, DeepSpeed's first shm-op build, a few steps) takes 15-60 s on 2 cores, 20-70 s
#: on 2 GPUs with 8 launches at once (CUDA and NCCL start-up). ``HF_FUSED_LAUNCH_TIMEOUT_S`` overrides it.
TIMEOUT_S = int(os.environ.get("HF_FUSED_LAUNCH_TIMEOUT_S", "400"))
#: Launches of one command before an "address already in use" on the rendezvous port fails a test.
PORT_ATTEMPTS = 3


def worker_env(cuda: bool = CUDA, gpus: int | None = None) -> dict:
    """The ranks' environment; ``gpus``: show a process only the first ``gpus`` GPUs (a plain process that sees
    several would have ``transformers.Trainer`` wrap its model in ``nn.DataParallel``)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # 2 ranks on 2 cores: intra-op threads only oversubscribe
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",  # a rank killed on timeout (SIGABRT, run()) prints every thread's stack
    }
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator: gloo without oneCCL
        # accelerate applies its FSDP plugin only on accelerators (DDP on CPU ranks otherwise): cpu_fsdp/
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "cpu_fsdp"), env["PYTHONPATH"]])
    elif gpus is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:gpus])
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list, cwd: Path = REPO, cuda: bool = CUDA, gpus: int | None = None,
        rank_logs: Path | None = None) -> None:
    """Run ``cmd`` in its own process group (seeing ``gpus`` GPUs: :func:`worker_env`), its output into a file; on
    timeout abort, then kill, it and every process it started. torchrun starts its ranks in sessions of their own,
    out of reach of the launcher's process group: a rank left running holds a pipe's write end open (a
    ``communicate()`` on it never returns) and outlives the test. ``rank_logs``: torchrun's ``--log_dir``, whose
    per-rank ``stderr.log`` tails the failure message adds (in the launch's own output two ranks' stacks at
    SIGABRT interleave line by line)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=worker_env(cuda, gpus), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # found before the signal: once the launcher dies its ranks hang from init, out of _descendants' reach
            tree = [proc.pid] + _descendants(proc.pid)
            _signal(tree, signal.SIGABRT)  # faulthandler: each hung process prints where it waits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            _signal(tree + _descendants(proc.pid), signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{_shown(cmd)} still running after {TIMEOUT_S} s, stacks at SIGABRT:\n"
                                 f"{_tail(log, 12000)}{_rank_tails(rank_logs)}") from None
        if proc.returncode != 0:
            raise AssertionError(f"{_shown(cmd)} exited with {proc.returncode}:\n{_tail(log, 6000)}"
                                 f"{_rank_tails(rank_logs)}")


def _shown(cmd: list) -> str:
    """The command for a failure message: its start and its last arguments (a script's flags, e.g. whether it
    was the stock or the fused run), without a long JSON case in between."""
    words = [str(w) if len(str(w)) <= 200 else str(w)[:200] + "..." for w in cmd]
    return " ".join(words if len(words) <= 16 else [*words[:6], "...", *words[-10:]])


def _rank_tails(rank_logs: Path | None, chars: int = 6000) -> str:
    if rank_logs is None:
        return ""
    parts = []
    for path in sorted(rank_logs.rglob("stderr.log")):  # <log_dir>/<run id>/attempt_<k>/<local rank>/stderr.log
        text = _without_module_lists(path.read_text(errors="replace"))
        parts.append(f"\n--- rank {path.parent.name} ({path.relative_to(rank_logs)}), last {chars} chars ---\n"
                     f"{text[-chars:]}")
    return "".join(parts)


def _tail(log, chars: int) -> str:
    log.seek(0)
    return _without_module_lists(log.read())[-chars:]


def _without_module_lists(text: str) -> str:
    """``text`` without faulthandler's one-line list of loaded extension modules after each stack (~5,000
    characters, which would push the stack's innermost frames out of a tail)."""
    return "".join(line for line in text.splitlines(keepends=True) if "Extension modules:" not in line)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _signal(pids: list[int], sig: int) -> None:
    """``sig`` to the process group of ``pids[0]`` (the launcher, its group's leader) and to each other process."""
    for i, pid in enumerate(dict.fromkeys(pids)):
        try:
            if i == 0:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def accelerate_launch(config: str | Path, script: Path, *args: str, processes: int = 2, cuda: bool = CUDA) -> None:
    """``accelerate launch --config_file examples/distributed/<config>.yaml script args`` (``config`` a name
    there, or a config file's path); each rank's stderr also goes to a file of its own (torchrun's ``--log_dir`` /
    ``--tee``), shown when the launch fails."""
    config_file = config if isinstance(config, Path) else CONFIGS / f"{config}.yaml"
    for attempt in range(PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory() as logs:
            try:
                return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(config_file), "--num_processes", str(processes), "--main_process_port",
                            str(free_port()), "--log_dir", logs, "--tee", "3", str(script), *args],
                           cuda=cuda, rank_logs=Path(logs))
            except AssertionError as e:
                # The port was free when chosen, then taken (by another launch's sockets under pytest -n)
                # before rank 0's store bound it: the launch never started, so it is run again on another port.
                if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                    raise


def train(case: dict, config: str | None, processes: int = 2) -> dict:
    """Run :mod:`train_worker` for ``case`` under the engine ``config`` (None: one plain process) and load
    what rank 0 saved, after checking that the engine wrapped the model (``parity.assert_wrapped_by``).
    ``case["cuda"]``: on the GPU (DeepSpeed's CUDA accelerator) instead of CPU ranks; ``case["gpus"]``: GPUs a
    plain process sees (default 1: with more, the Trainer uses ``nn.DataParallel``)."""
    from parity import assert_wrapped_by

    case = {"cuda": CUDA, **case}
    cuda = bool(case["cuda"])
    if config is None:
        run([sys.executable, str(WORKER), json.dumps(case)], cuda=cuda, gpus=case.get("gpus", 1))
        return torch.load(case["out"])
    accelerate_launch(config, WORKER, json.dumps(case), processes=processes, cuda=cuda)
    got = torch.load(case["out"])
    assert_wrapped_by(got, f"fsdp{case['trainer_fsdp']}" if case.get("trainer_fsdp") else config, processes)
    return got
