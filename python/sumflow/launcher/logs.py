"""Per-process output files (``--output-filename DIR``), as horovodrun writes them: worker
N's output in ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr``, and the others' in
``DIR/server.M``, ``DIR/cpu-server.K`` and ``DIR/coordinator``, unprefixed."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO


def log_dir(root: Path, process: str) -> Path:
    """The directory of a process named as in the prefixes (``worker 3``, ``server 1``,
    ``cpu-server 0``, ``coordinator``): ``rank.3``, ``server.1``, ``cpu-server.0``,
    ``coordinator``. In an elastic job, whose ranks change, a worker's is its name's
    (``worker w2``: ``worker.w2``) and a membership's servers' carry its number
    (``server 0 e1``: ``server.0.e1``)."""
    kind, _, index = process.partition(" ")
    if kind == "worker" and index.isdigit():
        kind = "rank"
    index = index.replace(" ", ".")
    return root / (f"{kind}.{index}" if index else kind)


def open_logs(root: Path, process: str) -> tuple[BinaryIO, BinaryIO]:
    """The process's stdout and stderr files, created (or emptied) in its directory."""
    directory = log_dir(root, process)
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / "stdout").open("wb"), (directory / "stderr").open("wb")
