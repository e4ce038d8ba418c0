"""Horovod's process sets: subsets of the workers an operation spans.

``add_process_set(ranks)`` is called by every worker, in the same order, as in Horovod;
each set gets the next id. An operation with ``process_set=`` is agreed and summed among
the set's members only: its keys are declared with their member list, so a summation
server's round counts the members alone. A worker outside the set that calls it gets a
``ValueError``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sumflow.torch import _runtime


class ProcessSet:
    """A set of worker ranks. ``ProcessSet(None)``, ``global_process_set``, is every worker."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        if ranks is not None:
            values = [int(r) for r in ranks]
            if len(set(values)) != len(values):
                raise ValueError(f"a process set lists each rank once, not {values}")
            ranks = sorted(values)
        self._ranks: list[int] | None = ranks
        #: Set by ``add_process_set`` (0 for the global set); None until registered.
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
        if self._ranks is None:
            return "ProcessSet(global)"
        return f"ProcessSet({self._ranks}, id={self.process_set_id})"


global_process_set = ProcessSet()
_registered: dict[int, ProcessSet] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


@dataclass(frozen=True)
class Group:
    """The workers one operation spans, as the operation needs them."""

    #: Members' worker ranks, ascending.
    ranks: list[int]
    #: This worker's index among them.
    rank: int
    #: The member list keys are declared with; None for every worker.
    members: list[int] | None
    #: What the set adds to tensor names ("" for every worker).
    tag: str

    @property
    def size(self) -> int:
        return len(self.ranks)


def group_of(process_set: Any, what: str) -> Group:
    """The group `process_set` stands for (None: every worker); a ValueError when this
    worker is not a member or the set is not registered, a TypeError for anything else."""
    service = _runtime.current().service
    if process_set is None or process_set is global_process_set:
        return Group(list(range(service.size)), service.rank, None, "")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"{what}: process_set must be a sumflow.torch.ProcessSet, not {process_set!r}"
        )
    with _lock:
        known = (
            process_set.process_set_id is not None
            and _registered.get(process_set.process_set_id) is process_set
        )
    if not known:
        raise ValueError(
            f"{what}: {process_set!r} is not registered: call add_process_set() on every worker "
            "first (or pass it to init(process_sets=...))"
        )
    ranks = process_set.ranks
    if service.rank not in ranks:
        raise ValueError(
            f"{what}: worker {service.rank} is not a member of {process_set!r}; only its "
            "members may run its operations"
        )
    if ranks == list(range(service.size)):
        return Group(ranks, service.rank, None, "")
    return Group(ranks, ranks.index(service.rank), ranks, f"ps{process_set.process_set_id}.")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set (every worker must call it, in the same order) and returns
    it, with its id."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size = _runtime.current().service.size
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad or not ps.ranks:
        raise ValueError(
            f"process set {ps!r}: ranks {bad or '[]'} are not worker ranks (0 to {size - 1})"
        )
    if ps is global_process_set:
        return ps
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    with _lock:
        ps.process_set_id = next(_ids)
        _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set; False for the global set or one not registered."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    with _lock:
        removed = _registered.pop(process_set.process_set_id, None) is not None
    process_set.process_set_id = None
    return removed


def reset() -> None:
    """Forgets every registered set (at shutdown)."""
    global _ids
    with _lock:
        for ps in _registered.values():
            ps.process_set_id = None
        _registered.clear()
        _ids = itertools.count(1)
