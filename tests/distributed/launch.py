"""Run tests/distributed workers the way users launch training: ``accelerate launch --config_file`` with the
ready configs under ``examples/distributed/``, 2 CPU processes over gloo (DeepSpeed's CPU accelerator
falls back to gloo without oneCCL) or, with ``HF_FUSED_TEST_DEVICE=cuda``, 2 GPUs over NCCL (ranks.py), or as
one plain process for the single-process reference.

A launch costs far more than the few training steps it runs (each rank imports torch, transformers, TRL and
DeepSpeed: 10-20 s on 2 loaded cores), so the tests share launches: :class:`SharedLaunches` runs, in one launch
per engine, every run of that engine that the selected tests of a module will ask for, and hands each test its
own runs' results (or their own failure).

Robust under load: every launch gets a generous timeout that grows with the runs it holds, a rendezvous port
outside the kernel's ephemeral range (:func:`free_port`), and is run again only when that port was taken
(``EADDRINUSE``, before any rank started); on timeout every process it started is stopped.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ranks import CUDA

HERE = Path(__file__).parent
REPO = HERE.parent.parent
CONFIGS = REPO / "examples" / "distributed"
WORKER = HERE / "train_worker.py"
#: One launch (2 ranks: imports, a few steps) takes 15-60 s on 2 cores, 20-70 s on 2 GPUs with 8 launches at once
#: (CUDA and NCCL start-up); 140 s on 2 cores under a load of 7. ``HF_FUSED_LAUNCH_TIMEOUT_S`` overrides it.
TIMEOUT_S = int(os.environ.get("HF_FUSED_LAUNCH_TIMEOUT_S", "600"))
#: What each further run sharing a launch adds to its timeout (a few training steps, a model load).
RUN_TIMEOUT_S = int(os.environ.get("HF_FUSED_RUN_TIMEOUT_S", "240"))
#: Launches of one command before an "address already in use" on the rendezvous port fails a test.
PORT_ATTEMPTS = 3
#: Engines whose runs cannot share a process (none at present: DeepSpeed's Ulysses groups, set up once per process,
#: are undone between runs by ``ranks.sequence_parallelism_undone_after``).
ONE_RUN_PER_LAUNCH: set[str] = set()


def gpus_short(ranks: int) -> str | None:
    """Why a run on ``ranks`` ranks cannot run here: under ``HF_FUSED_TEST_DEVICE=cuda`` each rank takes a GPU of its
    own (conftest.py skips the modules with fewer than 2); None where it can."""
    if CUDA and torch.cuda.device_count() < ranks:
        return (f"HF_FUSED_TEST_DEVICE=cuda runs each rank on its own GPU: {ranks} ranks need {ranks} GPUs, found "
                f"{torch.cuda.device_count()}")
    return None


def skip_if_gpus_short(ranks: int) -> None:
    """Skip the calling test where :func:`gpus_short` says its ``ranks`` cannot run."""
    reason = gpus_short(ranks)
    if reason:
        import pytest  # the workers import this module too: pytest only where a test skips

        pytest.skip(reason)


def worker_env(cuda: bool = CUDA, gpus: int | None = None) -> dict:
    """The ranks' environment; ``gpus``: show a process only the first ``gpus`` GPUs (a plain process that sees
    several would have ``transformers.Trainer`` wrap its model in ``nn.DataParallel``)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # 2 ranks on 2 cores: intra-op threads only oversubscribe
        # the repository (benchmarks, examples), the shared test modules, the launcher's workers, the example scripts'
        # shared module (examples/distributed/tiny.py, which the test's own scripts use too)
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE.parent), str(HERE), str(CONFIGS),
                                       os.environ.get("PYTHONPATH", "")]),
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


