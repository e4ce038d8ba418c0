"""Failures the coordinator detects reach the operations that depend on the failed node
at once (issue 24): a summation server that hangs with its sockets open (SIGSTOP), and a
lost coordinator, fail every worker's sums within the heartbeat timeout, naming the node,
instead of after the operation timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HEARTBEAT = 2.0


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("servers", "the coordinator declared it failed: no heartbeat"),
        ("coordinator", "is lost"),
    ],
)
def test_a_hung_node_fails_every_workers_sums_within_the_heartbeat_timeout(
    tmp_path: Path, target: str, needle: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "sumflow.launcher",
                "-np",
                "2",
                "--machine-per-worker",
                "--heartbeat-timeout",
                str(HEARTBEAT),
                # Far beyond what the test allows: only the notice can end the sums in time.
                "--timeout",
                "120",
                sys.executable,
                str(HERE / "failure_notice_worker.py"),
                str(tmp_path),
                target,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    finally:
        stopped = tmp_path / "stopped.json"
        for pid in json.loads(stopped.read_text()) if stopped.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((tmp_path / "stopped.json").read_text()), log
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank, got in enumerate(results):
        assert got["failed"], (rank, got, log)
        assert got["type"] == "NodeFailedError", (rank, got)
        # Noticed within the heartbeat timeout, plus a heartbeat's slack and the sums' time.
        assert got["seconds"] < 2 * HEARTBEAT + 3, (rank, got)
    # Each worker's own heartbeat notices the loss; the first to fail may end the other's
    # sum by leaving the job before its own notice comes, which is named too.
    assert any(needle in got["message"] for got in results), results
    assert run.returncode != 0, log
