"""A worker for test_failure_notices.py: after three sums, rank 0 stops (SIGSTOP) the
job's summation servers or its coordinator, siblings of this worker under sumflow-run;
then every rank sums until that fails and writes what failed, and after how long, to
DIR/RANK.json (the stopped pids to DIR/stopped.json), exiting 1 as a script whose sum
failed would."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import sumflow.torch as hvd

#: What each target's command line contains, as a console script or through sumflow._cli.
MARKS = {
    "servers": (b"sumflow-server", b"import server"),
    "coordinator": (b"sumflow-coordinator", b"import coordinator"),
}


def siblings(marks: tuple[bytes, ...]) -> list[int]:
    """Processes started by this worker's launcher whose command line has a mark."""
    found = []
    launcher = os.getppid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher and any(m in cmd for m in marks):
            found.append(int(entry))
    return found


def main() -> int:
    out, target = Path(sys.argv[1]), sys.argv[2]
    hvd.init()
    x = torch.ones(1 << 16)
    for _ in range(3):
        hvd.allreduce(x, name="x")
    if hvd.rank() == 0:
        pids = siblings(MARKS[target])
        (out / "stopped.json").write_text(json.dumps(pids))
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    result: dict[str, object] = {"failed": False}
    try:
        for _ in range(10_000):
            hvd.allreduce(x, name="x")
            time.sleep(0.01)
    except Exception as e:  # what the test checks
        result = {"failed": True, "type": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - started
    (out / f"{hvd.rank()}.json").write_text(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
