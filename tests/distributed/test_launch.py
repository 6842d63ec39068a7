"""The launcher of the multi-process tests (launch.run) on a command that hangs: it fails the test in bounded time
and leaves no process behind, also one the command started in a session of its own (as torchrun starts its ranks),
whose open output would otherwise keep the test waiting forever."""

from __future__ import annotations

import os
import sys
import time

import pytest

import launch


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


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
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"still running after 5 s(.|\n)*launched"):
        launch.run([sys.executable, str(script)], cuda=False)
    assert time.monotonic() - start < 45
    rank = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_run_reports_a_failing_command(tmp_path):
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
