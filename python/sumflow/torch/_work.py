"""Operations in flight, from the caller's side: handles, and the negotiation driver.

An operation is a ``Work``: ``poll`` says whether it is done, ``wait`` returns its result.
``CoreWork`` is one or more sums in the core followed by a finishing step in Python.
``NegotiatedWork`` first agrees on the operation with every worker (``negotiate.py``);
once the agreement arrives, the driver thread starts the data stage, so the caller's
``*_async`` never blocks on other workers and operations still overlap each other.

A work knows the tensors it declared; those of a ``transient`` operation (an unnamed one,
whose names never recur) are retired once it is synchronized (``declarations.release``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sumflow import SumflowTimeoutError
from sumflow.torch import _runtime, _staging, declarations


class Work:
    """An operation in flight."""

    #: The name the operation was issued under (for "already in flight" checks).
    name: str = ""
    #: Whether its tensors are retired once it is synchronized (an unnamed operation).
    transient: bool = False

    def poll(self) -> bool:
        raise NotImplementedError

    def wait(self) -> Any:
        raise NotImplementedError

    def settled(self, ok: bool) -> list[int]:
        """The ids of the tensors it declared that no operation uses any more, once its
        wait returned (``ok``) or raised."""
        return []


class CoreWork(Work):
    """Sums in the core (their handles), then ``finish()``, whose value is the result.
    Sums of CUDA tensors are issued once their copies to host memory complete
    (``copies``: ``_staging.Staged``)."""

    def __init__(
        self,
        name: str,
        cores: list[int],
        finish: Callable[[], Any],
        tensors: list[int] | None = None,
        copies: list[_staging.Staged] | None = None,
    ) -> None:
        self.name = name
        self.cores = cores
        self.finish = finish
        #: The ids of the tensors its sums are of.
        self.tensors = tensors or []
        self.copies = copies or []

    def settled(self, ok: bool) -> list[int]:
        # Every core was waited for, failed or not; a timed-out one may still be in flight
        # (then the core refuses to retire it, and it stays).
        return list(self.tensors)

    def poll(self) -> bool:
        if not all(c.ready() for c in self.copies):
            return False
        self._issue_copied(0.0)
        service = _runtime.current().service
        return all(service.poll(c) for c in self.cores)

    def wait(self) -> Any:
        rt = _runtime.current()
        try:
            self._issue_copied(rt.timeout)
        finally:
            # Whatever was issued is waited for, so no sum is left holding a buffer.
            _wait_every(self.cores, lambda core: rt.service.wait(core, rt.timeout))
        return self.finish()

    def _issue_copied(self, timeout: float) -> None:
        """Moves the handles of the sums whose copies are done into ``cores``; raises the
        first copy's failure (a copy that timed out stays, to be waited for again)."""
        while self.copies:
            self.cores += self.copies[0].cores(timeout)
            self.copies.pop(0)

    def then(self, after: Callable[[Any], Any]) -> CoreWork:
        """This work with `after` applied to its result."""
        before = self.finish
        self.finish = lambda: after(before())
        return self


class NegotiatedWork(Work):
    """An agreement to reach (a core sum of the request table), then the data stage that
    ``start(table)`` issues; both run on the driver thread."""

    def __init__(
        self,
        name: str,
        core: int,
        start: Callable[[], Work],
        agreement: int | None = None,
        transient: bool = False,
    ) -> None:
        self.name = name
        self.core = core
        self.start = start
        #: The id of the agreement's table.
        self.agreement = agreement
        self.transient = transient
        self.agreed = False
        self.ready = threading.Event()
        self.data: Work | None = None
        self.error: BaseException | None = None

    def settled(self, ok: bool) -> list[int]:
        table = [self.agreement] if self.agreement is not None and self.agreed else []
        if self.data is None:
            return table
        return table + self.data.settled(ok) if ok else table

    def run(self) -> None:
        rt = _runtime.running()
        try:
            if rt is None:
                raise RuntimeError("sumflow was shut down before the operation was agreed")
            rt.service.wait(self.core, rt.timeout)
            self.agreed = True
            self.data = self.start()
        except BaseException as e:  # handed to the caller's wait()
            self.error = e
        finally:
            self.ready.set()

    def poll(self) -> bool:
        if not self.ready.is_set():
            return False
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data.poll()

    def wait(self) -> Any:
        timeout = _runtime.current().timeout
        # The driver's own wait has the same timeout; this one only bounds a stuck driver.
        if not self.ready.wait(timeout + 5.0):
            raise SumflowTimeoutError(
                f"'{self.name}': no agreement from every worker within {timeout:.0f} s"
            )
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data.wait()


