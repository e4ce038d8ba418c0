"""Entry points of the ``sumflow-server``, ``sumflow-coordinator`` and ``sumflow`` console
scripts.

The first two run the Rust program in this process (see ``sumflow._core.run_server``), so
the wheel needs no separate binaries. The programs own SIGINT and SIGTERM while they run: both
stop them gracefully, and their exit status is the script's.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import NoReturn

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


def main() -> NoReturn:
    """``sumflow``: the package's own commands. ``sumflow sim ...`` runs the simulator
    (``sumflow.sim.cli``, docs/simulator.md)."""
    commands = {"sim": "simulate training on a cluster (sumflow sim --help)"}
    argv = sys.argv[1:]
    if not argv or argv[0] not in commands:
        listing = "\n".join(f"  {name}  {what}" for name, what in commands.items())
        print(f"usage: sumflow COMMAND ...\n\ncommands:\n{listing}", file=sys.stderr)
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    from sumflow.sim import cli

    sys.exit(cli.main(argv[1:]))
