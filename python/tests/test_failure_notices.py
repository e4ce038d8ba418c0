"""Failures the coordinator detects reach the operations that depend on the failed node
at once (issue 24): a summation server that hangs with its sockets open (SIGSTOP) fails
every worker's sums within the heartbeat timeout, naming it, instead of after the
operation timeout; when the coordinator hangs, the servers stop by themselves and the job
ends within the heartbeat timeout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sumflow import _core
from sumflow.torch import _runtime

HERE = Path(__file__).parent
HEARTBEAT = 2.0


def launch(flags: list[str], worker: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs `worker` (a file beside this one) with `args` as a two-worker job of sumflow-run
    with `flags`, in an environment without SUMFLOW_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    launcher = [sys.executable, "-m", "sumflow.launcher", "-np", "2", *flags]
    return subprocess.run(
        [*launcher, sys.executable, str(HERE / worker), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def run_job(tmp_path: Path, target: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs failure_notice_worker.py on two one-worker machines, stopping `target`; returns
    the launcher's result and how long the job ran."""
    started = time.monotonic()
    # The operation timeout is far beyond what the tests allow: only the notice can end
    # the sums in time.
    flags = ["--machine-per-worker", "--heartbeat-timeout", str(HEARTBEAT), "--timeout", "120"]
    try:
        run = launch(flags, "failure_notice_worker.py", str(tmp_path), target)
    finally:
        stopped = tmp_path / "stopped.json"
        for pid in json.loads(stopped.read_text()) if stopped.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert json.loads((tmp_path / "stopped.json").read_text()), run.stderr[-3000:]
    return run, time.monotonic() - started


def results(tmp_path: Path) -> list[dict[str, Any]]:
    """What each worker that got to write it recorded."""
    found = (tmp_path / f"{rank}.json" for rank in range(2))
    return [json.loads(p.read_text()) for p in found if p.exists()]


def check_failed_in_time(got: dict[str, Any]) -> None:
    assert got["failed"], got
    assert got["type"] == "NodeFailedError", got
    # Noticed within the heartbeat timeout, plus a heartbeat's slack and the sums' time.
    assert got["seconds"] < 2 * HEARTBEAT + 3, got


def test_a_hung_server_fails_every_workers_sums_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    run, _ = run_job(tmp_path, "servers")
    log = run.stdout[-3000:] + run.stderr[-3000:]
    got = results(tmp_path)
    assert len(got) == 2, log
    for r in got:
        check_failed_in_time(r)
    # Each worker's sum waits on the stopped servers; the first to fail may end the
    # other's by leaving the job before its own notice comes, which is named too.
    assert any("the coordinator declared it failed: no heartbeat" in r["message"] for r in got)
    assert run.returncode != 0, log
    # The launcher blames the server that hung, not the process it saw exit first (a
    # worker, or the coordinator ending a job with failed nodes).
    blamed = r"exited with code 1, after server \d '.*' \(pid \d+ on .*\) failed: no heartbeat"
    assert re.search(blamed, run.stderr), log
    # The core's own warning reaches the worker's stderr, as plain text (no colour codes
    # in a pipe or a file).
    assert re.search(r"\[worker \d\] .*WARN.*lost a summation server", run.stderr), log
    assert "\x1b[" not in run.stdout + run.stderr, log


def test_servers_that_lose_their_coordinator_stop_and_the_job_ends(tmp_path: Path) -> None:
    run, took = run_job(tmp_path, "coordinator")
    log = run.stdout[-3000:] + run.stderr[-3000:]
    # The first server to notice ends the job (the launcher then stops the rest).
    assert re.search(r"\[server \d\].*the job is gone; stopping", run.stderr), log
    assert re.search(r"server \d \(pid \d+\) exited with code 1", run.stderr), log
    assert run.returncode != 0, log
    # The launcher stops the job as soon as a server exits 1: a worker may not get to
    # record its own failure, but one that does names the lost coordinator in time.
    for r in results(tmp_path):
        check_failed_in_time(r)
        # Its own notice, or (a worker noticing a few hundred ms before the other and
        # leaving) the server's word that the other left: either way, in time.
        assert "coordinator" in r["message"] or "left the job" in r["message"], r
    # Start-up, three sums, the heartbeat timeout and the launcher's grace for the
    # stopped coordinator (5 s): nowhere near the 120 s operation timeout.
    assert took < 45, log