class Chain(Work):
    """Operations already issued (their handles), and what to make of their results."""

    def __init__(self, name: str, handles: list[int], finish: Callable[[list[Any]], Any]) -> None:
        self.name = name
        self.handles = handles
        self.finish = finish

    def poll(self) -> bool:
        return all(poll(h) for h in self.handles)

    def wait(self) -> Any:
        return self.finish(_wait_every(self.handles, wait))


def _wait_every(handles: list[int], wait_one: Callable[[int], Any]) -> list[Any]:
    """Every handle's result. Each is waited for even after one fails, so none is left
    holding a buffer; then the first failure is raised."""
    results, errors = [], []
    for h in handles:
        try:
            results.append(wait_one(h))
        except BaseException as e:  # raised below, once every handle is done
            errors.append(e)
    if errors:
        raise errors[0]
    return results


class _Driver:
    """One thread that waits for agreements in the order they were asked for and starts
    each operation's data stage."""

    def __init__(self) -> None:
        self.queue: queue.Queue[NegotiatedWork | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="sumflow-negotiation", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            work = self.queue.get()
            if work is None:
                return
            work.run()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5.0)


_works: dict[int, Work] = {}
_in_flight: dict[str, int] = {}
_lock = threading.Lock()
_next_handle = itertools.count(1)
_driver: _Driver | None = None


def register(work: Work) -> int:
    """A handle for `work`; a NegotiatedWork is handed to the driver."""
    global _driver
    handle = next(_next_handle)
    with _lock:
        _works[handle] = work
        if work.name:
            _in_flight[work.name] = handle
        if isinstance(work, NegotiatedWork):
            if _driver is None:
                _driver = _Driver()
            _driver.queue.put(work)
    return handle


def check_not_in_flight(name: str) -> None:
    """Horovod's rule: one operation per name at a time, from its call until
    ``synchronize`` returns (even if it has finished meanwhile). A ValueError naming it."""
    with _lock:
        handle = _in_flight.get(name)
    if handle is not None:
        raise ValueError(
            f"an operation named '{name}' is already in flight (handle {handle}): "
            "synchronize it before reusing the name, or give this one another name"
        )


def _get(handle: int, pop: bool) -> Work:
    with _lock:
        work = _works.pop(handle, None) if pop else _works.get(handle)
        if work is not None and pop and _in_flight.get(work.name) == handle:
            del _in_flight[work.name]
    if work is None:
        raise ValueError(f"unknown handle {handle}: never issued, or already synchronized")
    return work


def poll(handle: int) -> bool:
    return _get(handle, pop=False).poll()


def wait(handle: int) -> Any:
    work = _get(handle, pop=False)
    ok = False
    try:
        result = work.wait()
        ok = True
        return result
    finally:
        _get(handle, pop=True)
        if work.transient:
            declarations.release(work.settled(ok))


def quiesce(timeout: float) -> None:
    """Waits until the driver has taken up every agreed operation issued so far (its data
    stage issued, or its failure known), so that every sum of this worker is in the core
    (``join()``, which then waits for the core's)."""
    with _lock:
        pending = [w for w in _works.values() if isinstance(w, NegotiatedWork)]
    deadline = time.monotonic() + timeout
    for work in pending:
        if not work.ready.wait(max(0.0, deadline - time.monotonic())):
            raise SumflowTimeoutError(
                f"join(): '{work.name}' has had no agreement from every worker within "
                f"{timeout:.0f} s"
            )


def reset() -> None:
    """Forgets every handle and stops the driver (at shutdown)."""
    global _driver
    with _lock:
        _works.clear()
        _in_flight.clear()
        driver, _driver = _driver, None
    if driver is not None:
        driver.stop()
