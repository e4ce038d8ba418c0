"""Communication scheduling from Python: every scheduler trains exactly, and the partition
size and credit switch during a job (docs/scheduling.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from jobs import run_worker_processes
from test_torch import results, run, trains_like_one_process

WORKER = str(Path(__file__).with_name("scheduling_worker.py"))


@pytest.mark.parametrize("scheduler", ["fifo", "p3", "prophet"])
def test_every_scheduler_trains_like_one_process(tmp_path: Path, scheduler: str) -> None:
    trains_like_one_process(tmp_path, {"SUMFLOW_SCHEDULER": scheduler})


def test_the_derived_partition_size_is_told_once_by_worker_0(tmp_path: Path) -> None:
    outcomes = run(tmp_path, 2, "train-sgd-1")
    results(tmp_path, outcomes)
    told = [o.stderr.count("tensors declared together") for o in outcomes]
    assert told == [1, 0], [o.stderr[-2000:] for o in outcomes]
    line = next(x for x in outcomes[0].stderr.splitlines() if "declared together" in x)
    assert "256 KiB partitions, the smallest derived size" in line, line
    assert "SUMFLOW_PARTITION_BYTES" in line, line


def test_a_stated_link_rate_raises_the_derived_size_and_trains_alike(tmp_path: Path) -> None:
    outcomes = trains_like_one_process(tmp_path, {"SUMFLOW_LINK_GBITS": "100"})
    line = next(x for x in outcomes[0].stderr.splitlines() if "declared together" in x)
    # 0.34 ms at 100 Gbit/s is BytePS's 4 MiB, however small the model.
    assert "100 Gbit/s links: 4 MiB partitions" in line, line
    assert "the smallest derived size at that link rate" in line, line


def test_partition_size_and_credit_switch_during_a_job(tmp_path: Path) -> None:
    outcomes = run_worker_processes(
        tmp_path, 2, [WORKER, str(tmp_path)], 1, env={"SUMFLOW_SCHEDULER": "prophet"}
    )
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    lines = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    refused = lines[0][0]
    assert "reconfigure() with 1 push_pull operation(s) in flight" in refused, refused
    for worker in lines:
        first, switched, last = (ast.literal_eval(line) for line in worker[1:])
        assert first["scheduler"] == "prophet"
        assert (first["partition_bytes"], first["credit_bytes"]) == (4 << 20, 8 << 20)
        assert (switched["partition_bytes"], switched["credit_bytes"]) == (256, 512)
        assert (last["partition_bytes"], last["credit_bytes"]) == (4 << 20, 512)


def test_an_unknown_scheduler_is_refused_by_name(tmp_path: Path) -> None:
    outcomes = run_worker_processes(
        tmp_path, 1, [WORKER, str(tmp_path)], 0, env={"SUMFLOW_SCHEDULER": "lifo"}
    )
    assert outcomes[0].returncode != 0
    assert "SUMFLOW_SCHEDULER='lifo': expected one of fifo, p3, bytescheduler, prophet" in (
        outcomes[0].stderr
    ), outcomes[0].stderr[-2000:]
