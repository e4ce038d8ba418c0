"""Machine-wide CPU utilisation, sampled in the background from /proc/stat, and the CPU
time of the job's processes by role.

The emulated cluster shares this machine's cores among all its hosts, so a benchmark is
only meaningful while the CPUs are not the bottleneck; the harness reads the utilisation of
each run's measured window and flags runs above a threshold. The same samples say where the
CPU went (issue 22: CPU per byte against gloo): workers, summation servers on worker hosts
(colocated) and on CPU hosts, the coordinator and launcher, and the rest (the kernel's
network processing, mostly: softirq time is charged to no process).
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import time
from pathlib import Path
from types import TracebackType

STAT = Path("/proc/stat")
UPTIME = Path("/proc/uptime")
PROC = Path("/proc")
#: Jiffies per second of /proc's CPU times.
TICKS = os.sysconf("SC_CLK_TCK")

#: Patterns of a command line, in order, and the role of a process whose command line
#: holds the first (the programs as the launcher starts them, the benchmark's worker
#: modules; the launcher's own command line names the worker module too). A program is
#: matched as a whole word or path component: the launcher's temporary directory
#: (``/tmp/sumflow-run-XXXX/``) appears in the coordinator's arguments.
ROLES = tuple(
    (re.compile(pattern), role)
    for pattern, role in (
        (r"sumflow\.launcher", "launcher"),
        (r"(^|[ /])sumflow-run( |$)", "launcher"),
        (r"(^|[ /])sumflow-server( |$)", "servers"),
        (r"import server;", "servers"),
        (r"(^|[ /])sumflow-coordinator( |$)", "coordinator"),
        (r"import coordinator;", "coordinator"),
        (r"_worker", "workers"),
    )
)


def role_of(cmdline: str) -> str | None:
    """The role of a process with this command line, or None for one not the job's."""
    return next((role for pattern, role in ROLES if pattern.search(cmdline)), None)


#: One process as sampled: its role, its network namespace, and its CPU jiffies.
Process = tuple[str, str, int]


def read_processes(
    cache: dict[tuple[int, str, str], tuple[str, str] | None],
) -> dict[int, Process]:
    """Every job process's (role, network namespace, user + system jiffies), by pid.
    ``cache`` keeps each process's role and namespace to spare a read of its command line
    per sample, keyed by pid, start time (a reused pid is looked at again) and command
    name: a child forked by the launcher's remote wrapper carries the wrapper's command
    line until it execs the worker, and its pid and start time stay the same across the
    exec while its command name changes."""
    found: dict[int, Process] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command (field 2) may hold spaces: fields are counted after its ')'.
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
            fields = tail.split()
            key = (int(entry.name), fields[19], head.split("(", 1)[1])  # starttime, comm
            if key not in cache:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                role = role_of(cmdline)
                cache[key] = None if role is None else (role, os.readlink(entry / "ns" / "net"))
            known = cache[key]
            if known is not None:
                found[key[0]] = (*known, int(fields[11]) + int(fields[12]))  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # gone while being read, or not ours to read
    return found


def by_role(before: dict[int, Process], after: dict[int, Process]) -> dict[str, float]:
    """CPU seconds per role between two samples. Servers sharing a network namespace
    (an emulated host) with a worker are "colocated servers", the others "CPU servers". A
    process that started in between counts from zero; one that ended is left out."""
    worker_hosts = {ns for role, ns, _ in after.values() if role == "workers"}
    seconds: dict[str, float] = {}
    for pid, (role, ns, jiffies) in after.items():
        if role == "servers":
            role = "colocated servers" if ns in worker_hosts else "CPU servers"
        spent = jiffies - (before[pid][2] if pid in before else 0)
        seconds[role] = seconds.get(role, 0.0) + spent / TICKS
    return seconds


def read_cpu_seconds(stat: str | None = None, uptime: str | None = None) -> tuple[float, float]:
    """(busy, total) seconds of all online CPUs since boot, from /proc/stat and /proc/uptime
    (or ``stat`` and ``uptime``): total is the uptime times the CPUs, busy is total less
    the idle and iowait time.

    Not /proc/stat's busy fields: a tick-accounted kernel samples those at the scheduler
    tick, which a tickless kernel stops while a CPU idles, so busy spells shorter than a
    tick between idle ones go uncounted. The idle and iowait times are measured on
    entering and leaving idle, so they are exact. On this VM the busy fields missed a
    third of gloo's busy time and a sixth of sumflow's (issue 22), which made gloo look
    cheaper than it was."""
    lines = (stat if stat is not None else STAT.read_text()).splitlines()
    fields = [int(x) for x in lines[0].split()[1:]]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    wall = float((uptime if uptime is not None else UPTIME.read_text()).split()[0])
    total = wall * cpus
    idle = (fields[3] + (fields[4] if len(fields) > 4 else 0)) / TICKS
    return max(0.0, total - idle), total


class CpuSampler:
    """Samples /proc/stat, and with ``processes`` the job's processes, every ``interval``
    seconds while running (a context manager)."""

    def __init__(self, interval: float = 0.2, processes: bool = False) -> None:
        self.interval = interval
        self.processes = processes
        self._times: list[float] = []
        self._samples: list[tuple[float, float]] = []
        self._processes: list[dict[int, Process]] = []
        self._known: dict[tuple[int, str, str], tuple[str, str] | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        processes = read_processes(self._known) if self.processes else {}
        self._times.append(time.time())
        self._samples.append(read_cpu_seconds())
        self._processes.append(processes)

    def _window(self, start: float, end: float) -> tuple[int, int] | None:
        """The first and last samples inside ``start``..``end``, if there are two."""
        i = bisect.bisect_left(self._times, start)
        j = bisect.bisect_right(self._times, end) - 1
        return (i, j) if j > i else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def utilisation(self, start: float, end: float) -> float | None:
        """Busy fraction of all CPUs between wall-clock times ``start`` and ``end`` (the
        samples just inside the window); None when the window holds fewer than 2."""
        window = self._window(start, end)
        if window is None:
            return None
        i, j = window
        busy = self._samples[j][0] - self._samples[i][0]
        total = self._samples[j][1] - self._samples[i][1]
        return busy / total if total else None

    def seconds(self, start: float, end: float) -> dict[str, float] | None:
        """CPU seconds spent between the samples just inside ``start``..``end``: "busy"
        (all CPUs), each role's (:func:`by_role`), "other" (busy less the roles: the kernel's
        softirq work, mostly), and "wall" (the samples' span); None when the window holds
        fewer than 2 samples."""
        window = self._window(start, end)
        if window is None:
            return None
        i, j = window
        roles = by_role(self._processes[i], self._processes[j])
        busy = self._samples[j][0] - self._samples[i][0]
        return {
            "wall": self._times[j] - self._times[i],
            "busy": busy,
            **roles,
            "other": max(0.0, busy - sum(roles.values())),
        }
