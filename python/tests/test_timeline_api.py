"""Horovod's timeline (sumflow.torch.timeline), without a job: what it asks of the
communication service, shown by a stand-in that records the calls. The service's own side
(a trace of an interval, written with the partitions) and a timeline of a real job are
tested in test_trace.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from sumflow import _core
from sumflow.torch import _runtime, timeline


class Service:
    """Records what the timeline asks of ``CommunicationService``; its clock ticks by 10
    ns at each reading."""

    def __init__(self) -> None:
        self.clock = 0
        self.calls: list[tuple[Any, ...]] = []
        self.refuse: Exception | None = None

    def trace_now(self) -> int:
        self.clock += 10
        return self.clock

    def trace_span(
        self, track: str, name: str, start: int, end: int, args: dict[str, Any] | None = None
    ) -> None:
        self.calls.append(("span", track, name, start, end, args))

    def trace_instant(
        self, track: str, name: str, at: int | None = None, args: dict[str, Any] | None = None
    ) -> None:
        self.calls.append(("instant", track, name, at))

    def trace_interval_start(self, path: Path, max_events: int | None = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.calls.append(("start", path))

    def trace_interval_stop(self) -> None:
        self.calls.append(("stop",))


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    svc = Service()
    rt = _runtime.Runtime(cast(_core.CommunicationService, svc), timeout=1.0)
    monkeypatch.setattr(_runtime, "_runtime", rt)
    yield svc
    timeline.stop_timeline()


def test_phases_become_slices_on_the_tensors_track(service: Service, tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline.start_timeline(path, mark_cycles=True)
    timeline.phase("allreduce.x", "NEGOTIATE_ALLREDUCE")  # at 10
    timeline.phase("allgather.y", "NEGOTIATE_ALLGATHER")  # 20
    timeline.phase("allreduce.x", "ALLREDUCE")  # 30
    timeline.phase("allreduce.x", None)  # 40
    timeline.stop_timeline()  # 50
    x = {"tensor": "allreduce.x"}
    assert service.calls == [
        ("start", path),
        ("span", "allreduce.x", "NEGOTIATE_ALLREDUCE", 10, 30, x),
        # mark_cycles: a cycle begins with each data stage, not with an agreement.
        ("instant", timeline.CYCLES_TRACK, "CYCLE_START", 30),
        ("span", "allreduce.x", "ALLREDUCE", 30, 40, x),
        # A phase still open when the timeline stops is recorded up to the stop, and says so.
        (
            "span",
            "allgather.y",
            "NEGOTIATE_ALLGATHER",
            20,
            50,
            {"tensor": "allgather.y", "cut short": timeline.CUT_SHORT},
        ),
        ("stop",),
    ]


def test_without_mark_cycles_no_cycle_is_marked(service: Service, tmp_path: Path) -> None:
    timeline.start_timeline(tmp_path / "t.json")
    timeline.phase("allreduce.x", "ALLREDUCE")
    timeline.phase("allreduce.x", None)
    timeline.stop_timeline()
    assert [c[0] for c in service.calls] == ["start", "span", "stop"]


def test_nothing_is_recorded_when_no_timeline_runs(service: Service) -> None:
    timeline.phase("allreduce.x", "ALLREDUCE")  # no timeline: no effect, no error
    timeline.phase("allreduce.x", None)
    timeline.stop_timeline()
    assert service.calls == []


def test_starting_again_writes_the_running_timeline_first(service: Service, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    timeline.start_timeline(a)
    timeline.phase("allreduce.x", "NEGOTIATE_ALLREDUCE")
    timeline.start_timeline(b)
    timeline.phase("allreduce.x", "ALLREDUCE")  # its agreement was a's
    timeline.stop_timeline()
    assert [c[:3] for c in service.calls] == [
        ("start", a),
        ("span", "allreduce.x", "NEGOTIATE_ALLREDUCE"),
        ("stop",),
        ("start", b),
        ("span", "allreduce.x", "ALLREDUCE"),
        ("stop",),
    ]


def test_a_refused_start_leaves_no_timeline_running(service: Service, tmp_path: Path) -> None:
    service.refuse = OSError("its directory does not exist")
    with pytest.raises(OSError, match="does not exist"):
        timeline.start_timeline(tmp_path / "nowhere" / "t.json")
    timeline.phase("allreduce.x", "ALLREDUCE")
    timeline.stop_timeline()
    assert service.calls == []


def test_a_timeline_needs_init(tmp_path: Path) -> None:
    assert _runtime.running() is None
    with pytest.raises(ValueError, match="not initialised"):
        timeline.start_timeline(tmp_path / "t.json")
    timeline.phase("allreduce.x", "ALLREDUCE")
    timeline.stop_timeline()
    assert not list(tmp_path.iterdir())