def _ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. Between this choice and the moment rank 0's store binds
    it, the launcher imports torch (seconds, a minute under load); a port from the ephemeral range could meanwhile
    be handed to any outgoing connection on the machine (other launches' gloo and store connections), which is how
    an example launch once failed on a busy machine. Ports below that range are only ever taken by explicit binds."""
    low = _ephemeral_ports().start
    candidates = range(max(1024, low - 12000), low) if low > 2048 else range(20000, 30000)
    for _ in range(100):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every candidate busy: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list, cwd: Path = REPO, cuda: bool = CUDA, gpus: int | None = None,
        rank_logs: Path | None = None, timeout_s: int | None = None) -> str:
    """Run ``cmd`` in its own process group (seeing ``gpus`` GPUs: :func:`worker_env`), its output into a file, and
    return that output; on timeout (``timeout_s``, default :data:`TIMEOUT_S`) abort, then kill, it and every process
    it started. torchrun starts its ranks in sessions of their own, out of reach of the launcher's process group: a
    rank left running holds a pipe's write end open (a ``communicate()`` on it never returns) and outlives the test.
    ``rank_logs``: torchrun's ``--log_dir``, whose per-rank ``stderr.log`` tails the failure message adds (in the
    launch's own output two ranks' stacks at SIGABRT interleave line by line)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=worker_env(cuda, gpus), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
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
            raise AssertionError(f"{_shown(cmd)} still running after {timeout_s} s, stacks at SIGABRT:\n"
                                 f"{_tail(log, 12000)}{_rank_tails(rank_logs)}") from None
        if proc.returncode != 0:
            raise AssertionError(f"{_shown(cmd)} exited with {proc.returncode}:\n{_tail(log, 6000)}"
                                 f"{_rank_tails(rank_logs)}")
        log.seek(0)
        return log.read()


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


def config_file(config: str | Path) -> Path:
    """``config``: a config's name under examples/distributed/, or a config file's path."""
    return config if isinstance(config, Path) else CONFIGS / f"{config}.yaml"


#: The variables of a rank's environment that ``accelerate launch`` derives from a config file.
_CONFIG_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


@functools.lru_cache(maxsize=None)
def accelerate_environment(config: str | Path, processes: int) -> dict[str, str]:
    """The variables ``accelerate launch --config_file <config> --num_processes <processes>`` gives each rank from the
    config (the engine and its plugin's settings, mixed precision, the parallelism config), computed by accelerate's
    own launch code, as its launchers call it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file(config)), "--num_processes",
                                               str(processes), "script.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []  # as accelerate's launch_command sets them
        args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + (["mixed_precision"] if mixed_precision_from_config else []))
        _, environment = prepare_deepspeed_cmd_env(args)
    else:
        environment = prepare_multi_gpu_env(args)
    return {k: v for k, v in environment.items() if k.startswith(_CONFIG_PREFIXES)}


def accelerate_launch(config: str | Path, script: Path, *args: str, processes: int = 2, cuda: bool = CUDA,
                      timeout_s: int | None = None) -> str:
    """``accelerate launch --config_file examples/distributed/<config>.yaml script args`` (``config`` a name
    there, or a config file's path); each rank's stderr also goes to a file of its own (torchrun's ``--log_dir`` /
    ``--tee``), shown when the launch fails. Returns the launch's output."""
    for attempt in range(PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory() as logs:
            try:
                return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(config_file(config)), "--num_processes", str(processes), "--main_process_port",
                            str(free_port()), "--log_dir", logs, "--tee", "3", str(script), *args],
                           cuda=cuda, rank_logs=Path(logs), timeout_s=timeout_s)
            except AssertionError as e:
                # The port was free when chosen, then taken before rank 0's store bound it: the launch never
                # started, so it is run again on another port.
                if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                    raise


def launch_timeout(runs: int) -> int:
    """The timeout of a launch that holds ``runs`` runs."""
    return TIMEOUT_S + RUN_TIMEOUT_S * max(0, runs - 1)


# -- runs shared between the tests of a module, one launch per launch key (an engine, a rank count) -----------------


