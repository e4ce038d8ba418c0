"""The online protocol (ByteScheduler §5): rank 0 tunes and decides, every worker switches
at the same step.

Every worker counts its optimizer steps. At a trial boundary every worker

1. drains its communication (no push_pull in flight: the service refuses to switch
   under one),
2. takes part in a broadcast of rank 0's decision (rank 0 makes it from the step times
   it measured since the last boundary), and
3. applies it: ``reconfigure`` with the same values, at the same step, on every worker.

The decision also says how many steps run until the next boundary, so only rank 0's
settings count; the first boundary is after the first step. After the last decision the
tuner does nothing but count, and ``after_step`` costs one comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from sumflow.tune.session import Decision, TuningSession


class Reconfigurable(Protocol):
    """What the tuner needs of the communication service (and, for the fusion
    threshold, of the optimizer)."""

    def reconfigure(
        self,
        partition_bytes: int | None = None,
        credit_bytes: int | None = None,
        fusion_bytes: int | None = None,
    ) -> None: ...


class OnlineTuner:
    """One worker's part. `open_session` makes rank 0's decision maker (None on other
    ranks), at the first boundary, so that a failure to set it up reaches every worker;
    `broadcast(obj)` returns rank 0's `obj` on every worker; `drain()` returns once no
    communication is in flight."""

    def __init__(
        self,
        service: Reconfigurable,
        broadcast: Callable[[Any], Any],
        drain: Callable[[], None],
        open_session: Callable[[], TuningSession] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._broadcast = broadcast
        self._drain = drain
        self._open_session = open_session
        self._session: TuningSession | None = None
        self._clock = clock
        self._step = 0
        self._next_boundary: int | None = 1
        self._last = clock()
        self._step_times: list[float] = []

    @property
    def done(self) -> bool:
        """Whether tuning is over (the final configuration is applied)."""
        return self._next_boundary is None

    def after_step(self) -> None:
        """Called by every worker once per optimizer step, after the step."""
        if self._next_boundary is None:
            return
        self._step += 1
        now = self._clock()
        if self._open_session is not None:
            self._step_times.append(now - self._last)
        self._last = now
        if self._step == self._next_boundary:
            self._boundary(now)

    def _boundary(self, started: float) -> None:
        self._drain()
        wire: dict[str, Any] | None = None
        failure: Exception | None = None
        if self._open_session is not None:
            try:
                if self._session is None:
                    self._session = self._open_session()
                    decision = self._session.begin()
                else:
                    decision = self._session.end_trial(self._step_times)
                wire = decision.to_wire()
            except Exception as e:
                # The others are already waiting in the broadcast: tell them, so that
                # every worker fails now, naming the cause, instead of timing out.
                failure = e
                wire = {"error": f"{type(e).__name__}: {e}"}
        wire = self._broadcast(wire)
        if "error" in wire:
            self._next_boundary = None
            if failure is not None:
                raise failure
            raise RuntimeError(f"auto-tuning failed on rank 0: {wire['error']}")
        decision = Decision.from_wire(wire)
        if decision.apply is not None:
            self._service.reconfigure(
                partition_bytes=decision.apply.partition_bytes,
                credit_bytes=decision.apply.credit_bytes,
                fusion_bytes=decision.apply.fusion_bytes,
            )
        self._next_boundary = None if decision.steps is None else self._step + decision.steps
        self._step_times = []
        # The next trial's first step is timed from here: the boundary's own cost is
        # accounted separately, not charged to the configuration.
        self._last = self._clock()
        if self._session is not None:
            self._session.add_overhead(self._last - started)
