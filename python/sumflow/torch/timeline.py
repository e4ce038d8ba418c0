"""Horovod's timeline, on the worker's Chrome trace (docs/tracing.md).

``start_timeline(path)`` ... ``stop_timeline()`` writes one Chrome trace at ``path`` of
that interval: each Horovod operation's agreement (``NEGOTIATE_<KIND>``) and data stage
(``<KIND>``) as slices on a track named after its tensor, above what the communication
service recorded meanwhile (each partition pushed to and received from each server, the
scheduler's decisions, the script's own ``sumflow.torch.trace`` spans), all on one clock.
The service records the interval on demand (``CommunicationService.trace_interval_start``),
independently of a ``SUMFLOW_TRACE_DIR`` window, which may run at the same time.

When no timeline runs, a phase costs one read of a module attribute.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sumflow import _core
from sumflow.torch import _runtime

#: The track of ``mark_cycles``'s ``CYCLE_START`` instants.
CYCLES_TRACK = "horovod cycles"
#: The argument a phase still open when the timeline stops gets.
CUT_SHORT = "the timeline stopped before this phase ended"

#: Serializes starting and stopping.
_lock = threading.Lock()


class _Timeline:
    """A running timeline: the phases begun and not yet ended, by tensor."""

    def __init__(self, service: _core.CommunicationService, path: Path, mark_cycles: bool) -> None:
        self.service = service
        self.path = path
        self.mark_cycles = mark_cycles
        #: Tensor -> (its phase, when it began on the trace clock).
        self.open: dict[str, tuple[str, int]] = {}
        self.lock = threading.Lock()

    def phase(self, name: str, event: str | None) -> None:
        service = self.service
        now = service.trace_now()
        with self.lock:
            begun = self.open.pop(name, None)
            if event is not None:
                self.open[name] = (event, now)
        if begun is not None:
            service.trace_span(name, begun[0], begun[1], now, {"tensor": name})
        if event is not None and self.mark_cycles and not event.startswith("NEGOTIATE_"):
            service.trace_instant(CYCLES_TRACK, "CYCLE_START", now)

    def stop(self) -> None:
        """Records the phases still open, cut short, and writes the file."""
        service = self.service
        now = service.trace_now()
        with self.lock:
            still_open, self.open = self.open, {}
        for name, (event, began) in still_open.items():
            service.trace_span(name, event, began, now, {"tensor": name, "cut short": CUT_SHORT})
        service.trace_interval_stop()


_active: _Timeline | None = None


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
    """Starts recording this worker's trace into `file_path` (written by
    ``stop_timeline``): the Horovod operations' phases, one track per tensor, and the
    communication service's partitions, servers and scheduler. With `mark_cycles`, a
    ``CYCLE_START`` instant marks each data stage's start. A timeline already running is
    written and replaced. Raises ``ValueError`` before ``init()`` and ``OSError`` if the
    directory of `file_path` does not exist."""
    global _active
    service = _runtime.current().service
    path = Path(file_path)
    with _lock:
        previous, _active = _active, None
        if previous is not None:
            previous.stop()
        service.trace_interval_start(path)
        _active = _Timeline(service, path, mark_cycles)


def stop_timeline() -> None:
    """Stops recording and writes the timeline; nothing if none is running."""
    global _active
    with _lock:
        timeline, _active = _active, None
        if timeline is not None:
            timeline.stop()


def stop_quietly() -> None:
    """At shutdown: writes a running timeline, reporting rather than raising a failure."""
    try:
        stop_timeline()
    except OSError as e:
        import warnings

        warnings.warn(f"sumflow: timeline not written: {e}", stacklevel=2)


def running() -> bool:
    """Whether a timeline runs: a guard for work done only to record phases."""
    return _active is not None


def phase(name: str, event: str | None) -> None:
    """Ends the open phase of tensor `name` and begins `event` (None: just ends it)."""
    timeline = _active
    if timeline is not None:
        timeline.phase(name, event)
