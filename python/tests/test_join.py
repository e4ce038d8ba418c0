"""hvd.join() across a job of three workers and one CPU server, and of two machines of two
workers each, whose sums are aggregated inside each machine first (join_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import assert_every_worker_reported_ok, run_worker_processes

WORKER = str(Path(__file__).with_name("join_worker.py"))


@pytest.mark.parametrize(
    ("workers", "machines", "cpu_servers"), [(3, None, 1), (4, 2, 0)], ids=["3x1", "2x2"]
)
def test_joined_workers_count_as_zeros_gathers_fail_and_everything_works_after(
    tmp_path: Path, workers: int, machines: int | None, cpu_servers: int
) -> None:
    outcomes = run_worker_processes(
        tmp_path,
        workers,
        [WORKER, str(tmp_path)],
        cpu_servers,
        colocated=cpu_servers == 0,
        machines=machines,
        env={"SUMFLOW_TIMEOUT": "60"},
    )
    assert_every_worker_reported_ok(tmp_path, outcomes)
