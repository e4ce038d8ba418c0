"""Horovod's timeline (sumflow.torch.timeline), without a job: phases become a Chrome trace
with one track per tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sumflow.torch import timeline


def test_phases_become_begin_and_end_events_on_the_tensors_track(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline.start_timeline(path, mark_cycles=True)
    timeline.phase("allreduce.x", "NEGOTIATE_ALLREDUCE")
    timeline.phase("allreduce.y", "NEGOTIATE_ALLGATHER")
    timeline.phase("allreduce.x", "ALLREDUCE")
    timeline.phase("allreduce.x", None)
    timeline.stop_timeline()
    doc = json.loads(path.read_text())
    assert doc["otherData"]["start_time_since_epoch_in_micros"] > 0
    events = doc["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M"}
    x = [(e["ph"], e.get("name")) for e in events if e.get("pid") == tracks["allreduce.x"]]
    assert x == [
        ("M", "process_name"),
        ("B", "NEGOTIATE_ALLREDUCE"),
        ("E", None),
        ("B", "ALLREDUCE"),
        ("E", None),
    ]
    # The other tensor's phase is still open: begun, never ended.
    y = [e["ph"] for e in events if e.get("pid") == tracks["allreduce.y"]]
    assert y == ["M", "B"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["CYCLE_START"]


def test_nothing_is_recorded_when_no_timeline_runs(tmp_path: Path) -> None:
    timeline.phase("allreduce.x", "ALLREDUCE")  # no timeline: no effect, no error
    timeline.stop_timeline()
    assert not list(tmp_path.iterdir())


def test_a_missing_directory_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="does not exist"):
        timeline.start_timeline(tmp_path / "nowhere" / "t.json")