class _BrokenService:
    """A service whose job is gone: leaving it fails, as after a lost coordinator."""

    def trace_flush(self) -> None:
        return None

    def shutdown(self, reason: str) -> None:
        raise _core.NodeFailedError("coordinator at 127.0.0.1:1 is unreachable: no reply")


def test_leaving_a_broken_job_at_exit_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime = _runtime.Runtime(service=_BrokenService(), timeout=1.0)  # type: ignore[arg-type]
    monkeypatch.setattr(_runtime, "_runtime", runtime)
    _runtime._shutdown_at_exit()
    err = capsys.readouterr().err
    assert err == "sumflow: leaving the job: coordinator at 127.0.0.1:1 is unreachable: no reply\n"
    assert _runtime._runtime is None
    # Called by the script itself, it raises as before.
    monkeypatch.setattr(_runtime, "_runtime", runtime)
    with pytest.raises(_core.NodeFailedError):
        _runtime.shutdown()


@pytest.mark.parametrize(
    ("how", "owes"),
    [
        ([], "this machine's shared memory, waiting for workers [1] to push"),
        (["--machine-per-worker"], "from server"),
    ],
    ids=["shared-memory", "servers"],
)
def test_a_stalled_wait_says_what_it_waits_for(how: list[str], owes: str) -> None:
    run = launch(["-x", "SUMFLOW_STALL_WARNING=1", *how], "stall_worker.py", "3.5")
    log = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, log
    # The wait is the agreement's (Horovod's negotiation) on the late sum.
    pattern = r"\[worker 0\] .*WARN.*tensor '(?:agree\.)?allreduce\.late': still waiting.*"
    warnings = re.findall(pattern, log)
    # Warned after 1 s, again after 2 s and 3 s, and the sum then completed.
    assert len(warnings) >= 2, log
    assert owes in warnings[0], warnings[0]
    assert not re.search(r"\[worker 1\] .*still waiting", log), log
    if how:
        # Through the servers, the server names the worker that has not pushed.
        named = (
            r"\[worker 0\] .*WARN.*round \d+ has waited \d+ s on server \d .* "
            r"for rank 1 'worker 1', which has not pushed it"
        )
        assert re.search(named, log), log
    # The waiting side (the server, or worker 0 in shared memory) tells the coordinator,
    # which names the stalled worker too.
    told = r"\[coordinator\] .*WARN.*worker 1 'worker 1': has not pushed round \d+ of tensor"
    assert re.search(told, log), log


@pytest.mark.parametrize("how", [[], ["--machine-per-worker"]], ids=["shared-memory", "servers"])
def test_the_launcher_blames_a_stalled_worker_not_the_one_that_gave_up_waiting(
    how: list[str],
) -> None:
    flags = [*how, "--timeout", "4", "-x", "SUMFLOW_STALL_WARNING=1"]
    run = launch(flags, "stall_worker.py", "60")
    log = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode != 0, log
    blamed = (
        r"worker 0 \(pid \d+\) exited with code 1, after worker 1 'worker 1' \(pid \d+ on "
        r"[^)]+\) stalled: has not pushed round \d+ of tensor '[^']*late'"
    )
    assert re.search(blamed, run.stderr), log
    # Worker 0's own error names the worker it waited for, as the server told it.
    waited_for = r"rank 1 'worker 1' to push" if how else r"waiting for workers \[1\] to push"
    assert re.search(r"\[worker 0\] .*timed out after .*" + waited_for, run.stderr), log
