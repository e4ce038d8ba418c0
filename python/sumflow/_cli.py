"""Entry points of the ``sumflow-server`` and ``sumflow-coordinator`` console scripts.

Each runs the Rust program in this process (see ``sumflow._core.run_server``), so the
wheel needs no separate binaries. The programs own SIGINT and SIGTERM while they run: both
stop them gracefully, and their exit status is the script's.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable, NoReturn

from sumflow import _core


def _run(program: Callable[[list[str]], int]) -> NoReturn:
    # Python's own SIGINT handler would raise KeyboardInterrupt once the program has already
    # stopped gracefully; the Rust program handles SIGINT itself, so hand it the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(program(sys.argv[1:]))


def server() -> NoReturn:
    """``sumflow-server``: a summation server (see ``sumflow-server --help``)."""
    _run(_core.run_server)


def coordinator() -> NoReturn:
    """``sumflow-coordinator``: a job's coordinator (see ``sumflow-coordinator --help``)."""
    _run(_core.run_coordinator)
