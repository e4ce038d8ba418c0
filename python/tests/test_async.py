"""AsyncOptimizer (BytePS §4.3): asynchronous training through the summation servers,
unbounded and under staleness bounds, with one worker made slow (async_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import assert_every_worker_reported_ok, run_worker_processes

import sumflow.torch as hvd

WORKER = str(Path(__file__).with_name("async_worker.py"))


@pytest.mark.parametrize(
    ("staleness", "cpu_servers"), [("none", 1), ("0", 0), ("2", 1)], ids=["free", "ssp0", "ssp2"]
)
def test_every_delta_reaches_the_servers_within_the_staleness_bound(
    tmp_path: Path, staleness: str, cpu_servers: int
) -> None:
    outcomes = run_worker_processes(
        tmp_path,
        3,
        [WORKER, str(tmp_path), staleness, "1"],
        cpu_servers,
        colocated=True,
        env={"SUMFLOW_TIMEOUT": "60"},
    )
    assert_every_worker_reported_ok(tmp_path, outcomes)


@pytest.mark.parametrize("staleness", [-1, 1.5, True, 1 << 32])
def test_a_bad_staleness_is_refused_by_name(staleness: object) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="staleness must be None"):
        hvd.AsyncOptimizer(torch.optim.SGD([p], lr=1.0), staleness=staleness)  # type: ignore[arg-type]
