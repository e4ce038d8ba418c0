"""Horovod's process sets: subsets of the workers an operation spans.

Only the global set, every worker, is carried today: a summation server's round counts
every worker of the job, so an operation over a subset needs rounds that count the
set's members only (planned: docs/torch.md lists it). Asking for another set is a clear
``NotImplementedError``, never an operation silently widened to every worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sumflow.torch import _runtime


class ProcessSet:
    """A set of worker ranks. ``ranks`` None means every worker (the global set)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self._ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: int | None = 0 if ranks is None else None

    @property
    def ranks(self) -> list[int]:
        """The members' ranks, ascending."""
        if self._ranks is None:
            return list(range(_runtime.current().service.size))
        return list(self._ranks)

    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    def rank(self) -> int:
        """This worker's index among the members; -1 when it is not one."""
        me = _runtime.current().service.rank
        ranks = self.ranks
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        """Whether this worker is a member."""
        return self.rank() >= 0

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet({self._ranks})"


global_process_set = ProcessSet()


def check_global(process_set: Any) -> None:
    """Accepts None and the global set (or a set of every worker); anything else is a
    NotImplementedError saying what sumflow does instead."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet):
        if process_set.ranks == list(range(_runtime.current().service.size)):
            return
        raise NotImplementedError(
            f"{process_set!r}: operations over a subset of the workers are not supported by "
            "sumflow yet (every summation round counts every worker); use the global set"
        )
    raise TypeError(f"process_set must be a sumflow.torch.ProcessSet, not {process_set!r}")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set. Only a set of every worker can be used today."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size = _runtime.current().service.size
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"process set {ps!r}: ranks {bad} are not worker ranks (0 to {size - 1})")
    check_global(ps)
    ps.process_set_id = 0
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set; the global set cannot be removed (returns False)."""
    return process_set is not global_process_set and process_set.process_set_id is not None
