"""Every Horovod collective against a reference, on 1 to 4 workers and 0 to 2 CPU
summation servers (collectives_worker.py does the checking, for every dtype), and the
errors that must reach every worker while the job goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import assert_every_worker_reported_ok, run_worker_processes

WORKER = str(Path(__file__).with_name("collectives_worker.py"))
ERRORS = str(Path(__file__).with_name("collective_errors_worker.py"))
WIRE_BYTES = str(Path(__file__).with_name("wire_bytes_worker.py"))


@pytest.mark.parametrize(("workers", "cpu_servers"), [(1, 0), (2, 2), (3, 1), (4, 0)])
def test_every_collective_matches_its_reference(
    tmp_path: Path, workers: int, cpu_servers: int
) -> None:
    outcomes = run_worker_processes(tmp_path, workers, [WORKER, str(tmp_path)], cpu_servers)
    assert_every_worker_reported_ok(tmp_path, outcomes)


def test_bad_calls_fail_that_call_on_every_worker_and_the_job_goes_on(tmp_path: Path) -> None:
    outcomes = run_worker_processes(tmp_path, 3, [ERRORS, str(tmp_path)], 1)
    assert_every_worker_reported_ok(tmp_path, outcomes)


@pytest.mark.parametrize(("workers", "cpu_servers"), [(3, 0), (2, 2)])
def test_collectives_move_only_the_bytes_they_need(
    tmp_path: Path, workers: int, cpu_servers: int
) -> None:
    outcomes = run_worker_processes(tmp_path, workers, [WIRE_BYTES, str(tmp_path)], cpu_servers)
    assert_every_worker_reported_ok(tmp_path, outcomes)