@dataclass(frozen=True)
class Run:
    """One run of a worker: ``case`` (its JSON text) under the accelerate ``config`` (a name under
    examples/distributed/ or a config file's path; None: one plain process) on ``processes`` ranks."""

    config: str | Path | None
    processes: int
    case: str

    @staticmethod
    def of(config: str | Path | None, processes: int, case) -> "Run":
        return Run(config, processes, json.dumps(case, sort_keys=True))

    @property
    def engine(self) -> tuple:
        return (str(self.config), self.processes)

    @property
    def rank_count(self) -> tuple:
        """The launch key of :func:`run_cases`' launches: accelerate-launched runs of every config on ``processes``
        ranks together (each rank takes its run's config's environment: ranks.launched_under), one plain process
        apart."""
        return (self.config is not None, self.processes)

    def unpatched_first(self) -> tuple:
        """Sort key: in a shared launch, runs that never touch hf_fused come first, so that an unpatched reference
        runs in a process in the state a launch of its own would give it."""
        case = json.loads(self.case)
        patched = str(case.get("trainer", "")).startswith("Fused") or case.get("fused", False)
        return (bool(patched), self.case)


class SharedLaunches:
    """The results of :class:`Run` s, each launch holding every planned run of one launch ``key`` (by default
    :attr:`Run.engine`; :func:`run_cases`' launches take :attr:`Run.rank_count`).

    ``planned``: every run the selected tests will ask for. The first request for a run launches, at once, all the
    planned runs of its key not yet done (``launch(runs, dirs)``: each run writes into its own
    directory; a run that raised writes its traceback to ``error.txt`` there); ``load(run, directory)`` reads
    a run's result. A test gets its own run's result (also when the launch failed after writing it), or an
    AssertionError with that run's traceback, or with the launch's failure when the run wrote nothing."""

    def __init__(self, root: Path, planned: Iterable[Run], launch: Callable[[list[Run], list[Path]], None],
                 load: Callable[[Run, Path], dict], key: Callable[[Run], tuple] = lambda run: run.engine):
        self.root, self.launch, self.load, self.key = root, launch, load, key
        self.planned = list(dict.fromkeys(planned))
        self.dirs: dict[Run, Path] = {}
        self.launch_errors: dict[Run, str] = {}
        self.results: dict[Run, dict] = {}

    def __call__(self, run: Run) -> dict:
        if run not in self.dirs:
            self._launch_engine_of(run)
        if run not in self.results:
            directory = self.dirs[run]
            error = directory / "error.txt"
            if error.exists():
                raise AssertionError(f"run {run.case} under {run.config} raised:\n{error.read_text()}")
            try:
                self.results[run] = self.load(run, directory)
            except FileNotFoundError:
                if run in self.launch_errors:
                    raise AssertionError(f"the launch holding run {run.case} under {run.config} failed before the run "
                                         f"finished:\n{self.launch_errors[run]}") from None
                raise
        return self.results[run]

    def _launch_engine_of(self, run: Run) -> None:
        runs = [r for r in self.planned if self.key(r) == self.key(run) and r not in self.dirs]
        if run not in runs:
            runs.append(run)  # asked for without being planned: launched with the rest of its engine
        if str(run.config) in ONE_RUN_PER_LAUNCH:
            runs = [run]
        runs.sort(key=Run.unpatched_first)
        dirs = []
        for r in runs:
            self.dirs[r] = self.root / f"run{len(self.dirs)}"
            self.dirs[r].mkdir(parents=True)
            dirs.append(self.dirs[r])
        try:
            self.launch(runs, dirs)
        except AssertionError as e:
            for r in runs:
                self.launch_errors[r] = str(e)


def planned_runs(request, plans: dict[str, Callable[..., list[Run]]]) -> list[Run]:
    """The runs the selected tests of ``request``'s module will ask for: ``plans[test function name](**params)``
    for each of them (a test function not in ``plans`` plans nothing)."""
    runs = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and item.originalname in plans:
            params = getattr(item, "callspec", None)
            runs += plans[item.originalname](**(params.params if params else {}))
    return runs


