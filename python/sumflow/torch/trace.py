"""The training script's side of the worker's Chrome trace (see ``docs/tracing.md``).

Spans and instants recorded here appear in the worker's trace file on Python tracks of
their own, next to what the communication service recorded, on the same clock::

    from sumflow.torch import trace

    for batch in loader:
        with trace.span("compute", "forward", batch=i):
            loss = model(batch)
        ...
        optimizer.step()  # DistributedOptimizer marks the step itself
        trace.mark_step()  # only without DistributedOptimizer (e.g. the DDP hook)

Nothing is recorded unless the worker traces (``sumflow-run --trace DIR`` or
``SUMFLOW_TRACE_DIR``) and the current step lies in the trace window, or a timeline runs
(``start_timeline``, which then holds them too); otherwise a span costs one attribute read
of the service. Spans on one track must nest (each inside the last one still open, as on
a call stack): give concurrent activities tracks of their own.
"""

from __future__ import annotations

from types import TracebackType

from sumflow import _core
from sumflow.torch import _runtime

#: Argument values shown with an event; other types are shown as their ``str()``.
ArgValue = int | float | str


class _Span:
    """A span being timed; recorded when the ``with`` block ends."""

    __slots__ = ("_args", "_name", "_service", "_start", "_track")

    def __init__(
        self, service: _core.CommunicationService, track: str, name: str, args: dict[str, object]
    ) -> None:
        self._service = service
        self._track = track
        self._name = name
        self._args = args
        self._start = 0

    def __enter__(self) -> None:
        self._start = self._service.trace_now()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = self._service.trace_now()
        if exc_type is not None:
            self._args["error"] = exc_type.__name__
        self._service.trace_span(self._track, self._name, self._start, end, self._args or None)


class _NoSpan:
    """What ``span`` returns when nothing is recorded."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


def recording() -> bool:
    """Whether events are being recorded now (the worker traces and the step is in the
    window, or a timeline runs): a guard for building costly arguments."""
    rt = _runtime.running()
    return rt is not None and rt.service.tracing


def span(track: str, name: str, **args: ArgValue) -> _Span | _NoSpan:
    """A context manager that records its ``with`` block as the slice ``name`` on the
    track ``track``, with ``args`` shown when the slice is selected. If the block raises,
    the slice gets an ``error`` argument naming the exception, which propagates."""
    rt = _runtime.running()
    if rt is None or not rt.service.tracing:
        return _NO_SPAN
    return _Span(rt.service, track, name, dict(args))


def instant(track: str, name: str, **args: ArgValue) -> None:
    """Records a moment (a decision, a change of settings) on the track ``track``."""
    rt = _runtime.running()
    if rt is not None and rt.service.tracing:
        rt.service.trace_instant(track, name, None, args or None)


def mark_step() -> None:
    """Ends the current training step (its backward pass) for the scheduler and the trace
    window. When this closes the window the trace is written, and its path printed on
    stderr. ``DistributedOptimizer.step()`` calls it; without that optimizer, call it once
    per step after backward.

    Raises ``ValueError`` before ``sumflow.torch.init()`` and ``OSError`` if the trace
    cannot be written."""
    _runtime.report_trace(_runtime.current().service.mark_step())
