"""The launcher of the multi-process tests (launch.py): on a command that hangs it fails the test in bounded time
and leaves no process behind, also one the command started in a session of its own (as torchrun starts its ranks),
whose open output would otherwise keep the test waiting forever; a failed launch shows each rank's stderr; a
launch whose rendezvous port was taken runs again, on a port outside the ephemeral range; runs sharing a launch
each get their own result or their own failure."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import launch


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def plain_python(monkeypatch) -> None:
    """Commands run without the CPU ranks' start-up shim (cpu_fsdp/sitecustomize.py imports torch and accelerate in
    every process: seconds, more under load, which would eat this test's 5 s timeout before the command printed)."""
    monkeypatch.setattr(launch, "worker_env", lambda cuda, gpus: dict(os.environ))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes through /proc")
def test_run_kills_a_hung_command_and_the_ranks_in_their_own_sessions(monkeypatch, tmp_path):
    script, pid_file = tmp_path / "hang.py", tmp_path / "rank.pid"
    script.write_text(
        "import subprocess, sys, time\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(rank.pid))\n"
        "print('launched', flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(launch, "TIMEOUT_S", 5)
    plain_python(monkeypatch)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"still running after 5 s(.|\n)*launched"):
        launch.run([sys.executable, str(script)], cuda=False)
    assert time.monotonic() - start < 45
    rank = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_run_reports_a_failing_command(monkeypatch):
    plain_python(monkeypatch)
    with pytest.raises(AssertionError, match=r"exited with 3:(.|\n)*boom"):
        launch.run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], cuda=False)


@pytest.mark.distributed
def test_a_failed_launch_shows_each_ranks_own_stderr(tmp_path):
    """Two ranks under ``accelerate launch`` (DDP config, CPU): rank 1 fails; the message carries each rank's own
    stderr, so the stacks of a hang or a crash can be read rank by rank."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\n"
                      "rank = os.environ['RANK']\n"
                      "print(f'rank {rank} says hello', file=sys.stderr, flush=True)\n"
                      "print('Extension modules: numpy.core, torch._C (total: 2)', file=sys.stderr, flush=True)\n"
                      "sys.exit(3 if rank == '1' else 0)\n")
    with pytest.raises(AssertionError) as failure:
        launch.accelerate_launch("ddp", script, cuda=False)
    message = str(failure.value)
    assert "--- rank 0 (" in message and "--- rank 1 (" in message, message[-3000:]
    rank1 = message.split("--- rank 1 (")[1]
    assert "rank 1 says hello" in rank1 and "rank 0 says hello" not in rank1
    assert "Extension modules" not in message  # faulthandler's module list, which would crowd the stacks out


def _fake_run(errors: list, calls: list):
    def run(cmd, **kwargs):
        calls.append(cmd[cmd.index("--main_process_port") + 1])
        if errors:
            raise AssertionError(errors.pop(0))
    return run


def test_a_launch_whose_port_was_taken_is_run_again(monkeypatch, tmp_path):
    """torchrun's rendezvous failing to bind its port (taken between ``free_port`` and the bind, by another
    launch's sockets under ``pytest -n``) fails before any rank starts: the launch runs again on a new port; any
    other failure, or the port taken every time, fails the test."""
    calls = []
    monkeypatch.setattr(launch, "run", _fake_run(["... DistNetworkError: ... EADDRINUSE, message: address already in "
                                                  "use"], calls))
    launch.accelerate_launch("ddp", tmp_path / "script.py", cuda=False)
    assert len(calls) == 2

    calls = []
    monkeypatch.setattr(launch, "run", _fake_run(["exited with 1: ValueError"], calls))
    with pytest.raises(AssertionError, match="ValueError"):
        launch.accelerate_launch("ddp", tmp_path / "script.py", cuda=False)
    assert len(calls) == 1

    calls = []
    monkeypatch.setattr(launch, "run", _fake_run(["EADDRINUSE"] * launch.PORT_ATTEMPTS, calls))
    with pytest.raises(AssertionError, match="EADDRINUSE"):
        launch.accelerate_launch("ddp", tmp_path / "script.py", cuda=False)
    assert len(calls) == launch.PORT_ATTEMPTS


def test_a_rendezvous_port_is_free_and_outside_the_ephemeral_range():
    """The port a launch's rank 0 binds later is never one the kernel may meanwhile hand to an outgoing connection."""
    ephemeral = launch._ephemeral_ports()
    for _ in range(20):
        port = launch.free_port()
        assert 1024 <= port < ephemeral.start, (port, ephemeral)


def _fake_launch(launches: list, fail: dict | None = None):
    """A launch that records its runs and writes each run's result (for the runs in ``fail``, an error file, or nothing
for None); ``fail["launch"]``: the launch itself then fails."""
    def launch_runs(runs, dirs):
        launches.append([json.loads(r.case)["name"] for r in runs])
        for run, directory in zip(runs, dirs):
            name = json.loads(run.case)["name"]
            if fail and name in fail:
                if fail[name] is not None:
                    (directory / "error.txt").write_text(fail[name])
            else:
                (directory / "result.json").write_text(json.dumps({"name": name}))
        if fail and "launch" in fail:
            raise AssertionError(fail["launch"])
    return launch_runs


