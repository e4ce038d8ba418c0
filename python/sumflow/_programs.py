"""How to start the core's programs as processes: ``sumflow-server`` and
``sumflow-coordinator``. The launcher and the torch plugin's runtime both start them, and
neither should import the other to learn how."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

#: The console scripts, by name, and the function of ``sumflow._cli`` each runs.
_ENTRY_POINTS = {"sumflow-server": "server", "sumflow-coordinator": "coordinator"}


def program(name: str) -> list[str]:
    """How to run the console script ``name`` ("sumflow-server" or "sumflow-coordinator"):
    this environment's script, else one on PATH, else this interpreter running the same
    entry point (``sumflow._cli``)."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which(name)
    if found:
        return [found]
    entry = _ENTRY_POINTS[name]
    return [sys.executable, "-c", f"from sumflow._cli import {entry}; {entry}()"]