def run_cases(runs: list[Run], dirs: list[Path], worker: Path = WORKER,
              model_dirs: Callable[[str], str] | None = None) -> None:
    """Launch ``worker`` once for ``runs`` (one plain process, or accelerate-launched ranks: then runs of several
    configs of one rank count, :attr:`Run.rank_count`): it reads ``[{"case", "dir", "environment"}, ...]`` from the
    JSON file named on its command line (train_worker.py, script_runner.py, grpo_worker.py) and runs each under its
    own config's environment (:func:`accelerate_environment`, ranks.run_each). ``model_dirs``: where the tiny model a case
    names (``"model"``) was saved, given to the worker as the case's ``"model_dir"``."""
    config, processes = runs[0].config, runs[0].processes
    environments = {r.config: accelerate_environment(r.config, processes) for r in runs if r.config is not None}
    variables = {key for environment in environments.values() for key in environment}
    entries = []
    for r, d in zip(runs, dirs):
        case = {"cuda": CUDA, **json.loads(r.case)}
        if model_dirs is not None and "model" in case:
            case["model_dir"] = model_dirs(case["model"])
        entry = {"case": case, "dir": str(d)}
        if r.config is not None:  # the launch is under runs[0]'s config; each run takes its own's variables
            entry["environment"] = {"set": environments[r.config],
                                    "unset": sorted(variables - environments[r.config].keys())}
        entries.append(entry)
    batch = dirs[0] / "batch.json"
    batch.write_text(json.dumps(entries))
    cuda = any(entry["case"]["cuda"] for entry in entries)
    timeout_s = launch_timeout(len(runs))
    if config is None:
        gpus = json.loads(runs[0].case).get("gpus", 1)
        run([sys.executable, str(worker), str(batch)], cuda=cuda, gpus=gpus, timeout_s=timeout_s)
    else:
        accelerate_launch(config, worker, str(batch), processes=processes, cuda=cuda, timeout_s=timeout_s)


def torchrun_cases(worker: Path) -> Callable[[list[Run], list[Path]], None]:
    """Launches of ``worker`` under ``torch.distributed.run --standalone`` (its own rendezvous port, bound by the
    agent itself), ``processes`` ranks, every run's case in one launch (``[{"case", "dir"}, ...]``, as
    :func:`run_cases` writes it)."""
    def launch(runs: list[Run], dirs: list[Path]) -> None:
        batch = dirs[0] / "batch.json"
        batch.write_text(json.dumps([{"case": json.loads(r.case), "dir": str(d)} for r, d in zip(runs, dirs)]))
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(runs[0].processes),
             str(worker), str(batch)], timeout_s=launch_timeout(len(runs)))

    return launch


def load_json_result(run: Run, directory: Path) -> dict:
    """What a torchrun worker's rank 0 wrote for ``run``."""
    return json.loads((directory / "result.json").read_text())


def train(case: dict, config: str | None, processes: int = 2) -> dict:
    """Run :mod:`train_worker` for ``case`` alone under the engine ``config`` (None: one plain process) and load
    what rank 0 saved, after checking that the engine wrapped the model (``parity.assert_wrapped_by``).
    ``case["cuda"]``: on the GPU (DeepSpeed's CUDA accelerator) instead of CPU ranks; ``case["gpus"]``: GPUs a
    plain process sees (default 1: with more, the Trainer uses ``nn.DataParallel``)."""
    with tempfile.TemporaryDirectory() as root:
        launches = SharedLaunches(Path(root), [], run_cases, load_train_result)
        return launches(Run.of(config, processes, case))


def load_train_result(run: Run, directory: Path) -> dict:
    """What train_worker.py's rank 0 saved for ``run``, after checking that the engine wrapped the model."""
    from parity import assert_wrapped_by

    got = torch.load(directory / "result.pt")
    if run.config is not None:
        case = json.loads(run.case)
        assert_wrapped_by(got, f"fsdp{case['trainer_fsdp']}" if case.get("trainer_fsdp") else run.config,
                          run.processes)
    return got