def test_runs_of_one_engine_share_one_launch_and_each_gets_its_own_result(tmp_path):
    """The first run asked for launches every planned run of its engine, unpatched runs first; other engines wait
    for their own first request; a run asked for without being planned gets a launch of its own."""
    launches = []
    planned = [launch.Run.of("zero3", 2, dict(name="fused", trainer="FusedTrainer")),
               launch.Run.of("zero3", 2, dict(name="stock", trainer="Trainer")),
               launch.Run.of("zero3", 3, dict(name="three ranks", trainer="Trainer")),
               launch.Run.of(None, 1, dict(name="reference", trainer="Trainer"))]
    runs = launch.SharedLaunches(tmp_path, planned, _fake_launch(launches), launch.load_json_result)
    assert runs(planned[0]) == {"name": "fused"}
    assert launches == [["stock", "fused"]]
    assert runs(planned[1]) == {"name": "stock"} and len(launches) == 1
    assert runs(planned[3]) == {"name": "reference"}
    assert launches == [["stock", "fused"], ["reference"]]
    assert runs(launch.Run.of("zero3", 2, dict(name="unplanned"))) == {"name": "unplanned"}
    assert launches[-1] == ["unplanned"]


def test_a_run_that_raised_fails_alone_and_a_failed_launch_fails_the_runs_it_left(tmp_path):
    launches = []
    planned = [launch.Run.of("ddp", 2, dict(name=name)) for name in ("a", "b", "c")]
    runs = launch.SharedLaunches(tmp_path, planned, _fake_launch(launches, fail={"b": "Traceback: b broke"}),
                                 launch.load_json_result)
    assert runs(planned[0]) == {"name": "a"} and runs(planned[2]) == {"name": "c"}
    with pytest.raises(AssertionError, match="b broke"):
        runs(planned[1])

    planned = [launch.Run.of("fsdp2", 2, dict(name=name)) for name in ("d", "e")]
    runs = launch.SharedLaunches(tmp_path / "second", planned,
                                 _fake_launch(launches, fail={"e": None, "launch": "exited with -9: killed"}),
                                 launch.load_json_result)
    assert runs(planned[0]) == {"name": "d"}  # written before the launch failed
    with pytest.raises(AssertionError, match="killed"):
        runs(planned[1])


def test_runs_of_an_engine_that_cannot_share_a_process_get_a_launch_each(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "ONE_RUN_PER_LAUNCH", {"zero3_sp2"})
    launches = []
    planned = [launch.Run.of("zero3_sp2", 2, dict(name=name)) for name in ("stock", "fused")]
    runs = launch.SharedLaunches(tmp_path, planned, _fake_launch(launches), launch.load_json_result)
    assert runs(planned[1]) == {"name": "fused"} and runs(planned[0]) == {"name": "stock"}
    assert launches == [["fused"], ["stock"]]


def test_runs_of_several_engines_on_one_rank_count_share_a_launch_keyed_by_rank_count(tmp_path):
    """With ``key=Run.rank_count`` (run_cases' launches) the runs of every config on 2 ranks share one launch, those
    on 3 ranks and the plain process launches of their own."""
    launches = []
    planned = [launch.Run.of("zero3", 2, dict(name="zero3")), launch.Run.of("ddp", 2, dict(name="ddp")),
               launch.Run.of("fsdp2", 3, dict(name="fsdp2 on 3")), launch.Run.of(None, 1, dict(name="reference"))]
    runs = launch.SharedLaunches(tmp_path, planned, _fake_launch(launches), launch.load_json_result,
                                 key=lambda run: run.rank_count)
    assert runs(planned[1]) == {"name": "ddp"} and runs(planned[0]) == {"name": "zero3"}
    assert launches == [["ddp", "zero3"]]
    runs(planned[2]), runs(planned[3])
    assert launches == [["ddp", "zero3"], ["fsdp2 on 3"], ["reference"]]


def test_each_run_of_a_shared_launch_gets_its_configs_accelerate_environment(tmp_path, monkeypatch):
    """run_cases hands each run the variables ``accelerate launch`` derives from its own config (accelerate's own
    code computes them) and the names of the other configs' variables to drop."""
    env = {name: launch.accelerate_environment(name, 2) for name in ("zero3", "fsdp2", "ddp")}
    assert env["zero3"]["ACCELERATE_USE_DEEPSPEED"] == "true" and env["zero3"]["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["fsdp2"]["ACCELERATE_USE_FSDP"] == "true" and env["fsdp2"]["FSDP_VERSION"] == "2"
    assert not {k for k in env["ddp"] if "DEEPSPEED" in k or k.startswith("FSDP_")}
    launched = {}
    monkeypatch.setattr(launch, "accelerate_launch", lambda config, worker, batch, **kw: launched.update(
        config=config, batch=json.loads(Path(batch).read_text())))
    runs = [launch.Run.of(name, 2, dict(name=name)) for name in ("zero3", "fsdp2", "ddp")]
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    launch.run_cases(runs, dirs)
    assert launched["config"] == "zero3"
    for entry, name in zip(launched["batch"], ("zero3", "fsdp2", "ddp")):
        assert entry["environment"]["set"] == env[name]
        others = set(env["zero3"]) | set(env["fsdp2"]) | set(env["ddp"])
        assert set(entry["environment"]["unset"]) == others - set(env[name])
