"""Who takes part in an elastic job, epoch by epoch: the hosts and their slots, the worker
processes on them, failures and the blacklist, and each epoch's ranks.

Pure bookkeeping with no processes or sockets, so every rule is tested alone
(``python/tests/test_membership.py``); ``sumflow.launcher.elastic`` drives it.

The rules (docs/elastic.md):

- A worker is started on each free slot of a host that is not blacklisted, up to
  ``max_np`` workers in all. A slot whose worker failed is not used again while its host
  stays listed: a failure says something about the slot. A host that the discovery script
  stops listing and lists again comes back with fresh slots (a preempted machine that
  returned).
- Every failure counts against its host; at ``blacklist_after`` failures the host is
  blacklisted: no worker starts there again and its workers leave at the next epoch.
- An epoch's members are the live workers of the previous one (minus those that must
  leave), in their previous rank order, then the workers that asked to join, grouped by
  host so that a machine's workers hold consecutive ranks. Rank 0 is therefore the
  oldest surviving worker, the one whose state the others take.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: A reply that tells a worker to ask again shortly.
WAIT: dict[str, Any] = {"wait": True}


@dataclass
class Worker:
    """A worker process of the job, named for its whole life."""

    name: str
    host: str
    slot: int
    alive: bool = True
    #: The last epoch it has left, from its requests (-1: it has not asked yet).
    asked_after: int | None = None
    #: Why it must leave the job at the next epoch, if it must.
    leave: str | None = None


@dataclass
class HandServer:
    """A summation server started by hand (``sumflow-server --elastic ADDR``)."""

    name: str
    #: The last epoch it has left, from its requests (-1: none yet).
    asked_after: int
    #: It asked to leave: it takes no part in the next epoch.
    retiring: bool = False


@dataclass(frozen=True)
class Place:
    """A worker's place in an epoch."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str


@dataclass
class Epoch:
    """One membership: its number, its members in rank order, and the coordinator they
    join (set once it listens)."""

    number: int
    members: list[str]
    places: dict[str, Place]
    coordinator: str | None = None
    #: Why it ended, once it has.
    ended: str | None = None
    #: Members that have taken their place (the coordinator's address) so far.
    placed: set[str] = field(default_factory=set)
    #: Summation servers started by hand that serve it, by name.
    hand_servers: list[str] = field(default_factory=list)
    #: When it ended (monotonic seconds).
    ended_at: float | None = None

    @property
    def machines(self) -> list[tuple[str, int]]:
        """(host, workers) per machine, in rank order."""
        out: list[tuple[str, int]] = []
        for name in self.members:
            host = self.places[name].host
            if out and out[-1][0] == host:
                out[-1] = (host, out[-1][1] + 1)
            else:
                out.append((host, 1))
        return out


