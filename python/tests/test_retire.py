"""Tensors that will never be used again are retired everywhere: a loop of unnamed
operations, of allgathers whose sizes change, and of a name whose shape alternates keeps
the servers' keys and the coordinator's table small, whatever the number of iterations."""

from __future__ import annotations

import json
import re
from pathlib import Path

from jobs import run_worker_processes

WORKER = str(Path(__file__).with_name("retire_worker.py"))

#: Far below the ~1,000 tensors the loop declares over its life (300 + 2 x 100
#: operations, each with an agreement table and data tensors or regions).
BOUND = 40


def test_retired_tensors_keep_keys_and_names_bounded(tmp_path: Path) -> None:
    logs: list[str] = []
    outcomes = run_worker_processes(tmp_path, 2, [WORKER, str(tmp_path)], 1, service_logs=logs)
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
        report = json.loads((tmp_path / f"rank{o.rank}.json").read_text())
        assert report["failures"] == [], report["failures"]
        # Named tensors stay (one layout each); everything unnamed is gone.
        assert report["python_live"] <= 12, report
        assert report["core_live"] == report["python_live"], report
    coordinator, servers = logs[0], logs[1:]
    table = re.findall(
        r"tensor table: (\d+) live at the end, at most (\d+) at once, (\d+) retired", coordinator
    )
    assert table, coordinator[-3000:]
    live, peak, retired = map(int, table[-1])
    assert live <= BOUND, coordinator[-3000:]
    assert peak <= BOUND, coordinator[-3000:]
    assert retired >= 700, f"only {retired} tensors left the coordinator's table"
    freed_total = 0
    for log in servers:
        keys = re.findall(r"keys: (\d+) live at the end, at most (\d+) at once, (\d+) freed", log)
        assert keys, log[-3000:]
        live, peak, freed = map(int, keys[-1])
        assert live <= BOUND, log[-3000:]
        assert peak <= BOUND, log[-3000:]
        freed_total += freed
    assert freed_total >= 700, f"servers freed only {freed_total} keys"
