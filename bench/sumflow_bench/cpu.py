"""Machine-wide CPU utilisation, sampled in the background from /proc/stat.

The emulated cluster shares this machine's cores among all its hosts, so a benchmark is
only meaningful while the CPUs are not the bottleneck; the harness reads the utilisation of
each run's measured window and flags runs above a threshold.
"""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path
from types import TracebackType

STAT = Path("/proc/stat")


def read_jiffies(stat: str | None = None) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat's first line (or ``stat``).
    Idle and iowait count as not busy."""
    text = stat if stat is not None else STAT.read_text()
    fields = [int(x) for x in text.splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user..steal; guest time is already inside user
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle, total


class CpuSampler:
    """Samples /proc/stat every ``interval`` seconds while running (a context manager)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self._times: list[float] = []
        self._samples: list[tuple[int, int]] = []
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
        self._times.append(time.time())
        self._samples.append(read_jiffies())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def utilisation(self, start: float, end: float) -> float | None:
        """Busy fraction of all CPUs between wall-clock times ``start`` and ``end`` (the
        samples just inside the window); None when the window holds fewer than 2."""
        i = bisect.bisect_left(self._times, start)
        j = bisect.bisect_right(self._times, end) - 1
        if j <= i:
            return None
        busy = self._samples[j][0] - self._samples[i][0]
        total = self._samples[j][1] - self._samples[i][1]
        return busy / total if total else None
