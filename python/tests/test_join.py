"""hvd.join() across a job of three workers and one CPU server (join_worker.py)."""

from __future__ import annotations

from pathlib import Path

from jobs import run_worker_processes

WORKER = str(Path(__file__).with_name("join_worker.py"))


def test_joined_workers_count_as_zeros_gathers_fail_and_everything_works_after(
    tmp_path: Path,
) -> None:
    outcomes = run_worker_processes(
        tmp_path, 3, [WORKER, str(tmp_path)], 1, colocated=False, env={"SUMFLOW_TIMEOUT": "60"}
    )
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
        report = (tmp_path / f"rank{o.rank}.txt").read_text()
        assert report == "ok", f"worker {o.rank}:\n{report}"
