"""Horovod's timeline: ``start_timeline(path)`` records each operation's agreement
(``NEGOTIATE_<KIND>``) and data stage (``<KIND>``), one track per tensor, until
``stop_timeline()`` writes them as a Chrome trace (open it in ui.perfetto.dev).

It records operations of the Horovod API as this worker sees them; the communication
service's own trace (``SUMFLOW_TRACE_DIR``, docs/tracing.md) shows partitions, servers
and the scheduler.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

_lock = threading.Lock()


class _Timeline:
    def __init__(self, path: Path, mark_cycles: bool) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self.start_us = time.time_ns() // 1000
        self.events: list[dict[str, Any]] = []
        self.tracks: dict[str, int] = {}
        #: Tracks with a phase begun and not yet ended.
        self.open: set[int] = set()

    def _now(self) -> int:
        return time.time_ns() // 1000 - self.start_us

    def _track(self, name: str) -> int:
        tid = self.tracks.get(name)
        if tid is None:
            tid = self.tracks[name] = len(self.tracks) + 1
            self.events.append(
                {"name": "process_name", "ph": "M", "pid": tid, "args": {"name": name}}
            )
        return tid

    def phase(self, name: str, event: str | None) -> None:
        pid = self._track(name)
        ts = self._now()
        if pid in self.open:
            self.open.discard(pid)
            self.events.append({"ph": "E", "pid": pid, "ts": ts})
        if event is not None:
            if self.mark_cycles and not event.startswith("NEGOTIATE_"):
                self.events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": ts, "pid": 0})
            self.events.append({"name": event, "ph": "B", "pid": pid, "ts": ts})
            self.open.add(pid)

    def write(self) -> None:
        doc = {
            "traceEvents": self.events,
            "otherData": {"start_time_since_epoch_in_micros": self.start_us},
        }
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.path)


_active: _Timeline | None = None


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
    """Starts recording this worker's operations into `file_path` (written by
    ``stop_timeline``); a timeline already running is written and replaced."""
    global _active
    path = Path(file_path)
    if not path.parent.is_dir():
        raise OSError(f"start_timeline: directory {path.parent} does not exist")
    with _lock:
        previous, _active = _active, _Timeline(path, mark_cycles)
    if previous is not None:
        previous.write()


def stop_timeline() -> None:
    """Stops recording and writes the timeline; nothing if none is running."""
    global _active
    with _lock:
        timeline, _active = _active, None
    if timeline is not None:
        timeline.write()


def stop_quietly() -> None:
    """At shutdown: writes a running timeline, reporting rather than raising a failure."""
    try:
        stop_timeline()
    except OSError as e:
        import warnings

        warnings.warn(f"sumflow: timeline not written: {e}", stacklevel=2)


def phase(name: str, event: str | None) -> None:
    """Ends the open phase of tensor `name` and begins `event` (None: just ends it)."""
    with _lock:
        if _active is not None:
            _active.phase(name, event)