@dataclass
class Membership:
    """The state of an elastic job's membership."""

    min_np: int
    max_np: int
    blacklist_after: int
    #: Hosts and their slots, in the order they were first listed.
    hosts: dict[str, int] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    epoch: Epoch | None = None
    failures: Counter[str] = field(default_factory=Counter)
    blacklisted: set[str] = field(default_factory=set)
    #: Slots whose worker failed, per host.
    retired: dict[str, set[int]] = field(default_factory=dict)
    #: Set when the CPU servers to run change: the next commit forms a new epoch.
    servers_changed: bool = False
    #: Summation servers started by hand, by name.
    servers: dict[str, HandServer] = field(default_factory=dict)
    #: Set once the training is over: servers and workers still asking are told to leave.
    finished: bool = False
    _started: int = 0

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ValueError(f"--min-np must be at least 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise ValueError(f"--max-np {self.max_np} is below --min-np {self.min_np}")
        if self.blacklist_after < 1:
            raise ValueError(f"--blacklist-after must be at least 1, got {self.blacklist_after}")

    # -- hosts and workers -------------------------------------------------------------

    def live(self) -> list[Worker]:
        """Workers whose process runs, in start order."""
        return [w for w in self.workers.values() if w.alive]

    def update_hosts(self, listed: list[tuple[str, int]]) -> list[str]:
        """Takes a new host list (the discovery script's); returns what changed, in words.
        Workers on a host no longer listed, or on a slot beyond its new count, must leave."""
        changes = []
        now = dict(listed)
        for host in list(self.hosts):
            if host not in now:
                del self.hosts[host]
                self.retired.pop(host, None)
                changes.append(f"host {host} is no longer listed")
        for host, slots in listed:
            before = self.hosts.get(host)
            if before != slots:
                changes.append(
                    f"host {host} listed with {slots} slot{'s' if slots != 1 else ''}"
                    + ("" if before is None else f" (was {before})")
                )
            self.hosts[host] = slots
        for w in self.live():
            if w.leave is None and (w.host not in self.hosts or w.slot >= self.hosts[w.host]):
                w.leave = f"host {w.host} slot {w.slot} is no longer listed"
        return changes

    def free_slots(self) -> list[tuple[str, int]]:
        """Where new workers start now: free slots of listed, not blacklisted hosts, in
        host order, as many as ``max_np`` allows."""
        room = self.max_np - sum(1 for w in self.live() if w.leave is None)
        taken = {(w.host, w.slot) for w in self.live()}
        free = []
        for host, slots in self.hosts.items():
            if host in self.blacklisted:
                continue
            for slot in range(slots):
                if (host, slot) not in taken and slot not in self.retired.get(host, set()):
                    free.append((host, slot))
        return free[: max(0, room)]

    def started(self, host: str, slot: int) -> Worker:
        """Records a worker started on ``host``'s ``slot``; returns it, named."""
        w = Worker(f"w{self._started}", host, slot)
        self._started += 1
        self.workers[w.name] = w
        return w

    def exited(self, name: str, failed: bool) -> tuple[str | None, bool]:
        """Records a worker's exit; returns (what it did to its host, in words, or None;
        whether the current epoch ends with it)."""
        w = self.workers[name]
        w.alive = False
        note = None
        if failed:
            self.failures[w.host] += 1
            self.retired.setdefault(w.host, set()).add(w.slot)
            if w.host not in self.blacklisted and self.failures[w.host] >= self.blacklist_after:
                self.blacklisted.add(w.host)
                note = (
                    f"host {w.host} blacklisted after {self.failures[w.host]} failure"
                    f"{'s' if self.failures[w.host] != 1 else ''} (--blacklist-after)"
                )
                for other in self.live():
                    if other.host == w.host and other.leave is None:
                        other.leave = f"host {w.host} is blacklisted"
        epoch = self.epoch
        ends = bool(failed and epoch and epoch.ended is None and name in epoch.places)
        return note, ends

    # -- epochs ------------------------------------------------------------------------

    def candidates(self) -> list[Worker]:
        """The members the next epoch would have, in rank order (see the module docs)."""
        previous = self.epoch.members if self.epoch is not None else []
        rank_of = {n: r for r, n in enumerate(previous)}
        chosen = [
            w
            for w in self.live()
            if w.leave is None
            and w.host not in self.blacklisted
            # The previous epoch's members come back; a new worker once it has asked, so
            # that no epoch waits for a process still starting.
            and (w.name in rank_of or w.asked_after is not None)
        ]
        host_order = list(self.hosts)

        def host_key(host: str) -> tuple[int, int]:
            ranks = [rank_of[w.name] for w in chosen if w.host == host and w.name in rank_of]
            if ranks:
                return (0, min(ranks))
            return (1, host_order.index(host) if host in host_order else len(host_order))

        by_host: dict[str, list[Worker]] = {}
        for w in chosen:
            by_host.setdefault(w.host, []).append(w)
        out: list[Worker] = []
        for host in sorted(by_host, key=host_key):
            out += sorted(
                by_host[host],
                key=lambda w: (w.name not in rank_of, rank_of.get(w.name, 0), int(w.name[1:])),
            )
        return out

    def form(self) -> Epoch:
        """The next epoch, from :meth:`candidates` (the caller checked there are enough);
        it becomes current once its coordinator is set."""
        members = self.candidates()
        machines: dict[str, int] = Counter(w.host for w in members)
        seen: Counter[str] = Counter()
        places = {}
        for rank, w in enumerate(members):
            places[w.name] = Place(rank, len(members), seen[w.host], machines[w.host], w.host)
            seen[w.host] += 1
        number = 0 if self.epoch is None else self.epoch.number + 1
        hand = [s.name for s in self.hand_servers_ready()]
        self.epoch = Epoch(number, [w.name for w in members], places, hand_servers=hand)
        self.servers_changed = False
        return self.epoch

    def hand_servers_ready(self) -> list[HandServer]:
        """The servers started by hand that the next epoch takes: those not retiring that
        wait to join, or that served the current epoch and have left it (one that has not
        asked again since is leaving it still, or dead)."""
        epoch = self.epoch
        return [
            s
            for s in self.servers.values()
            if not s.retiring
            and (epoch is None or s.name not in epoch.hand_servers or s.asked_after >= epoch.number)
        ]

    def hand_servers_settling(self) -> list[str]:
        """Servers started by hand that served the ended epoch and have not asked for the
        next yet (they are still leaving the old one)."""
        epoch = self.epoch
        if epoch is None or epoch.ended is None:
            return []
        return [
            n
            for n in epoch.hand_servers
            if n in self.servers
            and not self.servers[n].retiring
            and self.servers[n].asked_after < epoch.number
        ]

    def end(self, why: str, now: float = 0.0) -> None:
        """Ends the current epoch (a member failed or left it, or its services did) at
        monotonic time `now`."""
        if self.epoch is not None and self.epoch.ended is None:
            self.epoch.ended = why
            self.epoch.ended_at = now

    def pending(self) -> bool:
        """Whether the membership should change at the next commit: a worker waits to
        join, a member must leave, or the CPU servers change."""
        epoch = self.epoch
        if epoch is None:
            return False
        if self.servers_changed:
            return True
        for server in self.servers.values():
            serving = server.name in epoch.hand_servers
            if serving == server.retiring:  # a newcomer waits, or a server leaves
                return True
        for w in self.live():
            if w.name in epoch.places:
                if w.leave is not None:
                    return True
            elif w.leave is None and w.asked_after is not None:
                return True
        return False

    # -- the rendezvous ----------------------------------------------------------------

    def ask(self, name: str, op: str, after: int) -> tuple[dict[str, Any], str | None]:
        """The reply to worker or server ``name``'s request, and why the current epoch ends
        with it (a member asking for a later one has left it), if it does."""
        if op in ("serve", "retire"):
            return self._ask_server(name, op, after)
        w = self.workers.get(name)
        if w is None or not w.alive:
            return {"error": f"{name!r} is not a running worker of this job"}, None
        epoch = self.epoch
        if op == "updates":
            return {"pending": self.pending()}, None
        if op != "assignment":
            return {"error": f"unknown request {op!r}"}, None
        w.asked_after = after if w.asked_after is None else max(w.asked_after, after)
        if w.leave is not None and (
            epoch is None or name not in epoch.places or after >= epoch.number
        ):
            return {"leave": w.leave}, None
        if epoch is None:
            return dict(WAIT), None
        if after < epoch.number and name in epoch.places:
            if epoch.coordinator is None or epoch.ended is not None:
                return dict(WAIT), None
            p = epoch.places[name]
            epoch.placed.add(name)
            return {
                "epoch": epoch.number,
                "coordinator": epoch.coordinator,
                "rank": p.rank,
                "size": p.size,
                "local_rank": p.local_rank,
                "local_size": p.local_size,
                "host_id": p.host,
            }, None
        ends = None
        if name in epoch.places and after >= epoch.number and epoch.ended is None:
            ends = f"worker {epoch.places[name].rank} ({name}) left epoch {epoch.number}"
        return dict(WAIT), ends

    def _ask_server(self, name: str, op: str, after: int) -> tuple[dict[str, Any], str | None]:
        """A server started by hand: registered at its first request; its place once an
        epoch takes it; told to leave once it retired and is out of the running epoch."""
        server = self.servers.get(name)
        epoch = self.epoch
        if op == "retire":
            if server is None:
                return {"error": f"{name!r} is not a summation server of this job"}, None
            server.retiring = True
            return {"ok": True}, None
        if self.finished:
            self.servers.pop(name, None)
            return {"leave": "the training has finished"}, None
        if server is None:
            server = self.servers[name] = HandServer(name, after)
        server.asked_after = max(server.asked_after, after)
        serving = epoch is not None and name in epoch.hand_servers
        if server.retiring and not (serving and epoch is not None and after < epoch.number):
            del self.servers[name]
            return {"leave": "it retired"}, None
        if epoch is None or not serving:
            return dict(WAIT), None
        if after < epoch.number:
            if epoch.coordinator is None or epoch.ended is not None:
                return dict(WAIT), None
            return {
                "epoch": epoch.number,
                "coordinator": epoch.coordinator,
                "host_id": f"cpu-{name}",
            }, None
        ends = None
        if epoch.ended is None:
            ends = f"summation server {name} left epoch {epoch.number}"
        return dict(WAIT), ends
